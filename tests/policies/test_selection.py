"""Keep masks and index compaction vs loop references, with ties."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.policies import (
    PAD_INDEX,
    mask_to_indices,
    shared_quota_mask,
    sink_recent_mask,
    top_quota_mask,
    window_mask,
)

from .reference import ref_adakv, ref_top

FAST = settings(max_examples=60, deadline=None)


def test_ties_go_to_the_lower_index():
    scores = torch.zeros(2, 10)
    scores[1, 7] = 1.0
    mask = top_quota_mask(scores, torch.tensor([3, 3]))
    assert mask[0].nonzero().flatten().tolist() == [0, 1, 2]
    assert mask[1].nonzero().flatten().tolist() == [0, 1, 7]


@FAST
@given(
    rows=st.integers(1, 6),
    length=st.integers(1, 40),
    levels=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_top_quota_matches_sorted_reference(rows, length, levels, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (rows, length), generator=gen).float()  # many ties
    quota = torch.randint(0, length + 1, (rows,), generator=gen)
    mask = top_quota_mask(scores, quota)
    for r in range(rows):
        expected = ref_top(scores[r].tolist(), int(quota[r]))
        assert set(mask[r].nonzero().flatten().tolist()) == expected


@FAST
@given(
    heads=st.integers(1, 5),
    length=st.integers(1, 25),
    floor=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_shared_quota_matches_reference(heads, length, floor, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (heads, length), generator=gen).float()
    quota = int(torch.randint(0, length + 1, (1,), generator=gen))
    head_floor = -(-quota * int(floor * 10) // 10)  # ceil(floor * quota) for these decimals
    mask = shared_quota_mask(scores, torch.tensor(head_floor), torch.tensor(heads * quota))
    expected = ref_adakv([row.tolist() for row in scores], quota, floor)
    for h in range(heads):
        assert set(mask[h].nonzero().flatten().tolist()) == expected[h]
    assert int(mask.sum()) == heads * quota
    assert bool((mask.sum(-1) >= head_floor).all())


def test_shared_quota_with_different_floors_per_group():
    """Groups with smaller floors than the batch maximum (regression: spurious floor writes)."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(4, 3, 20, generator=gen)  # 4 groups of 3 heads
    scores[1, 0] *= 0.01  # head 0 of group 1 only survives through its floor ...
    scores[1, 0, 0] = 0.02  # ... and its best token sits where padded floor slots used to point
    quota = torch.tensor([10, 6, 2, 0])
    head_floor = torch.tensor([10, 3, 0, 0])
    mask = shared_quota_mask(scores, head_floor, quota * 3)
    for group in range(4):
        rows = [row.tolist() for row in scores[group]]
        floor = int(head_floor[group]) / max(int(quota[group]), 1)
        expected = ref_adakv(rows, int(quota[group]), floor)
        got = [set(mask[group, h].nonzero().flatten().tolist()) for h in range(3)]
        assert got == expected


def test_shared_quota_never_picks_unselectable_positions():
    scores = torch.tensor([[5.0, 4.0, float("-inf")], [1.0, float("-inf"), float("-inf")]])
    mask = shared_quota_mask(scores, torch.tensor(0), torch.tensor(3))
    assert mask.tolist() == [[True, True, False], [True, False, False]]


def test_window_and_sink_masks():
    lengths = torch.tensor([10, 3])
    assert window_mask(lengths, torch.tensor([4, 3]), 10).nonzero().tolist() == [
        [0, 6],
        [0, 7],
        [0, 8],
        [0, 9],
        [1, 0],
        [1, 1],
        [1, 2],
    ]
    mask = sink_recent_mask(lengths, torch.tensor([2, 0]), torch.tensor([3, 1]), 10)
    assert mask[0].nonzero().flatten().tolist() == [0, 1, 7, 8, 9]
    assert mask[1].nonzero().flatten().tolist() == [2]


@FAST
@given(rows=st.integers(1, 5), length=st.integers(0, 30), seed=st.integers(0, 2**16))
def test_mask_to_indices_is_sorted_and_padded(rows, length, seed):
    mask = torch.rand(rows, length, generator=torch.Generator().manual_seed(seed)) < 0.4
    width = int(mask.sum(-1).max()) if length else 0
    indices = mask_to_indices(mask, width + 2)
    for r in range(rows):
        kept = mask[r].nonzero().flatten().tolist()
        assert indices[r, : len(kept)].tolist() == kept
        assert torch.all(indices[r, len(kept) :] == PAD_INDEX)
