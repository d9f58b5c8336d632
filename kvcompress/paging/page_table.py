"""A request's page table: for every (layer, KV head) row, the pages it holds, in order."""

from __future__ import annotations

import itertools

import numpy as np

# Every change of any table takes the next number: a (table, contents) pair is identified
# by its version alone, so a cache keyed on versions never mistakes a new table for an old.
_VERSIONS = itertools.count(1)


def pages_for_lengths(lengths: np.ndarray, page_size: int) -> np.ndarray:
    return (lengths + (page_size - 1)) // page_size


def fill_of_lengths(lengths: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each request (a row of ``lengths [requests, rows]``): the pages its rows' tokens
    take, and ``free_below[k]``, how many of its rows have fewer than ``k`` free slots in
    their last page (``k`` in [0, page_size]; an empty row has none).

    A row with ``f`` free slots needs ``ceil(max(0, d - f) / page_size)`` new pages after
    ``d`` more tokens, so a request's rows together need ``(d // page_size) * rows +
    free_below[d % page_size]``.
    """
    # Per-row arithmetic in int32 (a row's tokens fit) and in place: admission calls this
    # every step over many requests' rows.
    lengths = np.asarray(lengths).astype(np.int32)
    count = lengths.shape[0]
    pages = pages_for_lengths(lengths, page_size)
    slack = pages * page_size
    slack -= lengths
    slack += (np.arange(count, dtype=np.int32) * page_size)[:, None]  # a bin range per request
    free_slots = np.bincount(slack.ravel(), minlength=count * page_size)
    free_below = np.zeros((count, page_size + 1), dtype=np.int64)
    np.cumsum(free_slots.reshape(count, page_size), axis=1, out=free_below[:, 1:])
    return pages.sum(axis=1, dtype=np.int64), free_below


def most_of_fills(pages: np.ndarray, free_below: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``fill_of_lengths`` of alternative outcomes (``pages [k, ...]``, ``free_below [k, ...,
    page_size + 1]``) as one fill that takes, after any growth, the most pages any outcome
    takes then: outcome ``a`` takes ``pages[a] + (d // page_size) * rows +
    free_below[a, d % page_size]`` after ``d`` more tokens per row, so the most is the
    same form over the slot-wise maximum."""
    most = (np.asarray(pages)[..., None] + free_below).max(axis=0)
    return most[..., 0], most - most[..., :1]


class HeadPageTable:
    """Page ids per row (``pages[row, :num_pages[row]]``), growing on demand.

    Both the scheduler's page manager and the worker's mirror use this class and apply
    the same appends and truncations, so their tables stay identical.
    """

    def __init__(self, num_rows: int, page_size: int, initial_capacity: int = 4) -> None:
        self.page_size = page_size
        self.pages = np.zeros((num_rows, max(1, initial_capacity)), dtype=np.int32)
        self.num_pages = np.zeros(num_rows, dtype=np.int32)
        # num_pages.sum(), kept up to date: admission reads it for every request each step.
        self.total_pages = 0
        self.version = next(_VERSIONS)

    @property
    def num_rows(self) -> int:
        return self.pages.shape[0]

    def pages_missing(self, lengths: np.ndarray) -> np.ndarray:
        """Pages each row still needs to hold ``lengths`` tokens (0 where it has enough)."""
        needed = pages_for_lengths(lengths, self.page_size) - self.num_pages
        return np.maximum(needed, 0).astype(np.int32)

    def append(self, counts: np.ndarray, page_ids: np.ndarray) -> None:
        """Append ``counts[row]`` pages to each row, taken in row order from ``page_ids``."""
        total = int(counts.sum())
        if total != len(page_ids):
            raise ValueError(f"{total} pages requested by counts, {len(page_ids)} given")
        if total == 0:
            return
        self._reserve(int((self.num_pages + counts).max()))
        rows = np.repeat(np.arange(self.num_rows), counts)
        first_of_row = np.cumsum(counts) - counts
        offset_in_row = np.arange(total) - np.repeat(first_of_row, counts)
        self.pages[rows, self.num_pages[rows] + offset_in_row] = page_ids
        self.num_pages += counts.astype(np.int32)
        self.total_pages += total
        self.version = next(_VERSIONS)

    def truncate(self, lengths: np.ndarray) -> np.ndarray:
        """Drop trailing pages beyond what ``lengths`` tokens need; return the dropped ids."""
        keep = np.minimum(pages_for_lengths(lengths, self.page_size), self.num_pages)
        dropped = self.pages_between(keep, self.num_pages)
        self.num_pages = keep.astype(np.int32)
        self.total_pages -= len(dropped)
        self.version = next(_VERSIONS)
        return dropped

    def drop_leading(self, counts: np.ndarray) -> np.ndarray:
        """Drop the first ``counts[row]`` pages of each row (tokens that fell out of a
        sliding window); the rest shift to the front. Return the dropped ids."""
        counts = np.asarray(counts, dtype=np.int32)
        if (counts < 0).any() or (counts > self.num_pages).any():
            raise ValueError(f"cannot drop {counts.tolist()} leading pages of rows holding "
                             f"{self.num_pages.tolist()}")
        return self.drop_between(np.zeros_like(counts), counts)

    def drop_between(self, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """Drop pages ``[start[row], stop[row])`` of each row (a shared segment compacted
        in place: the pages it no longer needs leave the middle of every reader's row); the
        pages after them shift down. Return the dropped ids, in row order."""
        start = np.asarray(start, dtype=np.int32)
        stop = np.asarray(stop, dtype=np.int32)
        if (start < 0).any() or (stop < start).any() or (stop > self.num_pages).any():
            raise ValueError(f"cannot drop pages {start.tolist()}..{stop.tolist()} of rows "
                             f"holding {self.num_pages.tolist()}")
        dropped = self.pages_between(start, stop)
        width = self.pages.shape[1]
        columns = np.arange(width)[None, :]
        source = np.where(columns < start[:, None], columns, columns + (stop - start)[:, None])
        self.pages = np.take_along_axis(self.pages, np.minimum(source, width - 1), axis=1)
        self.num_pages = (self.num_pages - (stop - start)).astype(np.int32)
        self.total_pages -= len(dropped)
        self.version = next(_VERSIONS)
        return dropped

    def leading_pages(self, counts: np.ndarray) -> np.ndarray:
        """The first ``counts[row]`` pages of each row, in row order (the table unchanged)."""
        return self.pages_between(np.zeros_like(self.num_pages),
                                  np.minimum(counts, self.num_pages))

    def pages_after(self, counts: np.ndarray) -> np.ndarray:
        """Each row's pages past its first ``counts[row]``, in row order."""
        return self.pages_between(np.minimum(counts, self.num_pages), self.num_pages)

    def all_pages(self) -> np.ndarray:
        return self.pages_between(np.zeros_like(self.num_pages), self.num_pages)

    def pages_between(self, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """Each row's pages ``[start[row], stop[row])``, in row order."""
        width = self.pages.shape[1]
        columns = np.arange(width)[None, :]
        mask = (columns >= start[:, None]) & (columns < stop[:, None])
        return self.pages[mask]

    def _reserve(self, width: int) -> None:
        if width <= self.pages.shape[1]:
            return
        new_width = max(width, 2 * self.pages.shape[1])
        grown = np.zeros((self.num_rows, new_width), dtype=np.int32)
        grown[:, : self.pages.shape[1]] = self.pages
        self.pages = grown
