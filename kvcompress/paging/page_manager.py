"""Scheduler-side owner of the page pool: who holds which page, and how many are free.

Admission and preemption are decided in pages. Every page is on the free stack, in exactly
one request's page table, or in exactly one cached entry (a finished request's pages kept for
a later prompt that continues it, multi-turn reuse); ``check_invariants`` verifies it.
Cached pages count as available: they are evicted, least recently used first, only when
the free stack runs short. Entries that an adoption of this schedule copies from are pinned
until its deltas are taken: the worker copies after the schedule, and the pages of an entry
evicted meanwhile could be another adopter's copy destinations (a retried copy would then
read them overwritten).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.page_table import HeadPageTable, fill_of_lengths, pages_for_lengths


@dataclass
class PageTableDelta:
    """Page-table changes of one request since the worker last heard about it.

    ``fresh``: the request's table was (re)created, so the worker must drop whatever it
    holds for this request id before applying ``appends``. ``drops[row]``: leading pages
    that fell out of the row's sliding window (``HeadPageTable.drop_leading``), applied
    before the appends (a request drops when it is scheduled, before it grows). Each append
    is a pair ``(counts[rows], page_ids)`` for ``HeadPageTable.append``.

    A fresh table may start from a cached context (multi-turn reuse): ``adopted_lengths[row]``
    physical tokens that stand for the first ``adopted_len`` logical tokens are already in
    the row's first pages (the first append). ``copies = (src_page_ids, dst_page_ids)``:
    pages to copy, ``pool[dst[i]] = pool[src[i]]``, before this step's forward (the adopted
    pages are a copy of a cached entry's; without copies they were handed over as they are).
    """

    fresh: bool
    appends: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    drops: np.ndarray | None = None
    adopted_lengths: np.ndarray | None = None
    adopted_len: int = 0
    copies: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(slots=True)  # admission reads a few fields of every request each step
class _RequestPages:
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
    # prompt part in order, one slot per position (no decode eviction ran).
    prompt_evicted: np.ndarray | None = None
    tail_in_order: bool = True
    # Started from a cached entry: logical tokens adopted, and their per-row physical ones.
    adopted: tuple[int, np.ndarray] | None = None
    adopted_from: int | None = None  # that entry's id
    # ``evicted`` of the full-attention rows summarized for ``PageManager.page_fill`` (None:
    # not computed since it changed). Only compaction changes it: window drops touch
    # sliding rows only.
    evicted_fill: np.ndarray | None = None

    def refresh_headroom(self, page_size: int) -> None:
        slots = self.table.num_pages.astype(np.int64) * page_size
        self.headroom = int((slots - (self.logical_len - self.evicted)).min())


@dataclass(frozen=True)
class PageFill:
    """Many requests' rows against their pages now, entry ``i`` for request ``i`` (what
    admission reads of every running request, every step)."""

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


@dataclass
class CachedEntry:
    """A finished request's pages, kept for a prompt that continues it."""

    table: HeadPageTable
    logical_len: int  # tokens whose K/V the rows hold (the request's computed tokens)
    evicted: np.ndarray  # per row, logical tokens without a slot
    prompt_len: int
    prompt_evicted: np.ndarray  # per row, evicted by the prompt's compaction
    tail_in_order: bool

    @property
    def exact_prompt(self) -> bool:
        """Whether its prompt part kept every token (so it can be cut anywhere inside)."""
        return not self.prompt_evicted.any()

    @property
    def first_cut(self) -> int:
        return 1 if self.exact_prompt else self.prompt_len

    def best_hit(self, shared: int) -> int:
        """The longest cut at most ``shared`` tokens long (0: none)."""
        shared = min(shared, self.logical_len)
        if shared > self.prompt_len and not self.tail_in_order:
            shared = self.prompt_len
        if shared < self.prompt_len and not self.exact_prompt:
            return 0
        return shared

    def lengths_at(self, hit: int) -> np.ndarray | None:
        """Per-row physical tokens that stand for the first ``hit`` logical tokens, or None
        when the rows cannot be cut there (the slots of those tokens are not known)."""
        if hit > self.logical_len:
            return None
        if hit < self.prompt_len:
            # Inside the prompt: only where the prompt kept every token.
            return np.full_like(self.evicted, hit) if self.exact_prompt else None
        if hit == self.prompt_len:
            lengths = self.prompt_len - self.prompt_evicted
        elif self.tail_in_order:
            lengths = hit - self.evicted
        else:
            return None
        return None if (lengths < 0).any() else lengths


class PageManager:
    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self._free_stack = np.arange(layout.total_pages - 1, -1, -1, dtype=np.int32)
        self._num_free = layout.total_pages
        self._requests: dict[str, _RequestPages] = {}
        self._pending: dict[str, PageTableDelta] = {}
        # Cached entries by id, least recently used first, and the pages they hold.
        self._entries: OrderedDict[int, CachedEntry] = OrderedDict()
        self._num_cached = 0
        # Entries evicted for pages since the owner last asked (take_evicted_entries).
        self._evicted_entries: list[int] = []
        # Entries this schedule's copies read (until take_deltas), and the pages they hold.
        self._pinned: set[int] = set()
        self._num_pinned = 0

    # ----------------------------------------------------------------- figures
    @property
    def total_pages(self) -> int:
        return self.layout.total_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        """Pages held by cached entries (evictable)."""
        return self._num_cached

    @property
    def num_available(self) -> int:
        """Pages an allocation may take: free ones, then cached ones (evicted for it) but
        those a copy of this schedule reads."""
        return self._num_free + self._num_cached - self._num_pinned

    @property
    def usage(self) -> float:
        # As vLLM counts its prefix cache: evictable cached pages are not in use.
        return 1.0 - self.num_available / self.layout.total_pages

    def owned_pages(self, request_id: str | None = None) -> int:
        if request_id is not None:
            state = self._requests.get(request_id)
            return 0 if state is None else state.table.total_pages
        return sum(state.table.total_pages for state in self._requests.values())

    def physical_lengths(self, request_id: str) -> np.ndarray:
        """Per-row physical tokens of the slots reserved for the request."""
        state = self._requests[request_id]
        return state.logical_len - state.evicted

    def lengths_and_owned_pages(self, request_ids: Sequence[str]) -> tuple[np.ndarray,
                                                                         np.ndarray]:
        """``physical_lengths`` ``[requests, rows]`` and ``owned_pages`` ``[requests]`` of
        many requests in one call, row by row (``page_fill`` needs no per-row work)."""
        states = [self._requests[request_id] for request_id in request_ids]
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
        """``PageFill`` of the requests, equal to ``PageFill.of_lengths`` of their physical
        lengths, without per-row work. A full-attention row holds ``L - e`` tokens (``L``
        the logical tokens, ``e`` its evicted ones): writing ``e = q * page_size + r`` and
        ``L = Q * page_size + R``, it takes ``Q - q + (r < R)`` pages and has ``(r - R) mod
        page_size`` free slots. So each request keeps, over its full rows, the sum of ``q``
        and the rows counted by ``r`` (``_evicted_fill``), which only compaction changes."""
        layout = self.layout
        page_size = layout.page_size
        states = [self._requests[request_id] for request_id in request_ids]
        count = len(states)
        logical = np.array([state.logical_len for state in states], dtype=np.int64)
        owned = np.array([state.table.total_pages for state in states], dtype=np.int64)
        summaries = [state.evicted_fill for state in states]
        for index, summary in enumerate(summaries):
            if summary is None:
                summaries[index] = states[index].evicted_fill = self._evicted_fill(
                    states[index].evicted)
        width = 2 * page_size + 2
        flat = np.concatenate(summaries) if summaries else np.zeros(0, dtype=np.int64)
        whole, slot = np.divmod(logical, page_size)
        start = np.arange(count) * width  # each summary's place in ``flat``
        at_slot = start + 1 + slot  # rows_below[R]
        below_slot = flat[at_slot]
        full_pages = len(layout.compressed_rows) * whole - flat[start] + below_slot
        # Rows with fewer than k free slots: those with r in [R, R + k), wrapping around.
        free_below = flat[at_slot[:, None] + np.arange(page_size + 1)] - below_slot[:, None]
        if layout.has_sliding_layers:
            evicted = np.array([state.evicted for state in states],
                               dtype=np.int64).reshape(count, layout.num_rows)
            sliding_lengths = logical[:, None] - evicted[:, layout.row_windows > 0]
        else:
            sliding_lengths = np.zeros((count, 0), dtype=np.int64)
        return PageFill(owned, full_pages, free_below, sliding_lengths)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def adoption(self, request_id: str) -> tuple[int, np.ndarray] | None:
        """(logical tokens, per-row physical tokens) the request took from a cached entry."""
        state = self._requests.get(request_id)
        return None if state is None else state.adopted

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
        if needed + reserve > self.num_available:
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
        self, request_id: str, logical_len: int, physical_lengths: np.ndarray,
        kind: str = "prompt", prompt_evicted: np.ndarray | None = None,
    ) -> int:
        """The worker compacted the request: ``logical_len`` logical tokens now occupy
        ``physical_lengths[row]`` slots. Free the trailing pages; return how many.
        ``kind``: "prompt" (the prompt part was compacted, a generated tail kept whole) or
        "decode" (generated tokens were evicted: their slots no longer follow positions).
        ``prompt_evicted``: with "decode", the per-row prompt tokens a prompt compaction
        reported together with it evicted (``Compaction.prompt_evicted``)."""
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
        state.evicted_fill = None
        if kind == "decode":
            state.tail_in_order = False
            if prompt_evicted is not None:
                state.prompt_evicted = np.asarray(prompt_evicted, dtype=np.int64).copy()
        else:
            state.prompt_evicted = state.evicted.copy()
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
        """The changes since the last call, for the worker, which runs their copies before
        anything else: the copies' sources may be evicted from now on."""
        deltas, self._pending = self._pending, {}
        self._pinned.clear()
        self._num_pinned = 0
        return deltas

    # ---------------------------------------------------------- cached entries
    def retire(self, request_id: str, entry_id: int, logical_len: int, prompt_len: int) -> bool:
        """The request finished: keep the K/V of its first ``logical_len`` tokens as cached
        entry ``entry_id`` (most recently used) instead of freeing it; pages beyond them are
        freed. False (everything freed) when the rows do not hold those tokens."""
        state = self._requests.get(request_id)
        if state is None or logical_len <= 0 or logical_len > state.logical_len:
            self.free(request_id)
            return False
        del self._requests[request_id]
        self._pending.pop(request_id, None)
        if state.adopted_from in self._entries:
            # The new entry continues the one it adopted, which now serves only a branch
            # from its own end: evicted first.
            self._entries.move_to_end(state.adopted_from, last=False)
        lengths = logical_len - state.evicted
        if (lengths < 0).any():
            self._push(state.table.all_pages())
            return False
        self._push(state.table.truncate(lengths))
        prompt_evicted = (state.prompt_evicted if state.prompt_evicted is not None
                          else np.zeros_like(state.evicted))
        self._entries[entry_id] = CachedEntry(
            state.table, logical_len, state.evicted.copy(), prompt_len, prompt_evicted.copy(),
            state.tail_in_order)
        self._num_cached += state.table.total_pages
        return True

    def entry(self, entry_id: int) -> CachedEntry | None:
        return self._entries.get(entry_id)

    def entry_ids(self) -> list[int]:
        """Cached entries, least recently used first."""
        return list(self._entries)

    def can_adopt(self, entry_id: int, hit: int, logical_len: int, copy: bool,
                  reserve: int = 0) -> bool:
        """Whether ``adopt(..., hit, copy)`` and the growth to ``logical_len`` logical
        tokens fit, leaving ``reserve`` pages available."""
        entry = self._entries.get(entry_id)
        lengths = None if entry is None else entry.lengths_at(hit)
        if lengths is None:
            return False
        if not copy and entry_id in self._pinned:
            return False  # a copy of this schedule reads it: handed over next schedule
        grown = pages_for_lengths(lengths + (logical_len - hit), self.layout.page_size)
        # A copy takes new pages for every row while the entry stays cached (and pinned); a
        # handover keeps the entry's first pages and frees the rest: only growth costs pages.
        available = self.num_available - (self._unpinned_pages(entry_id) if copy else 0)
        return int(grown.sum()) + reserve <= available

    def can_copy_from_free(self, entry_id: int, hit: int, logical_len: int,
                           reserve: int = 0) -> bool:
        """Whether ``adopt(..., hit, copy=True)`` and the growth to ``logical_len`` logical
        tokens fit in free pages, leaving ``reserve`` of them free: no other cached entry
        is evicted for the copy."""
        entry = self._entries.get(entry_id)
        lengths = None if entry is None else entry.lengths_at(hit)
        if lengths is None:
            return False
        grown = pages_for_lengths(lengths + (logical_len - hit), self.layout.page_size)
        return int(grown.sum()) + reserve <= self._num_free

    def adopt(self, request_id: str, entry_id: int, hit: int, copy: bool) -> bool:
        """Start ``request_id`` from the entry's first ``hit`` logical tokens; all or
        nothing. ``copy``: onto new pages (the worker copies them before the next forward)
        and the entry stays cached for another continuation; otherwise the entry's pages are
        handed over and the entry ends. The request then grows with ``allocate``."""
        entry = self._entries.get(entry_id)
        if request_id in self._requests or entry is None:
            return False
        lengths = entry.lengths_at(hit)
        if lengths is None:
            return False
        page_size = self.layout.page_size
        counts = pages_for_lengths(lengths, page_size).astype(np.int32)
        table = HeadPageTable(self.layout.num_rows, page_size)
        copies = None
        if copy:
            needed = int(counts.sum())
            if needed > self.num_available - self._unpinned_pages(entry_id):
                return False
            self._entries.move_to_end(entry_id)
            self._num_pinned += self._unpinned_pages(entry_id)
            self._pinned.add(entry_id)
            page_ids = self._pop(needed)
            copies = (entry.table.leading_pages(counts), page_ids)
        elif entry_id in self._pinned:
            return False
        else:
            del self._entries[entry_id]
            self._num_cached -= entry.table.total_pages
            self._push(entry.table.truncate(lengths))
            page_ids = entry.table.all_pages()
        table.append(counts, page_ids)
        state = _RequestPages(table=table, logical_len=hit, evicted=hit - lengths,
                              prompt_evicted=hit - lengths, adopted=(hit, lengths.copy()),
                              adopted_from=entry_id if copy else None)
        state.refresh_headroom(page_size)
        self._requests[request_id] = state
        self._pending[request_id] = PageTableDelta(
            fresh=True, appends=[(counts, page_ids)] if len(page_ids) else [],
            adopted_lengths=lengths.copy(), adopted_len=hit, copies=copies)
        return True

    def drop_entry(self, entry_id: int) -> int:
        """Free a cached entry's pages; return how many."""
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return 0
        pages = entry.table.all_pages()
        self._num_cached -= len(pages)
        if entry_id in self._pinned:  # only a reset drops one, and never inside a schedule
            self._pinned.discard(entry_id)
            self._num_pinned -= len(pages)
        self._push(pages)
        return len(pages)

    def take_evicted_entries(self) -> list[int]:
        evicted, self._evicted_entries = self._evicted_entries, []
        return evicted

    # -------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Raise AssertionError unless every page is free, owned or cached exactly once."""
        owned = [state.table.all_pages() for state in self._requests.values()]
        cached = [entry.table.all_pages() for entry in self._entries.values()]
        num_cached = sum(len(pages) for pages in cached)
        assert num_cached == self._num_cached, (
            f"cached entries hold {num_cached} pages, counted {self._num_cached}")
        assert self._pinned <= set(self._entries) and self._num_pinned == sum(
            self._entries[entry_id].table.total_pages for entry_id in self._pinned), (
            "pinned entries miscounted")
        everything = np.concatenate([self._free_stack[: self._num_free], *owned, *cached])
        assert len(everything) == self.layout.total_pages, (
            f"free {self._num_free} + owned {len(everything) - self._num_free - num_cached} "
            f"+ cached {num_cached} != total {self.layout.total_pages}"
        )
        assert len(np.unique(everything)) == self.layout.total_pages, "a page is held twice"
        for request_id, state in self._requests.items():
            assert state.table.total_pages == state.table.num_pages.sum(), (
                f"request {request_id}: its table miscounts its pages")
            assert state.evicted_fill is None or np.array_equal(
                state.evicted_fill, self._evicted_fill(state.evicted)), (
                f"request {request_id}: stale summary of its evicted tokens")

    def _evicted_fill(self, evicted: np.ndarray) -> np.ndarray:
        """Over the full-attention rows' evicted tokens ``e = q * page_size + r``
        (``page_fill``): the sum of ``q``, then ``rows_below[j]`` for ``j`` in [0, 2 *
        page_size], the rows with ``r < j`` counting each row at ``r`` and again at ``r +
        page_size`` (so a range of ``r`` that wraps around is one difference)."""
        page_size = self.layout.page_size
        whole, slot = np.divmod(evicted[self.layout.compressed_rows], page_size)
        rows_by_slot = np.bincount(slot, minlength=page_size)
        rows_below = np.zeros(2 * page_size + 1, dtype=np.int64)
        np.cumsum(np.tile(rows_by_slot, 2), out=rows_below[1:])
        return np.concatenate(([whole.sum()], rows_below))

    # ------------------------------------------------------------ free stack
    def _unpinned_pages(self, entry_id: int) -> int:
        """Pages of the entry that pinning it would take from ``num_available``."""
        return 0 if entry_id in self._pinned else self._entries[entry_id].table.total_pages

    def _pop(self, count: int) -> np.ndarray:
        """``count`` free pages, evicting cached entries (least recently used first, never
        a pinned one) only as far as the free stack falls short."""
        if count > self._num_free:
            for entry_id in list(self._entries):
                if self._num_free >= count:
                    break
                if entry_id not in self._pinned:
                    self.drop_entry(entry_id)
                    self._evicted_entries.append(entry_id)
            if count > self._num_free:
                raise RuntimeError(f"{count} pages wanted, {self._num_free} free after "
                                   "evicting every cached entry")
        start = self._num_free - count
        page_ids = self._free_stack[start : self._num_free].copy()
        self._num_free = start
        return page_ids

    def _push(self, page_ids: np.ndarray) -> None:
        count = len(page_ids)
        self._free_stack[self._num_free : self._num_free + count] = page_ids
        self._num_free += count
