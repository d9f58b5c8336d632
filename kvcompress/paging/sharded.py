"""One page pool per tensor-parallel rank, seen by the scheduler as one manager.

Under tensor parallelism each rank holds the KV heads of its own slice in its own pool
(the same page count on every rank: vLLM sizes them alike). Rank ``r``'s pages are managed
by ``shards[r]``, a ``PageManager`` over the rank's rows (layers x its KV heads). Page ids
are per rank, so every shard counts from 0 and its deltas go to its rank only.

The shards change together: a request is admitted, grows, is preempted and ends on all
ranks at once. Only compaction can make them differ, when a policy's per-head counts
depend on the scores a rank sees (Ada-KV shares each layer's quota among the rank's own
heads). Questions the scheduler asks for admission are therefore answered for the rank
that has the least room: a request fits only if it fits on every rank.

Rows of all ranks together are in rank-major order: rank 0's rows, then rank 1's, ...
(``Compaction.physical_lengths`` of a tensor-parallel worker report).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.page_fill import PageFill
from kvcompress.paging.page_manager import PageManager
from kvcompress.paging.page_table import most_of_fills
from kvcompress.paging.request_tables import PageTableDelta


class ShardedPageManager:
    def __init__(self, layout: PageLayout, num_shards: int = 1, tier_pages: int = 0) -> None:
        """``tier_pages``: each rank's offload tier, in pages (0: none)."""
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.layout = layout  # of one rank
        self.shards = [PageManager(layout, tier_pages) for _ in range(num_shards)]
        self._evicted: list[int] = []  # entries evicted for pages, until taken

    # ------------------------------------------------------ the tightest rank
    @property
    def total_pages(self) -> int:
        """Pages of one rank's pool."""
        return self.layout.total_pages

    @property
    def num_free(self) -> int:
        """Free pages of the fullest rank."""
        return min(shard.num_free for shard in self.shards)

    @property
    def num_available(self) -> int:
        """Free plus cached (evictable) pages of the fullest rank."""
        return min(shard.num_available for shard in self.shards)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_available / self.layout.total_pages

    def owned_pages(self, request_id: str | None = None) -> int:
        """Pages the request (or all requests) hold on the rank where they hold most."""
        return max(shard.owned_pages(request_id) for shard in self.shards)

    @property
    def num_read(self) -> int:
        """Pages running requests read in shared runs, on the rank where they read most."""
        return max(shard.num_read for shard in self.shards)

    def shared_pages(self, request_ids: Sequence[str]) -> np.ndarray:
        """Per request, its shared runs' pages on the rank where it reads fewest (admission
        counts them once in ``num_read`` instead of in each reader)."""
        return np.min([shard.shared_pages(request_ids) for shard in self.shards], axis=0)

    def pages_read_already(self, entry_id: int, hit: int) -> int:
        """``PageManager.pages_read_already`` on the rank where it is fewest."""
        return min(shard.pages_read_already(entry_id, hit) for shard in self.shards)

    def physical_lengths(self, request_id: str) -> np.ndarray:
        """Per row of one rank: the longest of that row over the ranks."""
        if len(self.shards) == 1:
            return self.shards[0].physical_lengths(request_id)
        return np.max([shard.physical_lengths(request_id) for shard in self.shards], axis=0)

    def physical_lengths_by_rank(self, request_id: str) -> np.ndarray:
        """``[ranks, rows]``: each rank's rows (what admission counts rank by rank)."""
        return np.stack([shard.physical_lengths(request_id) for shard in self.shards])

    def lengths_and_owned_pages(self, request_ids: Sequence[str]) -> tuple[np.ndarray,
                                                                         np.ndarray]:
        """``physical_lengths`` and ``owned_pages`` of many requests in one call: per row of
        one rank the longest over the ranks, and the most pages a rank holds."""
        if len(self.shards) == 1:
            return self.shards[0].lengths_and_owned_pages(request_ids)
        per_rank = [shard.lengths_and_owned_pages(request_ids) for shard in self.shards]
        return (np.max([lengths for lengths, _ in per_rank], axis=0),
                np.max([owned for _, owned in per_rank], axis=0))

    def page_fill(self, request_ids: Sequence[str]) -> PageFill:
        """Per request the rank that takes the most pages after any growth (ranks only
        differ after a compaction that depends on what each rank scored: the longest of
        each row over the ranks would count up to every rank's spread at once), and the
        most pages a rank holds."""
        if len(self.shards) == 1:
            return self.shards[0].page_fill(request_ids)
        fills = [shard.page_fill(request_ids) for shard in self.shards]
        full_pages, free_below = most_of_fills(np.stack([fill.full_pages for fill in fills]),
                                               np.stack([fill.free_below for fill in fills]))
        return PageFill(np.max([fill.owned_pages for fill in fills], axis=0), full_pages,
                        free_below, np.max([fill.sliding_lengths for fill in fills], axis=0))

    def adoption(self, request_id: str) -> tuple[int, np.ndarray] | None:
        """What the request took from a cached entry: the logical tokens, and per row of one
        rank the longest of that row over the ranks."""
        adoptions = [shard.adoption(request_id) for shard in self.shards]
        if adoptions[0] is None:
            return None
        return adoptions[0][0], np.max([rows for _, rows in adoptions], axis=0)

    def entry_lengths(self, entry_id: int, hit: int) -> np.ndarray | None:
        """Per row of one rank, the longest over the ranks: the physical tokens an adoption
        of the entry's first ``hit`` logical tokens starts with (None: no cut there)."""
        lengths = [shard.entry(entry_id) for shard in self.shards]
        rows = [None if entry is None else entry.lengths_at(hit) for entry in lengths]
        if any(row is None for row in rows):
            return None
        return np.max(rows, axis=0)

    def pages_needed(self, request_id: str, logical_len: int) -> int:
        return max(shard.pages_needed(request_id, logical_len) for shard in self.shards)

    def pages_needed_for_sequence(self, request_id: str, logical_len: int,
                                  max_chunk: int) -> int:
        return max(shard.pages_needed_for_sequence(request_id, logical_len, max_chunk)
                   for shard in self.shards)

    # ------------------------------------------------------------ all ranks
    @property
    def free_pages_all_ranks(self) -> int:
        return sum(shard.num_free for shard in self.shards)

    @property
    def cached_pages_all_ranks(self) -> int:
        return sum(shard.num_cached for shard in self.shards)

    @property
    def total_pages_all_ranks(self) -> int:
        return self.layout.total_pages * len(self.shards)

    def all_physical_lengths(self, request_id: str) -> np.ndarray:
        """Per row of every rank, rank-major."""
        return np.concatenate([shard.physical_lengths(request_id) for shard in self.shards])

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.shards[0]

    def request_ids(self) -> set[str]:
        return self.shards[0].request_ids()

    def allocate(self, request_id: str, logical_len: int, reserve: int = 0) -> bool:
        """All ranks or none; ``reserve`` pages must stay free on each."""
        if len(self.shards) > 1 and (
            self.pages_needed(request_id, logical_len) + reserve > self.num_available
        ):
            return False
        allocated = [shard.allocate(request_id, logical_len, reserve) for shard in self.shards]
        assert all(allocated) or not any(allocated), "ranks disagree on an allocation"
        self._sync_evictions()
        return allocated[0]

    def drop_outside_window(self, request_id: str, processed: int) -> int:
        """Pages freed over all ranks (sliding-window rows are alike on every rank)."""
        return sum(shard.drop_outside_window(request_id, processed) for shard in self.shards)

    def release_after_compression(self, request_id: str, logical_len: int,
                                  physical_lengths: np.ndarray, kind: str = "prompt",
                                  prompt_evicted: np.ndarray | None = None) -> int:
        """``physical_lengths`` (and ``prompt_evicted``): every rank's rows, rank-major.
        Pages freed over all ranks."""
        per_rank = self._per_rank(physical_lengths, "physical lengths")
        prompt_per_rank = ([None] * len(self.shards) if prompt_evicted is None
                           else self._per_rank(prompt_evicted, "prompt evictions"))
        return sum(shard.release_after_compression(request_id, logical_len, lengths, kind,
                                                   prompt)
                   for shard, lengths, prompt in zip(self.shards, per_rank, prompt_per_rank))

    def _per_rank(self, rows: np.ndarray, what: str) -> np.ndarray:
        rows = np.asarray(rows)
        expected = (self.layout.num_rows * len(self.shards),)
        if rows.shape != expected:
            raise ValueError(f"expected {expected[0]} {what} ({len(self.shards)} ranks x "
                             f"{self.layout.num_rows} rows), got {rows.shape}")
        return rows.reshape(len(self.shards), self.layout.num_rows)

    def free(self, request_id: str) -> int:
        return sum(shard.free(request_id) for shard in self.shards)

    # --------------------------------------------------------- prefix cache
    def retire(self, request_id: str, entry_id: int, logical_len: int, prompt_len: int) -> bool:
        """Keep the finished request's pages as entry ``entry_id`` on every rank, or free
        them on every rank."""
        kept = [shard.retire(request_id, entry_id, logical_len, prompt_len)
                for shard in self.shards]
        if all(kept):
            return True
        for shard in self.shards:
            shard.drop_entry(entry_id)
        return False

    def import_entry(self, entry_id: int, lengths: Sequence[np.ndarray], prompt_len: int,
                     source: str) -> bool:
        """A handed-off prompt (``lengths``: each rank's rows) filed as entry ``entry_id``
        on every rank, or on none (False: it does not fit, or does not match the layout)."""
        if len(lengths) != len(self.shards) or not all(
                shard.can_import(entry_id, rows, prompt_len)
                for shard, rows in zip(self.shards, lengths)):
            return False
        imported = [shard.import_entry(entry_id, rows, prompt_len, source)
                    for shard, rows in zip(self.shards, lengths)]
        assert all(imported), "import check and import disagree"
        self._sync_evictions()
        return True

    def can_adopt(self, entry_id: int, hit: int, logical_len: int, share: bool,
                  reserve: int = 0) -> bool:
        return all(shard.can_adopt(entry_id, hit, logical_len, share, reserve)
                   for shard in self.shards)

    def can_share_from_free(self, entry_id: int, hit: int, logical_len: int,
                            reserve: int = 0) -> bool:
        return all(shard.can_share_from_free(entry_id, hit, logical_len, reserve)
                   for shard in self.shards)

    def adopt(self, request_id: str, entry_id: int, hit: int, share: bool) -> bool:
        """On every rank (``can_adopt`` first: ranks cannot roll an adoption back)."""
        adopted = [shard.adopt(request_id, entry_id, hit, share) for shard in self.shards]
        assert all(adopted) or not any(adopted), "ranks disagree on an adoption"
        self._sync_evictions()
        return adopted[0]

    def drop_entry(self, entry_id: int) -> int:
        return sum(shard.drop_entry(entry_id) for shard in self.shards)

    # ------------------------------------------------------------ offload tier
    @property
    def has_tier(self) -> bool:
        return self.shards[0].tier is not None

    def known_entries(self, entry_id: int) -> list:
        """Every rank's entry, resident or offloaded (None where a rank has none)."""
        return [shard.known_entry(entry_id) for shard in self.shards]

    def is_offloaded(self, entry_id: int) -> bool:
        """Whether the entry is in the tier (on every rank: ranks offload together)."""
        return self.shards[0].is_offloaded(entry_id)

    def offloaded_ids(self) -> list[int]:
        return self.shards[0].offloaded_ids()

    def can_restore(self, entry_id: int, hit: int, logical_len: int, reserve: int = 0) -> bool:
        return all(shard.can_restore(entry_id, hit, logical_len, reserve)
                   for shard in self.shards)

    def restore(self, entry_id: int) -> bool:
        """On every rank (``can_restore`` first)."""
        restored = [shard.restore(entry_id) for shard in self.shards]
        assert all(restored) or not any(restored), "ranks disagree on a restore"
        self._sync_evictions()
        return restored[0]

    def sweep_tier(self) -> None:
        """``PrefixCache.sweep_tier`` on every rank."""
        for shard in self.shards:
            shard.cache.sweep_tier()

    def tier_totals(self) -> dict[str, int]:
        """The offload tier over every rank since the start: bytes saved and loaded, entries
        saved, loaded and dropped (each on every rank), and bytes held now. Empty: no tier."""
        tiers = [shard.tier for shard in self.shards if shard.tier is not None]
        if not tiers:
            return {}
        page_bytes = self.layout.page_bytes
        first = tiers[0].counts
        return {
            "saved_bytes": page_bytes * sum(tier.counts.saved_pages for tier in tiers),
            "loaded_bytes": page_bytes * sum(tier.counts.loaded_pages for tier in tiers),
            # pages offloaded entries had that the tier held already (not written again)
            "known_bytes": page_bytes * sum(tier.counts.known_pages for tier in tiers),
            "saved_entries": first.saved_entries,
            "loaded_entries": first.loaded_entries,
            "dropped_entries": first.dropped_entries,
            "refused_entries": first.refused_entries,
            "held_bytes": page_bytes * sum(tier.used_pages for tier in tiers),
        }

    def take_tier_orders(self) -> list[list]:
        """Each rank's tier orders (``PageManager.take_tier_orders``), by rank."""
        return [shard.take_tier_orders() for shard in self.shards]

    def entry_ids(self) -> list[int]:
        return self.shards[0].entry_ids()

    # -------------------------------------------------------- pending segments
    def pending_ids(self) -> list[int]:
        """Entries pending compaction on any rank (a rank whose plan drops no page has
        none), oldest first."""
        return sorted({entry_id for shard in self.shards for entry_id in shard.pending_ids()})

    def pending_segment_id(self, entry_id: int) -> str | None:
        """The segment request whose plan the pending entry waits to run (None: none)."""
        for shard in self.shards:
            pending = shard.cache.pending(entry_id)
            if pending is not None:
                return pending.request_id
        return None

    def is_pending(self, entry_id: int) -> bool:
        return self.pending_segment_id(entry_id) is not None

    def segment_readers(self, entry_id: int) -> set[str]:
        """Running requests reading the pending entry's pages on any rank."""
        return {request_id for shard in self.shards
                for request_id in shard.segment_readers(entry_id)}

    @property
    def cache_version(self) -> tuple[int, ...]:
        """Every rank's ``PrefixCache.version``: unchanged, every entry is as it was."""
        return tuple(shard.cache.version for shard in self.shards)

    def entries_holding(self, entry_id: int) -> list[int]:
        """Entries whose rows hold the pending entry's pages on any rank (its own included)."""
        holders: set[int] = set()
        for shard in self.shards:
            pending = shard.cache.pending(entry_id)
            if pending is not None:
                holders.update(shard.cache.entries_holding(pending))
        return sorted(holders)

    def compact_segment(self, entry_id: int) -> int:
        """On every rank at once (``PageManager.compact_segment``); pages freed."""
        return sum(shard.compact_segment(entry_id) for shard in self.shards)

    def take_segment_orders(self) -> list[dict[str, np.ndarray | None]]:
        """Each rank's segment orders (``PageManager.take_segment_orders``), by rank."""
        return [shard.take_segment_orders() for shard in self.shards]

    def plan_evictions(self, next_use: dict[int, int]) -> None:
        """The same eviction order on every rank (``PrefixCache.plan_evictions``)."""
        for shard in self.shards:
            shard.plan_evictions(next_use)

    def take_evicted_entries(self) -> list[int]:
        """Entries evicted for pages (on any rank) since the last call; gone on every rank."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _sync_evictions(self) -> None:
        """An entry evicted on one rank (ranks can differ in pages) leaves every rank; one
        offloaded on one rank is offloaded on every rank, or dropped from all."""
        offloaded = {entry_id for shard in self.shards for entry_id in shard.cache.take_offloaded()}
        evicted: set[int] = set()
        if len(self.shards) > 1:
            for entry_id in sorted(offloaded):
                moved = [shard.is_offloaded(entry_id) or shard.offload(entry_id)
                         for shard in self.shards]
                if not all(moved):
                    evicted.add(entry_id)
            for shard in self.shards:
                shard.cache.take_offloaded()  # (those just made to follow)
        evicted.update(entry_id for shard in self.shards
                       for entry_id in shard.take_evicted_entries())
        if len(self.shards) > 1:
            for entry_id in evicted:
                self.drop_entry(entry_id)
        self._evicted.extend(sorted(evicted))

    def take_deltas(self) -> list[dict[str, PageTableDelta]]:
        """Each rank's page-table changes, indexed by rank."""
        return [shard.take_deltas() for shard in self.shards]

    def check_invariants(self) -> None:
        """Every rank's reference counts right, and the same requests and entries on every
        rank."""
        for rank, shard in enumerate(self.shards):
            shard.check_invariants()
            assert shard.request_ids() == self.shards[0].request_ids(), (
                f"rank {rank} holds pages of other requests than rank 0"
            )
            assert shard.entry_ids() == self.shards[0].entry_ids(), (
                f"rank {rank} caches other entries than rank 0"
            )
            assert sorted(shard.offloaded_ids()) == sorted(self.shards[0].offloaded_ids()), (
                f"rank {rank} offloaded other entries than rank 0")
