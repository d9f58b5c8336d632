"""Derive the page layout from vLLM's KV-cache config, identically in every process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

from kvcompress.engine.scoring_memory import reserved_bytes, scored_token_reserve
from kvcompress.paging import PageLayout


def attention_layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    """The model's attention layers in depth order (row order of the page tables)."""
    groups = kv_cache_config.kv_cache_groups
    specs = [group.kv_cache_spec for group in groups]
    if len(groups) != 1 or type(specs[0]) is not FullAttentionSpec:
        kinds = sorted({type(spec).__name__ for spec in specs})
        raise NotImplementedError(
            "kvcompress supports decoder-only models whose layers all use full attention "
            f"(one FullAttentionSpec KV-cache group); this model has {kinds}"
        )
    return sorted(groups[0].layer_names, key=extract_layer_index)


@dataclass(frozen=True)
class ScoringReserve:
    """What the window-score reserve is sized for (``scoring_memory``)."""

    scored_tokens: int
    longest_prompt: int

    @classmethod
    def of(cls, vllm_config: Any) -> ScoringReserve:
        max_model_len = vllm_config.model_config.max_model_len
        batched = vllm_config.scheduler_config.max_num_batched_tokens
        return cls(scored_token_reserve(max_model_len, batched), max_model_len)


def page_layout(kv_cache_config: KVCacheConfig, page_size: int,
                reserve: ScoringReserve | None = None) -> PageLayout:
    """Pages of ``page_size`` tokens fitting in the bytes vLLM budgets for its KV cache,
    less the window-score ``reserve``."""
    layer_names = attention_layer_names(kv_cache_config)
    spec: Any = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    if spec.head_size_v != spec.head_size:
        raise NotImplementedError("kvcompress needs equal key and value head sizes")
    kv_cache_bytes = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
    return PageLayout.for_memory(
        kv_cache_bytes=kv_cache_bytes,
        reserved_bytes=0 if reserve is None else reserved_bytes(
            reserve.scored_tokens, len(layer_names), spec.num_kv_heads, reserve.longest_prompt),
        num_layers=len(layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        page_size=page_size,
        dtype_bytes=torch.empty((), dtype=spec.dtype).element_size(),
    )
