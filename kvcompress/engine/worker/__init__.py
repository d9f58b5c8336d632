"""The worker processes: ``cpu`` / ``gpu`` (vLLM's workers with our model runner),
``runner`` (what both runners share), ``runtime`` (one step on the worker), ``state``
(page-table mirror, step batches), ``compaction`` (plan, moves), ``moves`` (which tokens
move where; one mover call per step), ``reconstruction`` / ``expected`` (reconstruction
passes, expected-attention scoring), ``decode_plan`` (a step's decode-scoring indices),
``host_transfer`` (the step's one device->host copy).

``runtime``, ``state``, ``compaction``, ``moves`` and ``reconstruction`` import no vLLM: the
worker pipeline runs with torch + Triton alone (scripts/gpu_check.sh)."""
