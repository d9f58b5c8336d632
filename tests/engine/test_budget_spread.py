"""The worst spread of a shared budget (kvcompress.engine.sched.budget_spread) against every
spread, enumerated."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.engine.sched.budget_spread import worst_spreads


def pages(lengths: np.ndarray, page_size: int) -> int:
    return int((-(-np.asarray(lengths) // page_size)).sum())


@st.composite
def groups(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    count, width = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    cap = draw(st.integers(0, 12))
    floors = np.array([draw(st.integers(0, cap)) for _ in range(count)])
    totals = np.array([draw(st.integers(width * f, width * cap)) for f in floors])
    offsets = np.array(draw(st.lists(st.integers(0, 9), min_size=count * width,
                                     max_size=count * width))).reshape(count, width)
    return offsets, floors, cap, totals, page_size


@settings(max_examples=300, deadline=None)
@given(groups(), st.integers(0, 20))
def test_the_worst_spread_takes_the_most_pages_any_spread_takes(case, growth):
    offsets, floors, cap, totals, page_size = case
    spreads = worst_spreads(offsets, floors, cap, totals, page_size)
    assert spreads.shape == (page_size, offsets.size)
    # Every one is a spread the policy could pick.
    shares = spreads.reshape(page_size, *offsets.shape) - offsets
    assert (shares >= floors[:, None]).all() and (shares <= cap).all()
    assert (shares.sum(axis=-1) == totals).all()
    # The one for this growth takes the most pages of all spreads.
    most = 0
    for group_shares in itertools.product(*[
            [c for c in itertools.product(range(f, cap + 1), repeat=offsets.shape[1])
             if sum(c) == total] for f, total in zip(floors, totals)]):
        most = max(most, pages(np.concatenate(group_shares) + offsets.ravel() + growth,
                               page_size))
    assert pages(spreads[growth % page_size] + growth, page_size) == most
