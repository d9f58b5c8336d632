"""kvcompress benchmarks, each run from the repository root as ``python -m benchmarks.NAME``
(benchmarks/README.md says how, what each measures and where results go):

    throughput          vanilla vLLM vs kvcompress on the same prompts (tok/s, concurrency, KV);
                        --sweep-kv-memory, --long-generation
    quality             RULER-style long-context tasks, full cache vs every method and budget
    multi_turn          multi-turn chat with and without reuse of compressed caches; --recall
    shared_context      several questions about one document, per scoring, chat and independent
    shared_prefix       concurrent requests on one long shared prefix
    streaming_latency   inter-token latency of streams while long prompts arrive, over HTTP
    random_model        a random-weight Llama for tensor-parallel throughput runs
    results_doc         docs/results.md from benchmarks/results (--check in CI)

One-off analyses live in ``studies/`` (``python -m benchmarks.studies.NAME``). Shared parts:
``specs`` (configurations, engine settings), ``engine`` (build and run a vLLM engine),
``jobs`` (worker subprocesses), ``report`` (tables, JSON, run metadata).
Nothing is imported here: ``benchmarks.studies.kernels`` must run without vLLM.
"""
