"""The running requests' pages: per request, per (layer, KV head) row, its page table and
how many of its logical tokens each row holds.

Rows start alike and differ once compaction (or a sliding window) evicts tokens, so each
request keeps its logical length (vLLM's positions with a slot reserved) and per row the
tokens evicted; a row's physical length is the difference. Every change is also recorded as
a ``PageTableDelta`` for the worker, which mirrors the tables (``take_deltas``). Pages come
from and go back to the ``PagePool``; a request that starts from a prefix-cache entry is
built by ``prefix_cache`` and added here (``add``).

Such a request's rows may begin with a *shared run*: leading whole pages it reads in place
(an entry's, which other requests and entries may hold too), never written; its own pages
follow (``RequestPages.shared``). Every write (appends, compaction moves, decode eviction)
lands at or beyond a row's adopted tokens, so past its shared run; a report that would cut
into one is refused. Freeing a request drops its references: a page goes back to the free
stack only when nobody else holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.page_fill import PageFill, evicted_fill
from kvcompress.paging.page_pool import Holder, PagePool
from kvcompress.paging.page_table import HeadPageTable, pages_for_lengths


@dataclass
class PageTableDelta:
    """Page-table changes of one request since the worker last heard about it.

    ``fresh``: the request's table was (re)created, so the worker must drop whatever it
    holds for this request id before applying ``appends``. ``drops[row]``: leading pages
    that fell out of the row's sliding window (``HeadPageTable.drop_leading``), applied
    before the appends (a request drops when it is scheduled, before it grows). Each append
    is a pair ``(counts[rows], page_ids)`` for ``HeadPageTable.append``.

    A fresh table may start from a prefix-cache entry: ``adopted_lengths[row]`` physical
    tokens that stand for the first ``adopted_len`` logical tokens are already in the row's
    first pages (the first appends: the entry's whole pages, read in place, then each
    row's last, partial page). ``copies = (src_page_ids, dst_page_ids)``: pages to copy,
    ``pool[dst[i]] = pool[src[i]]``, before this step's forward (an entry's partial last
    pages, copied onto the adopter's own pages so that it can write the rest of them).
    """

    fresh: bool
    appends: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    drops: np.ndarray | None = None
    adopted_lengths: np.ndarray | None = None
    adopted_len: int = 0
    copies: tuple[np.ndarray, np.ndarray] | None = None
    # Pages ``[start[row], stop[row])`` that leave the middle of the rows, applied after the
    # appends, in order: a shared segment the request reads was compacted in place
    # (``PrefixCache`` pending segments); the tokens after them shift down.
    removals: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


@dataclass(slots=True)  # admission reads a few fields of every request each step
class RequestPages:
    table: HeadPageTable
    # Logical tokens (vLLM's positions) that have slots reserved.
    logical_len: int
    # Per row: logical tokens that no longer have a physical slot (evicted).
    evicted: np.ndarray
    # Logical tokens every row can still take without a new page: most decode steps fit
    # (one token per row, a page every page_size steps) and skip the per-row arithmetic.
    headroom: int = 0

    # Per row: logical tokens evicted by the prompt's compaction only (decode eviction and
    # sliding windows excluded), and whether the generated tokens still sit after the
    # prompt part in order, one slot per position (no decode eviction ran). The prefix
    # cache reads both to know where a retired request's rows can be cut.
    prompt_evicted: np.ndarray | None = None
    tail_in_order: bool = True
    # Started from a prefix-cache entry: logical tokens adopted, and their per-row physical
    # ones; and that entry's id when it was shared (it stays cached).
    adopted: tuple[int, np.ndarray] | None = None
    adopted_from: int | None = None
    # Per row: leading pages read in place, shared with entries and other requests, never
    # written (None: none). They end on a page boundary: a partial page is always its own.
    shared: np.ndarray | None = None
    shared_pages: int = 0
    # Pending segments (filed uncompressed, compacted later) whose pages the rows read: while
    # any is, a retired entry of this request may not be cut inside its prompt (its pages
    # there will change). And a segment request's own plan, reported but not yet run:
    # per-row physical lengths once compacted (``Compaction`` kind "deferred").
    sealed: int = 0
    planned: np.ndarray | None = None
    # ``evicted_fill`` of ``evicted`` (None: not computed since it changed). Only compaction
    # changes it: window drops touch sliding rows only.
    evicted_fill: np.ndarray | None = None

    def refresh_headroom(self, page_size: int) -> None:
        slots = self.table.num_pages.astype(np.int64) * page_size
        self.headroom = int((slots - (self.logical_len - self.evicted)).min())

    def read_pages(self) -> np.ndarray:
        """The pages of the rows' shared runs, in row order."""
        if self.shared is None:
            return np.zeros(0, dtype=np.int32)
        return self.table.leading_pages(self.shared)

    def own_pages(self) -> np.ndarray:
        """The pages the rows own (past their shared runs), in row order."""
        if self.shared is None:
            return self.table.all_pages()
        return self.table.pages_after(self.shared)

    def cuts_shared_run(self, lengths: np.ndarray, page_size: int) -> bool:
        """Whether rows of ``lengths`` tokens would end inside their shared runs."""
        return self.shared is not None and bool(
            (pages_for_lengths(lengths, page_size) < self.shared).any())


class RequestTables:
    def __init__(self, layout: PageLayout, pool: PagePool) -> None:
        self.layout = layout
        self.pool = pool
        self.states: dict[str, RequestPages] = {}
        self._pending: dict[str, PageTableDelta] = {}

    # ----------------------------------------------------------------- figures
    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def owned_pages(self, request_id: str) -> int:
        """Pages in the request's rows, its shared runs included."""
        state = self.states.get(request_id)
        return 0 if state is None else state.table.total_pages

    def shared_pages(self, request_ids: Sequence[str]) -> np.ndarray:
        """Per request, the pages of its rows' shared runs."""
        states = self.states
        return np.array([states[request_id].shared_pages for request_id in request_ids],
                        dtype=np.int64)

    def physical_lengths(self, request_id: str) -> np.ndarray:
        """Per-row physical tokens of the slots reserved for the request."""
        state = self.states[request_id]
        return state.logical_len - state.evicted

    def lengths_and_owned_pages(self, request_ids: Sequence[str]) -> tuple[np.ndarray,
                                                                         np.ndarray]:
        """``physical_lengths`` ``[requests, rows]`` and ``owned_pages`` ``[requests]`` of
        many requests in one call, row by row (``page_fill`` needs no per-row work)."""
        states = [self.states[request_id] for request_id in request_ids]
        if not states:
            return (np.zeros((0, self.layout.num_rows), dtype=np.int64),
                    np.zeros(0, dtype=np.int64))
        logical = np.array([state.logical_len for state in states], dtype=np.int64)
        # np.array rather than np.stack: a fraction of the cost for hundreds of rows.
        lengths = logical[:, None] - np.array([state.evicted for state in states])
        owned = np.array([state.table.num_pages for state in states]).sum(axis=1,
                                                                          dtype=np.int64)
        return lengths, owned

    def page_fill(self, request_ids: Sequence[str]) -> PageFill:
        """``PageFill`` of the requests from their kept ``evicted_fill`` summaries."""
        layout = self.layout
        states = [self.states[request_id] for request_id in request_ids]
        logical = np.array([state.logical_len for state in states], dtype=np.int64)
        owned = np.array([state.table.total_pages for state in states], dtype=np.int64)
        for state in states:
            if state.evicted_fill is None:
                state.evicted_fill = evicted_fill(state.evicted, layout)
        if layout.has_sliding_layers:
            evicted = np.array([state.evicted for state in states],
                               dtype=np.int64).reshape(len(states), layout.num_rows)
            sliding_lengths = logical[:, None] - evicted[:, layout.row_windows > 0]
        else:
            sliding_lengths = np.zeros((len(states), 0), dtype=np.int64)
        return PageFill.of_summaries(logical, owned, [state.evicted_fill for state in states],
                                     sliding_lengths, layout)

    # ------------------------------------------------------------- allocation
    def pages_needed(self, request_id: str, logical_len: int) -> int:
        """Pages the request must gain to hold ``logical_len`` logical tokens."""
        state = self.states.get(request_id)
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
        state = self.states.get(request_id)
        evicted = 0 if state is None else state.evicted
        held = 0 if state is None else state.table.num_pages
        tokens = np.minimum(logical_len - evicted, layout.row_tokens_bound(logical_len, max_chunk))
        needed = -(-tokens // layout.page_size) - held
        return int(np.maximum(needed, 0).sum())

    def allocate(self, request_id: str, logical_len: int, available: int) -> bool:
        """Reserve slots up to ``logical_len`` tokens, taking at most ``available`` pages
        from the pool; all or nothing."""
        state = self.states.get(request_id)
        fresh = state is None
        if fresh:
            state = RequestPages(
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
        if needed > available:
            return False
        page_ids = self.pool.pop(needed)
        state.table.append(missing, page_ids)
        state.logical_len = logical_len
        state.refresh_headroom(self.layout.page_size)
        if fresh:
            self.states[request_id] = state
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
        state = self.states.get(request_id)
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
        if state.shared is not None:  # a shared run's pages go first (reuse is off there)
            read = np.minimum(drops, state.shared)
            self.pool.release(state.table.leading_pages(read), Holder.READER)
            self.pool.release(state.table.pages_between(read, drops), Holder.OWNER)
            state.table.drop_leading(drops)
            state.shared = state.shared - read
            state.shared_pages = int(state.shared.sum())
        else:
            self.pool.release(state.table.drop_leading(drops), Holder.OWNER)
        state.evicted = state.evicted + drops.astype(np.int64) * layout.page_size
        state.refresh_headroom(layout.page_size)
        return total

    def release_after_compression(
        self, request_id: str, logical_len: int, physical_lengths: np.ndarray,
        kind: str = "prompt", prompt_evicted: np.ndarray | None = None,
    ) -> int:
        """The worker compacted the request: ``logical_len`` logical tokens now occupy
        ``physical_lengths[row]`` slots. Free the trailing pages; return how many.
        ``kind``: "prompt" (the prompt part was compacted, a generated tail kept whole) or
        "decode" (generated tokens were evicted: their slots no longer follow positions).
        ``prompt_evicted``: with "decode", the per-row prompt tokens a prompt compaction
        reported together with it evicted (``Compaction.prompt_evicted``)."""
        state = self.states.get(request_id)
        if state is None:
            return 0  # finished or aborted while the step ran; already freed
        physical_lengths = np.asarray(physical_lengths, dtype=np.int64)
        if physical_lengths.shape != (self.layout.num_rows,):
            raise ValueError(
                f"expected {self.layout.num_rows} physical lengths, got {physical_lengths.shape}"
            )
        if kind == "deferred":
            # A segment's plan: its pages stay until it is filed and compacted in place.
            if logical_len != state.logical_len or (
                    physical_lengths > state.logical_len - state.evicted).any():
                raise ValueError(f"request {request_id}: deferred plan of {logical_len} "
                                 "logical tokens does not fit its rows")
            state.planned = physical_lengths.copy()
            return 0
        if logical_len > state.logical_len or np.any(physical_lengths > logical_len):
            raise ValueError(
                f"request {request_id}: compaction report ({logical_len} logical tokens, "
                f"max physical {physical_lengths.max()}) exceeds the "
                f"{state.logical_len} reserved logical tokens"
            )
        if state.cuts_shared_run(physical_lengths, self.layout.page_size):
            raise ValueError(f"request {request_id}: compaction report cuts into the pages "
                             "it reads from a cached entry")
        state.evicted = logical_len - physical_lengths
        state.evicted_fill = None
        if kind == "decode":
            state.tail_in_order = False
            if prompt_evicted is not None:
                state.prompt_evicted = np.asarray(prompt_evicted, dtype=np.int64).copy()
        else:
            state.prompt_evicted = state.evicted.copy()
        freed = state.table.truncate(state.logical_len - state.evicted)
        state.refresh_headroom(self.layout.page_size)
        return self.pool.release(freed, Holder.OWNER)

    def drop_compacted(self, request_id: str, start: np.ndarray, stop: np.ndarray) -> int:
        """A pending segment the request reads was compacted in place: pages ``[start[row],
        stop[row])`` of its shared runs are no longer needed (their tokens are evicted) and
        leave its rows, the rest shifting down. Return how many pages became free."""
        state = self.states[request_id]
        page_size = self.layout.page_size
        removed = (np.asarray(stop) - np.asarray(start)).astype(np.int64)
        if state.shared is None or (np.asarray(stop) > state.shared).any():
            raise ValueError(f"request {request_id}: compacted pages outside its shared runs")
        dropped = state.table.drop_between(start, stop)
        tokens = removed * page_size
        state.evicted = state.evicted + tokens
        state.evicted_fill = None
        if state.prompt_evicted is not None:
            state.prompt_evicted = state.prompt_evicted + tokens
        if state.adopted is not None:
            state.adopted = (state.adopted[0], state.adopted[1] - tokens)
        if state.planned is not None:  # a segment request's own plan keeps the rest
            state.planned = state.planned - tokens
        state.shared = (state.shared - removed).astype(state.shared.dtype)
        state.shared_pages = int(state.shared.sum())
        state.sealed = max(0, state.sealed - 1)
        state.refresh_headroom(page_size)
        delta = self._pending.get(request_id)
        if delta is None:
            delta = self._pending[request_id] = PageTableDelta(fresh=False)
        delta.removals.append((np.asarray(start, dtype=np.int32).copy(),
                               np.asarray(stop, dtype=np.int32).copy()))
        return self.pool.release(dropped, Holder.READER)

    # ---------------------------------------------------- requests come and go
    def add(self, request_id: str, state: RequestPages, delta: PageTableDelta) -> None:
        """A request whose table was built elsewhere (adopted from the prefix cache)."""
        self.states[request_id] = state
        self._pending[request_id] = delta

    def remove(self, request_id: str) -> RequestPages | None:
        """Forget the request without freeing its pages (they become a cache entry's)."""
        self._pending.pop(request_id, None)
        return self.states.pop(request_id, None)

    def free(self, request_id: str) -> int:
        """Drop the request's references; return how many pages became free (those of its
        shared runs only when nobody else holds them)."""
        state = self.remove(request_id)
        if state is None:
            return 0
        return release_request(self.pool, state)

    def take_deltas(self) -> dict[str, PageTableDelta]:
        """The changes since the last call, for the worker."""
        deltas, self._pending = self._pending, {}
        return deltas

    def check(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Raise AssertionError on a table that miscounts its pages, a shared run that is not
        whole pages of its row or a stale summary; return every request's owned pages and
        its shared runs' pages (for ``PagePool.check``)."""
        page_size = self.layout.page_size
        for request_id, state in self.states.items():
            assert state.table.total_pages == state.table.num_pages.sum(), (
                f"request {request_id}: its table miscounts its pages")
            assert state.evicted_fill is None or np.array_equal(
                state.evicted_fill, evicted_fill(state.evicted, self.layout)), (
                f"request {request_id}: stale summary of its evicted tokens")
            if state.shared is not None:
                lengths = state.logical_len - state.evicted
                assert (state.shared <= state.table.num_pages).all() and (
                    state.shared * page_size <= lengths).all() and (
                    state.shared_pages == state.shared.sum()), (
                    f"request {request_id}: its shared runs are not whole pages of its rows")
        return ([state.own_pages() for state in self.states.values()],
                [state.read_pages() for state in self.states.values()])


def release_request(pool: PagePool, state: RequestPages) -> int:
    """Drop every reference a request's rows hold; return how many pages became free."""
    return (pool.release(state.read_pages(), Holder.READER)
            + pool.release(state.own_pages(), Holder.OWNER))
