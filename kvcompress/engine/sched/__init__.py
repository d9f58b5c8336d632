"""The scheduler process: ``scheduler`` (vLLM's scheduler, every override of it in one
module) over ``sharing`` (shared prefixes: segments, forks, holds, segment compaction),
``request_life`` (one sharing state per request, its transitions checked),
``kv_cache_manager`` (vLLM's KV-cache manager, decided in pages), ``admission`` (a prompt
runs when it fits beside the running requests' growth), ``budget_spread`` (the pages a
shared budget may take), ``prefix_cache`` (who may read and who is kept, ``--kv-reuse``) and
``prefix_segments`` (which waiting requests share which prefix)."""
