"""Budgets shared model-wide (KVzip's pair-level eviction): every (layer, KV head, token) of
a prompt competes with every other for the whole request's total, by score.

The method still decides the total (the sum of its layer budgets; PyramidKV's schedule and
the uniform one sum to the same); only where it goes changes. The heads a context needs
(retrieval and copying heads) keep most of it, the rest little beyond the observation
window, which every head keeps anyway. Only scores that compare across layers and heads
make this meaningful: a reconstruction's (each a softmax probability) do, and ``hybrid``
ranks its two sources over the whole request before their union (worker_compaction).
"""

from __future__ import annotations

from typing import Literal

import torch

from .selection import shared_quota_positions

BudgetSharing = Literal["layer", "model"]
BUDGET_SHARINGS: tuple[BudgetSharing, ...] = ("layer", "model")


def model_wide_positions(scores: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """``scores [R, L, H, S]`` (pooled, -inf where not selectable), ``quota [R, L]`` per head:
    each request's best ``H * quota.sum()`` (layer, head, position) of all its rows ->
    kept positions ``[R, L, H, K]``, PAD_INDEX-padded (ties: lower layer, head, position)."""
    requests, layers, heads, length = scores.shape
    total = quota.sum(dim=1) * heads
    flat = scores.reshape(requests, 1, layers * heads, length)
    no_floor = torch.zeros(requests, 1, dtype=torch.long, device=scores.device)
    kept = shared_quota_positions(flat, no_floor, total[:, None])  # [R, 1, L * H, K]
    return kept.view(requests, layers, heads, kept.shape[-1])
