"""StreamingLLM: the first tokens (attention sinks) plus the most recent ones; no scores."""

from __future__ import annotations

import torch

from ..selection import PAD_INDEX
from .base import CompressionMethod, SelectionBlock, SelectionSettings


def select_sinks_and_recent(block: SelectionBlock, settings: SelectionSettings) -> torch.Tensor:
    """The first min(sink_tokens, quota) prefix positions, then the prefix's last ones.

    Capping the sinks at the quota keeps the whole observation window among the recent tokens.
    The same positions for every head of a layer.
    """
    quota = block.quota[:, :, None]  # [R, L, 1]
    sinks = quota.clamp(max=settings.sink_tokens)
    slot = torch.arange(int(block.quota.max()), device=quota.device)
    # Slots [0, sinks) are the sinks; slots [sinks, quota) the last quota - sinks of the prefix.
    recent = block.prefix[:, None, None] - quota + slot
    positions = torch.where(slot < sinks, slot, recent)
    positions = torch.where(slot < quota, positions, PAD_INDEX)
    return positions[:, :, None, :].expand(-1, -1, block.num_kv_heads, -1)


STREAMINGLLM = CompressionMethod(
    name="streamingllm",
    summary="keeps attention sinks plus the most recent tokens",
    budget_shape="uniform",
    needs_scores=False,
    select=select_sinks_and_recent,
)
