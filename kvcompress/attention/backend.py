"""vLLM attention backend reading per-(layer, KV head) page tables.

Selected by the kvcompress workers, in their own process only: the CPU worker resolves the
CPU_ATTN registry entry to it, the CUDA worker the CUSTOM entry
(``vllm_hooks.attention_backend_override``). The backend is thin: metadata comes from the
worker's paged-KV runtime (found through ``kvcompress.step.runtime_for``), the arithmetic
from the platform kernel (``kvcompress.step.PlatformKernel``). A layer that soft-caps its
logits or has attention sinks passes them to ``attend_layer``, which hands them to the kernel
and to every score.
"""

from __future__ import annotations

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
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheLayout

from kvcompress.attention.layer import attend_layer
from kvcompress.step import KVScales, PagedAttentionMetadata, runtime_for


class KVCompressAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # fp8 pages: one byte per element with vLLM's per-layer scales (CPU: AVX-512 or AMX;
    # CUDA: kvcompress's Triton kernels).
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]

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
        # vLLM resolves backends by registry name; on CPU ours fills the CPU_ATTN entry.
        return "CPU_ATTN"

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        # vLLM's backend selection on CUDA asks before building a model with attention sinks.
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type[KVCompressAttentionImpl]:
        return KVCompressAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVCompressMetadataBuilder]:
        return KVCompressMetadataBuilder


class KVCompressCudaAttentionBackend(KVCompressAttentionBackend):
    """The same backend under the registry name it is selected by on CUDA (CUSTOM)."""

    @staticmethod
    def get_name() -> str:
        return AttentionBackendEnum.CUSTOM.name


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
        # The window is applied by the kernel; the page layout frees what leaves it.
        self.sliding_window = sliding_window or None
        self.kv_sharing_target_layer_name = None
        # vLLM spells "no soft-cap" None or 0. The sinks stay the model's parameter (its
        # values are loaded after this), one logit per query head.
        self.logits_soft_cap = logits_soft_cap or None
        self.sinks = sinks

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
        layer_index = attn_metadata.layer_index[layer.layer_name]
        expected = attn_metadata.step.layout.window_of(layer_index)
        if (self.sliding_window or 0) != expected:
            raise RuntimeError(
                f"layer {layer.layer_name}: attention window {self.sliding_window} but the page "
                f"layout has {expected or 'full attention'}"
            )
        return attend_layer(attn_metadata, layer_index, query, key, value, kv_cache, output,
                            self.scale, soft_cap=self.logits_soft_cap, sinks=self.sinks,
                            sliding_window=self.sliding_window,
                            # the scales vLLM loaded or defaulted for this layer, as its own
                            # backends pass them to their cache write and attention
                            kv_scales=KVScales(layer._k_scale_float, layer._v_scale_float))
