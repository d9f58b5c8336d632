"""How full requests' pages are: what admission reads of every running request, every step.

A decoding request's full-attention rows all grow one token per step, so what its growth
will cost depends only on how many pages its rows take and how many free slots each row's
last page has (``fill_of_lengths``). Admission asks that of hundreds of requests every step,
so it is not recounted row by row: a full-attention row holds ``L - e`` tokens (``L`` the
request's logical tokens, ``e`` the row's evicted ones). Writing ``e = q * page_size + r``
and ``L = Q * page_size + R``, the row takes ``Q - q + (r < R)`` pages and has ``(r - R) mod
page_size`` free slots. So each request keeps, over its full rows, the sum of ``q`` and the
rows counted by ``r`` (``evicted_fill``), which only a compaction changes; ``L`` is applied
per request (``PageFill.of_summaries``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.page_table import fill_of_lengths


@dataclass(frozen=True)
class PageFill:
    """Many requests' rows against their pages now, entry ``i`` for request ``i``."""

    owned_pages: np.ndarray  # [n] pages held
    # Of the full-attention rows: the pages their tokens take, and [n, page_size + 1] how
    # many have fewer than k free slots in their last page (fill_of_lengths).
    full_pages: np.ndarray
    free_below: np.ndarray
    sliding_lengths: np.ndarray  # [n, sliding rows]: tokens of the sliding-window rows

    @classmethod
    def of_lengths(cls, lengths: np.ndarray, owned_pages: np.ndarray,
                   layout: PageLayout) -> PageFill:
        """From per-row tokens ``[n, rows]``, row by row."""
        full = layout.row_windows == 0
        pages, free_below = fill_of_lengths(lengths[:, full], layout.page_size)
        return cls(owned_pages, pages, free_below, lengths[:, ~full])

    @classmethod
    def of_summaries(cls, logical: np.ndarray, owned_pages: np.ndarray,
                     summaries: Sequence[np.ndarray], sliding_lengths: np.ndarray,
                     layout: PageLayout) -> PageFill:
        """Equal to ``of_lengths`` of the rows' physical lengths, from each request's
        ``logical`` tokens and the ``evicted_fill`` summary of its rows: no per-row work."""
        page_size = layout.page_size
        width = 2 * page_size + 2
        flat = np.concatenate(summaries) if len(summaries) else np.zeros(0, dtype=np.int64)
        whole, slot = np.divmod(logical, page_size)
        start = np.arange(len(logical)) * width  # each summary's place in ``flat``
        at_slot = start + 1 + slot  # rows_below[R]
        below_slot = flat[at_slot]
        full_pages = len(layout.compressed_rows) * whole - flat[start] + below_slot
        # Rows with fewer than k free slots: those with r in [R, R + k), wrapping around.
        free_below = flat[at_slot[:, None] + np.arange(page_size + 1)] - below_slot[:, None]
        return cls(owned_pages, full_pages, free_below, sliding_lengths)


def evicted_fill(evicted: np.ndarray, layout: PageLayout) -> np.ndarray:
    """Over the full-attention rows' evicted tokens ``e = q * page_size + r``: the sum of
    ``q``, then ``rows_below[j]`` for ``j`` in [0, 2 * page_size], the rows with ``r < j``
    counting each row at ``r`` and again at ``r + page_size`` (so a range of ``r`` that wraps
    around is one difference)."""
    page_size = layout.page_size
    whole, slot = np.divmod(evicted[layout.compressed_rows], page_size)
    rows_by_slot = np.bincount(slot, minlength=page_size)
    rows_below = np.zeros(2 * page_size + 1, dtype=np.int64)
    np.cumsum(np.tile(rows_by_slot, 2), out=rows_below[1:])
    return np.concatenate(([whole.sum()], rows_below))
