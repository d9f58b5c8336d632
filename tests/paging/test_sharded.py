"""One pool per tensor-parallel rank: every rank's pages free or owned once, ranks changed
together or not at all, each rank's deltas reaching only its own worker mirror."""

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import PageLayout, ShardedPageManager

RANKS = 2


def make_layout(total_pages=48, layers=2, heads=2, page_size=4, windows=()):
    return PageLayout(layers, heads, head_size=8, page_size=page_size, dtype_bytes=2,
                      total_pages=total_pages, layer_windows=windows)


def test_a_request_fits_only_if_it_fits_on_every_rank():
    manager = ShardedPageManager(make_layout(total_pages=12), RANKS)
    assert manager.allocate("a", 8)  # 2 pages x 4 rows on each rank
    # Rank 1 keeps more of "a" than rank 0 after compaction.
    manager.release_after_compression("a", 8, np.array([1, 1, 1, 1, 8, 8, 8, 8]))
    assert [shard.num_free for shard in manager.shards] == [8, 4]
    assert manager.num_free == 4 and manager.owned_pages("a") == 8
    assert manager.physical_lengths("a").tolist() == [8, 8, 8, 8]
    assert manager.all_physical_lengths("a").tolist() == [1, 1, 1, 1, 8, 8, 8, 8]
    assert manager.pages_needed("b", 8) == 8
    assert not manager.allocate("b", 8)  # rank 0 has room, rank 1 does not
    assert "b" not in manager and all("b" not in shard for shard in manager.shards)
    assert manager.free_pages_all_ranks == 12 and manager.total_pages_all_ranks == 24
    assert manager.free("a") == 4 + 8
    manager.check_invariants()


def test_a_compaction_report_must_cover_every_rank():
    manager = ShardedPageManager(make_layout(), RANKS)
    manager.allocate("a", 8)
    with pytest.raises(ValueError, match=r"2 ranks x 4 rows"):
        manager.release_after_compression("a", 8, np.full(4, 3))


def test_deltas_are_split_by_rank():
    manager = ShardedPageManager(make_layout(), RANKS)
    manager.allocate("a", 5)
    deltas = manager.take_deltas()
    assert len(deltas) == RANKS and all(set(rank) == {"a"} for rank in deltas)
    assert manager.take_deltas() == [{}, {}]


class ShardedPagingMachine(RuleBasedStateMachine):
    """Random allocate / compact (each rank its own lengths) / window drop / free, each
    rank's deltas mirrored into its own worker state."""

    def __init__(self):
        super().__init__()
        self.layout = make_layout(total_pages=40, windows=(5, 0))
        self.manager = ShardedPageManager(self.layout, RANKS)
        self.workers = [WorkerKVState(self.layout, torch.device("cpu")) for _ in range(RANKS)]
        self.logical: dict[str, int] = {}
        self.next_id = 0

    def _sync_workers(self):
        for worker, shard, deltas in zip(self.workers, self.manager.shards,
                                         self.manager.take_deltas()):
            worker.apply_deltas(deltas)
            for request_id, request in worker.requests.items():
                # As if the forward had written every reserved token.
                request.lengths = shard.physical_lengths(request_id).copy()

    @rule(length=st.integers(1, 30))
    def add_request(self, length):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        free_before = [shard.num_free for shard in self.manager.shards]
        if self.manager.allocate(request_id, length):
            self.logical[request_id] = length
        else:
            assert [shard.num_free for shard in self.manager.shards] == free_before
        self._sync_workers()

    @precondition(lambda self: self.logical)
    @rule(data=st.data(), extra=st.integers(1, 9))
    def grow(self, data, extra):
        request_id = data.draw(st.sampled_from(sorted(self.logical)))
        self.manager.drop_outside_window(request_id, self.logical[request_id])
        if self.manager.allocate(request_id, self.logical[request_id] + extra):
            self.logical[request_id] += extra
        self._sync_workers()

    @precondition(lambda self: self.logical)
    @rule(data=st.data())
    def compact(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.logical)))
        current = self.manager.all_physical_lengths(request_id)
        rows = self.layout.num_rows
        lengths = np.array(
            [data.draw(st.integers(0, int(length))) if index % rows in (2, 3) else length
             for index, length in enumerate(current)], dtype=np.int64)  # full rows only
        self.manager.release_after_compression(request_id, self.logical[request_id], lengths)
        for rank, worker in enumerate(self.workers):
            worker.requests[request_id].table.truncate(lengths[rank * rows:(rank + 1) * rows])
        assert self.manager.all_physical_lengths(request_id).tolist() == lengths.tolist()

    @precondition(lambda self: self.logical)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.logical)))
        self.manager.free(request_id)
        for worker in self.workers:
            worker.drop([request_id])
        del self.logical[request_id]

    @invariant()
    def every_rank_free_plus_owned_is_total(self):
        self.manager.check_invariants()
        for shard in self.manager.shards:
            assert shard.num_free + shard.owned_pages() == self.layout.total_pages
        assert self.manager.num_free == min(s.num_free for s in self.manager.shards)

    @invariant()
    def page_fill_reads_the_rank_that_takes_most_and_the_fullest_rank(self):
        """After any growth ``d``, the fill's pages are the most any rank's full rows take
        (not the longest row of each over the ranks: ranks that spread a budget differently
        would be counted at up to all their spreads at once)."""
        request_ids = sorted(self.logical)
        fill = self.manager.page_fill(request_ids)
        page_size, full = self.layout.page_size, self.layout.row_windows == 0
        for index, request_id in enumerate(request_ids):
            ranks = self.manager.physical_lengths_by_rank(request_id)[:, full]
            for grown in range(page_size + 1):
                most = max(int((-(-(rows + grown) // page_size)).sum()) for rows in ranks)
                assert fill.full_pages[index] + fill.free_below[index, grown] == most
        owned = np.array([self.manager.owned_pages(r) for r in request_ids], dtype=np.int64)
        assert np.array_equal(fill.owned_pages, owned)
        lengths = np.array([self.manager.physical_lengths(r) for r in request_ids],
                           dtype=np.int64).reshape(len(request_ids), self.layout.num_rows)
        assert np.array_equal(fill.sliding_lengths, lengths[:, ~full])

    @invariant()
    def each_worker_mirrors_its_own_rank(self):
        for shard, worker in zip(self.manager.shards, self.workers):
            assert set(worker.requests) == set(self.logical)
            for request_id, mirror in worker.requests.items():
                original = shard._requests[request_id].table
                assert np.array_equal(mirror.table.num_pages, original.num_pages)
                assert np.array_equal(mirror.table.all_pages(), original.all_pages())


TestShardedPagingMachine = ShardedPagingMachine.TestCase
TestShardedPagingMachine.settings = settings(max_examples=50, stateful_step_count=40,
                                             deadline=None)
