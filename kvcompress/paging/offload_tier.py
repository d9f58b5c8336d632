"""The offload tier, one rank's index of it: prefix-cache entries moved out of the page pool
(to host memory) instead of being dropped, so that a conversation's next turn loads its
compressed cache instead of prefilling it again (``--kv-offloading-size``).

The scheduler keeps here what an entry is without its pages (its lengths and evictions,
``CacheEntry`` with an empty table) and which **tier pages** hold its rows; the worker keeps
the tier pages' K/V (``engine.worker.offload``), told what to do by ``TierOrder``s in the
order the scheduler gave them. The words (see ``prefix_cache``):

- **offload**: an entry evicted for pages goes to the tier; a **save** copies those of its
  pages the tier does not hold yet, packed in row order as one **chunk** (a range of tier
  page ids), before anything writes them (the first thing of the next step on the worker);
- **restore**: an offloaded entry comes back on fresh pages (a **load**), resident again
  under the same id, then adopted as any entry;
- pages are **known by identity**: a pool page loaded from tier page ``t`` (or saved as it)
  holds ``t``'s K/V for as long as it is held and not written (``PagePool.tier_copy``: read
  in place by adopters, kept by entries). A conversation's next entry holds the pages its
  turn adopted, so its save writes only the turn's own pages: each kept page of a
  conversation goes to the tier once, not once per turn;
- a tier page lives while an offloaded entry uses it or a pool page is a copy of it; a chunk
  is **freed** (a **free** order) once none of its pages lives, and counts against the
  bound (``capacity_pages``) until then. Storing an entry frees dead chunks, then drops the
  least recently stored entries (a **drop**: gone for good) until it fits; it never blocks.

No vLLM imports, no tensors: the K/V moves on the worker.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvcompress.paging.page_table import HeadPageTable

_NONE = np.zeros(0, dtype=np.int64)


class StoredEntry(Protocol):
    """What the tier keeps of an entry: a dataclass with a page table (``CacheEntry``; the
    tier sits below the prefix cache and does not import it)."""

    table: HeadPageTable


@dataclass(frozen=True)
class TierOrder:
    """What the worker does with the tier, in order:

    - ``save``: pool ``pages`` (row order) become chunk ``key`` (tier pages ``key``,
      ``key + 1``, ...);
    - ``load``: tier pages ``tier_pages`` into pool ``pages`` (entry ``key`` restored);
    - ``free``: chunk ``key`` is no longer needed;
    - ``import``: a prefill instance's hand-off named ``source`` into pool ``pages`` (row
      order; entry ``key`` imported, ``PrefixCache.import_entry``), which fail as a load."""

    kind: str
    key: int
    pages: np.ndarray = field(default_factory=lambda: _NONE)
    tier_pages: np.ndarray = field(default_factory=lambda: _NONE)
    source: str = ""


@dataclass
class OffloadedEntry:
    """An entry in the tier: what it is (its table empty), its pages per row, and the tier
    pages that hold them (row order)."""

    entry: StoredEntry
    row_pages: np.ndarray  # int32 per row
    tier_pages: np.ndarray  # int64, one per page

    @property
    def num_pages(self) -> int:
        return len(self.tier_pages)


@dataclass
class TierCounts:
    """Since the start: what went through the tier."""

    saved_entries: int = 0
    saved_pages: int = 0  # pages written
    known_pages: int = 0  # pages offloaded entries had that the tier held already
    loaded_entries: int = 0
    loaded_pages: int = 0
    dropped_entries: int = 0  # stored, then dropped to make room (or by the cache)
    refused_entries: int = 0  # their new pages do not fit even in an empty tier


@dataclass
class StoreResult:
    stored: bool
    dropped: list[int]  # entries dropped to make room (gone for good)
    freed: list[int]  # chunks freed (their pages no longer needed)
    chunk: int = -1  # the new chunk's first tier page (-1: nothing new to write)
    new: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # per page


class OffloadTier:
    def __init__(self, capacity_pages: int,
                 copies_in_pool: Callable[[], np.ndarray] = lambda: _NONE) -> None:
        """``copies_in_pool``: the tier pages pool pages hold copies of now (they live)."""
        if capacity_pages < 0:
            raise ValueError(f"capacity_pages must be >= 0, got {capacity_pages}")
        self.capacity_pages = capacity_pages
        self.copies_in_pool = copies_in_pool
        self._entries: OrderedDict[int, OffloadedEntry] = OrderedDict()  # oldest first
        # Chunks by first tier page: per page, the offloaded entries that use it.
        self._chunks: dict[int, np.ndarray] = {}
        self._starts: list[int] = []  # sorted
        self._next_page = 0
        self.used_pages = 0  # pages of live chunks
        self.counts = TierCounts()
        # The entry being restored: never dropped to make room for the entries its restore
        # evicts from the pool (it leaves the tier once its pages are taken).
        self.restoring: int | None = None

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry_ids(self) -> list[int]:
        """Offloaded entries, least recently stored first."""
        return list(self._entries)

    def get(self, entry_id: int) -> OffloadedEntry | None:
        return self._entries.get(entry_id)

    def chunk_size(self, chunk: int) -> int:
        """Pages of a live chunk (0: none such)."""
        return len(self._chunks.get(chunk, ()))

    # ------------------------------------------------------------------- store
    def store(self, entry_id: int, entry: StoredEntry, known: np.ndarray) -> StoreResult:
        """Keep ``entry`` as offloaded. ``known``: per page of its table (row order), the
        tier page it is a copy of, or -1 (those are written, as one new chunk)."""
        known = np.asarray(known, dtype=np.int64)
        new = known < 0
        count = int(new.sum())
        if count > self.capacity_pages:
            self.counts.refused_entries += 1
            return StoreResult(False, [], [])
        dropped, freed = self._make_room(count)
        if self.used_pages + count > self.capacity_pages:
            self.counts.refused_entries += 1
            return StoreResult(False, dropped, freed)
        tier_pages = known.copy()
        chunk = -1
        if count:
            chunk = self._next_page
            self._next_page += count
            self._chunks[chunk] = np.zeros(count, dtype=np.int32)
            bisect.insort(self._starts, chunk)
            self.used_pages += count
            tier_pages[new] = np.arange(chunk, chunk + count)
        self._add_uses(tier_pages, 1)
        table = entry.table
        empty = HeadPageTable(table.num_rows, table.page_size, initial_capacity=1)
        self._entries[entry_id] = OffloadedEntry(dataclasses.replace(entry, table=empty),  # type: ignore[type-var]
                                                 table.num_pages.copy(), tier_pages)
        self.counts.saved_entries += 1
        self.counts.saved_pages += count
        self.counts.known_pages += len(known) - count
        return StoreResult(True, dropped, freed, chunk, new)

    def _make_room(self, count: int) -> tuple[list[int], list[int]]:
        """Free dead chunks, then drop the least recently stored entries, until ``count``
        more pages fit or nothing is left to drop."""
        freed = self.sweep() if self.used_pages + count > self.capacity_pages else []
        dropped = []
        while self.used_pages + count > self.capacity_pages:
            oldest = next((e for e in self._entries if e != self.restoring), None)
            if oldest is None:
                break
            freed += self.drop(oldest)
            dropped.append(oldest)
        return dropped, freed

    # ------------------------------------------------------------ take, drop
    def take(self, entry_id: int) -> OffloadedEntry:
        """The entry leaves the tier to be loaded (its pages live on as long as the pool
        pages loaded from them are copies of them)."""
        offloaded = self._entries.pop(entry_id)
        self._add_uses(offloaded.tier_pages, -1)
        self.counts.loaded_entries += 1
        self.counts.loaded_pages += offloaded.num_pages
        return offloaded

    def drop(self, entry_id: int) -> list[int]:
        """Forget an offloaded entry; return the chunks that died with it."""
        offloaded = self._entries.pop(entry_id, None)
        if offloaded is None:
            return []
        self._add_uses(offloaded.tier_pages, -1)
        self.counts.dropped_entries += 1
        return self.sweep(self._chunks_of(offloaded.tier_pages))

    def sweep(self, chunks: list[int] | None = None) -> list[int]:
        """Free the chunks (of ``chunks``, or all) no offloaded entry uses and no pool page
        is a copy of; return them."""
        candidates = [start for start in (self._starts if chunks is None else chunks)
                      if start in self._chunks and not self._chunks[start].any()]
        if not candidates:
            return []
        copies = np.unique(self.copies_in_pool())
        freed = []
        for start in candidates:
            size = len(self._chunks[start])
            lo, hi = np.searchsorted(copies, [start, start + size])
            if hi > lo:
                continue  # a pool page still is a copy of one of its pages
            del self._chunks[start]
            self._starts.remove(start)
            self.used_pages -= size
            freed.append(start)
        return freed

    def forget_chunk(self, chunk: int) -> tuple[list[int], list[int]]:
        """The worker lost chunk ``chunk`` (its save failed): the entries using it are
        dropped, and the chunk forgotten. Returns those entries and the other chunks that
        died with them."""
        users = [entry_id for entry_id, offloaded in self._entries.items()
                 if chunk in self._chunks_of(offloaded.tier_pages)]
        freed: list[int] = []
        for entry_id in users:
            freed += self.drop(entry_id)
        if chunk in self._chunks:
            self.used_pages -= len(self._chunks.pop(chunk))
            self._starts.remove(chunk)
        return users, [start for start in freed if start != chunk]

    def chunk_of(self, tier_pages: np.ndarray) -> np.ndarray:
        """The chunk (first tier page) of each tier page."""
        starts = np.asarray(self._starts, dtype=np.int64)
        return starts[np.searchsorted(starts, tier_pages, side="right") - 1]

    def _chunks_of(self, tier_pages: np.ndarray) -> list[int]:
        if not len(tier_pages):
            return []
        return np.unique(self.chunk_of(tier_pages)).tolist()

    def _add_uses(self, tier_pages: np.ndarray, delta: int) -> None:
        if not len(tier_pages):
            return
        chunks = self.chunk_of(tier_pages)
        for start in np.unique(chunks).tolist():
            mine = tier_pages[chunks == start] - start
            np.add.at(self._chunks[start], mine, delta)

    # ---------------------------------------------------------------- checking
    def check(self) -> None:
        """Every use counted, the bound held, every pool copy of a live chunk's page."""
        uses = {start: np.zeros_like(refs) for start, refs in self._chunks.items()}
        for offloaded in self._entries.values():
            assert offloaded.num_pages == int(offloaded.row_pages.sum())
            chunks = self.chunk_of(offloaded.tier_pages)
            for start in np.unique(chunks).tolist():
                assert start in uses, f"an offloaded entry uses freed chunk {start}"
                np.add.at(uses[start], offloaded.tier_pages[chunks == start] - start, 1)
        for start, refs in self._chunks.items():
            assert np.array_equal(uses[start], refs), f"chunk {start}: uses miscounted"
        used = sum(len(refs) for refs in self._chunks.values())
        assert used == self.used_pages <= self.capacity_pages, (
            f"tier holds {used} pages (counted {self.used_pages}), bound "
            f"{self.capacity_pages}")
        assert self._starts == sorted(self._chunks)
        copies = np.unique(self.copies_in_pool())
        if len(copies):
            chunks = self.chunk_of(copies)
            ends = chunks + np.array([len(self._chunks.get(int(c), ())) for c in chunks])
            assert (copies >= chunks).all() and (copies < ends).all(), (
                "a pool page is a copy of a freed tier page")
