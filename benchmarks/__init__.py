"""kvcompress benchmarks, each run from the repository root as ``python -m benchmarks.NAME``
(benchmarks/README.md says how, what each measures and where results go):

    throughput          vanilla vLLM vs kvcompress on the same prompts (tok/s, concurrency, KV);
                        --sweep-kv-memory, --long-generation
    quality             RULER-style long-context tasks, full cache vs every method and budget
    multi_turn          multi-turn chat with and without reuse of compressed caches; --recall
    shared_context      several questions about one document, per scoring, chat and independent
    decode_fidelity     decode-time eviction against the full cache; --recall
    step_overhead       host work per engine step at Llama-3-8B shapes
    attention_analysis  per-layer attention entropy and attention recall vs budget
    retention_analysis  which (layer, KV head) rows keep a retrieval answer
    compression_cost    scoring + selection + compaction as a share of prefill time
    hybrid_memory       KV held on a hybrid (sliding-window) model, vanilla vs kvcompress
    kvpress_reference   kept sets and accuracy against NVIDIA kvpress (its own environment)
    kernels             Triton kernel microbenchmarks (torch + triton only)
    results_doc         docs/results.md from benchmarks/results (--check in CI)

Shared parts: ``specs`` (configurations, engine settings), ``engine`` (build and run a vLLM
engine), ``jobs`` (worker subprocesses), ``report`` (tables, JSON, run metadata).
Nothing is imported here: ``benchmarks.kernels`` must run without vLLM.
"""
