"""What the CPU and CUDA model runners share: one page pool instead of vLLM's per-layer KV
tensors, the runtime's step hooks around ``execute_model``, and the compaction reports
attached to the runner's output."""

from __future__ import annotations

from collections.abc import Collection
from contextlib import AbstractContextManager
from copy import copy
from typing import Any

import torch
from vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)
from vllm.forward_context import set_forward_context
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.utils import bind_kv_cache

from kvcompress.engine.handoff import Handoff, handoff_fingerprint
from kvcompress.engine.messages import REPORT_ATTR, WorkerReport, merge_rank_reports
from kvcompress.engine.scoring_memory import reconstruction_chunk
from kvcompress.engine.vllm_layout import ScoringReserve, attention_layer_names, page_layout
from kvcompress.engine.worker.reconstruction import ReconstructionPass
from kvcompress.engine.worker.runtime import PagedKVRuntime
from kvcompress.log import get_logger
from kvcompress.paging import PageLayout
from kvcompress.profile_model.calibration import REPEAT_PROMPT
from kvcompress.profile_model.profiles import check_profile_shape, load_profile
from kvcompress.profile_model.surrogates import check_surrogate_shape, load_surrogate
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import PagedAttentionMetadata, PlatformKernel, register_runtime

logger = get_logger(__name__)


class PagedKVRunnerMixin:
    """Replaces vLLM's per-layer KV tensors by one page pool and reports what compression
    did (compactions, failed requests, timings).

    Mixed in before a vLLM model runner class; platform specifics come from
    ``make_kernel`` (the attention kernel and page format of the platform).
    """

    paged_runtime: PagedKVRuntime | None = None
    _pending_report: WorkerReport

    def make_kernel(self, layout: PageLayout, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> PlatformKernel:
        """The platform kernel for queries in ``dtype`` over pages of vLLM's
        ``--kv-cache-dtype`` (``auto``: the model's dtype; fp8 ones: one byte per element)."""
        raise NotImplementedError

    def initialize_kv_cache_tensors(
        self,
        kv_cache_config: Any,
        kernel_block_sizes: list[int],
        kv_cache_allocation_context: AbstractContextManager | None = None,
    ) -> dict[str, torch.Tensor]:
        config = KVCompressionConfig.from_mapping(self.vllm_config.additional_config)
        layout = page_layout(kv_cache_config, config.page_size,
                             ScoringReserve.of(self.vllm_config))
        layer_names = attention_layer_names(kv_cache_config)
        # Pages hold vLLM's KV-cache dtype (uint8 for fp8 pages); queries the model's.
        page_dtype = kv_cache_config.kv_cache_groups[0].kv_cache_spec.dtype
        kernel = self.make_kernel(layout, self.vllm_config.model_config.dtype,
                                  self.vllm_config.cache_config.cache_dtype)
        ranks = get_tensor_model_parallel_world_size()
        handoff = Handoff.from_additional_config(self.vllm_config.additional_config)
        runtime = PagedKVRuntime(
            config, layout, layer_names, kernel, page_dtype, self.device,
            rank=get_tensor_model_parallel_rank(),
            handoff=None if handoff is None else handoff.per_rank(ranks),
            fingerprint=handoff_fingerprint(self.vllm_config.model_config.model, layout,
                                            page_dtype,
                                            self.vllm_config.cache_config.cache_dtype, ranks))
        runtime.bind_runner(self)
        if ranks > 1:
            runtime.agree_on_failures = _failed_on_any_rank
        if layout.scratch_pages:
            self._enable_reconstruction(runtime, config)
        elif config.reserves_reconstruction:
            logger.warning("kvcompress: no room for reconstruction passes (sliding-window "
                           "layers, or a sixteenth of the KV memory holds none): prompts are "
                           "scored by their observation window (--kv-scoring window)")
        if config.loads_profile:
            self._enable_expected_scoring(runtime, config, layout, layer_names)
        if config.loads_surrogate:
            self._enable_surrogate_scoring(runtime, config, layout)
        self.paged_runtime = runtime
        self._pending_report = WorkerReport()
        register_runtime(self.vllm_config, runtime)
        kv_caches = {name: runtime.pool for name in layer_names}
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches)
        logger.info(
            "kvcompress: page pool of %d pages x %d tokens (%.2f GiB) shared by %d layers",
            layout.total_pages, layout.page_size,
            runtime.pool.numel() * runtime.pool.element_size() / 2**30, len(layer_names),
        )
        return kv_caches

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        """Stages 2-7 of a step (``kvcompress.step``) on this worker: page deltas before
        vLLM's forward (which writes, attends and scores), plan + moves after it, and the
        reports attached to the output."""
        runtime = self.paged_runtime
        if runtime is not None:
            runtime.begin_step(scheduler_output)
        result = super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        if runtime is not None:
            runtime.reconstruct(self._forward_reconstruction)
            self._pending_report.merge(_gather_over_ranks(runtime.end_step()))
            if isinstance(result, ModelRunnerOutput):
                runtime.publish_exports(result.req_ids, result.sampled_token_ids)
                result = self._attach_report(result)
        return result

    def _enable_reconstruction(self, runtime: PagedKVRuntime,
                               config: KVCompressionConfig) -> None:
        """Reconstruction passes need the instruction's token ids; an engine started without
        a tokenizer scores every prompt by its window (logged)."""
        tokenizer = cached_tokenizer_from_config(self.vllm_config.model_config)
        if tokenizer is None:
            logger.warning("kvcompress: no tokenizer (skip_tokenizer_init): prompts are scored "
                           "by their observation window instead of a reconstruction")
            return
        batched = self.vllm_config.scheduler_config.max_num_batched_tokens
        runtime.enable_reconstruction(
            tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False),
            reconstruction_chunk(config.reconstruct_chunk, batched), batched)

    def _enable_expected_scoring(self, runtime: PagedKVRuntime, config: KVCompressionConfig,
                                 layout: PageLayout, layer_names: list[str]) -> None:
        """The query profile at the path ``prepare_engine_args`` resolved, after it checked
        the profile's fingerprint against the model (not hashed again here), its shape
        checked against this model, cut to this rank's query heads. fp8 pages: with each
        layer's K scale (loaded with the weights, before the KV cache is made)."""
        model_config = self.vllm_config.model_config
        profile = load_profile(config.profile)
        check_profile_shape(profile, layout.num_layers,
                            model_config.hf_text_config.num_attention_heads, layout.head_size)
        key_scales: tuple[float, ...] = ()
        if runtime.kernel.page_format.fp8_dtype is not None:
            layers = self.compilation_config.static_forward_context
            key_scales = tuple(float(layers[name]._k_scale_float) for name in layer_names)
        runtime.enable_expected_scoring(profile.heads_of_rank(
            get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()),
            key_scales)

    def _enable_surrogate_scoring(self, runtime: PagedKVRuntime, config: KVCompressionConfig,
                                  layout: PageLayout) -> None:
        """The score surrogate at the path ``prepare_engine_args`` resolved (and checked
        against the model), cut to this rank's KV heads, its shape checked."""
        surrogate = load_surrogate(config.surrogate).heads_of_rank(
            get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
        check_surrogate_shape(surrogate, layout.num_layers, layout.num_kv_heads,
                              layout.head_size)
        runtime.enable_surrogate_scoring(surrogate)

    @torch.inference_mode()
    def _forward_reconstruction(self, reconstruction: ReconstructionPass,
                                metadata: PagedAttentionMetadata) -> None:
        """The model over one reconstruction pass (hidden states only: nothing is sampled);
        its attention layers score the prompt and write the pass's K/V to scratch slots."""
        per_layer = dict.fromkeys(metadata.layer_index, metadata)
        with set_forward_context(per_layer, self.vllm_config,
                                 num_tokens=len(reconstruction.input_ids)):
            self.model(input_ids=reconstruction.input_ids, positions=reconstruction.positions,
                       intermediate_tensors=None, inputs_embeds=None)

    def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
        # Dummy batches (warm-up, graph capture, profiling) have no requests in the page
        # tables: hide the runtime so they build no paged metadata (attention is a no-op).
        runtime = self.paged_runtime
        register_runtime(self.vllm_config, None)
        try:
            return super()._dummy_run(*args, **kwargs)  # type: ignore[misc]
        finally:
            if runtime is not None and self.paged_runtime is runtime:
                register_runtime(self.vllm_config, runtime)

    def sample_tokens(self, grammar_output: Any) -> Any:
        output = super().sample_tokens(grammar_output)  # type: ignore[misc]
        if self.paged_runtime is not None and isinstance(output, ModelRunnerOutput):
            self.paged_runtime.publish_exports(output.req_ids, output.sampled_token_ids)
            output = self._attach_report(output)
        return output

    def shutdown(self) -> None:
        if self.paged_runtime is not None:
            register_runtime(self.vllm_config, None)
            self.paged_runtime.close()
            self.paged_runtime = None  # releases the page pool
        super().shutdown()  # type: ignore[misc]

    def _attach_report(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        if not self._pending_report:
            return output
        output = copy(output)  # may be vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT
        setattr(output, REPORT_ATTR, self._pending_report)
        self._pending_report = WorkerReport()
        return output


def _gather_over_ranks(report: WorkerReport) -> WorkerReport:
    """Every tensor-parallel rank's report, merged, on every rank: vLLM hands the
    scheduler one rank's output, and each rank compacted only its own KV heads."""
    group = get_tp_group()
    if group.world_size == 1:
        return report
    reports: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(reports, report, group=group.cpu_group)
    return merge_rank_reports(reports)


def _failed_on_any_rank(failed: Collection[str]) -> set[str]:
    """The requests that failed on any tensor-parallel rank, given this rank's: what every
    rank must leave out of a step's collectives (reconstruction passes)."""
    group = get_tp_group()
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, sorted(failed), group=group.cpu_group)
    return set().union(*gathered)


def require_v1_model_runner(uses_v2_model_runner: bool) -> None:
    if uses_v2_model_runner:
        raise NotImplementedError(
            "kvcompress needs vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0"
        )
