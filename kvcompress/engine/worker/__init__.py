"""The worker processes: ``cpu`` / ``gpu`` (vLLM's workers with our model runner),
``runner`` (what both runners share), ``runtime`` (one step on the worker), ``state``
(page-table mirror, step batches) over ``request_kv`` (what it holds of one request),
``page_work`` (a step's segment compactions and adoption copies before the forward),
``compression`` (the step's compression after it) over ``compaction`` (completed prompts)
and ``decode_eviction`` (--kv-decode-budget), ``moves`` (which tokens move where; one mover
call per step), ``reconstruction`` / ``expected`` (reconstruction passes, expected-attention
scoring), ``decode_plan`` (a step's decode-scoring indices), ``host_transfer`` (the step's
one device->host copy).

All but ``cpu``, ``gpu`` and ``runner`` import no vLLM: the worker pipeline runs with torch +
Triton alone (scripts/gpu_check.sh; the import-linter contract in pyproject.toml)."""
