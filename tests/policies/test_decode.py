"""Decode-time eviction methods: the registry, when each collects scores, and which generated
offsets each keeps, against a loop reference (ties included)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.policies.decode import (
    DECODE_METHODS,
    DECODE_POLICIES,
    DecodeEviction,
    get_decode_method,
)


def eviction(name: str, budget: int = 6, interval: int = 4, recent: int = 2) -> DecodeEviction:
    return DecodeEviction(get_decode_method(name), budget, interval, recent)


def reference_keep(scores: torch.Tensor, budget: int, recent: int) -> list[list[int]]:
    """Per row: the newest ``recent`` offsets plus the best-scored older ones (ties: older)."""
    kept = []
    for row in scores.tolist():
        older = len(row) - recent
        ranked = sorted(range(older), key=lambda offset: (-row[offset], offset))
        kept.append(sorted(ranked[: budget - recent] + list(range(older, len(row)))))
    return kept


def test_registry_lists_the_methods_in_order_and_names_them_on_a_typo():
    assert DECODE_POLICIES == ("window", "h2o", "snapkv", "rkv", "anchors")
    assert [method.name for method in DECODE_METHODS] == list(DECODE_POLICIES)
    with pytest.raises(ValueError, match="window, h2o, snapkv, rkv, anchors"):
        get_decode_method("h2")


def test_what_each_method_scores_and_whether_scores_survive_an_eviction():
    window, h2o, snapkv, rkv, anchors = (get_decode_method(name) for name in DECODE_POLICIES)
    assert not window.needs_scores and all(m.needs_scores for m in (h2o, snapkv, rkv, anchors))
    assert [m.name for m in DECODE_METHODS if m.carries_scores] == ["h2o", "anchors"]
    assert [m.name for m in DECODE_METHODS if m.needs_keys] == ["rkv"]
    assert [m.name for m in DECODE_METHODS if m.scores_anchors] == ["anchors"]
    # budget 6 + interval 4: evicts once a head holds 10 generated tokens
    scored = {name: [g for g in range(1, 13) if eviction(name).scores_step(g)]
              for name in DECODE_POLICIES}
    assert scored == {
        "window": [],
        "h2o": list(range(1, 11)),  # every decode step up to the eviction
        "snapkv": [9, 10],  # the steps of the newest `recent` tokens before it
        "rkv": [9, 10],
        "anchors": list(range(1, 11)),
    }
    assert eviction("h2o").capacity == 10
    assert [g for g in range(8, 13) if eviction("h2o").due(g)] == [10, 11, 12]


FAST = settings(max_examples=80, deadline=None)


@FAST
@given(
    rows=st.integers(1, 5),
    budget=st.integers(1, 20),
    extra=st.integers(0, 20),
    recent_share=st.floats(0, 1),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(["h2o", "snapkv"]),
)
def test_scored_methods_keep_the_newest_plus_the_best_scored_older_offsets(
        rows, budget, extra, recent_share, levels, seed, name):
    generated = budget + extra
    recent = round(recent_share * budget)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (rows, generated), generator=gen).float()  # many ties
    rule = DecodeEviction(get_decode_method(name), budget, 3, recent)
    kept = rule.keep(scores, rows, generated)
    assert kept.dtype == torch.int64 and tuple(kept.shape) == (rows, budget)
    assert kept.tolist() == reference_keep(scores, budget, recent)


@pytest.mark.parametrize("name", DECODE_POLICIES)
def test_without_scores_every_method_keeps_the_newest(name):
    kept = eviction(name).keep(None, 3, 11)
    assert kept.tolist() == [list(range(5, 11))] * 3


def test_window_ignores_scores():
    scores = torch.arange(10.0).flip(0).expand(2, -1)  # the oldest score highest
    assert eviction("window").keep(scores, 2, 10).tolist() == [list(range(4, 10))] * 2


def test_h2o_keeps_a_heavy_hitter_far_behind_the_recent_tokens():
    scores = torch.zeros(2, 10)
    scores[0, 1], scores[0, 3], scores[0, 5] = 5.0, 4.0, 0.5
    scores[1, 0] = 1.0
    kept = eviction("h2o", budget=5, recent=2).keep(scores, 2, 10)
    assert kept.tolist() == [[1, 3, 5, 8, 9], [0, 1, 2, 8, 9]]


@pytest.mark.parametrize(
    ("arguments", "named"),
    [((0, 4, 0), "decode budget"), ((6, 0, 2), "decode interval"), ((6, 4, 7), "recent")],
)
def test_settings_are_checked_on_construction(arguments, named):
    with pytest.raises(ValueError, match=named):
        DecodeEviction(get_decode_method("h2o"), *arguments)


def test_keep_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="generated"):
        eviction("h2o").keep(None, 2, 5)  # fewer generated tokens than the budget
    with pytest.raises(ValueError, match=r"\[2, 10\]"):
        eviction("h2o").keep(torch.zeros(2, 9), 2, 10)
