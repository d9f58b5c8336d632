"""The prefix cache, one rank's pages of it: finished requests' K/V, kept for later prompts
that start with the same tokens (the next turn of a conversation).

vLLM's prefix cache shares full blocks by hash; compacted per-head rows cannot be shared that
way, so here the unit is a whole finished request. The words, used the same everywhere:

- **entry**: a finished request's page table cut to its computed tokens (``CacheEntry``);
  its pages are cached (evictable) unless a running request reads them too.
- **retire**: a finished request's pages become an entry instead of being freed.
- **cut**: a logical length at which an entry's rows can be split, knowing how many physical
  tokens of each row stand for it (``CacheEntry.lengths_at``); the **hit** is the cut a new
  prompt gets (``CacheEntry.best_hit``: the longest cut within the tokens it shares).
- **adopt**: a new request starts from an entry's first ``hit`` tokens, by **share** (the
  entry stays) or by **handover** (the entry ends). Either way each row's whole pages of the
  cut are read in place: the adopter is their **reader**, and they form its row's shared
  run, never written (its writes all land past the adopted tokens). A row's last, partial
  page is one the adopter writes, so it is its own: a **copy** of the entry's (onto a new
  page, the worker copies it) or, in a handover where nobody else holds it, the entry's
  page itself.
- **evict**: entries are dropped, least recently used first, only when the free stack falls
  short (``evict_for``, the pool's ``reclaim``); a page goes back to the free stack only
  when no running request (reader) and no other entry holds it. With an offload tier an
  evicted entry is **offloaded** instead (``offload_tier``): its pages are freed all the
  same, their K/V saved first, and it is **restored** onto fresh pages for an adopter.
- **pin**: the source of a copy of this schedule is held (``Holder.PIN``) until the deltas
  are taken: the worker copies after the schedule, and a page freed meanwhile could be
  another adopter's copy destination.
- **pending**: a shared prefix's segment request is filed *uncompressed*, its plan reported
  but not run (``PendingSegment``), so that its first readers prefill their own parts over
  the whole prefix; once none of them is in prefill any more, it is **compacted in place**
  (``PageManager.compact_segment``): per row the kept tokens fill the first whole pages,
  and the last whole pages no longer needed leave the middle of every holder's rows (the
  entry's, its readers', and entries those readers retired into). Until then every such
  holder is **sealed**: cut only at its prompt's end, adopted only whole.

Which entry a prompt starts with is found by tokens (``prefix_index``), and who may adopt it
is the engine's rule (``kvcompress.engine.sched.prefix_cache``); this module only holds pages.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.offload_tier import OffloadTier, TierOrder
from kvcompress.paging.page_pool import Holder, PagePool, PageState
from kvcompress.paging.page_table import HeadPageTable, pages_for_lengths
from kvcompress.paging.request_tables import PageTableDelta, RequestPages, release_request


@dataclass
class CacheEntry:
    """A finished request's pages, kept for a prompt that starts with its tokens."""

    table: HeadPageTable
    logical_len: int  # tokens whose K/V the rows hold (the request's computed tokens)
    evicted: np.ndarray  # per row, logical tokens without a slot
    prompt_len: int
    prompt_evicted: np.ndarray  # per row, evicted by the prompt's compaction
    tail_in_order: bool
    sealed: int = 0  # pending segments whose pages it holds (see the module's words)
    segment: bool = False  # a shared prefix's segment request's, compressed by its plan

    @property
    def exact_prompt(self) -> bool:
        """Whether its prompt part kept every token (so it can be cut anywhere inside)."""
        return not self.sealed and not self.prompt_evicted.any()

    @property
    def first_cut(self) -> int:
        return 1 if self.exact_prompt else self.prompt_len

    def best_hit(self, shared: int) -> int:
        """The longest cut at most ``shared`` tokens long (0: none)."""
        shared = min(shared, self.logical_len)
        if self.prompt_len < shared < self.logical_len and not self.tail_in_order:
            shared = self.prompt_len  # (the whole entry stays a cut: every slot is in it)
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
        elif self.tail_in_order or hit == self.logical_len:
            # In order, a generated token's slot is its position less the evictions; after
            # a decode eviction only the whole rows stand for a known set of tokens (all of
            # them; their order does not matter to attention, positions are in the keys).
            lengths = hit - self.evicted
        else:
            return None
        return None if (lengths < 0).any() else lengths


@dataclass
class PendingSegment:
    """An entry filed uncompressed whose plan the worker holds: compacting it in place drops
    ``counts[row]`` pages of each row (the row's last whole pages, ``removed`` in row order)
    from every holder's rows.

    The pages are known by id, not by position: a holder finds them where its own row has
    them (``start_in``). Another segment compacted first (a shorter prefix this one adopted)
    shifts them down in every row, and a recorded position would then name other pages."""

    request_id: str  # the segment request: the worker keeps its plan under this id
    counts: np.ndarray  # int32 per row, pages dropped
    removed: np.ndarray  # their ids, in row order

    def __post_init__(self) -> None:
        self._rows = np.flatnonzero(self.counts)
        firsts = (np.cumsum(self.counts) - self.counts)[self._rows]
        self._firsts = self.removed[firsts]  # per row that drops pages, its first dropped

    def start_in(self, table: HeadPageTable, verify: bool = True) -> np.ndarray | None:
        """Per row, where ``table`` holds the segment's dropped pages (None: it does not).
        A holder adopted them whole, as leading pages, so it holds all of them, in order,
        or none: anything else is a bookkeeping error, which ``verify`` checks page by page
        (asking only whether a table holds them, ``holds``, checks the first of each row)."""
        rows = self._rows
        if not len(rows):
            return None
        probe = rows[0]  # most tables hold none: one row tells
        if not (table.pages[probe, : table.num_pages[probe]] == self._firsts[0]).any():
            return None
        width = table.pages.shape[1]
        inside = np.arange(width)[None, :] < table.num_pages[rows][:, None]
        found = (table.pages[rows] == self._firsts[:, None]) & inside
        if not found.any(axis=1).all():
            raise AssertionError(f"a table reads only some rows of segment {self.request_id}")
        start = np.zeros(len(self.counts), dtype=np.int32)
        start[rows] = found.argmax(axis=1)
        stop = start + self.counts
        if verify and ((stop > table.num_pages).any() or not np.array_equal(
                table.pages_between(start, stop), self.removed)):
            raise AssertionError(f"a table reads segment {self.request_id}'s pages out of "
                                 "order")
        return start

    def holds(self, table: HeadPageTable) -> bool:
        """Whether ``table``'s rows read the segment's pages."""
        return self.start_in(table, verify=False) is not None


@dataclass(frozen=True)
class _Cut:
    """An entry's rows split at a cut, as an adoption takes them."""

    entry: CacheEntry
    lengths: np.ndarray  # per row, physical tokens standing for the cut
    whole: np.ndarray  # int32 per row, whole pages: read in place
    partial: np.ndarray  # int32 per row, 1 where a last, partial page follows them
    read: np.ndarray  # the whole pages' ids, in row order
    tails: np.ndarray  # the partial pages' ids, in row order


class PrefixCache:
    def __init__(self, layout: PageLayout, pool: PagePool,
                 tier: OffloadTier | None = None) -> None:
        self.layout = layout
        self.pool = pool
        self.tier = tier  # where evicted entries go (None: they are dropped)
        # The worker's tier work since the owner last asked (take_tier_orders), in order.
        self._tier_orders: list[TierOrder] = []
        # Entries offloaded since the owner last asked (take_offloaded).
        self._offloaded: list[int] = []
        # Entries by id, least recently used first.
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        # Entries evicted for pages since the owner last asked (take_evicted_entries).
        self._evicted: list[int] = []
        # The sources of this schedule's copies (held until unpin_all).
        self._pins: list[np.ndarray] = []
        # The entry being adopted: not evicted for the pages of its own adoption.
        self._adopting: int | None = None
        # Entries waiting requests will adopt -> how soon (their queue position): evicted
        # last, the one needed latest first (``plan_evictions``).
        self._next_use: dict[int, int] = {}
        # Entries filed uncompressed, compacted once their first readers prefilled.
        self._pending: dict[int, PendingSegment] = {}
        # Segment plans the worker may forget (their entry is gone, or never was).
        self.discarded_plans: list[str] = []
        # Counts every change of an entry's existence or rows (retire, compaction, adoption
        # by handover, drop): a lookup's answer stays right while it does not move.
        self.version = 0

    @property
    def num_cached(self) -> int:
        """Pages entries hold that no running request reads."""
        return self.pool.num_cached

    @property
    def num_evictable(self) -> int:
        """Pages evicting every entry would free: those only entries hold, unpinned."""
        return self.pool.num_evictable

    def entry(self, entry_id: int) -> CacheEntry | None:
        return self._entries.get(entry_id)

    def entry_ids(self) -> list[int]:
        """Entries, least recently used first."""
        return list(self._entries)

    def known(self, entry_id: int) -> CacheEntry | None:
        """The entry, resident or offloaded (then its table is empty: ask what it holds, not
        where)."""
        entry = self._entries.get(entry_id)
        if entry is None and self.tier is not None:
            offloaded = self.tier.get(entry_id)
            entry = None if offloaded is None else offloaded.entry
        return entry

    def is_offloaded(self, entry_id: int) -> bool:
        return self.tier is not None and entry_id in self.tier

    def offloaded_ids(self) -> list[int]:
        return [] if self.tier is None else self.tier.entry_ids()

    # ------------------------------------------------------------------ retire
    def retire(self, entry_id: int, state: RequestPages, logical_len: int,
               prompt_len: int, request_id: str = "") -> bool:
        """Keep the K/V of a finished request's first ``logical_len`` tokens as entry
        ``entry_id`` (most recently used); pages beyond them are released. False
        (everything released) when its rows do not hold those tokens. A segment request
        with a deferred plan (``RequestPages.planned``) is filed pending."""
        self.version += 1
        evicted = state.evicted
        if logical_len == prompt_len < state.logical_len and state.prompt_evicted is not None:
            # Cut at the prompt's end: what the generated tokens evicted is not in the entry.
            evicted = state.prompt_evicted
        lengths = logical_len - evicted
        if (logical_len <= 0 or logical_len > state.logical_len or (lengths < 0).any()
                or state.cuts_shared_run(lengths, self.layout.page_size)):
            release_request(self.pool, state)
            if state.planned is not None:
                self.discarded_plans.append(request_id)
            return False
        if state.adopted_from in self._entries:
            # The new entry extends the one it adopted, which now serves only a branch
            # from its own end: evicted first.
            self._entries.move_to_end(state.adopted_from, last=False)
        self.pool.release(state.table.truncate(lengths), Holder.OWNER)
        # The rows' references become the entry's (the pages it read stay shared).
        self.pool.transfer(state.read_pages(), Holder.READER, Holder.ENTRY)
        self.pool.transfer(state.own_pages(), Holder.OWNER, Holder.ENTRY)
        prompt_evicted = (state.prompt_evicted if state.prompt_evicted is not None
                          else np.zeros_like(state.evicted))
        entry = self._entries[entry_id] = CacheEntry(
            state.table, logical_len, evicted.copy(), prompt_len, prompt_evicted.copy(),
            state.tail_in_order, sealed=state.sealed, segment=state.planned is not None)
        if state.planned is not None:
            # Only a segment cut at its prompt's end, as planned, is compacted by its plan.
            pending = (self._pending_of(state, lengths, request_id)
                       if logical_len == prompt_len == state.logical_len else None)
            if pending is None:
                self.discarded_plans.append(request_id)
            else:
                self._pending[entry_id] = pending
                entry.sealed += 1
        return True

    def _pending_of(self, state: RequestPages, lengths: np.ndarray,
                    request_id: str) -> PendingSegment | None:
        """The pending segment of a retired segment request's deferred plan, or None when it
        drops no page (or does not fit its rows: then it is not run)."""
        page_size = self.layout.page_size
        shrink = lengths - state.planned
        whole = lengths // page_size
        shared = np.zeros_like(whole) if state.shared is None else state.shared
        drop = shrink // page_size
        if (shrink < 0).any() or (shrink % page_size).any() or (drop > whole - shared).any():
            return None
        if not drop.any():
            return None
        start, stop = (whole - drop).astype(np.int32), whole.astype(np.int32)
        return PendingSegment(request_id, drop.astype(np.int32),
                              state.table.pages_between(start, stop).copy())

    # ----------------------------------------------------------------- pending
    def pending(self, entry_id: int) -> PendingSegment | None:
        return self._pending.get(entry_id)

    def pending_ids(self) -> list[int]:
        """Entries filed uncompressed, waiting to be compacted, oldest first."""
        return list(self._pending)

    def entries_holding(self, pending: PendingSegment) -> list[int]:
        """Entries whose rows hold the pending segment's pages (its own included)."""
        return [entry_id for entry_id, entry in self._entries.items()
                if pending.holds(entry.table)]

    def compact_entry(self, entry_id: int, pending: PendingSegment) -> int:
        """Entry ``entry_id`` holds a pending segment compacted in place: its dropped pages
        leave, their tokens evicted. Return how many pages became free."""
        self.version += 1
        entry = self._entries[entry_id]
        start = pending.start_in(entry.table)
        if start is None:
            raise AssertionError(f"entry {entry_id} does not hold segment "
                                 f"{pending.request_id}")
        tokens = pending.counts.astype(np.int64) * self.layout.page_size
        dropped = entry.table.drop_between(start, start + pending.counts)
        entry.evicted = entry.evicted + tokens
        entry.prompt_evicted = entry.prompt_evicted + tokens
        entry.sealed = max(0, entry.sealed - 1)
        return self.pool.release(dropped, Holder.ENTRY)

    def finish_pending(self, entry_id: int) -> PendingSegment:
        return self._pending.pop(entry_id)

    def _forget_pending(self, entry_id: int) -> None:
        """The entry is gone before its compaction: its readers keep the whole prefix (the
        pages may go to anyone once they finish), the worker forgets the plan."""
        pending = self._pending.pop(entry_id, None)
        if pending is not None:
            self.discarded_plans.append(pending.request_id)

    # ------------------------------------------------------------------- adopt
    def can_adopt(self, entry_id: int, hit: int, logical_len: int, share: bool,
                  reserve: int = 0) -> bool:
        """Whether ``adopt(..., hit, share)`` and the growth to ``logical_len`` logical
        tokens fit, leaving ``reserve`` pages available."""
        cut = self._cut(entry_id, hit)
        if cut is None:
            return False
        available = self.pool.num_free + self.pool.num_evictable
        if self._growth(cut, hit, logical_len) + reserve > available:
            return False  # (the growth alone is too much: no need to count the rest)
        return self._adoption_cost(cut, hit, logical_len, share) + reserve <= available

    def can_share_from_free(self, entry_id: int, hit: int, logical_len: int,
                            reserve: int = 0) -> bool:
        """Whether ``adopt(..., hit, share=True)`` and the growth to ``logical_len`` logical
        tokens fit in free pages, leaving ``reserve`` of them free: no other entry is
        evicted for the adopter's own pages (the copies and its growth)."""
        cut = self._cut(entry_id, hit)
        if cut is None:
            return False
        return len(cut.tails) + self._growth(cut, hit, logical_len) + reserve <= (
            self.pool.num_free)

    def adopt(self, entry_id: int, hit: int,
              share: bool) -> tuple[RequestPages, PageTableDelta] | None:
        """The pages and fresh delta of a request that starts from the entry's first ``hit``
        logical tokens, by share (the entry stays) or handover (the entry ends); None,
        nothing changed, when the entry cannot be cut there or the adoption does not fit.
        The caller adds them to the request tables (``RequestTables.add``)."""
        cut = self._cut(entry_id, hit)
        if cut is None or not self.can_adopt(entry_id, hit, hit, share):
            return None
        pool = self.pool
        if share:
            self._entries.move_to_end(entry_id)
            pool.share(cut.read, Holder.READER)
            sources = cut.tails
            self._pin(sources)
            self._adopting = entry_id
            try:
                tails = copies_to = pool.pop(len(sources))  # may evict others, not this one
            finally:
                self._adopting = None
        else:
            self.version += 1
            del self._entries[entry_id]
            self._forget_pending(entry_id)
            # A partial page nobody else holds is taken as it is; one others hold (a longer
            # cut's reader, an entry that continued this one) is copied.
            in_place = pool.counts(cut.tails) == 1
            sources = cut.tails[~in_place]
            pool.transfer(cut.read, Holder.ENTRY, Holder.READER)
            pool.transfer(cut.tails[in_place], Holder.ENTRY, Holder.OWNER)
            self._pin(sources)
            pool.release(sources, Holder.ENTRY)
            pool.release(cut.entry.table.pages_after(cut.whole + cut.partial), Holder.ENTRY)
            copies_to = pool.pop(len(sources))
            tails = cut.tails.copy()
            tails[~in_place] = copies_to
        page_size = self.layout.page_size
        table = HeadPageTable(self.layout.num_rows, page_size)
        table.append(cut.whole, cut.read)
        table.append(cut.partial, tails)
        lengths = cut.lengths
        state = RequestPages(table=table, logical_len=hit, evicted=hit - lengths,
                             prompt_evicted=hit - lengths, adopted=(hit, lengths.copy()),
                             adopted_from=entry_id if share else None,
                             shared=cut.whole.copy(), shared_pages=len(cut.read),
                             sealed=cut.entry.sealed)
        state.refresh_headroom(page_size)
        appends = [(counts, pages) for counts, pages in ((cut.whole, cut.read),
                                                         (cut.partial, tails)) if len(pages)]
        delta = PageTableDelta(fresh=True, appends=appends, adopted_lengths=lengths.copy(),
                               adopted_len=hit,
                               copies=(sources, copies_to) if len(sources) else None)
        return state, delta

    def pages_read_already(self, entry_id: int, hit: int) -> int:
        """Of the whole pages an adoption of the cut would read, those rows read already."""
        cut = self._cut(entry_id, hit)
        return 0 if cut is None else self.pool.count_in_state(cut.read, PageState.READ)

    def unpin_all(self) -> None:
        """The worker has this schedule's copies: their sources are released."""
        for sources in self._pins:
            self.pool.release(sources, Holder.PIN)
        self._pins = []

    def _pin(self, sources: np.ndarray) -> None:
        if len(sources):
            self.pool.share(sources, Holder.PIN)
            self._pins.append(sources)

    def _cut(self, entry_id: int, hit: int) -> _Cut | None:
        entry = self._entries.get(entry_id)
        lengths = None if entry is None else entry.lengths_at(hit)
        if lengths is None:
            return None
        page_size = self.layout.page_size
        whole = (lengths // page_size).astype(np.int32)
        pages = pages_for_lengths(lengths, page_size).astype(np.int32)
        return _Cut(entry, lengths, whole, pages - whole, entry.table.leading_pages(whole),
                    entry.table.pages_between(whole, pages))

    def _growth(self, cut: _Cut, hit: int, logical_len: int) -> int:
        """New pages the adopter's rows take past the cut to hold ``logical_len`` tokens."""
        grown = pages_for_lengths(cut.lengths + max(0, logical_len - hit), self.layout.page_size)
        return int((grown - cut.whole - cut.partial).sum())

    def _adoption_cost(self, cut: _Cut, hit: int, logical_len: int, share: bool) -> int:
        """Pages the adoption and the growth take from the available ones: new pages, and
        the evictable ones it makes held (read, owned, or kept while it takes pages)."""
        growth = self._growth(cut, hit, logical_len)
        if share:
            # The whole entry is kept from eviction while its adoption pops pages.
            held = cut.entry.table.all_pages()
            return growth + len(cut.tails) + self.pool.count_in_state(held, PageState.CACHED)
        in_place = self.pool.counts(cut.tails) == 1
        held = np.concatenate([cut.read, cut.tails[in_place]])
        return (growth + int((~in_place).sum())
                + self.pool.count_in_state(held, PageState.CACHED))

    # ------------------------------------------------------------------- evict
    def drop_entry(self, entry_id: int) -> int:
        """Drop an entry; return how many of its pages became free (those no running
        request or other entry holds)."""
        if self.tier is not None and entry_id in self.tier:
            self.version += 1
            self._tier_orders += [TierOrder("free", chunk)
                                  for chunk in self.tier.drop(entry_id)]
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return 0
        self.version += 1
        self._forget_pending(entry_id)
        return self.pool.release(entry.table.all_pages(), Holder.ENTRY)

    # ---------------------------------------------------------------- offload
    def offload(self, entry_id: int) -> bool:
        """Move a resident entry to the tier: its pages are released (free unless a
        running request or another entry holds them), the worker saves those the tier does
        not hold yet first. False, nothing changed, without a tier, for an entry whose rows
        a pending compaction will still change (sealed), or one whose pages do not fit in
        the tier. Entries the tier drops to make room are gone (``take_evicted_entries``)."""
        entry = self._entries.get(entry_id)
        if self.tier is None or entry is None or entry.sealed or entry_id in self._pending:
            return False
        pages = entry.table.all_pages()
        result = self.tier.store(entry_id, entry, self.pool.tier_copy[pages])
        self._tier_orders += [TierOrder("free", chunk) for chunk in result.freed]
        self._evicted += result.dropped
        if not result.stored:
            return False
        self.version += 1
        del self._entries[entry_id]
        if result.chunk >= 0:
            self._tier_orders.append(TierOrder("save", result.chunk, pages[result.new]))
        self._offloaded.append(entry_id)
        # Pages others still read or keep hold what the tier does (until written or freed).
        self.pool.tier_copy[pages] = self.tier.get(entry_id).tier_pages  # type: ignore[union-attr]
        self.pool.release(pages, Holder.ENTRY)
        return True

    def restore_cost(self, entry_id: int, hit: int, logical_len: int) -> int | None:
        """Pages restoring the offloaded entry and then growing an adopter of its first
        ``hit`` tokens to ``logical_len`` take (None: not offloaded, or no cut there)."""
        offloaded = None if self.tier is None else self.tier.get(entry_id)
        lengths = None if offloaded is None else offloaded.entry.lengths_at(hit)
        if lengths is None:
            return None
        page_size = self.layout.page_size
        growth = (pages_for_lengths(lengths + max(0, logical_len - hit), page_size).sum()
                  - pages_for_lengths(lengths, page_size).sum())
        return offloaded.num_pages + int(growth)

    def restore(self, entry_id: int) -> bool:
        """Bring an offloaded entry back onto fresh pages (evicting, or offloading, others
        for them), most recently used, the worker loading them before anything reads
        them. False, nothing changed, when it is not offloaded or its pages do not fit."""
        tier = self.tier
        if tier is None:
            return False
        offloaded = tier.get(entry_id)
        if offloaded is None or offloaded.num_pages > (self.pool.num_free
                                                       + self.pool.num_evictable):
            return False
        self.version += 1
        tier.restoring = entry_id
        try:  # it stays in the tier while others are evicted for its pages
            pages = self.pool.pop(offloaded.num_pages)
        finally:
            tier.restoring = None
        tier.take(entry_id)
        self.pool.transfer(pages, Holder.OWNER, Holder.ENTRY)
        self.pool.tier_copy[pages] = offloaded.tier_pages  # (so they live on)
        table = HeadPageTable(self.layout.num_rows, self.layout.page_size)
        table.append(offloaded.row_pages, pages)
        self._entries[entry_id] = replace(offloaded.entry, table=table)
        self._tier_orders.append(TierOrder("load", entry_id, pages, offloaded.tier_pages))
        return True

    def import_entry(self, entry_id: int, lengths: np.ndarray, prompt_len: int,
                     source: str) -> bool:
        """File a prefill instance's handed-off prompt (``engine.handoff``: per row the
        tokens kept of its ``prompt_len``) as entry ``entry_id`` on fresh pages (evicting,
        or offloading, others for them), most recently used; the worker loads them before
        anything reads them (an ``import`` order). False, nothing changed, when they do not
        fit or a row holds more tokens than the prompt."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if not self.can_import(entry_id, lengths, prompt_len):
            return False
        row_pages = pages_for_lengths(lengths, self.layout.page_size)
        self.version += 1
        pages = self.pool.pop(int(row_pages.sum()))
        self.pool.transfer(pages, Holder.OWNER, Holder.ENTRY)
        table = HeadPageTable(self.layout.num_rows, self.layout.page_size)
        table.append(row_pages, pages)
        evicted = prompt_len - lengths
        self._entries[entry_id] = CacheEntry(table, prompt_len, evicted, prompt_len,
                                             evicted.copy(), tail_in_order=True)
        self._tier_orders.append(TierOrder("import", entry_id, pages, source=source))
        return True

    def can_import(self, entry_id: int, lengths: np.ndarray, prompt_len: int) -> bool:
        """Whether ``import_entry`` would file it."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if (entry_id in self._entries or lengths.shape != (self.layout.num_rows,)
                or (lengths < 1).any() or (lengths > prompt_len).any()):
            return False
        needed = int(pages_for_lengths(lengths, self.layout.page_size).sum())
        return needed <= self.pool.num_free + self.pool.num_evictable

    def forget_tier_chunk(self, chunk: int) -> list[int]:
        """The worker lost a chunk (its save failed): the offloaded entries using it are
        dropped (returned: the caller drops them on every rank), and no pool page is a copy
        of it any more."""
        if self.tier is None:
            return []
        size = self.tier.chunk_size(chunk)
        users, freed = self.tier.forget_chunk(chunk)
        self._tier_orders += [TierOrder("free", start) for start in freed]
        copies = self.pool.tier_copy
        copies[(copies >= chunk) & (copies < chunk + size)] = -1
        self.version += 1
        return users

    def sweep_tier(self) -> None:
        """Free the tier's chunks nothing uses any more (after dropping every entry)."""
        if self.tier is not None:
            self._tier_orders += [TierOrder("free", chunk) for chunk in self.tier.sweep()]

    def take_tier_orders(self) -> list[TierOrder]:
        orders, self._tier_orders = self._tier_orders, []
        return orders

    def take_offloaded(self) -> list[int]:
        offloaded, self._offloaded = self._offloaded, []
        return offloaded

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
        """Drop entries in ``eviction_order`` until ``count`` pages are free or none is left
        to drop (``PagePool.reclaim``). An entry all of whose pages running requests read
        (or pins hold) is kept: dropping it would free nothing."""
        for entry_id in self.eviction_order():
            if self.pool.num_free >= count:
                break
            if entry_id == self._adopting:
                continue
            pages = self._entries[entry_id].table.all_pages()
            if self.pool.count_in_state(pages, PageState.CACHED) and not self.offload(entry_id):
                self.drop_entry(entry_id)
                self._evicted.append(entry_id)

    def take_evicted_entries(self) -> list[int]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def check(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every entry's pages and the pins (for ``PagePool.check``)."""
        assert self._adopting is None, "an adoption did not finish"
        for entry_id, pending in self._pending.items():
            entry = self._entries.get(entry_id)
            assert entry is not None and entry.sealed and pending.start_in(
                entry.table) is not None, (
                f"pending segment {pending.request_id} is not its entry {entry_id}'s")
        if self.tier is not None:
            self.tier.check()
            both = set(self._entries) & set(self.tier.entry_ids())
            assert not both, f"entries {sorted(both)} are both resident and offloaded"
        return [entry.table.all_pages() for entry in self._entries.values()], list(self._pins)
