"""Threshold eviction (after KVzap): a head keeps the prefix tokens whose score passes a
threshold, so how much survives follows the content instead of a fixed budget.

A token passes when ``log(score) > T``, ``score`` being what the selection ranks (pooled by
--kv-pooling; reconstruction and expected scores are attention probabilities in (0, 1], window
scores sums of them over the window's queries). Every head also keeps a floor whatever its
scores: the observation window (added by the planner) and the first ``sink_tokens`` positions,
where heads with nothing to read park their attention (StreamingLLM's sinks). Without a cap the
head keeps the floor and every passing token. With a cap (a budget or ratio given besides the
threshold) the passing tokens compete for the cap as the method's own selection splits it (per
head, Ada-KV's shared layer totals, or the request's total shared model-wide); the sinks count
against it, so no head or request ever keeps more than its budget alone would give it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .methods.base import SelectionBlock
from .selection import PAD_INDEX, mask_to_indices

# The selection a cap goes through: a block of candidate scores (-inf: not a candidate) and
# its quotas -> kept positions [R, L, H, K], PAD_INDEX-padded, -inf picks allowed (dropped).
CappedSelection = Callable[[SelectionBlock], torch.Tensor]


def passes_threshold(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Where ``log(scores) > threshold`` (zero, negative and -inf scores never pass)."""
    return torch.log(scores.clamp(min=0.0)) > threshold


def sink_counts(quota: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """Sinks each head keeps, ``[R, L]``: ``sink_tokens``, at most the head's quota (a cap
    smaller than the sinks keeps the first ``quota`` positions)."""
    return quota.clamp(max=sink_tokens)


def threshold_candidates(scores: torch.Tensor, threshold: float,
                         sinks: torch.Tensor) -> torch.Tensor:
    """``[R, L, H, S]``: the tokens of ``scores`` (pooled) that pass ``threshold`` past each
    head's first ``sinks [R, L]`` positions (kept anyway): what a cap's selection picks
    among."""
    positions = torch.arange(scores.shape[-1], device=scores.device)
    candidate = passes_threshold(scores, threshold)
    candidate &= positions >= sinks[:, :, None, None]
    return candidate


def threshold_positions(
    block: SelectionBlock,
    threshold: float,
    sink_tokens: int,
    capped_selection: CappedSelection | None,
) -> torch.Tensor:
    """Kept prefix positions ``[R, L, H, K]`` (any order, PAD_INDEX-padded): each head's
    first ``min(sink_tokens, quota)`` positions, then its passing tokens, all of them
    (``capped_selection`` None) or those ``capped_selection`` picks within the quotas left.

    ``block.scores`` are pooled, -inf from each prefix on; ``block.quota`` is each head's cap
    beyond its window (the whole prefix when there is no cap).
    """
    scores = block.scores
    assert scores is not None, "settings refuse a threshold for methods without scores"
    requests, layers, heads, length = scores.shape
    device = scores.device
    positions = torch.arange(length, device=device)
    sinks = sink_counts(block.quota, sink_tokens)  # [R, L]
    candidate = threshold_candidates(scores, threshold, sinks)
    if capped_selection is None:
        most = int(candidate.sum(dim=-1).max()) if candidate.numel() else 0
        picked = mask_to_indices(candidate, most)
    else:
        candidate_scores = torch.where(candidate, scores, float("-inf"))
        picked = capped_selection(SelectionBlock(candidate_scores, block.prefix,
                                                 block.quota - sinks, heads))
        # A cap larger than a head's candidates fills up with -inf picks: not candidates.
        chosen = candidate.gather(-1, picked.clamp(max=max(length - 1, 0)))
        picked = torch.where((picked != PAD_INDEX) & chosen, picked, PAD_INDEX)
    most_sinks = int(sinks.max()) if sinks.numel() else 0
    slot = positions[:most_sinks]
    sink_positions = torch.where(slot < sinks[:, :, None, None], slot, PAD_INDEX)
    return torch.cat([sink_positions.expand(requests, layers, heads, most_sinks), picked], dim=-1)
