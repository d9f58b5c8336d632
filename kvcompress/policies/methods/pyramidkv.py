"""PyramidKV: SnapKV's per-head top-k selection under budgets that shrink with depth."""

from __future__ import annotations

from .base import CompressionMethod
from .snapkv import select_top_per_head

PYRAMIDKV = CompressionMethod(
    name="pyramidkv",
    summary="shrinks the per-layer budget with depth",
    budget_shape="pyramid",
    needs_scores=True,
    select=select_top_per_head,  # the paper changes the budgets, not the selection
)
