"""SnapKV: every layer keeps the same budget; each KV head keeps its top-scored tokens."""

from __future__ import annotations

import torch

from ..selection import top_quota_positions
from .base import CompressionMethod, SelectionBlock, SelectionSettings


def select_top_per_head(block: SelectionBlock, settings: SelectionSettings) -> torch.Tensor:
    """Each head's ``quota`` highest pooled scores (ties: lower position)."""
    return top_quota_positions(block.scores, block.quota[:, :, None])


SNAPKV = CompressionMethod(
    name="snapkv",
    summary="keeps the same budget in every layer",
    budget_shape="uniform",
    needs_scores=True,
    select=select_top_per_head,
)
