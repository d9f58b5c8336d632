"""The vLLM glue, by side (as vLLM's v1 keeps ``core/sched`` apart from ``worker``). The
stages of one engine step are listed in ``kvcompress.step``.

Before the engine starts: ``engine_args`` (validate, select our classes, refuse what cannot
work), ``request_settings`` (per-request ``kv_*`` checked at admission, HTTP 400).
Scheduler process: ``sched/`` (vLLM's scheduler with page admission, frees and shared
prefixes). Worker processes: ``worker/`` (vLLM's workers with our model runner; the step on
the worker). Both: ``messages`` (what rides on vLLM's step messages), ``pass_schedule``
(reconstruction passes as scheduled work), ``scoring_memory`` (window-score memory),
``vllm_layout`` (the page layout from vLLM's KV-cache config), ``metrics`` (compression
figures for /metrics), ``stats`` (a stat logger for benchmarks and tests).

Neither side imports the other (import-linter contract in pyproject.toml).
"""
