"""Budgets shared model-wide (KVzip's pair-level eviction): every (layer, KV head, token) of
a prompt competes with every other for the whole request's total, by score.

The method still decides the total (the sum of its layer budgets; PyramidKV's schedule and
the uniform one sum to the same); only where it goes changes. The heads a context needs
(retrieval and copying heads) keep most of it, the rest little beyond the observation
window, which every head keeps anyway. Only scores that compare across layers and heads
make this meaningful: a reconstruction's (each a softmax probability) do, and ``hybrid``
ranks its two sources over the whole request before their union (worker.compaction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal

import torch

from .selection import PAD_INDEX, mask_to_indices, score_keys, shared_quota_positions

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


# Model-wide sharing of a long prompt, exactly, a slice of layers at a time: the request's
# cut-off key (the ``total``-th largest of its keys, as ``model_wide_positions`` ranks them)
# is found digit by digit (16 bits a pass over the slices: a histogram per request), then
# each slice keeps its keys at or above it. Unique keys make that the same set as the top-k.
_DIGIT_BITS = 16
_DIGITS = 1 << _DIGIT_BITS
_ONE = torch.ones((), dtype=torch.long)


def model_wide_keys(scores: torch.Tensor, first_layer: int) -> torch.Tensor:
    """``scores [R, L', H, S]`` of layers ``first_layer...`` -> their keys ``[R, L' * H * S]``
    as ``model_wide_positions`` ranks a request's whole ``[L, H, S]`` (``ranking_keys`` of
    the flattened rows: ties to the lower layer, head, position)."""
    requests, layers, heads, length = scores.shape
    keys = score_keys(scores).view(requests, layers * heads, length)
    first_row = first_layer * heads
    rows = torch.arange(first_row, first_row + layers * heads, device=scores.device)
    # The low 32 bits are zero: adding the inverted flat position is or-ing it in, here by
    # broadcast parts (row, then position) rather than one flat arange as large as the keys.
    keys += (0xFFFFFFFF - rows * length)[:, None]
    keys -= torch.arange(length, device=scores.device)
    return keys.view(requests, -1)


def model_wide_cutoffs(key_slices: Callable[[], Iterator[torch.Tensor]],
                       total: torch.Tensor) -> torch.Tensor:
    """Each request's ``total[r]``-th largest key (``[R]``, int64; any value where
    ``total[r]`` is 0), reading its keys as ``key_slices()`` yields them (``[R, N]`` slices,
    read once per 16-bit digit: four times)."""
    requests = total.shape[0]
    device = total.device
    remaining = total.clone()
    prefix = torch.zeros(requests, dtype=torch.long, device=device)
    for number, shift in enumerate(range(64 - _DIGIT_BITS, -1, -_DIGIT_BITS)):
        histogram = torch.zeros(requests, _DIGITS + 1, dtype=torch.long, device=device)
        for keys in key_slices():  # in place where it can: a slice's keys are large
            if number == 0:  # the sign digit: signed, made unsigned in order
                digit = (keys >> shift).add_(_DIGITS // 2)
            else:  # the keys under the digits found so far; the others to a spare bin
                outside = (keys >> (shift + _DIGIT_BITS)) != prefix[:, None]
                digit = (keys >> shift).bitwise_and_(_DIGITS - 1).masked_fill_(outside, _DIGITS)
                del outside
            del keys
            histogram.scatter_add_(1, digit, _ONE.to(device).expand_as(digit))
            del digit
        # at_least[d]: keys whose digit is d or more; the cut-off's digit is the largest d
        # with at least ``remaining`` of them.
        at_least = histogram[:, :_DIGITS].flip(1).cumsum(1).flip(1)
        chosen = (at_least >= remaining[:, None].clamp(min=1)).sum(1) - 1
        above = torch.where(chosen + 1 < _DIGITS,
                            at_least.gather(1, (chosen + 1).clamp(max=_DIGITS - 1)[:, None])[:, 0],
                            0)
        remaining = remaining - above
        prefix = chosen - _DIGITS // 2 if number == 0 else (prefix << _DIGIT_BITS) | chosen
    return prefix


def model_wide_counts(keys: torch.Tensor, cutoff: torch.Tensor, total: torch.Tensor,
                      candidate: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, rows]``: how many of each row's keys (``keys [R, rows, S]``) are kept, at or
    above its request's cut-off (and ``candidate``, where given)."""
    kept = keys >= cutoff[:, None, None]
    if candidate is not None:
        kept &= candidate
    return kept.sum(dim=-1) * (total > 0)[:, None]


def model_wide_slice_positions(scores: torch.Tensor, first_layer: int, cutoff: torch.Tensor,
                               total: torch.Tensor) -> torch.Tensor:
    """Kept positions ``[R, L', H, K]`` (ascending, PAD_INDEX-padded) of layers
    ``first_layer...`` of ``scores [R, L', H, S]``: the keys at or above each request's
    ``cutoff`` (``model_wide_cutoffs``), none where its ``total`` is 0."""
    keys = model_wide_keys(scores, first_layer).view(scores.shape)
    kept = keys >= cutoff[:, None, None, None]
    del keys
    kept &= (total > 0)[:, None, None, None]
    width = int(kept.sum(dim=-1).max()) if kept.numel() else 0
    return mask_to_indices(kept, width, PAD_INDEX)
