"""kvcompress benchmarks, each run from the repository root as ``python -m benchmarks.NAME``:

    throughput          vanilla vLLM vs kvcompress on the same prompts (tok/s, concurrency, KV)
    quality             RULER-style long-context tasks, full cache vs every method and budget
    attention_analysis  per-layer attention entropy and attention recall vs budget
    compression_cost    scoring + selection + compaction as a share of prefill time
    kernels             Triton kernel microbenchmarks (torch + triton only)

Shared parts: ``specs`` (configurations, engine settings), ``engine`` (build and run a vLLM
engine), ``jobs`` (worker subprocesses), ``report`` (tables, JSON, run metadata).
Nothing is imported here: ``benchmarks.kernels`` must run without vLLM.
"""
