"""Studies: analyses that answer a question about kvcompress's design rather than measure
what a user runs, each as ``python -m benchmarks.studies.NAME`` from the repository root
(benchmarks/README.md, "Studies", says which question each still answers):

    kernels             Triton kernel microbenchmarks (torch + triton only; scripts/gpu_check.sh)
    step_overhead       host work per engine step at Llama-3-8B shapes (target: 2 ms)
    scheduler_cost      one schedule() with a long waiting queue, against vLLM's scheduler
    compression_cost    scoring + selection + compaction as a share of prefill time
    hybrid_memory       KV held on a hybrid (sliding-window) model, vanilla vs kvcompress
    decode_fidelity     decode-time eviction against the full cache; --recall (decode_recall)

A study that no longer answers a live question is deleted; its results stay in
docs/results.md with the commit whose tree still holds it (benchmarks/results_doc/sections.py,
``RETIRED``). Nothing is imported here: ``benchmarks.studies.kernels`` must run without vLLM.
"""
