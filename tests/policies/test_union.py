"""Hybrid scoring's union of rankings shared model-wide, selected slice by slice
(``policies.union``): the same kept set as ranking the whole request (``rank_union`` with
ranked_dims over every element, then the top by value), key for key, ties included."""

from __future__ import annotations

import pytest
import torch

from kvcompress.policies import rank_union, ranking_keys
from kvcompress.policies.union import (
    _bracket_point,
    kth_largest_keys,
    model_wide_union_selection,
    union_keys,
    union_values,
)


def ranked_whole(first: torch.Tensor, second: torch.Tensor, total: int) -> torch.Tensor:
    """The kept mask of the whole ranking: the union's ``total`` best values, ties to the
    lower flat position (as model-wide planning keeps them)."""
    union = rank_union([first, second], ranked_dims=first.dim()).reshape(-1)
    kept = torch.zeros(union.numel(), dtype=torch.bool)
    kept[torch.topk(ranking_keys(union), total).indices] = True
    return kept


def selected_by_slices(first: torch.Tensor, second: torch.Tensor, total: int,
                       rows_at_once: int, capacity: int, points: int) -> torch.Tensor:
    rows, length = first.shape

    def slices():
        for row in range(0, rows, rows_at_once):
            yield row * length, [first[row:row + rows_at_once].reshape(-1),
                                 second[row:row + rows_at_once].reshape(-1)]

    selection = model_wide_union_selection(slices, rows * length, total, capacity, points,
                                           torch.device("cpu"))
    kept = torch.zeros(rows * length, dtype=torch.bool)
    for start, scores in slices():
        kept[start:start + scores[0].numel()] = selection(start, scores)
    return kept


@pytest.mark.parametrize("levels", [3, 50, None], ids=["many-ties", "some-ties", "no-ties"])
@pytest.mark.parametrize("seed", range(5))
def test_the_kept_set_is_the_whole_rankings(levels, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 20, (1,), generator=generator))
    length = int(torch.randint(2, 200, (1,), generator=generator))
    if levels is None:
        first = torch.rand(rows, length, generator=generator)
        second = torch.rand(rows, length, generator=generator) * 100
    else:  # equal scores: a source ranks them by position
        first = torch.randint(0, levels, (rows, length), generator=generator).float()
        second = torch.randint(0, levels, (rows, length), generator=generator).float()
    window = int(torch.randint(0, min(5, length), (1,), generator=generator))
    if window:  # not selectable: ranked lowest, never kept
        first[:, -window:] = second[:, -window:] = float("-inf")
    selectable = rows * (length - window)
    for total in (0, 1, selectable // 3, selectable // 2 + 1, selectable):
        expected = ranked_whole(first, second, total)
        for rows_at_once, capacity, points in [(1, 5, 3), (3, 40, 2), (rows, 10**9, 4),
                                                (2, 50, 5)]:
            kept = selected_by_slices(first, second, total, rows_at_once, capacity, points)
            assert torch.equal(kept, expected), (total, rows_at_once, capacity, points)


def test_kth_largest_keys_reads_the_keys_by_digits():
    generator = torch.Generator().manual_seed(0)
    scores = [torch.randint(0, 5, (1000,), generator=generator).float(),
              torch.randn(1000, generator=generator)]
    keys = [union_keys(score, 0) for score in scores]
    counts = [[1, 7, 500, 1000], [3, 999, 2, 1000]]

    def slices():
        for start in range(0, 1000, 300):
            yield [key[start:start + 300] for key in keys]

    found = kth_largest_keys(slices, counts, torch.device("cpu"))
    for source, key in enumerate(keys):
        descending = key.sort(descending=True).values
        assert found[source] == [int(descending[k - 1]) for k in counts[source]]


def test_bracket_points_sit_where_the_union_value_steps():
    """Past 2**24 elements fp32 rounds neighbouring ranks to one union value: a bracket
    point never splits them (so the kept set ends between two values)."""
    size = 3 * 2**25 + 5
    for k in (1, 12_345, 2**25 - 3, 2**25, 3 * 2**24 + 1, size - 1):
        for upward in (False, True):
            point = _bracket_point(k, size, upward)
            assert (point >= k) if upward else (point <= k)
            rank = size - point  # the lowest rank of the top ``point``
            if 0 < rank < size:
                below, at = union_values(torch.tensor([rank - 1, rank]), size)
                assert below < at
    small = 2**20
    assert all(_bracket_point(k, small, upward) == k
               for k in (1, 77, small - 1) for upward in (False, True))
