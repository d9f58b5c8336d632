"""The page pool: a reference count per page, and the free pages as a stack of ids.

A page is free iff nobody refers to it. Its holders are of four kinds (``Holder``): the one
request row that owns it (and writes it), request rows that read it as part of a shared,
read-only leading run (``request_tables``), prefix-cache entries (``prefix_cache``), and
pins (a page copy of this schedule reads it, until the worker has the deltas). A page's
count is the sum over the kinds; between schedules there are no pins, so it is the number
of rows and entries pointing at it. ``check`` proves, given everything the holders report,
that every count is right and that the free stack holds exactly the pages at count 0, each
once: free + pages with count > 0 == total.

Every page is in one of five states, counted as references change: free; owned (a row
writes it: its only holder); read (rows read it, entries may hold it too); pinned (no row
holds it, a pin does); cached (only entries hold it: evicting them frees it). So "available"
is free + cached, and a shared page is counted once however many rows and entries hold it.

A pop that needs more pages than are free first asks ``reclaim`` for them: the prefix cache
evicts entries there (``PageManager`` wires it); an eviction frees only the pages nothing
else holds, so ``reclaim`` watches ``num_free``, not what the entries held.

Page ids within one call are distinct (one holder's pages): counts are changed by
indexing, which would count a repeated id once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum

import numpy as np


class Holder(IntEnum):
    OWNER = 0  # a request row's own page, which it writes: no one else holds it
    READER = 1  # a request row's shared leading run: read in place, never written
    ENTRY = 2  # a prefix-cache entry
    PIN = 3  # the source of a page copy of this schedule, until the deltas are taken


class PageState(IntEnum):
    FREE = 0
    OWNED = 1
    READ = 2
    PINNED = 3
    CACHED = 4


class PagePool:
    def __init__(self, total_pages: int, track_tier_copies: bool = False) -> None:
        """``track_tier_copies``: keep ``tier_copy`` (an offload tier saves and loads pages;
        without one nothing sets it, and reference changes skip clearing it)."""
        self.total_pages = total_pages
        # Popped from the end: the lowest ids go first (a fresh pool hands out 0, 1, ...).
        self._stack = np.arange(total_pages - 1, -1, -1, dtype=np.int32)
        self._num_free = total_pages
        # References per (holder kind, page), and pages per state.
        self._refs = np.zeros((len(Holder), total_pages), dtype=np.int32)
        self._states = np.zeros(len(PageState), dtype=np.int64)
        self._states[PageState.FREE] = total_pages
        # Called with the pages a pop wants when fewer are free; it evicts what it can spare.
        self.reclaim: Callable[[int], None] | None = None
        # Per page, the offload-tier page whose K/V it holds (-1: none), set by the prefix
        # cache when it saves or loads the page (``offload_tier``): true while the page is
        # only read, so cleared when it is freed or owned (its owner writes it).
        self.tier_copy = np.full(total_pages, -1, dtype=np.int64)
        self._tracks_tier_copies = track_tier_copies

    # ----------------------------------------------------------------- figures
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_owned(self) -> int:
        """Pages a request row owns (and writes)."""
        return int(self._states[PageState.OWNED])

    @property
    def num_read(self) -> int:
        """Pages request rows read in shared runs, each counted once."""
        return int(self._states[PageState.READ])

    @property
    def num_evictable(self) -> int:
        """Pages only (unpinned) entries hold: evicting every entry frees exactly these."""
        return int(self._states[PageState.CACHED])

    @property
    def num_cached(self) -> int:
        """Pages no request row holds and entries or pins do."""
        return int(self._states[PageState.CACHED] + self._states[PageState.PINNED])

    def counts(self, pages: np.ndarray) -> np.ndarray:
        """Each page's reference count (all holders)."""
        return self._refs[:, pages].sum(axis=0)

    def count_in_state(self, pages: np.ndarray, state: PageState) -> int:
        return int((self._state_of(pages) == state).sum())

    # ------------------------------------------------------------- references
    def pop(self, count: int) -> np.ndarray:
        """``count`` free page ids, each now owned by one row (reclaiming first when the
        stack falls short)."""
        if count > self._num_free and self.reclaim is not None:
            self.reclaim(count)
        if count > self._num_free:
            raise RuntimeError(f"{count} pages wanted, {self._num_free} free after "
                               "evicting every cached entry")
        start = self._num_free - count
        page_ids = self._stack[start : self._num_free].copy()
        self._num_free = start
        self._refs[Holder.OWNER, page_ids] = 1
        if self._tracks_tier_copies:
            self.tier_copy[page_ids] = -1
        self._states[PageState.FREE] -= count
        self._states[PageState.OWNED] += count
        return page_ids

    def share(self, pages: np.ndarray, holder: Holder) -> None:
        """One more ``holder`` reference to each of ``pages`` (which are held already)."""
        if not len(pages):
            return
        if not self.counts(pages).all():
            raise RuntimeError("sharing a free page")
        if holder == Holder.OWNER or self._refs[Holder.OWNER, pages].any():
            raise RuntimeError("a page a row owns (and writes) has no other holder")
        self._change(pages, {holder: 1})

    def release(self, pages: np.ndarray, holder: Holder) -> int:
        """One ``holder`` reference fewer to each of ``pages``; those nobody holds any more
        go back to the free stack. Return how many did."""
        return self._change(pages, {holder: -1})

    def transfer(self, pages: np.ndarray, source: Holder, target: Holder) -> None:
        """A ``source`` reference to each page becomes a ``target`` one (a finished row's
        pages retired into an entry, an entry's handed over to a row)."""
        if target == Holder.OWNER and len(pages) and (self.counts(pages) != 1).any():
            raise RuntimeError("a page others hold cannot become a row's own")
        self._change(pages, {source: -1, target: 1})

    def _change(self, pages: np.ndarray, deltas: Mapping[Holder, int]) -> int:
        if not len(pages):
            return 0
        before = self._state_of(pages)
        for holder, delta in deltas.items():
            self._refs[holder, pages] += delta
        if (self._refs[np.ix_(list(deltas), pages)] < 0).any():
            for holder, delta in deltas.items():  # undo: the caller's bookkeeping is wrong
                self._refs[holder, pages] -= delta
            raise RuntimeError("a page released by a holder that did not hold it")
        after = self._state_of(pages)
        if self._tracks_tier_copies:
            self.tier_copy[pages[(after == PageState.FREE) | (after == PageState.OWNED)]] = -1
        self._states += (np.bincount(after, minlength=len(PageState))
                         - np.bincount(before, minlength=len(PageState)))
        freed = pages[(after == PageState.FREE) & (before != PageState.FREE)]
        count = len(freed)
        self._stack[self._num_free : self._num_free + count] = freed
        self._num_free += count
        return count

    def _state_of(self, pages: np.ndarray) -> np.ndarray:
        refs = self._refs[:, pages]
        state = np.full(len(pages), PageState.FREE, dtype=np.int64)
        state[refs[Holder.ENTRY] > 0] = PageState.CACHED
        state[refs[Holder.PIN] > 0] = PageState.PINNED
        state[refs[Holder.READER] > 0] = PageState.READ
        state[refs[Holder.OWNER] > 0] = PageState.OWNED
        return state

    # ---------------------------------------------------------------- checking
    def check(self, held: Mapping[Holder, Sequence[np.ndarray]]) -> None:
        """Raise AssertionError unless ``held`` (page-id arrays by kind of holder: each
        row's owned pages, each row's shared run, each entry's pages, the pins) accounts
        for every reference: each page's counts equal the holders pointing at it, an
        owned page has no other holder, and the free stack holds exactly the pages nobody
        holds, each once (free + pages with count > 0 == total)."""
        total = self.total_pages
        for holder in Holder:
            arrays = held.get(holder, ())
            pages = (np.concatenate(arrays) if len(arrays) else np.zeros(0, dtype=np.int64))
            counted = np.bincount(pages.astype(np.int64), minlength=total)
            wrong = np.flatnonzero(counted != self._refs[holder])
            assert not len(wrong), (
                f"{holder.name} references of pages {wrong[:8].tolist()}: counted "
                f"{self._refs[holder, wrong[:8]].tolist()}, held {counted[wrong[:8]].tolist()}")
        counts = self._refs.sum(axis=0)
        owned = self._refs[Holder.OWNER] > 0
        assert (self._refs[Holder.OWNER] <= 1).all() and (counts[owned] == 1).all(), (
            f"owned pages held by others too: {np.flatnonzero(owned & (counts > 1))[:8]}")
        free = self._stack[: self._num_free]
        assert len(np.unique(free)) == len(free), "a page is on the free stack twice"
        assert np.array_equal(np.sort(free), np.flatnonzero(counts == 0)), (
            f"free {self._num_free} + held {int((counts > 0).sum())} != total {total}, "
            "or a held page is on the free stack")
        states_of = self._state_of(np.arange(total))
        states = np.bincount(states_of, minlength=len(PageState))
        assert np.array_equal(states, self._states), (
            f"pages per state counted {self._states.tolist()}, are {states.tolist()}")
        written = (self.tier_copy >= 0) & np.isin(states_of, (PageState.FREE, PageState.OWNED))
        assert not written.any(), (
            f"free or owned pages {np.flatnonzero(written)[:8].tolist()} said to hold a tier "
            "page's K/V")
