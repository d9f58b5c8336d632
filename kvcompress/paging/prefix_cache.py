"""The prefix cache, one rank's pages of it: finished requests' K/V, kept for later prompts
that start with the same tokens (the next turn of a conversation).

vLLM's prefix cache shares full blocks by hash; compacted per-head rows cannot be shared that
way, so here the unit is a whole finished request. The words, used the same everywhere:

- **entry**: a finished request's page table cut to its computed tokens (``CacheEntry``);
  its pages are neither free nor owned by a request, but cached (and evictable).
- **retire**: a finished request's pages become an entry instead of being freed.
- **cut**: a logical length at which an entry's rows can be split, knowing how many physical
  tokens of each row stand for it (``CacheEntry.lengths_at``); the **hit** is the cut a new
  prompt gets (``CacheEntry.best_hit``: the longest cut within the tokens it shares).
- **adopt**: a new request starts from an entry's first ``hit`` tokens, by **copy** (onto new
  pages, the worker copies them; the entry stays) or by **handover** (the entry's pages become
  the request's; the entry ends).
- **evict**: entries are dropped, least recently used first, only when the free stack falls
  short (``evict_for``, the pool's ``reclaim``).
- **pin**: an entry that an adoption of this schedule copies from is not evicted or handed
  over until the deltas are taken: the worker copies after the schedule, and the pages of an
  entry evicted meanwhile could be another adopter's copy destinations.

Which entry a prompt starts with is found by tokens (``prefix_index``), and who may adopt it
is the engine's rule (``kvcompress.engine.prefix_cache``); this module only holds pages.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.page_pool import PagePool
from kvcompress.paging.page_table import HeadPageTable, pages_for_lengths
from kvcompress.paging.request_tables import PageTableDelta, RequestPages


@dataclass
class CacheEntry:
    """A finished request's pages, kept for a prompt that starts with its tokens."""

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


class PrefixCache:
    def __init__(self, layout: PageLayout, pool: PagePool) -> None:
        self.layout = layout
        self.pool = pool
        # Entries by id, least recently used first, and the pages they hold.
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._num_cached = 0
        # Entries evicted for pages since the owner last asked (take_evicted_entries).
        self._evicted: list[int] = []
        # Entries this schedule's copies read (until unpin_all), and the pages they hold.
        self._pinned: set[int] = set()
        self._num_pinned = 0
        # Entries waiting requests will adopt -> how soon (their queue position): evicted
        # last, the one needed latest first (``plan_evictions``).
        self._next_use: dict[int, int] = {}

    @property
    def num_cached(self) -> int:
        """Pages held by entries."""
        return self._num_cached

    @property
    def num_evictable(self) -> int:
        """Pages an allocation may take from entries: all but the pinned ones'."""
        return self._num_cached - self._num_pinned

    def entry(self, entry_id: int) -> CacheEntry | None:
        return self._entries.get(entry_id)

    def entry_ids(self) -> list[int]:
        """Entries, least recently used first."""
        return list(self._entries)

    # ------------------------------------------------------------------ retire
    def retire(self, entry_id: int, state: RequestPages, logical_len: int,
               prompt_len: int) -> bool:
        """Keep the K/V of a finished request's first ``logical_len`` tokens as entry
        ``entry_id`` (most recently used); pages beyond them go back to the pool. False
        (everything freed) when its rows do not hold those tokens."""
        if logical_len <= 0 or logical_len > state.logical_len:
            self.pool.push(state.table.all_pages())
            return False
        if state.adopted_from in self._entries:
            # The new entry extends the one it adopted, which now serves only a branch
            # from its own end: evicted first.
            self._entries.move_to_end(state.adopted_from, last=False)
        lengths = logical_len - state.evicted
        if (lengths < 0).any():
            self.pool.push(state.table.all_pages())
            return False
        self.pool.push(state.table.truncate(lengths))
        prompt_evicted = (state.prompt_evicted if state.prompt_evicted is not None
                          else np.zeros_like(state.evicted))
        self._entries[entry_id] = CacheEntry(
            state.table, logical_len, state.evicted.copy(), prompt_len, prompt_evicted.copy(),
            state.tail_in_order)
        self._num_cached += state.table.total_pages
        return True

    # ------------------------------------------------------------------- adopt
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
        available = self._num_available() - (self._unpinned_pages(entry_id) if copy else 0)
        return int(grown.sum()) + reserve <= available

    def can_copy_from_free(self, entry_id: int, hit: int, logical_len: int,
                           reserve: int = 0) -> bool:
        """Whether ``adopt(..., hit, copy=True)`` and the growth to ``logical_len`` logical
        tokens fit in free pages, leaving ``reserve`` of them free: no other entry is
        evicted for the copy."""
        entry = self._entries.get(entry_id)
        lengths = None if entry is None else entry.lengths_at(hit)
        if lengths is None:
            return False
        grown = pages_for_lengths(lengths + (logical_len - hit), self.layout.page_size)
        return int(grown.sum()) + reserve <= self.pool.num_free

    def adopt(self, entry_id: int, hit: int,
              copy: bool) -> tuple[RequestPages, PageTableDelta] | None:
        """The pages and fresh delta of a request that starts from the entry's first ``hit``
        logical tokens, by copy (the entry stays, pinned) or handover (the entry ends);
        None, nothing changed, when the entry cannot be cut there or the copy does not fit.
        The caller adds them to the request tables (``RequestTables.add``)."""
        entry = self._entries.get(entry_id)
        lengths = None if entry is None else entry.lengths_at(hit)
        if lengths is None:
            return None
        page_size = self.layout.page_size
        counts = pages_for_lengths(lengths, page_size).astype(np.int32)
        table = HeadPageTable(self.layout.num_rows, page_size)
        copies = None
        if copy:
            needed = int(counts.sum())
            if needed > self._num_available() - self._unpinned_pages(entry_id):
                return None
            self._entries.move_to_end(entry_id)
            self._num_pinned += self._unpinned_pages(entry_id)
            self._pinned.add(entry_id)
            page_ids = self.pool.pop(needed)  # may evict others, never this pinned one
            copies = (entry.table.leading_pages(counts), page_ids)
        elif entry_id in self._pinned:
            return None
        else:
            del self._entries[entry_id]
            self._num_cached -= entry.table.total_pages
            self.pool.push(entry.table.truncate(lengths))
            page_ids = entry.table.all_pages()
        table.append(counts, page_ids)
        state = RequestPages(table=table, logical_len=hit, evicted=hit - lengths,
                             prompt_evicted=hit - lengths, adopted=(hit, lengths.copy()),
                             adopted_from=entry_id if copy else None)
        state.refresh_headroom(page_size)
        delta = PageTableDelta(fresh=True, appends=[(counts, page_ids)] if len(page_ids) else [],
                               adopted_lengths=lengths.copy(), adopted_len=hit, copies=copies)
        return state, delta

    def unpin_all(self) -> None:
        """The worker has this schedule's copies: their sources may be evicted again."""
        self._pinned.clear()
        self._num_pinned = 0

    # ------------------------------------------------------------------- evict
    def drop_entry(self, entry_id: int) -> int:
        """Free an entry's pages; return how many."""
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return 0
        pages = entry.table.all_pages()
        self._num_cached -= len(pages)
        if entry_id in self._pinned:  # only a reset drops one, and never inside a schedule
            self._pinned.discard(entry_id)
            self._num_pinned -= len(pages)
        self.pool.push(pages)
        return len(pages)

    def plan_evictions(self, next_use: dict[int, int]) -> None:
        """``next_use``: entry -> how soon a waiting request adopts it (0: the next one to
        be admitted). Such entries are evicted after every other, the one needed latest
        first (Belady's order over the known queue): the requests admitted first then do not
        evict the caches of the requests queued behind them (a round of chat turns)."""
        self._next_use = dict(next_use)

    def eviction_order(self) -> list[int]:
        """Entries in the order ``evict_for`` drops them: least recently used first among
        those no waiting request adopts, then those by latest use first."""
        wanted = [entry_id for entry_id in self._next_use if entry_id in self._entries]
        unwanted = [entry_id for entry_id in self._entries if entry_id not in self._next_use]
        return unwanted + sorted(wanted, key=lambda entry_id: -self._next_use[entry_id])

    def evict_for(self, count: int) -> None:
        """Drop entries in ``eviction_order``, never a pinned one, until ``count`` pages are
        free or none is left to drop (``PagePool.reclaim``)."""
        for entry_id in self.eviction_order():
            if self.pool.num_free >= count:
                break
            if entry_id not in self._pinned:
                self.drop_entry(entry_id)
                self._evicted.append(entry_id)

    def take_evicted_entries(self) -> list[int]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def check(self) -> list[np.ndarray]:
        """Raise AssertionError unless the cached and pinned pages are counted right; return
        every entry's pages (for ``PagePool.check``)."""
        cached = [entry.table.all_pages() for entry in self._entries.values()]
        num_cached = sum(len(pages) for pages in cached)
        assert num_cached == self._num_cached, (
            f"cached entries hold {num_cached} pages, counted {self._num_cached}")
        assert self._pinned <= set(self._entries) and self._num_pinned == sum(
            self._entries[entry_id].table.total_pages for entry_id in self._pinned), (
            "pinned entries miscounted")
        return cached

    def _num_available(self) -> int:
        return self.pool.num_free + self.num_evictable

    def _unpinned_pages(self, entry_id: int) -> int:
        """Pages of the entry that pinning it would take from what is available."""
        return 0 if entry_id in self._pinned else self._entries[entry_id].table.total_pages
