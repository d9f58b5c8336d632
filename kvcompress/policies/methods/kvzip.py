"""Model-wide budgets (KVzip's pair-level eviction): every (layer, KV head, token) of the
prompt competes with every other for the whole model's total, by score.

The heads that a context needs (retrieval and copying heads) keep most of it and the rest
keep little beyond the observation window, which every head keeps anyway. Only scores that
are comparable across layers and heads make this meaningful: the reconstruction's (each a
softmax probability) are; ranks (``hybrid``'s union) are not, so the engine plans each
source model-wide apart and unites them (see worker_compaction).
"""

from __future__ import annotations

import torch

from ..selection import shared_quota_positions
from .base import CompressionMethod, SelectionBlock, SelectionSettings


def select_model_wide(block: SelectionBlock, settings: SelectionSettings) -> torch.Tensor:
    """All of a request's rows as one group sharing the sum of their quotas."""
    scores = block.scores
    assert scores is not None
    requests, layers, heads, length = scores.shape
    total = block.quota.sum(dim=1) * heads  # [R]
    flat = scores.reshape(requests, 1, layers * heads, length)
    floor = torch.zeros(requests, 1, dtype=torch.long, device=scores.device)
    kept = shared_quota_positions(flat, floor, total[:, None])  # [R, 1, L * H, K]
    return kept.view(requests, layers, heads, kept.shape[-1])


KVZIP = CompressionMethod(
    name="kvzip",
    summary="shares the whole model's budget among all layers and KV heads by score",
    budget_shape="uniform",
    needs_scores=True,
    select=select_model_wide,
    spans_layers=True,
)
