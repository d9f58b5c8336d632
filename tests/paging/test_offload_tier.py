"""The offload tier (``--kv-offloading-size``): prefix-cache entries evicted for pages go to
a bounded tier instead of away, and come back onto fresh pages for an adopter. The model
below runs the worker's orders on a labelled pool in the worker's order (tier orders, then
the adoptions' page copies, then the requests' writes): a save must read what the entry
held, a load must give the adopter exactly that, and every page count stays right while
entries move between the pool and the tier."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from kvcompress.paging import PageLayout, PageManager, ShardedPageManager
from kvcompress.paging.offload_tier import OffloadTier
from tests.paging.test_prefix_cache import PAGE, ReuseMachine, accounted, finished

HANDOFF_LABELS = 10**9  # labels an import writes (above every other label)
LAYOUT = PageLayout(2, 2, head_size=8, page_size=PAGE, dtype_bytes=2, total_pages=40)


def make_manager(total_pages=40, tier_pages=24) -> PageManager:
    layout = PageLayout(2, 2, head_size=8, page_size=PAGE, dtype_bytes=2,
                        total_pages=total_pages)
    return PageManager(layout, tier_pages)


def kinds(orders):
    return [(order.kind, order.key) for order in orders]


def test_an_entry_evicted_for_pages_goes_to_the_tier_and_comes_back_whole():
    manager = make_manager(total_pages=24, tier_pages=24)
    finished(manager, "a", 1, logical=10, prompt_len=8, physical=[8, 4, 6, 8])
    kept = manager.entry(1).table.all_pages()
    lengths = manager.entry(1).lengths_at(10)
    assert manager.allocate("b", 20)  # 20 pages: the entry's 7 must go
    assert manager.entry(1) is None and manager.is_offloaded(1)
    assert manager.take_evicted_entries() == []  # not gone: findable in the tier
    (save,) = manager.take_tier_orders()
    assert (save.kind, save.key, save.pages.tolist()) == ("save", 0, kept.tolist())
    manager.check_invariants()
    assert accounted(manager) == 24
    manager.free("b")
    assert manager.can_restore(1, 10, 12)
    assert manager.restore(1)
    (load,) = manager.take_tier_orders()
    assert (load.kind, load.key, load.tier_pages.tolist()) == ("load", 1, list(range(7)))
    assert manager.entry(1).lengths_at(10).tolist() == lengths.tolist()
    assert manager.entry(1).table.all_pages().tolist() == load.pages.tolist()
    # Unchanged since it was loaded: offloaded again, it writes nothing.
    assert manager.offload(1)
    assert manager.take_tier_orders() == [] and manager.tier.counts.saved_pages == 7
    manager.check_invariants()


def test_a_conversation_s_next_entry_writes_only_its_own_pages():
    """Turn 1's entry goes to the tier, comes back for turn 2 (handed over: its whole pages
    read in place, its partial ones taken and written), and turn 2's entry, evicted,
    writes only what turn 2 added and the pages it wrote."""
    manager = make_manager(total_pages=40, tier_pages=40)
    finished(manager, "t1", 1, logical=10, prompt_len=10)  # 3 pages a row: 2 whole
    assert manager.offload(1)
    manager.take_tier_orders()
    assert manager.restore(1) and manager.adopt("t2", 1, 10, share=False)
    assert manager.allocate("t2", 20)  # 5 pages a row: 2 read, 3 its own
    manager.take_deltas()
    assert manager.retire("t2", 2, 20, 20)
    manager.take_tier_orders()
    assert manager.offload(2)
    (save,) = manager.take_tier_orders()
    assert save.kind == "save" and len(save.pages) == 4 * 3
    assert manager.tier.counts.saved_pages == 4 * 3 + 4 * 3
    # The tier holds turn 1's whole pages once (turn 1's chunk, its partial pages dead).
    offloaded = manager.tier.get(2)
    assert offloaded.num_pages == 4 * 5
    assert len(set(manager.tier.chunk_of(offloaded.tier_pages).tolist())) == 2
    manager.check_invariants()
    assert manager.restore(2)
    (load,) = manager.take_tier_orders()
    assert load.tier_pages.tolist() == offloaded.tier_pages.tolist()
    manager.check_invariants()


def test_a_lost_chunk_drops_its_users_and_frees_what_died_with_them():
    """Turn 2's entry uses turn 1's chunk and its own; its own chunk's save failed: the
    entry goes, turn 1's chunk dies with it (a free order: the worker still holds it), and
    no pool page claims to hold the lost chunk's pages."""
    manager = make_manager(total_pages=40, tier_pages=40)
    finished(manager, "t1", 1, logical=10, prompt_len=10)
    assert manager.offload(1) and manager.restore(1) and manager.adopt("t2", 1, 10, False)
    assert manager.allocate("t2", 20)
    manager.take_deltas()
    assert manager.retire("t2", 2, 20, 20) and manager.offload(2)
    orders = manager.take_tier_orders()
    lost = orders[-1].key
    assert kinds(orders) == [("save", 0), ("load", 1), ("save", lost)]
    assert manager.forget_tier_chunk(lost) == [2]
    assert kinds(manager.take_tier_orders()) == [("free", 0)]
    assert not manager.offloaded_ids() and manager.tier.used_pages == 0
    manager.check_invariants()


def test_a_full_tier_drops_its_oldest_entries_and_never_blocks():
    manager = make_manager(total_pages=16, tier_pages=10)
    for number in range(1, 5):  # each 8 pages (2 per row): the pool holds 2, the tier 1
        finished(manager, f"r{number}", number, logical=8, prompt_len=8)
    assert manager.offloaded_ids() == [2]  # 1 went in, then made room for 2
    assert kinds(manager.take_tier_orders()) == [("save", 0), ("free", 0), ("save", 8)]
    assert manager.take_evicted_entries() == [1]  # gone for good
    manager.check_invariants()


def test_an_entry_larger_than_the_tier_is_dropped_as_without_one():
    manager = make_manager(total_pages=16, tier_pages=4)
    finished(manager, "a", 1, logical=8, prompt_len=8)
    assert manager.allocate("b", 16)
    assert manager.offloaded_ids() == [] and manager.take_evicted_entries() == [1]
    assert manager.take_tier_orders() == []
    assert manager.tier.counts.refused_entries == 1


def test_a_restore_that_does_not_fit_changes_nothing():
    manager = make_manager(total_pages=16, tier_pages=16)
    finished(manager, "a", 1, logical=8, prompt_len=8)
    assert manager.allocate("b", 12)  # 12 pages: the entry goes to the tier
    manager.take_tier_orders()
    assert not manager.can_restore(1, 8, 9)
    assert not manager.restore(1)
    assert manager.is_offloaded(1) and manager.take_tier_orders() == []
    manager.check_invariants()


def test_a_restore_never_drops_itself_to_make_room_for_what_it_evicts():
    """The tier holds only the entry being restored; the pool must evict a resident entry
    for its pages, and that one does not fit in the tier beside it: it is dropped, the
    restore goes on."""
    manager = make_manager(total_pages=16, tier_pages=8)
    finished(manager, "a", 1, logical=8, prompt_len=8)  # 8 pages
    assert manager.offload(1)
    finished(manager, "b", 2, logical=8, prompt_len=8)  # 8 pages
    assert manager.allocate("c", 4)  # 4 pages: the pool has 8 free, now 4
    manager.take_tier_orders()
    assert manager.restore(1)  # 8 pages: entry 2 must leave the pool
    assert manager.offloaded_ids() == [] and manager.entry(1) is not None
    assert manager.take_evicted_entries() == [2]
    assert [order.kind for order in manager.take_tier_orders()] == ["load"]
    manager.check_invariants()


def test_a_cleared_cache_leaves_no_chunk_behind():
    """vLLM's reset_prefix_cache drops every entry, resident or offloaded: a chunk kept alive
    only by a restored entry's pages dies with them."""
    manager = ShardedPageManager(LAYOUT, tier_pages=16)
    finished(manager.shards[0], "a", 1, logical=8, prompt_len=8)
    assert manager.shards[0].offload(1) and manager.restore(1)
    manager.take_tier_orders()
    manager.drop_entry(1)
    assert manager.shards[0].tier.used_pages == 8  # the pages were freed, nobody swept
    manager.sweep_tier()
    assert [order.kind for order in manager.take_tier_orders()[0]] == ["free"]
    assert manager.shards[0].tier.used_pages == 0


def test_dropping_an_offloaded_entry_forgets_its_copy():
    manager = make_manager(total_pages=16, tier_pages=16)
    finished(manager, "a", 1, logical=8, prompt_len=8)
    assert manager.allocate("b", 12)
    manager.take_tier_orders()
    assert manager.drop_entry(1) == 0
    assert kinds(manager.take_tier_orders()) == [("free", 0)]
    assert not manager.is_offloaded(1) and manager.tier.used_pages == 0


def test_a_sealed_entry_is_dropped_not_offloaded():
    manager = make_manager(total_pages=16, tier_pages=16)
    assert manager.allocate("s", 8)
    manager.release_after_compression("s", 8, np.array([4, 8, 8, 8]), kind="deferred")
    manager.take_deltas()
    assert manager.retire("s", 1, 8, 8) and manager.entry(1).sealed
    assert not manager.offload(1)
    assert manager.allocate("b", 16)
    assert manager.take_evicted_entries() == [1] and not manager.offloaded_ids()


def test_ranks_offload_and_restore_together():
    manager = ShardedPageManager(LAYOUT, num_shards=2, tier_pages=16)
    manager.allocate("a", 8)
    # Rank 0 compacted its rows to one page each, rank 1 kept both.
    manager.release_after_compression("a", 8, np.array([4] * 4 + [8] * 4))
    manager.take_deltas()
    assert manager.retire("a", 1, 8, 8)
    assert manager.allocate("b", 34)  # 36 pages: only rank 1 runs short
    assert manager.offloaded_ids() == [1] == manager.shards[1].offloaded_ids()
    assert [shard.tier.used_pages for shard in manager.shards] == [4, 8]
    manager.check_invariants()
    manager.free("b")
    assert manager.can_restore(1, 8, 9) and manager.restore(1)
    assert [kinds(orders) for orders in manager.take_tier_orders()] == [
        [("save", 0), ("load", 1)]] * 2
    manager.check_invariants()


def test_the_tier_bound_holds():
    tier = OffloadTier(capacity_pages=5)
    with pytest.raises(ValueError, match="capacity_pages"):
        OffloadTier(-1)
    assert tier.capacity_pages == 5 and len(tier) == 0


class TierMachine(ReuseMachine):
    """``ReuseMachine`` (allocate / write / compact / retire / adopt / segments / evict)
    with a tier of 24 pages: entries evicted for pages are offloaded (or dropped when the
    tier cannot take them), offloaded on purpose, restored and adopted in the same schedule
    (as the engine does), dropped from the tier. The worker model runs the tier orders
    first: a save must read the entry's labels (nobody wrote its freed pages yet), a load
    writes them back, and the adopter then reads exactly what the entry held."""

    def __init__(self):
        super().__init__()
        self.manager = make_manager(total_pages=40, tier_pages=24)
        self.tier_content: dict[int, list[int]] = {}  # offloaded entry -> its labels, sorted
        self.tier_store: dict[int, int] = {}  # tier page -> label (the worker's tier)
        self.chunk_sizes: dict[int, int] = {}

    def _sync(self):
        self._run_tier_orders()
        super()._sync()

    def _run_tier_orders(self):
        """The worker's part, in order; then every offloaded entry's tier pages must hold
        the labels its pages held when it was evicted."""
        for entry_id in set(self.manager.offloaded_ids()) - set(self.tier_content):
            self.tier_content[entry_id] = sorted(self.entry_content.pop(entry_id).values())
        saved = []
        for order in self.manager.take_tier_orders():
            if order.kind == "save":
                for number, page in enumerate(order.pages):
                    self.tier_store[order.key + number] = int(self.pool[page])
                self.chunk_sizes[order.key] = len(order.pages)
                saved.append(order.pages)
            elif order.kind == "import":  # a hand-off's rows, read from its file
                labels = [HANDOFF_LABELS + order.key * 100 + n for n in range(len(order.pages))]
                self.pool[order.pages] = labels
                self.entry_content[order.key] = dict(zip(order.pages.tolist(), labels))
            elif order.kind == "load":
                labels = [self.tier_store[int(t)] for t in order.tier_pages]
                self.pool[order.pages] = labels
                assert sorted(labels) == self.tier_content.pop(order.key)
                self.entry_content[order.key] = dict(zip(order.pages.tolist(), labels))
            else:
                for number in range(self.chunk_sizes.pop(order.key)):
                    del self.tier_store[order.key + number]
        for pages in saved:  # free now, written by their next owners after the orders
            self._released(pages)
        for entry_id in list(self.tier_content):
            offloaded = self.manager.tier.get(entry_id)
            if offloaded is None:
                del self.tier_content[entry_id]  # dropped: gone
                continue
            labels = sorted(self.tier_store[int(t)] for t in offloaded.tier_pages)
            assert labels == self.tier_content[entry_id], (
                f"entry {entry_id}'s tier pages do not hold what it held")

    @precondition(lambda self: self.manager.entry_ids())
    @rule(data=st.data())
    def offload(self, data):
        entry_id = data.draw(st.sampled_from(self.manager.entry_ids()))
        sealed = self.manager.entry(entry_id).sealed
        offloaded = self.manager.offload(entry_id)
        assert offloaded or sealed or self.manager.tier.counts.refused_entries
        self._forget_evicted()
        self._sync()

    @precondition(lambda self: self.manager.offloaded_ids())
    @rule(data=st.data(), extra=st.integers(1, 6), share=st.booleans())
    def restore_and_adopt(self, data, extra, share):
        entry_id = data.draw(st.sampled_from(self.manager.offloaded_ids()))
        entry = self.manager.known_entry(entry_id)
        hit = entry.best_hit(data.draw(st.integers(1, entry.logical_len)))
        if not hit or not self.manager.can_restore(entry_id, hit, hit + extra):
            return
        assert self.manager.restore(entry_id)
        assert self.manager.entry(entry_id) is not None
        self._forget_evicted()
        self._sync()  # the load: the adopter must then read what the entry held
        self._adopt(entry_id, hit, extra, share)

    @rule(data=st.data(), prompt_len=st.integers(17, 30), extra=st.integers(1, 6),
          share=st.booleans(), adopt=st.booleans())
    def import_handoff(self, data, prompt_len, extra, share, adopt):
        """A prefill instance's hand-off arrives (between any other operations: entries
        pending, offloaded, read): filed on fresh pages (evicting or offloading others),
        written by its import before anything reads them; an adopter of the whole prompt
        then reads exactly the handed-off rows."""
        rows = self.layout.num_rows
        lengths = np.array(data.draw(st.lists(st.integers(1, prompt_len), min_size=rows,
                                              max_size=rows)))
        entry_id = 1_000_000 + self.next_id
        self.next_id += 1
        fits = self.manager.can_import(entry_id, lengths, prompt_len)
        assert self.manager.import_entry(entry_id, lengths, prompt_len, f"h{entry_id}") == fits
        self._forget_evicted()  # (runs the orders: saves of those offloaded, the import)
        if not fits:
            return
        entry = self.manager.entry(entry_id)
        assert entry.lengths_at(prompt_len).tolist() == lengths.tolist()
        assert sorted(self.entry_content[entry_id]) == sorted(entry.table.all_pages().tolist())
        if adopt:
            self._adopt(entry_id, prompt_len, extra, share)

    @precondition(lambda self: self.manager.offloaded_ids())
    @rule(data=st.data())
    def drop_offloaded(self, data):
        entry_id = data.draw(st.sampled_from(self.manager.offloaded_ids()))
        assert self.manager.drop_entry(entry_id) == 0
        self._sync()
        assert entry_id not in self.tier_content
        assert self.manager.tier.used_pages == sum(self.chunk_sizes.values())

    def _forget_evicted(self):
        self._run_tier_orders()  # (an entry saved, then dropped to make room: gone)
        super()._forget_evicted()

    @invariant()
    def every_reference_counted_and_no_held_page_free(self):
        self._sync()
        super().every_reference_counted_and_no_held_page_free()
        assert sorted(self.tier_content) == sorted(self.manager.offloaded_ids())


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
