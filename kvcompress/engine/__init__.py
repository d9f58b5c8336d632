"""The vLLM glue, by side. The stages of one engine step are listed in ``kvcompress.step``.

Before the engine starts: ``engine_args`` (validate, select our classes, refuse what cannot
work), ``request_settings`` (per-request ``kv_*`` checked at admission, HTTP 400).
Scheduler process: ``scheduler`` (vLLM's scheduler with page admission and frees) over
``scheduler_kv_cache`` (vLLM's KV-cache manager, decided in pages), ``admission`` (a prompt
runs when it fits beside the running requests' growth), ``budget_spread`` (the pages a shared
budget may take, for admission), ``prefix_cache`` (who may read and who is kept,
``--kv-reuse``), ``scoring_memory`` (window-score memory, gated per chunk), ``metrics``
(compression figures for /metrics).
Worker processes: ``worker_cpu`` / ``worker_gpu`` (vLLM's workers with our model runner),
``worker_runner`` (what both runners share), ``worker_runtime`` (one step on the worker),
``worker_state`` (page-table mirror, step batches), ``worker_compaction`` (plan, moves),
``worker_moves`` (which tokens move where; one mover call per step),
``worker_reconstruction`` / ``worker_expected`` (reconstruction passes, expected-attention
scoring), ``decode_plan`` (a step's decode-scoring indices), ``host_transfer`` (the step's
one device->host copy).
Both: ``messages`` (what rides on vLLM's step messages), ``pass_schedule`` (reconstruction
passes as scheduled work), ``vllm_layout`` (the page layout from vLLM's KV-cache config),
``stats`` (a stat logger for benchmarks and tests).

``worker_runtime``, ``worker_state``, ``worker_compaction``, ``worker_moves`` and ``messages``
import no vLLM: the worker pipeline runs with torch + Triton alone (scripts/gpu_check.sh).
"""
