"""Names vulture cannot see used: vLLM calls them (by interface, by class path or by keyword),
or they are kept on purpose. `vulture` (settings in pyproject.toml) reads this file with the
package; nothing imports it. Every entry says who uses the name."""

# ruff: noqa: B018, F821  (bare names are how vulture whitelists mark a use)

# Selected by class path strings (engine/engine_args.py, engine/worker/*.py) or entry points
# (pyproject.toml).
KVCompressScheduler
KVCompressCPUWorker
KVCompressGPUWorker
KVCompressCudaAttentionBackend
RequestSettingsValidator
KVCompressStatLogger
ForcedScriptProcessor  # benchmarks.studies.decode_recall.PROCESSOR_PATH, loaded by vLLM

# vLLM's AttentionBackend / AttentionMetadataBuilder / AttentionImpl interface.
_.forward_includes_kv_cache_update
_.supported_dtypes
_.supported_kv_cache_dtypes
_.get_supported_kernel_block_sizes
_.get_supported_head_sizes
_.supported_kv_cache_layouts
_.get_name
_.supports_attn_type
_.supports_sink
_.supports_sliding_window
_.get_impl_cls
_.get_builder_cls
_.build
_.forward
common_prefix_len  # AttentionMetadataBuilder.build's parameters, passed by keyword
fast_build
unused  # AttentionImpl.__init__ takes backend-specific keywords we ignore

# vLLM's LogitsProcessor interface (engine/request_settings.py).
_.validate_params
_.apply
_.is_argmax_invariant
_.update_state
is_pin_memory
batch_update

# vLLM's StatLoggerBase interface (engine/stats.py).
_.record
_.log_engine_initialized
mm_cache_stats
engine_idx
_.waiting  # recorded per step with running and KV usage, for whoever reads the samples

# vLLM's KVCacheManager interface (engine/sched/kv_cache_manager.py): its scheduler asks.
_.get_computed_blocks
_.record_prefix_cache_stats
_.make_prefix_cache_stats

# PrefixCacheFigures fields go to /metrics by name (dataclasses.asdict, engine/metrics.py).
_.handovers
_.shares

# vLLM's workers and model runners (engine/worker/*.py).
_.model_runner
_._make_model_runner
_.initialize_kv_cache_tensors
kernel_block_sizes  # initialize_kv_cache_tensors's parameters, passed by keyword
kv_cache_allocation_context

# Read by the engine tests; the metrics work (issue 15) exports it.
_.num_pages_freed_by_compression

# dataclasses' own record of a field's kind, set on the field vllm_hooks adds.
_._field_type

# transformers model attributes cleared before saving the converted model (models.py).
_.hf_quantizer
_._name_or_path

# Read by the engine tests: how often the scheduler's ScoringGate held a chunk short of its
# observation window (engine/scoring_memory.py).
_.deferred_chunks

# benchmarks/multi_turn/driver.py: TurnRecord fields, read by name from its asdict() records.
_.cached_tokens
_.context_tokens
_.context_match
_.ttft_s
_.ttft_vllm_s
_.queue_s
_.prefill_s

# CompactionStats fields read by name by benchmarks/engine.py (the measured kept fraction of
# threshold eviction) from the workers' stats dicts.
_.prompt_rows_planned
_.prompt_rows_kept

# PageFill's definition, row by row: tests/paging/test_page_manager.py checks the summaries
# admission reads (of_summaries) against it.
_.of_lengths

# The torch reference of expected scoring, all keys at once: the chunked reading of
# engine/worker/expected.py is tested against it (tests/attention, tests/engine).
expected_scores

# benchmarks/streaming_latency.py: the Row's fields are read through dataclasses.asdict.
_.itl_median_ms
_.itl_max_ms
_.long_ttft_s
_.output_tokens_per_s
_.ratio_p99_vs_first
# engine/pass_schedule.py: budget tokens granted over the engine's life (tests read it).
_.tokens_granted
# engine/sched/scheduler.py: vLLM's Scheduler reads these limits while the parked requests are
# out of running.
_.max_num_running_reqs
_.max_num_active_reqs
# engine/sched/prefix_segments.py: a segment request's SamplingParams fields, read by vLLM.
_.logprobs
_.prompt_logprobs
_.structured_outputs

# transformers' attention-function signature (AttentionInterface), which
# kvcompress.profile_model.teacher.teacher_attention takes whole; the teacher lays out its
# own mask and runs in eval mode.
attention_mask
dropout
