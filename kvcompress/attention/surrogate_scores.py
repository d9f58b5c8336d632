"""Surrogate scores (``--kv-scoring surrogate``), written where the layer writes its K/V.

Every prompt token a surrogate-scored request prefills in a step, in any chunk, gets its
predicted reconstruction score (``profile_model.surrogates``) from the key and value the layer
has just written, in the same forward: no extra pass, no scratch pages, no device-to-host
transfer. The score (the exp of the predicted log score, in the same units as a
reconstruction pass's: the largest attention probability the key is expected to get) goes
to the request's accumulator at the token's physical slot in each row, as a pass's would.
"""

from __future__ import annotations

import math

import torch

from kvcompress.profile_model.surrogates import MIN_SCORE
from kvcompress.step import StepBatch, SurrogateTokens

# Predicted log scores are clamped before their exp: a surrogate that extrapolates badly (a
# key far outside what it was fitted on) must give a large finite score, never inf or NaN,
# which would poison every sum and top-k its request's plan takes. exp(40) ~ 2e17 leaves
# fp32 room for the sums over layers and heads.
LOG_SCORE_RANGE = (math.log(MIN_SCORE), 40.0)


def accumulate_surrogate_scores(key: torch.Tensor, value: torch.Tensor, step: StepBatch,
                                layer: int) -> None:
    """``key`` / ``value`` ``[T, H, D]``: the step's tokens as ``layer`` writes them. Fills
    the slots of every ``step.surrogate_plan`` entry's tokens in its accumulator."""
    plan = step.surrogate_plan
    assert plan is not None and plan.surrogate is not None
    log_scores = plan.surrogate.log_scores(layer, key.index_select(0, plan.token_index),
                                           value.index_select(0, plan.token_index),
                                           plan.place_features)  # [N, H]
    low, high = LOG_SCORE_RANGE
    scores = log_scores.nan_to_num_(nan=low).clamp_(low, high).exp_().T  # [H, N]
    rows = step.layer_rows(layer)
    for entry in plan.entries:
        _store(entry, layer, scores[:, entry.first : entry.first + entry.num_tokens], rows)


def _store(entry: SurrogateTokens, layer: int, scores: torch.Tensor, rows: slice) -> None:
    """One request's ``[H, n]`` scores to its slots: one slice where every row starts at
    the same slot (a request without an adopted context), else a scatter per row."""
    if entry.first_slot is not None:
        entry.scores[layer, :, entry.first_slot : entry.first_slot + entry.num_tokens] = scores
        return
    assert entry.slot_base is not None
    slots = entry.slot_base[rows, None] + torch.arange(entry.num_tokens,
                                                       device=scores.device)[None, :]
    entry.scores[layer].scatter_(1, slots, scores)
