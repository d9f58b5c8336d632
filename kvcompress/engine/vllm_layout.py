"""Derive the page layout from vLLM's KV-cache config, identically in every process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVQuantMode,
    SlidingWindowSpec,
)

from kvcompress.attention.reconstruction_scores import (
    MIN_SCORING_WORKSPACE_BYTES,
    scoring_elements,
    scoring_workspace_bytes,
)
from kvcompress.engine.scoring_memory import (
    MAX_REPEAT_TOKENS,
    decode_reserved_bytes,
    reconstruction_tokens,
    reserved_bytes,
    scored_token_reserve,
)
from kvcompress.paging import PageLayout
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.settings.flags import AMX_PAGE_SIZE, DEFAULT_PAGE_SIZE


def attention_layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    """The model's attention layers in depth order (row order of the page tables)."""
    return [name for name, _ in _layer_specs(kv_cache_config)]


def _layer_specs(kv_cache_config: KVCacheConfig) -> list[tuple[str, Any]]:
    """(layer name, spec) of every attention layer in depth order, over all KV-cache groups:
    full-attention and sliding-window layers of one shape share one page layout. Anything
    else is refused with the reason."""
    layers: list[tuple[str, Any]] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
            raise NotImplementedError(
                "kvcompress supports decoder-only models whose layers use full or "
                f"sliding-window attention; this model has {type(spec).__name__} layers"
            )
        if type(spec) is FullAttentionSpec and (spec.sliding_window or
                                                 spec.attention_chunk_size):
            # The hybrid KV-cache manager is off: one merged group no longer says which
            # layers slide, so dead tokens could not be freed per layer.
            raise NotImplementedError(
                "kvcompress needs vLLM's hybrid KV-cache manager for models with "
                "sliding-window or chunked local attention layers; do not pass "
                "--disable-hybrid-kv-cache-manager"
            )
        layers += [(name, spec) for name in group.layer_names]
    if not layers:
        raise NotImplementedError("kvcompress needs a model with attention layers")
    shapes = {(spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.dtype)
              for _, spec in layers}
    if len(shapes) != 1:
        raise NotImplementedError(
            "kvcompress needs every attention layer to have the same KV heads, head size and "
            f"dtype; this model has {sorted(map(str, shapes))}"
        )
    return sorted(layers, key=lambda item: extract_layer_index(item[0]))


def _window(spec: Any) -> int:
    return int(spec.sliding_window) if type(spec) is SlidingWindowSpec else 0


@dataclass(frozen=True)
class ScoringReserve:
    """What the window-score reserve is sized for (``scoring_memory``): prompt tokens scored at
    once, the accumulators each holds (2 where hybrid scoring keeps its window's apart from
    its reconstruction's or its surrogate's), and the tokens of one reconstruction pass
    whose K/V the scratch pages hold (0: none)."""

    scored_tokens: int
    longest_prompt: int
    reconstruction_tokens: int = 0
    accumulators: int = 1
    # Decode scores: requests that may hold them at once, offsets each (0: none) and
    # accumulators each (2 for anchors; 0: the decode policy scores nothing).
    decode_requests: int = 0
    decode_capacity: int = 0
    decode_accumulators: int = 1
    # The largest prefill chunk (0: max_model_len): a sliding row's peak (``row_tokens_bound``).
    max_chunk: int = 0
    # One layer's reconstruction scoring workspace (bytes; 0 without passes): bounded by the
    # pass's own extents where they are smaller than its blocks (small models).
    scoring_workspace: int = 0

    @classmethod
    def of(cls, vllm_config: Any) -> ScoringReserve:
        max_model_len = vllm_config.model_config.max_model_len
        batched = vllm_config.scheduler_config.max_num_batched_tokens
        config = KVCompressionConfig.from_mapping(vllm_config.additional_config)
        decode = {"decode_requests": vllm_config.scheduler_config.max_num_seqs,
                  "max_chunk": batched,
                  "decode_capacity": config.decode_score_capacity,
                  "decode_accumulators": config.decode_score_accumulators}
        if not config.reserves_reconstruction:
            # hybrid-surrogate keeps the window's scores apart from the surrogate's
            accumulators = 2 if config.loads_surrogate and config.scores_window else 1
            return cls(scored_token_reserve(max_model_len, batched), max_model_len,
                       accumulators=accumulators, **decode)
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        pass_tokens = reconstruction_tokens(config.reconstruct_chunk, batched)
        workspace = scoring_workspace_bytes(
            model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel),
            model.get_head_size(), pass_tokens, max_model_len)
        return cls(scored_token_reserve(max_model_len, batched), max_model_len, pass_tokens,
                   accumulators=2, scoring_workspace=workspace, **decode)

    def decode_request_bytes(self, num_layers: int, num_kv_heads: int) -> int:
        """One running request's decode scores at the capacity: its accumulators and its
        share of the step's scores."""
        return decode_reserved_bytes(1, num_layers, num_kv_heads, self.decode_capacity,
                                     self.decode_accumulators)


def default_page_size(dtype: torch.dtype, head_size: int, fp8_pages: bool = False) -> int:
    """Pages of 32 tokens where vLLM's CPU attention runs on AMX tiles (its amx kernel needs
    pages of multiples of 32 and runs prefill attention ~3x faster than the vec16 kernel
    16-token pages get) or reads fp8 pages (only its vec kernel does, on pages of multiples
    of 32), else 16. The scheduler and the workers run on the same machine, so both sides
    pick the same."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        if fp8_pages:
            return AMX_PAGE_SIZE
        from kvcompress.attention.cpu_kernel import cpu_isa

        if cpu_isa(AMX_PAGE_SIZE, head_size, dtype) == "amx":
            return AMX_PAGE_SIZE
    return DEFAULT_PAGE_SIZE


def page_layout(kv_cache_config: KVCacheConfig, page_size: int | None,
                reserve: ScoringReserve | None = None) -> PageLayout:
    """Pages of ``page_size`` tokens (None: ``default_page_size``) fitting in the bytes vLLM
    budgets for its KV cache, less the score ``reserve`` and reconstruction scratch."""
    layers = _layer_specs(kv_cache_config)
    spec: Any = layers[0][1]
    fp8_pages = spec.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
    if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        raise NotImplementedError(f"kvcompress pages cannot hold {spec.kv_quant_mode.name} "
                                  "KV caches; use --kv-cache-dtype auto or fp8")
    page_size = page_size or default_page_size(spec.dtype, spec.head_size, fp8_pages)
    if spec.head_size_v != spec.head_size:
        raise NotImplementedError("kvcompress needs equal key and value head sizes")
    windows = tuple(_window(layer_spec) for _, layer_spec in layers)
    # The element size of vLLM's KV-cache dtype (1 for fp8 pages): page bytes, pool size,
    # admission and scratch all follow it.
    dtype_bytes = torch.empty((), dtype=spec.dtype).element_size()
    memory = kv_cache_bytes(kv_cache_config)
    # Reconstruction passes run on full-attention models only (sliding rows drop pages).
    scratch = 0 if reserve is None or any(windows) else _scratch_tokens(
        reserve.reconstruction_tokens, memory,
        len(layers) * spec.num_kv_heads * 2 * spec.head_size * dtype_bytes)
    # A pass's scoring workspace, at most a sixteenth of the memory, like its scratch (its
    # blocks shrink to fit: ``PageLayout.scoring_elements``).
    workspace = 0 if not scratch else max(MIN_SCORING_WORKSPACE_BYTES,
                                          min(reserve.scoring_workspace, memory // 16))
    score_bytes = 0 if reserve is None else reserved_bytes(
        reserve.scored_tokens, len(layers), spec.num_kv_heads, reserve.longest_prompt,
        # without scratch pages a reconstruction's hybrid is scored by its window alone
        1 if reserve.reconstruction_tokens and not scratch else reserve.accumulators,
        workspace)
    request_bytes = 0 if reserve is None else reserve.decode_request_bytes(
        len(layers), spec.num_kv_heads)
    decode_requests = 0 if not request_bytes else min(reserve.decode_requests, _runnable_requests(
        memory - score_bytes, len(layers) * spec.num_kv_heads,
        2 * page_size * spec.head_size * dtype_bytes, request_bytes))

    def layout_for(decode_requests: int) -> PageLayout:
        return PageLayout.for_memory(
            kv_cache_bytes=memory,
            reserved_bytes=score_bytes,
            decode_score_requests=decode_requests,
            decode_score_request_bytes=request_bytes,
            num_layers=len(layers),
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            page_size=page_size,
            dtype_bytes=dtype_bytes,
            layer_windows=windows if any(windows) else (),
            scratch_tokens=scratch,
            scoring_elements=scoring_elements(workspace) if workspace else 0,
        )

    layout = layout_for(decode_requests)
    if decode_requests and reserve is not None and reserve.longest_prompt:
        # Decode scores for fewer running requests (the scheduler runs no more) rather than
        # too few pages for one request of max_model_len: a small pool still starts.
        missing = layout.pages_for_longest_request(
            reserve.longest_prompt, reserve.max_chunk) - layout.total_pages
        fitting = layout.decode_requests_fitting(missing) if missing > 0 else decode_requests
        if 0 < fitting < decode_requests:
            layout = layout_for(fitting)
    return layout


def _runnable_requests(bytes_left: int, num_rows: int, page_bytes: int,
                       request_bytes: int) -> int:
    """Requests that can hold decode scores at once: a request scores its decode steps only
    while it runs, and a running request holds a page of every (layer, KV head) row besides
    its accumulator. A small pool thus runs fewer than max_num_seqs, and reserving for all of
    them would leave too few pages for one request of max_model_len. ``bytes_left`` counts
    scratch pages as pool pages: an overestimate, so the reserve is never too small."""
    return max(0, bytes_left) // (num_rows * page_bytes + request_bytes)


def _scratch_tokens(wanted: int, kv_bytes: int, bytes_per_token: int) -> int:
    """Tokens per row of reconstruction scratch: one pass's, but at most a sixteenth of the
    KV memory (a small pool then runs shorter passes, ``worker.reconstruction``). A pool
    whose sixteenth holds less than the instruction and a few prompt tokens gets none: its
    prompts are scored by their window."""
    affordable = kv_bytes // 16 // max(1, bytes_per_token)
    if not wanted or affordable < MAX_REPEAT_TOKENS + 16:
        return 0
    return min(wanted, affordable)


def kv_cache_bytes(kv_cache_config: KVCacheConfig) -> int:
    """The bytes of vLLM's KV-cache allocation. With several KV-cache groups (a hybrid
    model) every group's tensor aliases the same allocation from byte 0, so it is counted
    once, not once per group."""
    sizes = {tensor.size for tensor in kv_cache_config.kv_cache_tensors}
    if len(sizes) > 1:
        raise NotImplementedError(
            f"kvcompress expects vLLM's KV-cache tensors to share one allocation; got sizes "
            f"{sorted(sizes)}"
        )
    return sizes.pop() if sizes else 0
