"""Anchors: besides the recent window and H2O's heavy hitters, a small budget of its own for
the tokens the generation itself marked as important when they were written, i.e. those that
received the most attention from the ``recent`` decode queries right after them (a stated
fact that the next tokens lean on, a code being spelled out).

H2O alone ranks by attention mass summed over the whole generation, where a fact nobody
looks at for a thousand tokens loses to filler that every query glances at. An anchor's score
is fixed once it is ``recent`` tokens old, so no later filler outgrows it; anchors compete
only with each other for their share.
"""

from __future__ import annotations

import torch

from ..selection import top_quota_positions
from .base import DecodeMethod, GeneratedSignals, newest_offsets

# Share of the scored part (budget - recent) reserved for anchors, rounded up.
ANCHOR_SHARE = 0.25


def anchor_quota(budget: int, recent: int) -> int:
    """Anchors kept per row: ``ANCHOR_SHARE`` of ``budget - recent``, rounded up."""
    scored = budget - recent
    return min(scored, int(-(-scored * ANCHOR_SHARE // 1)))


def select_anchors_and_heavy_hitters(signals: GeneratedSignals, num_rows: int, generated: int,
                                     budget: int, recent: int) -> torch.Tensor:
    """Per row: the newest ``recent`` offsets, the ``anchor_quota`` older ones with the most
    anchor score, then the rest of the budget by accumulated attention mass among the others
    (ties: the older offset), ascending. Without scores, the newest ``budget``."""
    scores, anchor_scores = signals.scores, signals.anchor_scores
    if scores is None or anchor_scores is None:
        return newest_offsets(num_rows, generated, budget)
    older = generated - recent
    device = scores.device
    anchors = top_quota_positions(anchor_scores[:, :older].float(),
                                  torch.tensor(anchor_quota(budget, recent), device=device))
    others = scores[:, :older].float().scatter(-1, anchors, float("-inf"))
    heavy = top_quota_positions(others, torch.tensor(budget - recent - anchors.shape[-1],
                                                     device=device))
    newest = torch.arange(older, generated, device=device).expand(num_rows, -1)
    return torch.cat([anchors, heavy, newest], dim=-1).sort(dim=-1).values


# Scores: H2O's (every decode step, carried over an eviction); anchor scores: the same mass
# counted only while a token is among the newest ``recent``, carried likewise.
ANCHORS = DecodeMethod(
    name="anchors",
    summary="keeps the newest generated tokens, a quarter of the rest for those the next "
    "tokens attended to most when they were written, and the rest by attention mass so far",
    score_collection="every_step",
    select=select_anchors_and_heavy_hitters,
    scores_anchors=True,
)
