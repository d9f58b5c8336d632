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


# ----------------------------------------------------------------------------- rkv, anchors
def random_signals(rows, generated, seed, head_size=8):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, generated, generator=gen),
            torch.randn(rows, generated, head_size, generator=gen),
            torch.rand(rows, generated, generator=gen))


@FAST
@given(
    rows=st.integers(1, 4),
    budget=st.integers(2, 24),
    extra=st.integers(0, 24),
    recent_share=st.floats(0, 1),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(["rkv", "anchors"]),
)
def test_new_methods_keep_exactly_the_budget_ascending_with_the_newest(
        rows, budget, extra, recent_share, seed, name):
    generated = budget + extra
    recent = round(recent_share * budget)
    scores, keys, anchor_scores = random_signals(rows, generated, seed)
    kept = DecodeEviction(get_decode_method(name), budget, 3, recent).keep(
        scores, rows, generated, keys=keys, anchor_scores=anchor_scores)
    assert kept.dtype == torch.int64 and tuple(kept.shape) == (rows, budget)
    for row in kept.tolist():
        assert row == sorted(set(row)), "ascending, no offset twice"
        assert row[0] >= 0 and row[-1] < generated
        assert set(range(generated - recent, generated)) <= set(row)


@pytest.mark.parametrize("name", ["rkv", "anchors"])
def test_new_methods_keep_the_newest_without_their_signals(name):
    scores = torch.rand(2, 11)
    # rkv without keys, anchors without anchor scores (a request resumed after preemption)
    assert eviction(name).keep(scores, 2, 11).tolist() == [list(range(5, 11))] * 2


def test_key_redundancy_matches_a_loop_reference():
    from kvcompress.policies.decode.rkv import key_redundancy

    keys = torch.randn(3, 9, 5, generator=torch.Generator().manual_seed(1))
    got = key_redundancy(keys, 6)
    for row in range(3):
        centred = keys[row] - keys[row].mean(0)
        for offset in range(6):
            others = [max(0.0, torch.nn.functional.cosine_similarity(
                centred[offset], centred[other], dim=0).item())
                for other in range(9) if other != offset]
            assert got[row, offset].item() == pytest.approx(sum(others) / 8, abs=1e-5)


def test_rkv_drops_repeated_filler_before_rare_tokens_of_equal_importance():
    # 12 generated tokens: offsets 0, 3, 6 are unique keys (a code being stated), the other
    # older ones are copies of two filler keys; the newest 2 are kept anyway.
    gen = torch.Generator().manual_seed(0)
    filler = torch.randn(2, 16, generator=gen)
    keys = torch.randn(1, 12, 16, generator=gen)
    for offset in (1, 2, 4, 5, 7, 8, 9):
        keys[0, offset] = filler[offset % 2] + 0.01 * torch.randn(16, generator=gen)
    scores = torch.ones(1, 12)  # equal importance: redundancy decides
    kept = eviction("rkv", budget=5, recent=2).keep(scores, 1, 12, keys=keys)
    assert kept.tolist() == [[0, 3, 6, 10, 11]]
    # and a pure heavy-hitter selection (h2o over the same scores) would not have known
    assert eviction("h2o", budget=5, recent=2).keep(scores, 1, 12).tolist() == [[0, 1, 2, 10, 11]]


def test_rkv_still_keeps_a_strong_heavy_hitter_among_duplicates():
    from kvcompress.policies.decode.rkv import IMPORTANCE_WEIGHT

    keys = torch.zeros(1, 10, 4)
    keys[0, :, 0] = 1.0  # every key alike (highly redundant) but offset 4's
    keys[0, 4] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    scores = torch.zeros(1, 10)
    scores[0, 7] = 1.0
    assert IMPORTANCE_WEIGHT > 0
    kept = eviction("rkv", budget=4, recent=2).keep(scores, 1, 10, keys=keys)
    assert kept.tolist() == [[4, 7, 8, 9]]  # the rare key, the heavy hitter, the newest


def test_anchors_keep_their_share_by_anchor_score_and_the_rest_by_mass():
    from kvcompress.policies.decode.anchors import anchor_quota

    # budget 10, recent 2: 8 scored, ceil(8 / 4) = 2 anchors, 6 by mass
    assert anchor_quota(10, 2) == 2 and anchor_quota(3, 3) == 0 and anchor_quota(4, 3) == 1
    generated = 20
    scores = torch.arange(generated, dtype=torch.float32)[None]  # newer: more mass
    anchor_scores = torch.zeros(1, generated)
    anchor_scores[0, 1], anchor_scores[0, 3] = 5.0, 4.0  # old tokens marked when written
    anchor_scores[0, 17] = 9.0  # one of the heavy hitters too: its anchor slot is not lost
    kept = eviction("anchors", budget=10, recent=2).keep(scores, 1, generated,
                                                          anchor_scores=anchor_scores)
    # anchors 17 and 1; by mass the best others of 0..17: 16, 15, 14, 13, 12, 11
    assert kept.tolist() == [[1, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    # h2o over the same mass drops both old tokens
    h2o = eviction("h2o", budget=10, recent=2).keep(scores, 1, generated).tolist()[0]
    assert 1 not in h2o and 3 not in h2o


def test_anchor_scores_need_every_step_collection():
    from kvcompress.policies.decode import DecodeMethod
    from kvcompress.policies.decode.anchors import select_anchors_and_heavy_hitters

    with pytest.raises(ValueError, match="every_step"):
        DecodeMethod("bad", "x", "last_window", select_anchors_and_heavy_hitters,
                     scores_anchors=True)


def test_keep_checks_the_shapes_of_keys_and_anchor_scores():
    with pytest.raises(ValueError, match="keys"):
        eviction("rkv").keep(torch.zeros(2, 10), 2, 10, keys=torch.zeros(2, 9, 4))
    with pytest.raises(ValueError, match="anchor scores"):
        eviction("anchors").keep(torch.zeros(2, 10), 2, 10, anchor_scores=torch.zeros(1, 10))
