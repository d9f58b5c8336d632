"""Window: the newest generated tokens (StreamingLLM over the output); no scores."""

from __future__ import annotations

import torch

from .base import DecodeMethod, GeneratedSignals, newest_offsets


def select_newest(signals: GeneratedSignals, num_rows: int, generated: int, budget: int,
                  recent: int) -> torch.Tensor:
    """The newest ``budget`` offsets of every row (scores are ignored)."""
    return newest_offsets(num_rows, generated, budget)


WINDOW = DecodeMethod(
    name="window",
    summary="keeps the newest generated tokens",
    score_collection="none",
    select=select_newest,
)
