"""R-KV style: recent attention for importance, key similarity for redundancy, so that tokens
much like many others among the generated ones (repeated filler) go first and rare ones (a
number stated once) stay.

Each older offset (not among the newest ``recent``, which are always kept) scores
``IMPORTANCE_WEIGHT * importance - (1 - IMPORTANCE_WEIGHT) * redundancy``:

- importance: the attention the newest ``recent`` decode queries paid it (SnapKV's
  observation window over the output), divided by the row's largest, so in [0, 1];
- redundancy: the mean, over every other generated token of the row, of the cosine
  similarity of their keys, negative similarities counted as 0, so in [0, 1]. Keys are
  centred on the row's mean key first: they share a large common component that would make
  every pair look alike.
"""

from __future__ import annotations

import torch

from .base import DecodeMethod, GeneratedSignals, newest_offsets, recent_and_top_offsets

# R-KV's lambda. Measured on the decode recall task's attention (SmolLM2-135M, offline, full
# cache): 0.5 keeps the code in 0.38 of the heads that retrieve it at budget 256, 0.1 in 0.88.
IMPORTANCE_WEIGHT = 0.1


def key_redundancy(keys: torch.Tensor, candidates: int) -> torch.Tensor:
    """``keys [rows, generated, D]`` -> ``[rows, candidates]``: for each of the first
    ``candidates`` offsets, the mean over the row's other offsets of the centred cosine
    similarity of their keys, clamped at 0 (a different key adds nothing)."""
    keys = keys.float()
    generated = keys.shape[1]
    centred = keys - keys.mean(dim=1, keepdim=True)
    unit = torch.nn.functional.normalize(centred, dim=-1)
    similarity = (unit[:, :candidates] @ unit.transpose(1, 2)).clamp(min=0.0)
    offsets = torch.arange(generated, device=keys.device)
    itself = offsets[None, :] == offsets[:candidates, None]
    return similarity.masked_fill(itself, 0.0).sum(dim=-1) / max(1, generated - 1)


def importance_minus_redundancy(scores: torch.Tensor, keys: torch.Tensor,
                                recent: int) -> torch.Tensor:
    """``[rows, generated]`` ranking scores: the combined score on the older offsets, zero
    on the newest ``recent`` (kept anyway, never ranked)."""
    older = scores.shape[-1] - recent
    combined = torch.zeros_like(scores, dtype=torch.float32)
    if older > 0:
        importance = scores[:, :older].float()
        importance = importance / importance.amax(dim=-1, keepdim=True).clamp(min=1e-30)
        combined[:, :older] = (IMPORTANCE_WEIGHT * importance
                               - (1.0 - IMPORTANCE_WEIGHT) * key_redundancy(keys, older))
    return combined


def select_important_and_novel(signals: GeneratedSignals, num_rows: int, generated: int,
                               budget: int, recent: int) -> torch.Tensor:
    """The newest ``recent`` offsets plus the ``budget - recent`` older ones ranking highest
    by importance minus redundancy (ties: the older offset); without scores or keys, the
    newest ``budget``."""
    if signals.scores is None or signals.keys is None:
        return newest_offsets(num_rows, generated, budget)
    ranking = importance_minus_redundancy(signals.scores, signals.keys, recent)
    return recent_and_top_offsets(ranking, num_rows, generated, budget, recent)


# Scores: as snapkv (the decode steps of the newest ``recent`` tokens before an eviction,
# reset after it); keys: read from the pool at the eviction.
RKV = DecodeMethod(
    name="rkv",
    summary="keeps the newest generated tokens plus those the newest attended to most, "
    "weighed against how alike their keys are to the others' (repeated filler goes first)",
    score_collection="last_window",
    select=select_important_and_novel,
    needs_keys=True,
)
