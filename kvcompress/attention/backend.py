"""vLLM attention backend reading per-(layer, KV head) page tables.

Selected by the kvcompress worker (it overrides the CPU_ATTN registry entry in its own
process only when compression is on). The backend is thin: metadata comes from the
worker's paged-KV runtime, the arithmetic from the platform kernel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from kvcompress.attention.window_scores import accumulate_window_scores
from kvcompress.engine.kv_state import StepBatch


@dataclass
class PagedAttentionMetadata:
    step: StepBatch
    num_actual_tokens: int
    kernel: Any  # the platform kernel object (e.g. CpuPagedKernel)
    kernel_args: Any  # what kernel.prepare(step) returned
    layer_index: dict[str, int]
    group_reduce: str


class KVCompressAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        # vLLM's blocks are only logical here; pages have their own size (--kv-page-size).
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        # vLLM resolves backends by registry name; ours overrides the CPU_ATTN entry.
        return "CPU_ATTN"

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[KVCompressAttentionImpl]:
        return KVCompressAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVCompressMetadataBuilder]:
        return KVCompressMetadataBuilder


class KVCompressMetadataBuilder(AttentionMetadataBuilder[PagedAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PagedAttentionMetadata | None:
        from kvcompress.engine.runtime import runtime_for

        runtime = runtime_for(self.vllm_config)
        if runtime is None:
            return None  # profiling / warm-up before the page pool exists
        return runtime.build_attention_metadata(common_attn_metadata)


class KVCompressAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unused: Any,
    ) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "sliding-window attention": sliding_window is not None,
            "logits soft-capping": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        found = [name for name, present in unsupported.items() if present]
        if found:
            raise NotImplementedError(
                f"kvcompress attention does not support {', '.join(found)} yet; "
                "serve this model with --kv-compression none"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.sliding_window = None
        self.kv_sharing_target_layer_name = None

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: PagedAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:
            return output.fill_(0)  # warm-up / profiling without a KV cache
        step = attn_metadata.step
        kernel = attn_metadata.kernel
        layer_index = attn_metadata.layer_index[layer.layer_name]
        num_tokens = attn_metadata.num_actual_tokens
        query, output = query[:num_tokens], output[:num_tokens]
        slots = step.slot_mapping[:, step.layer_rows(layer_index)]
        kernel.write(kv_cache, key[:num_tokens], value[:num_tokens], slots)
        kernel.attend(attn_metadata.kernel_args, layer_index, query, kv_cache, output, self.scale)
        if step.window_queries:
            started = time.perf_counter()
            # A platform kernel may score the window itself (one Triton launch on GPU).
            scorer = getattr(kernel, "accumulate_window_scores", None)
            if scorer is not None:
                scorer(attn_metadata.kernel_args, layer_index, query, kv_cache, step,
                       self.scale, attn_metadata.group_reduce)
            else:
                accumulate_window_scores(query, kv_cache, kernel.page_format, step,
                                         layer_index, self.scale, attn_metadata.group_reduce,
                                         key=key[:num_tokens])
            step.score_seconds += time.perf_counter() - started
        return output
