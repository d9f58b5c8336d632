"""Scheduler-side owner of one rank's pages: the pool, the requests' tables and the prefix
cache, behind one object.

Admission and preemption are decided in pages. Every page is free (``page_pool``) or held,
its reference count being the request rows (``request_tables``) and prefix-cache entries
(``prefix_cache``) that point at it: a row owns the pages it writes, and may read an
entry's whole pages in place as a shared run (an adopter by share or handover); a page is
free iff its count is 0. ``check_invariants`` verifies every count against the holders.
Pages only entries hold count as available: the pool asks the prefix cache to evict
entries, least recently used first, only when the free stack runs short. A page running
requests read counts as used once, however many read it. This class only composes the
three and moves a request between the tables and the cache (retire, adopt);
``ShardedPageManager`` puts one per tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.offload_tier import OffloadTier, TierOrder
from kvcompress.paging.page_fill import PageFill
from kvcompress.paging.page_pool import Holder, PagePool
from kvcompress.paging.prefix_cache import CacheEntry, PrefixCache
from kvcompress.paging.request_tables import PageTableDelta, RequestTables


class PageManager:
    def __init__(self, layout: PageLayout, tier_pages: int = 0) -> None:
        """``tier_pages``: pages of the offload tier (0: none, evicted entries are dropped)."""
        self.layout = layout
        self.pool = PagePool(layout.total_pages, track_tier_copies=tier_pages > 0)
        self.tables = RequestTables(layout, self.pool)
        self.tier = OffloadTier(tier_pages, self._tier_copies) if tier_pages > 0 else None
        self.cache = PrefixCache(layout, self.pool, self.tier)
        self.pool.reclaim = self.cache.evict_for
        # Pending segments compacted in this schedule: segment request id -> pages dropped
        # per row (the worker runs the plan it kept under that id).
        self._compacted: dict[str, np.ndarray] = {}
        # The tables' requests by id (``RequestPages``): the same dict, for the reads below.
        self._requests = self.tables.states

    def _tier_copies(self) -> np.ndarray:
        """The tier pages this pool's pages hold copies of (the tier keeps them)."""
        copies = self.pool.tier_copy
        return copies[copies >= 0]

    # ----------------------------------------------------------------- figures
    @property
    def total_pages(self) -> int:
        return self.layout.total_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_cached(self) -> int:
        """Pages prefix-cache entries hold that no running request reads."""
        return self.cache.num_cached

    @property
    def num_read(self) -> int:
        """Pages running requests read in shared runs (each once, however many read it)."""
        return self.pool.num_read

    @property
    def num_available(self) -> int:
        """Pages an allocation may take: free ones, then those only entries hold (evicted
        for it), but the sources of this schedule's copies."""
        return self.pool.num_free + self.cache.num_evictable

    @property
    def usage(self) -> float:
        # As vLLM counts its prefix cache: evictable cached pages are not in use.
        return 1.0 - self.num_available / self.layout.total_pages

    def owned_pages(self, request_id: str | None = None) -> int:
        """Pages in the request's rows (its shared runs included), or with no request the
        pages any running request holds, each counted once."""
        if request_id is None:
            return self.pool.num_owned + self.pool.num_read
        return self.tables.owned_pages(request_id)

    def shared_pages(self, request_ids: Sequence[str]) -> np.ndarray:
        """Per request, the pages of its rows' shared runs (``num_read`` counts them)."""
        return self.tables.shared_pages(request_ids)

    def pages_read_already(self, entry_id: int, hit: int) -> int:
        """Of the whole pages an adoption of the entry's first ``hit`` tokens would read,
        those running requests read already (``num_read`` counts them)."""
        return self.cache.pages_read_already(entry_id, hit)

    def physical_lengths(self, request_id: str) -> np.ndarray:
        """Per-row physical tokens of the slots reserved for the request."""
        return self.tables.physical_lengths(request_id)

    def physical_lengths_by_rank(self, request_id: str) -> np.ndarray:
        """``[1, rows]``: one rank (``ShardedPageManager`` has more)."""
        return self.physical_lengths(request_id)[None]

    def lengths_and_owned_pages(self, request_ids: Sequence[str]) -> tuple[np.ndarray,
                                                                         np.ndarray]:
        return self.tables.lengths_and_owned_pages(request_ids)

    def page_fill(self, request_ids: Sequence[str]) -> PageFill:
        """``PageFill.of_lengths`` of the requests' physical lengths, without per-row work."""
        return self.tables.page_fill(request_ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.tables

    def adoption(self, request_id: str) -> tuple[int, np.ndarray] | None:
        """(logical tokens, per-row physical tokens) the request took from a cached entry."""
        state = self._requests.get(request_id)
        return None if state is None else state.adopted

    def request_ids(self) -> set[str]:
        return set(self._requests)

    # ------------------------------------------------------------- allocation
    def pages_needed(self, request_id: str, logical_len: int) -> int:
        """Pages the request must gain to hold ``logical_len`` logical tokens."""
        return self.tables.pages_needed(request_id, logical_len)

    def pages_needed_for_sequence(self, request_id: str, logical_len: int,
                                  max_chunk: int) -> int:
        return self.tables.pages_needed_for_sequence(request_id, logical_len, max_chunk)

    def allocate(self, request_id: str, logical_len: int, reserve: int = 0) -> bool:
        """Reserve slots up to ``logical_len`` tokens; all or nothing. ``reserve`` pages
        must stay available afterwards (a watermark for admissions)."""
        return self.tables.allocate(request_id, logical_len, self.num_available - reserve)

    def drop_outside_window(self, request_id: str, processed: int) -> int:
        return self.tables.drop_outside_window(request_id, processed)

    def release_after_compression(
        self, request_id: str, logical_len: int, physical_lengths: np.ndarray,
        kind: str = "prompt", prompt_evicted: np.ndarray | None = None,
    ) -> int:
        """``RequestTables.release_after_compression``: pages freed."""
        return self.tables.release_after_compression(request_id, logical_len,
                                                     physical_lengths, kind, prompt_evicted)

    def free(self, request_id: str) -> int:
        state = self.tables.states.get(request_id)
        if state is not None and state.planned is not None:
            self.cache.discarded_plans.append(request_id)  # a segment not filed after all
        return self.tables.free(request_id)

    def take_deltas(self) -> dict[str, PageTableDelta]:
        """The changes since the last call, for the worker, which runs their copies before
        anything else: the copies' sources may be evicted from now on."""
        self.cache.unpin_all()
        return self.tables.take_deltas()

    # ------------------------------------------------------------ prefix cache
    def retire(self, request_id: str, entry_id: int, logical_len: int, prompt_len: int) -> bool:
        """The request finished: keep the K/V of its first ``logical_len`` tokens as entry
        ``entry_id`` instead of freeing it (``PrefixCache.retire``). False when it was freed."""
        state = self.tables.remove(request_id)
        return state is not None and self.cache.retire(entry_id, state, logical_len, prompt_len,
                                                       request_id)

    def entry(self, entry_id: int) -> CacheEntry | None:
        return self.cache.entry(entry_id)

    def entry_ids(self) -> list[int]:
        """Prefix-cache entries, least recently used first."""
        return self.cache.entry_ids()

    def plan_evictions(self, next_use: dict[int, int]) -> None:
        """``PrefixCache.plan_evictions``."""
        self.cache.plan_evictions(next_use)

    def can_adopt(self, entry_id: int, hit: int, logical_len: int, share: bool,
                  reserve: int = 0) -> bool:
        return self.cache.can_adopt(entry_id, hit, logical_len, share, reserve)

    def can_share_from_free(self, entry_id: int, hit: int, logical_len: int,
                            reserve: int = 0) -> bool:
        return self.cache.can_share_from_free(entry_id, hit, logical_len, reserve)

    def adopt(self, request_id: str, entry_id: int, hit: int, share: bool) -> bool:
        """Start ``request_id`` from the entry's first ``hit`` logical tokens; all or
        nothing (``PrefixCache.adopt``). The request then grows with ``allocate``."""
        if request_id in self.tables:
            return False
        adopted = self.cache.adopt(entry_id, hit, share)
        if adopted is None:
            return False
        self.tables.add(request_id, *adopted)
        return True

    def drop_entry(self, entry_id: int) -> int:
        """Drop an entry (resident or offloaded); return how many of its pages became free."""
        return self.cache.drop_entry(entry_id)

    # ------------------------------------------------------------ offload tier
    def known_entry(self, entry_id: int) -> CacheEntry | None:
        """``PrefixCache.known``: the entry, resident or offloaded."""
        return self.cache.known(entry_id)

    def is_offloaded(self, entry_id: int) -> bool:
        return self.cache.is_offloaded(entry_id)

    def offloaded_ids(self) -> list[int]:
        return self.cache.offloaded_ids()

    def can_restore(self, entry_id: int, hit: int, logical_len: int, reserve: int = 0) -> bool:
        """Whether restoring the offloaded entry and an adopter's growth from its first
        ``hit`` tokens to ``logical_len`` fit, leaving ``reserve`` pages available."""
        cost = self.cache.restore_cost(entry_id, hit, logical_len)
        return cost is not None and cost + reserve <= self.num_available

    def restore(self, entry_id: int) -> bool:
        return self.cache.restore(entry_id)

    def offload(self, entry_id: int) -> bool:
        return self.cache.offload(entry_id)

    def import_entry(self, entry_id: int, lengths: np.ndarray, prompt_len: int,
                     source: str) -> bool:
        """``PrefixCache.import_entry``: a handed-off prompt filed on fresh pages."""
        return self.cache.import_entry(entry_id, lengths, prompt_len, source)

    def can_import(self, entry_id: int, lengths: np.ndarray, prompt_len: int) -> bool:
        return self.cache.can_import(entry_id, lengths, prompt_len)

    def forget_tier_chunk(self, chunk: int) -> list[int]:
        """``PrefixCache.forget_tier_chunk``: the offloaded entries lost with it."""
        return self.cache.forget_tier_chunk(chunk)

    def take_tier_orders(self) -> list[TierOrder]:
        """For the worker: the tier's saves, loads and drops since the last call, in order."""
        return self.cache.take_tier_orders()

    # -------------------------------------------------------- pending segments
    def pending_ids(self) -> list[int]:
        return self.cache.pending_ids()

    def segment_readers(self, entry_id: int) -> list[str]:
        """Running requests whose rows read the pending entry's pages."""
        pending = self.cache.pending(entry_id)
        if pending is None:
            return []
        return [request_id for request_id, state in self.tables.states.items()
                if state.shared is not None and pending.holds(state.table)]

    def compact_segment(self, entry_id: int) -> int:
        """Compact the pending entry in place (``prefix_cache``): its dropped pages leave
        every holder's rows, requests' and entries', and are free. Return how many."""
        pending = self.cache.pending(entry_id)
        if pending is None:
            return 0
        freed = 0
        for request_id in self.segment_readers(entry_id):
            start = pending.start_in(self._requests[request_id].table)
            assert start is not None
            freed += self.tables.drop_compacted(request_id, start, start + pending.counts)
        freed += sum(self.cache.compact_entry(holder, pending)
                     for holder in self.cache.entries_holding(pending))
        self.cache.finish_pending(entry_id)
        if self.pool.counts(pending.removed).any():
            raise AssertionError(f"pages of segment {pending.request_id} still held after "
                                 "its compaction")
        self._compacted[pending.request_id] = pending.counts.copy()
        return freed

    def take_segment_orders(self) -> dict[str, np.ndarray | None]:
        """For the worker: segment plans to run (request id -> pages dropped per row) or to
        forget (None), since the last call."""
        orders: dict[str, np.ndarray | None] = dict.fromkeys(self.cache.discarded_plans)
        orders.update(self._compacted)
        self.cache.discarded_plans, self._compacted = [], {}
        return orders

    def take_evicted_entries(self) -> list[int]:
        """Entries evicted for pages since the last call."""
        return self.cache.take_evicted_entries()

    # -------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Raise AssertionError unless every page's reference count equals the rows, entries
        and pins pointing at it, the pages a row writes are held by it alone, and the free
        pages are exactly those at count 0."""
        entries, pins = self.cache.check()
        owned, read = self.tables.check()
        self.pool.check({Holder.OWNER: owned, Holder.READER: read, Holder.ENTRY: entries,
                         Holder.PIN: pins})
