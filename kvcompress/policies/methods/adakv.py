"""Ada-KV: the heads of a layer share its (pyramid) total, each above a floor, by score."""

from __future__ import annotations

import torch

from ..selection import shared_quota_positions
from ..validation import exact_fraction
from .base import CompressionMethod, SelectionBlock, SelectionSettings


def select_shared_by_heads(block: SelectionBlock, settings: SelectionSettings) -> torch.Tensor:
    """Each head first takes its top ceil(adakv_floor * quota), then the layer's H * quota slots
    left go to the best remaining scores of any head."""
    floor = exact_fraction(settings.adakv_floor)
    # ceil(floor * quota) in integers, exact for the decimal the user gave
    head_floor = (block.quota * floor.numerator + floor.denominator - 1) // floor.denominator
    return shared_quota_positions(block.scores, head_floor, block.quota * block.num_kv_heads)


ADAKV = CompressionMethod(
    name="adakv",
    summary="shares each layer's budget among its KV heads by score",
    budget_shape="pyramid",
    needs_scores=True,
    select=select_shared_by_heads,
    shape_setting="adakv_totals",
    shares_layer_budget=True,
)
