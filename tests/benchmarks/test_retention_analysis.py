"""Needle retention analysis: where the answer sits in the prompt, and which rows keep it."""

from __future__ import annotations

import random

import torch

from benchmarks.quality.tasks import TASKS, Sample
from benchmarks.retention_analysis import answer_positions, render, rows_holding_answer


def char_offsets(text: str) -> list[tuple[int, int]]:
    """A toy tokenizer: one token per character."""
    return [(i, i + 1) for i in range(len(text))]


def test_answer_positions_find_every_copy_outside_the_question(count_words):
    prompt, answers, _, _ = TASKS["passkey"](random.Random(3), 300, count_words)
    sample = Sample("passkey", 300, 0, prompt, answers, "all", 10)
    copies = answer_positions(sample, char_offsets(prompt))
    assert len(copies) == 2  # "The pass key is K. Remember it. K is the pass key."
    for copy in copies:
        assert "".join(prompt[i] for i in copy) == answers[0]
        assert copy[-1] < prompt.rindex("\n\n")


def test_a_row_holds_the_answer_when_one_whole_copy_is_kept():
    copies = [[3, 4], [10, 11]]
    kept = torch.tensor([[[3, 4, 7, 0], [3, 10, 11, 0]],   # copy 1 / copy 2 whole
                         [[3, 10, 0, 0], [4, 11, 5, 0]]])  # halves only
    counts = torch.tensor([[3, 3], [2, 3]])  # padding beyond the count never counts
    held = rows_holding_answer(kept, counts, copies)
    assert held.tolist() == [[True, True], [False, False]]
    padded = rows_holding_answer(torch.tensor([[[3, 4]]]), torch.tensor([[1]]), copies)
    assert padded.tolist() == [[False]]  # position 4 sits in the padding


def test_render_splits_layers_in_thirds():
    text = render([{"label": "snapkv:64", "rows_holding": 0.5, "prompts_all_rows": 0.0,
                    "per_layer": [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]}])
    assert "snapkv:64" in text and "1.00" in text
