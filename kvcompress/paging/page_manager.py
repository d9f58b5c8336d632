"""Scheduler-side owner of the page pool: who holds which page, and how many are free.

Admission and preemption are decided in pages. Every page is either on the free stack or
in exactly one request's page table; ``check_invariants`` verifies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.page_table import HeadPageTable


@dataclass
class PageTableDelta:
    """Page-table changes of one request since the worker last heard about it.

    ``fresh``: the request's table was (re)created, so the worker must drop whatever it
    holds for this request id before applying ``appends``. ``drops[row]``: leading pages
    that fell out of the row's sliding window (``HeadPageTable.drop_leading``), applied
    before the appends (a request drops when it is scheduled, before it grows). Each append
    is a pair ``(counts[rows], page_ids)`` for ``HeadPageTable.append``.
    """

    fresh: bool
    appends: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    drops: np.ndarray | None = None


@dataclass
class _RequestPages:
    table: HeadPageTable
    # Logical tokens (vLLM's positions) that have slots reserved.
    logical_len: int
    # Per row: logical tokens that no longer have a physical slot (evicted).
    evicted: np.ndarray
    # Logical tokens every row can still take without a new page: most decode steps fit
    # (one token per row, a page every page_size steps) and skip the per-row arithmetic.
    headroom: int = 0

    def refresh_headroom(self, page_size: int) -> None:
        slots = self.table.num_pages.astype(np.int64) * page_size
        self.headroom = int((slots - (self.logical_len - self.evicted)).min())


class PageManager:
    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self._free_stack = np.arange(layout.total_pages - 1, -1, -1, dtype=np.int32)
        self._num_free = layout.total_pages
        self._requests: dict[str, _RequestPages] = {}
        self._pending: dict[str, PageTableDelta] = {}

    # ----------------------------------------------------------------- figures
    @property
    def total_pages(self) -> int:
        return self.layout.total_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        return 1.0 - self._num_free / self.layout.total_pages

    def owned_pages(self, request_id: str | None = None) -> int:
        if request_id is not None:
            state = self._requests.get(request_id)
            return 0 if state is None else state.table.total_pages
        return sum(state.table.total_pages for state in self._requests.values())

    def physical_lengths(self, request_id: str) -> np.ndarray:
        """Per-row physical tokens of the slots reserved for the request."""
        state = self._requests[request_id]
        return state.logical_len - state.evicted

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> set[str]:
        return set(self._requests)

    # ------------------------------------------------------------- allocation
    def pages_needed(self, request_id: str, logical_len: int) -> int:
        """Pages the request must gain to hold ``logical_len`` logical tokens."""
        state = self._requests.get(request_id)
        if state is None:
            return self.layout.pages_for_tokens(logical_len)
        if logical_len - state.logical_len <= state.headroom:
            return 0
        return int(state.table.pages_missing(logical_len - state.evicted).sum())

    def pages_needed_for_sequence(self, request_id: str, logical_len: int,
                                  max_chunk: int) -> int:
        """Pages the request must gain before its whole ``logical_len`` tokens are in, when
        they arrive in chunks of at most ``max_chunk``: a sliding-window row never holds more
        than its window plus a chunk (``PageLayout.row_tokens_bound``)."""
        layout = self.layout
        if not layout.has_sliding_layers:
            return self.pages_needed(request_id, logical_len)
        state = self._requests.get(request_id)
        evicted = 0 if state is None else state.evicted
        held = 0 if state is None else state.table.num_pages
        tokens = np.minimum(logical_len - evicted, layout.row_tokens_bound(logical_len, max_chunk))
        needed = -(-tokens // layout.page_size) - held
        return int(np.maximum(needed, 0).sum())

    def allocate(self, request_id: str, logical_len: int, reserve: int = 0) -> bool:
        """Reserve slots up to ``logical_len`` tokens; all or nothing.

        ``reserve`` pages must stay free afterwards (a watermark for admissions).
        """
        state = self._requests.get(request_id)
        fresh = state is None
        if fresh:
            state = _RequestPages(
                table=HeadPageTable(self.layout.num_rows, self.layout.page_size),
                logical_len=0,
                evicted=np.zeros(self.layout.num_rows, dtype=np.int64),
            )
        if logical_len <= state.logical_len:
            return True
        growth = logical_len - state.logical_len
        if not fresh and growth <= state.headroom:
            state.logical_len, state.headroom = logical_len, state.headroom - growth
            return True
        missing = state.table.pages_missing(logical_len - state.evicted)
        needed = int(missing.sum())
        if needed + reserve > self._num_free:
            return False
        page_ids = self._pop(needed)
        state.table.append(missing, page_ids)
        state.logical_len = logical_len
        state.refresh_headroom(self.layout.page_size)
        if fresh:
            self._requests[request_id] = state
        delta = self._pending.get(request_id)
        if delta is None:
            delta = self._pending[request_id] = PageTableDelta(fresh=fresh)
        if needed:
            delta.appends.append((missing, page_ids))
        return True

    def drop_outside_window(self, request_id: str, processed: int) -> int:
        """Free the leading pages of sliding-window rows that only hold tokens no query
        from ``processed`` on can see (positions < processed - W + 1): whole pages, so a row
        loses a page every ``page_size`` tokens and nothing moves. Return how many."""
        layout = self.layout
        state = self._requests.get(request_id)
        if state is None or not layout.has_sliding_layers:
            return 0
        windows = layout.row_windows
        dead = np.where(windows > 0, np.maximum(0, processed - windows + 1), 0)
        drops = np.minimum((dead - state.evicted) // layout.page_size, state.table.num_pages)
        drops = np.maximum(drops, 0).astype(np.int32)
        total = int(drops.sum())
        if not total:
            return 0
        delta = self._pending.get(request_id)
        if delta is None:
            delta = self._pending[request_id] = PageTableDelta(fresh=False)
        if delta.appends:
            # Within one schedule a request drops before it grows; anything else would
            # reorder the worker's replay.
            raise RuntimeError(f"request {request_id}: window drop after an append in one "
                               "schedule")
        delta.drops = drops if delta.drops is None else delta.drops + drops
        self._push(state.table.drop_leading(drops))
        state.evicted = state.evicted + drops.astype(np.int64) * layout.page_size
        state.refresh_headroom(layout.page_size)
        return total

    def release_after_compression(
        self, request_id: str, logical_len: int, physical_lengths: np.ndarray
    ) -> int:
        """The worker compacted the request: ``logical_len`` logical tokens now occupy
        ``physical_lengths[row]`` slots. Free the trailing pages; return how many."""
        state = self._requests.get(request_id)
        if state is None:
            return 0  # finished or aborted while the step ran; already freed
        physical_lengths = np.asarray(physical_lengths, dtype=np.int64)
        if physical_lengths.shape != (self.layout.num_rows,):
            raise ValueError(
                f"expected {self.layout.num_rows} physical lengths, got {physical_lengths.shape}"
            )
        if logical_len > state.logical_len or np.any(physical_lengths > logical_len):
            raise ValueError(
                f"request {request_id}: compaction report ({logical_len} logical tokens, "
                f"max physical {physical_lengths.max()}) exceeds the "
                f"{state.logical_len} reserved logical tokens"
            )
        state.evicted = logical_len - physical_lengths
        freed = state.table.truncate(state.logical_len - state.evicted)
        state.refresh_headroom(self.layout.page_size)
        self._push(freed)
        return len(freed)

    def free(self, request_id: str) -> int:
        state = self._requests.pop(request_id, None)
        self._pending.pop(request_id, None)
        if state is None:
            return 0
        pages = state.table.all_pages()
        self._push(pages)
        return len(pages)

    def take_deltas(self) -> dict[str, PageTableDelta]:
        deltas, self._pending = self._pending, {}
        return deltas

    # -------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Raise AssertionError unless every page is free or owned exactly once."""
        owned = [state.table.all_pages() for state in self._requests.values()]
        everything = np.concatenate([self._free_stack[: self._num_free], *owned])
        assert len(everything) == self.layout.total_pages, (
            f"free {self._num_free} + owned {len(everything) - self._num_free} "
            f"!= total {self.layout.total_pages}"
        )
        assert len(np.unique(everything)) == self.layout.total_pages, "a page is held twice"

    # ------------------------------------------------------------ free stack
    def _pop(self, count: int) -> np.ndarray:
        start = self._num_free - count
        page_ids = self._free_stack[start : self._num_free].copy()
        self._num_free = start
        return page_ids

    def _push(self, page_ids: np.ndarray) -> None:
        count = len(page_ids)
        self._free_stack[self._num_free : self._num_free + count] = page_ids
        self._num_free += count
