"""Cached entries (multi-turn reuse): pages kept after a request ends, adopted by a prompt
that continues it (its whole pages read in place, shared), evicted least-recently-used only
when pages run short; every page's reference count equal to the rows and entries holding
it."""

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import PageLayout, PageManager, ShardedPageManager
from kvcompress.paging.prefix_index import BLOCK_TOKENS, PrefixIndex

PAGE = 4


def make_manager(total_pages=64, layers=2, heads=2) -> PageManager:
    return PageManager(PageLayout(layers, heads, head_size=8, page_size=PAGE, dtype_bytes=2,
                                  total_pages=total_pages))


def finished(manager, request_id, entry_id, logical, prompt_len, physical=None):
    """Allocate, optionally compact the prompt to ``physical`` per row, retire."""
    assert manager.allocate(request_id, logical)
    if physical is not None:
        manager.release_after_compression(request_id, logical, np.asarray(physical))
    manager.take_deltas()
    assert manager.retire(request_id, entry_id, logical, prompt_len)


def accounted(manager) -> int:
    return manager.num_free + manager.owned_pages() + manager.num_cached


def test_retired_pages_stay_cached_and_count_as_available():
    manager = make_manager(total_pages=40)
    finished(manager, "a", 1, logical=10, prompt_len=8)
    assert manager.num_cached == 4 * 3 and "a" not in manager
    assert manager.num_free == 40 - 12 and manager.num_available == 40
    assert manager.usage == 0.0  # as vLLM counts its evictable prefix cache
    manager.check_invariants()


def test_cut_points_follow_what_the_rows_hold():
    manager = make_manager()
    # Prompt of 12 compacted to [5, 6, 7, 12] per row, then 4 generated tokens in order.
    assert manager.allocate("a", 12)
    manager.release_after_compression("a", 12, np.array([5, 6, 7, 12]))
    assert manager.allocate("a", 16)
    manager.retire("a", 1, 16, prompt_len=12)
    entry = manager.entry(1)
    assert entry.lengths_at(12).tolist() == [5, 6, 7, 12]
    assert entry.lengths_at(14).tolist() == [7, 8, 9, 14]
    assert entry.lengths_at(11) is None  # inside a compacted prompt: slots unknown
    assert entry.lengths_at(17) is None
    assert (entry.best_hit(11), entry.best_hit(15), entry.best_hit(99)) == (0, 15, 16)
    # After a decode eviction the prompt's end and the entry's end are the cut points.
    assert manager.allocate("b", 12)
    manager.release_after_compression("b", 12, np.array([5, 6, 7, 12]))
    assert manager.allocate("b", 20)
    manager.release_after_compression("b", 20, np.array([9, 10, 11, 16]), kind="decode")
    manager.retire("b", 2, 20, prompt_len=12)
    entry = manager.entry(2)
    assert entry.lengths_at(13) is None and entry.lengths_at(19) is None
    assert (entry.best_hit(18), entry.best_hit(19), entry.best_hit(20)) == (12, 12, 20)
    assert entry.best_hit(99) == 20
    assert entry.lengths_at(12).tolist() == [5, 6, 7, 12]
    assert entry.lengths_at(20).tolist() == [9, 10, 11, 16]  # the whole rows
    # An exact prompt can be cut anywhere inside it.
    finished(manager, "c", 3, logical=9, prompt_len=6)
    assert manager.entry(3).lengths_at(3).tolist() == [3] * 4
    manager.check_invariants()


@pytest.mark.parametrize("decode_eviction", [False, True])
def test_a_request_retired_at_its_prompt_s_end_keeps_only_the_prompt_s_rows(decode_eviction):
    """``--kv-reuse prompts``: the entry is the compacted prompt, the generated tokens' pages
    go back (whatever a decode eviction did to them) and the only cut is the prompt's end."""
    manager = make_manager(total_pages=40)
    assert manager.allocate("a", 12)
    manager.release_after_compression("a", 12, np.array([5, 6, 7, 12]))
    assert manager.allocate("a", 20)
    if decode_eviction:
        manager.release_after_compression("a", 20, np.array([9, 10, 11, 16]), kind="decode")
    manager.take_deltas()
    assert manager.retire("a", 1, 12, prompt_len=12)
    entry = manager.entry(1)
    assert entry.table.num_pages.tolist() == [2, 2, 2, 3]  # 5, 6, 7 and 12 tokens
    assert manager.num_cached == 9 and manager.num_free == 40 - 9
    assert entry.lengths_at(12).tolist() == [5, 6, 7, 12]
    assert (entry.logical_len, entry.best_hit(30), entry.best_hit(11)) == (12, 12, 0)
    manager.check_invariants()


def test_a_share_reads_whole_pages_in_place_and_copies_only_partial_ones():
    manager = make_manager(total_pages=60)
    finished(manager, "a", 1, logical=12, prompt_len=12, physical=[5, 6, 7, 12])
    source = manager.entry(1).table
    assert manager.can_adopt(1, 12, logical_len=20, share=True)
    assert manager.adopt("b", 1, 12, share=True)
    assert manager.allocate("b", 20)
    delta = manager.take_deltas()["b"]
    assert delta.fresh and delta.adopted_len == 12
    assert delta.adopted_lengths.tolist() == [5, 6, 7, 12]
    table = manager._requests["b"].table
    # Rows of 5, 6, 7, 12 tokens: 1, 1, 1, 3 whole pages read in place (the shared run)...
    assert manager._requests["b"].shared.tolist() == [1, 1, 1, 3]
    for row, whole in enumerate([1, 1, 1, 3]):
        assert table.pages[row, :whole].tolist() == source.pages[row, :whole].tolist()
    # ... and the partial second page of the first three rows copied onto b's own pages.
    src, dst = delta.copies
    assert src.tolist() == source.pages[:3, 1].tolist()
    assert dst.tolist() == table.pages[:3, 1].tolist() and not set(dst) & set(src)
    assert manager.physical_lengths("b").tolist() == [13, 14, 15, 20]
    assert manager.entry(1) is not None  # still cached for another continuation
    # 9 entry pages (6 read by b), b's own 3 copies + 8 grown: 17 held by b, 3 cached.
    assert manager.owned_pages("b") == 17 and manager.num_read == 6
    assert manager.owned_pages() == 17 and manager.num_cached == 3
    assert manager.num_free == 60 - 9 - 11
    manager.check_invariants()
    assert accounted(manager) == 60


def test_handover_gives_the_pages_away_and_frees_what_is_past_the_cut():
    manager = make_manager(total_pages=60)
    finished(manager, "a", 1, logical=16, prompt_len=8)  # 4 pages per row
    pages = manager.entry(1).table.pages[:, :2].copy()
    assert manager.adopt("b", 1, 8, share=False)
    assert manager.entry(1) is None and manager.num_cached == 0
    assert manager.owned_pages("b") == 8 and manager.num_free == 60 - 8
    delta = manager.take_deltas()["b"]
    assert delta.copies is None
    assert np.array_equal(manager._requests["b"].table.pages[:, :2], pages)
    manager.check_invariants()


def test_a_handover_takes_partial_pages_nobody_else_holds_as_they_are():
    manager = make_manager(total_pages=60)
    finished(manager, "a", 1, logical=16, prompt_len=16)  # 4 pages per row
    entry_pages = manager.entry(1).table.pages[:, :3].copy()
    assert manager.adopt("b", 1, 10, share=False)  # 2 whole pages and a partial one a row
    assert manager.take_deltas()["b"].copies is None
    state = manager._requests["b"]
    assert np.array_equal(state.table.pages[:, :3], entry_pages)
    assert state.shared.tolist() == [2] * 4 and manager.num_free == 60 - 12
    manager.check_invariants()


def test_entries_are_evicted_least_recently_used_and_only_when_pages_run_short():
    manager = make_manager(total_pages=36)
    finished(manager, "a", 1, logical=8, prompt_len=8)  # 8 pages
    finished(manager, "b", 2, logical=8, prompt_len=8)  # 8 pages
    assert manager.adopt("c", 1, 4, share=True)  # touches entry 1: entry 2 is now the oldest
    assert manager.num_available == 36 - 4  # c reads entry 1's first pages: no copy
    manager.free("c")
    manager.take_deltas()  # a later schedule: entry 1 may be evicted again
    assert manager.allocate("d", 8 * 4)  # 32 pages: 20 free, so 12 come from eviction
    assert manager.take_evicted_entries() == [2, 1]
    assert manager.num_cached == 0 and accounted(manager) == 36
    finished(manager, "e", 3, logical=4, prompt_len=4)  # 4 pages, all that is left
    assert manager.allocate("f", 0) and manager.entry(3) is not None  # nothing needed: kept
    assert not manager.allocate("g", 8)  # 8 > 4 available: nothing evicted for a refusal
    assert manager.entry(3) is not None
    manager.check_invariants()


def test_a_continuation_s_entry_goes_first_once_its_adopter_retires():
    manager = make_manager(total_pages=60)
    finished(manager, "a", 1, logical=8, prompt_len=8)
    finished(manager, "b", 2, logical=8, prompt_len=8)
    assert manager.adopt("c", 1, 8, share=True) and manager.allocate("c", 12)
    assert manager.entry_ids() == [2, 1]  # adopted: used most recently
    assert manager.retire("c", 3, 12, prompt_len=10)
    assert manager.entry_ids() == [1, 2, 3]  # 3 continues 1: 1 serves only a branch now
    manager.check_invariants()


def test_a_share_never_evicts_its_own_entry():
    manager = make_manager(total_pages=15)
    finished(manager, "a", 1, logical=12, prompt_len=12)  # 12 pages, 3 free
    # Cut at 10: 2 whole pages a row read, 4 partial ones to copy: only evicting the entry
    # itself would free them. A handover takes the partial pages as they are.
    assert not manager.can_adopt(1, 10, logical_len=10, share=True)
    assert not manager.adopt("b", 1, 10, share=True) and manager.entry(1) is not None
    assert manager.can_adopt(1, 10, logical_len=12, share=False)
    manager = make_manager(total_pages=20)
    finished(manager, "a", 1, logical=12, prompt_len=12)  # 12 pages
    finished(manager, "o", 2, logical=4, prompt_len=4)  # 4 pages, 4 free
    assert not manager.can_share_from_free(1, 10, logical_len=14)  # 8 own pages, 4 free
    assert manager.can_adopt(1, 10, logical_len=14, share=True)  # entry 2 can go
    assert manager.adopt("b", 1, 10, share=True) and manager.allocate("b", 14)
    assert manager.take_evicted_entries() == [2] and manager.entry(1) is not None
    assert manager.num_free == 0
    manager.check_invariants()


def test_evicting_an_entry_frees_only_the_pages_nobody_reads():
    manager = make_manager(total_pages=40)
    finished(manager, "a", 1, logical=12, prompt_len=12)  # 3 pages a row
    assert manager.adopt("b", 1, 8, share=True)  # reads 2 pages a row
    manager.take_deltas()
    assert manager.num_available == 40 - 8
    assert manager.drop_entry(1) == 4  # the third page of each row; b's stay held
    assert manager.owned_pages("b") == 8 and manager.num_read == 8
    manager.check_invariants()
    assert manager.free("b") == 8  # the last reader: back to the free stack
    assert manager.num_free == 40
    manager.check_invariants()


def test_an_entry_every_page_of_which_is_read_is_not_evicted_for_nothing():
    manager = make_manager(total_pages=24)
    finished(manager, "a", 1, logical=8, prompt_len=8)  # 2 pages a row
    finished(manager, "x", 2, logical=4, prompt_len=4)  # 1 page a row
    assert manager.adopt("b", 1, 8, share=True)  # reads all of entry 1
    manager.take_deltas()
    assert manager.cache.eviction_order() == [2, 1]
    manager.plan_evictions({2: 0})  # entry 2 now goes last, entry 1 would go first
    assert manager.allocate("c", 4 * 4)  # 16 pages: 12 free, so 4 come from eviction
    assert manager.take_evicted_entries() == [2]  # dropping entry 1 frees nothing
    assert manager.entry(1) is not None
    manager.check_invariants()


def test_ranks_evict_together():
    layout = PageLayout(2, 2, head_size=8, page_size=PAGE, dtype_bytes=2, total_pages=20)
    pages = ShardedPageManager(layout, 2)
    assert pages.allocate("a", 8)
    # Rank 1 compacts more: its entry is smaller.
    pages.release_after_compression("a", 8, np.array([8, 8, 8, 8, 1, 1, 1, 1]))
    assert pages.retire("a", 1, 8, prompt_len=8)
    assert pages.num_available == 20
    assert pages.allocate("b", 16)  # rank 0 must evict entry 1, rank 1 need not
    assert pages.take_evicted_entries() == [1]
    assert pages.entry_ids() == [] and pages.cached_pages_all_ranks == 0
    pages.check_invariants()


def tokens(*values):
    return np.asarray(values, dtype=np.int64)


def test_index_finds_entries_by_shared_prefix_and_settings():
    index = PrefixIndex()
    base = np.arange(3 * BLOCK_TOKENS)
    assert index.add(1, base, first_cut=1, settings="none", exact=True)
    assert index.add(2, base[: 2 * BLOCK_TOKENS + 3], first_cut=2 * BLOCK_TOKENS + 3,
                     settings="pyramid", exact=False)
    assert not index.add(3, base[:5], first_cut=1, settings="none", exact=True)  # < a block
    prompt = np.concatenate([base[: 2 * BLOCK_TOKENS + 7], [-1, -2]])
    found = {e: (shared, same) for e, shared, same in
             index.candidates(prompt, limit=len(prompt) - 1, settings="pyramid")}
    assert found == {1: (2 * BLOCK_TOKENS + 7, False), 2: (2 * BLOCK_TOKENS + 3, True)}
    assert index.candidates(prompt, len(prompt) - 1, settings="snapkv") == [
        (1, 2 * BLOCK_TOKENS + 7, False)]  # exact: offered to other settings too
    different = prompt.copy()
    different[3] = 999
    assert index.candidates(different, len(prompt) - 1, "pyramid") == []
    index.remove(1)
    assert index.candidates(prompt, 10**6, "pyramid") == [(2, 2 * BLOCK_TOKENS + 3, True)]


class ReuseMachine(RuleBasedStateMachine):
    """Random allocate / write / compact / retire / adopt (share or handover) / free /
    evict sequences with a labelled pool: the worker mirror runs every page copy, a request
    writes (relabels) the last page of each row it grows, and an adopter's pages must hold
    exactly what the entry's held. Segments too: a request filed with a deferred plan
    (pending), read, retired into longer entries, evicted, and compacted in place (its kept
    pages rewritten, its dropped pages leaving every holder). After every operation: every
    reference count right, no page free that a row or an entry holds, and every page an
    entry or a reader holds keeps its contents (nobody wrote a shared page but a segment's
    compaction)."""

    def __init__(self):
        super().__init__()
        self.manager = make_manager(total_pages=40)
        self.layout = self.manager.layout
        self.worker = WorkerKVState(self.layout, torch.device("cpu"))
        self.pool = np.full(self.layout.total_pages, -1, dtype=np.int64)  # a label per page
        self.logical: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.entry_content: dict[int, dict[int, int]] = {}  # entry -> {page: label}
        self.read_content: dict[str, dict[int, int]] = {}  # reader -> {page: label}
        self.compacted: set[str] = set()
        self.next_id = 0
        self.segments: dict[int, str] = {}  # pending entry -> its segment request

    def _sync(self):
        for request_id, delta in self.manager.take_deltas().items():
            self.worker.apply_deltas({request_id: delta})
            if delta.copies is not None:
                src, dst = delta.copies
                self.pool[dst] = self.pool[src]
        # Every page a request owns gets written by it (labels its own).
        for request_id in self.logical:
            for page in self.worker.requests[request_id].table.all_pages():
                if self.pool[page] < 0:
                    self.pool[page] = self.next_id * 1000 + int(page)

    def _write_last_pages(self, request_id):
        """The request's new tokens land in each row's last page: its own, never shared."""
        state = self.manager._requests[request_id]
        table = state.table
        for row in range(table.num_rows):
            last = int(table.num_pages[row]) - 1
            if last >= 0:
                assert state.shared is None or last >= state.shared[row]
                self.pool[table.pages[row, last]] = self.next_id * 1000 + 999
        self.next_id += 1

    def _released(self, pages):
        for page in pages:
            if not self.manager.pool.counts(np.array([page])).all():
                self.pool[page] = -1  # free: its next owner writes it

    @rule(length=st.integers(1, 24))
    def add_request(self, length):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        if self.manager.allocate(request_id, length):
            self.logical[request_id] = self.prompt[request_id] = length
        self._forget_evicted()
        self._sync()

    @precondition(lambda self: self.logical)
    @rule(data=st.data(), extra=st.integers(1, 6))
    def grow(self, data, extra):
        request_id = data.draw(st.sampled_from(sorted(self.logical)))
        grown = self.manager.allocate(request_id, self.logical[request_id] + extra)
        if grown:
            self.logical[request_id] += extra
            if request_id not in self.compacted:
                self.prompt[request_id] = self.logical[request_id]  # still its prompt
        self._forget_evicted()
        self._sync()
        if grown:  # a request that got no slots is not scheduled: it writes nothing
            self._write_last_pages(request_id)

    @precondition(lambda self: set(self.logical) - self.compacted)
    @rule(data=st.data())
    def compact_prompt(self, data):
        """Once per request, as the engine does: its prompt ends here, and what it grows by
        afterwards is generated. An adopter keeps what it adopted (the worker plans only its
        new part)."""
        request_id = data.draw(st.sampled_from(sorted(set(self.logical) - self.compacted)))
        self.compacted.add(request_id)
        logical = self.prompt[request_id] = self.logical[request_id]
        current = self.manager.physical_lengths(request_id)
        adoption = self.manager.adoption(request_id)
        floor = np.zeros_like(current) if adoption is None else adoption[1]
        lengths = np.array([data.draw(st.integers(int(low), int(n)))
                            for low, n in zip(floor, current)])
        table = self.worker.requests[request_id].table
        before = table.all_pages()
        self.manager.release_after_compression(request_id, logical, lengths)
        table.truncate(lengths)
        self._released(np.setdiff1d(before, table.all_pages()))

    @precondition(lambda self: self.logical)
    @rule(data=st.data())
    def retire_or_free(self, data):
        """A request ends (finished: maybe retired into an entry, whole or, as with
        ``--kv-reuse prompts``, cut at its prompt's end) or is preempted."""
        request_id = data.draw(st.sampled_from(sorted(self.logical)))
        entry_id = self.next_id
        self.next_id += 1
        table = self.worker.requests[request_id].table
        length = data.draw(st.sampled_from(sorted({self.logical[request_id],
                                                   self.prompt[request_id]})))
        if data.draw(st.booleans()) and self.manager.retire(
                request_id, entry_id, length, self.prompt[request_id]):
            kept = self.manager.entry(entry_id).table.all_pages()
            self.entry_content[entry_id] = {int(p): int(self.pool[p]) for p in kept}
        else:
            self.manager.free(request_id)
        self._released(table.all_pages())
        self.worker.drop([request_id])
        del self.logical[request_id], self.prompt[request_id]
        self.read_content.pop(request_id, None)
        self.compacted.discard(request_id)

    @rule(length=st.integers(PAGE + 1, 24), data=st.data())
    def file_segment(self, length, data):
        """A segment request: its prompt planned, not compacted (a deferred report), then
        filed; pending when its plan drops a whole page of some row."""
        request_id = f"s{self.next_id}"
        entry_id = self.next_id + 1
        self.next_id += 2
        if not self.manager.allocate(request_id, length):
            return
        self._forget_evicted()
        self._sync()
        for page in self.worker.requests[request_id].table.all_pages():  # its prefill writes
            self.pool[page] = self.next_id * 1000 + int(page)
        self.next_id += 1
        whole = length // PAGE
        drops = np.array([data.draw(st.integers(0, whole)) for _ in range(self.layout.num_rows)])
        self.manager.release_after_compression(request_id, length, length - drops * PAGE,
                                               kind="deferred")
        table = self.worker.requests[request_id].table
        filed = self.manager.retire(request_id, entry_id, length, length)
        assert filed
        self.worker.drop([request_id])
        kept = self.manager.entry(entry_id).table.all_pages()
        self.entry_content[entry_id] = {int(p): int(self.pool[p]) for p in kept}
        self._released(table.all_pages())
        orders = self.manager.take_segment_orders()
        if drops.any():
            self.segments[entry_id] = request_id
            assert request_id not in orders and self.manager.entry(entry_id).sealed
            assert self.manager.entry(entry_id).best_hit(length - 1) == 0  # cut whole only
        else:
            assert orders[request_id] is None  # nothing to run: forgotten

    @precondition(lambda self: self.manager.pending_ids())
    @rule(data=st.data())
    def compact_segment(self, data):
        entry_id = data.draw(st.sampled_from(self.manager.pending_ids()))
        pending = self.manager.cache.pending(entry_id)
        readers = self.manager.segment_readers(entry_id)
        holders = self.manager.cache.entries_holding(pending)
        assert entry_id in holders
        start = pending.start_in(self.manager.entry(entry_id).table)
        reader_starts = {r: pending.start_in(self.manager._requests[r].table) for r in readers}
        self.manager.compact_segment(entry_id)
        orders = self.manager.take_segment_orders()
        assert orders[self.segments.pop(entry_id)].tolist() == pending.counts.tolist()
        for page in pending.removed:
            assert not self.manager.pool.counts(np.array([page])).any()
        self._released(pending.removed)
        # The moves rewrote the kept whole pages (read by every holder alike).
        kept = self.manager.entry(entry_id).table.leading_pages(start)
        self.pool[kept] = self.next_id * 1000 + 500
        self.next_id += 1
        for content in [*(self.entry_content[e] for e in holders),
                        *(self.read_content[r] for r in readers)]:
            for page in pending.removed:
                content.pop(int(page), None)
            content.update({int(p): int(self.pool[p]) for p in kept})
        self._sync()
        for request_id in readers:
            state = self.manager._requests[request_id]
            assert state.shared is not None and (state.shared >= reader_starts[request_id]).all()
            assert not state.sealed

    @precondition(lambda self: self.manager.entry_ids())
    @rule(data=st.data())
    def evict(self, data):
        entry_id = data.draw(st.sampled_from(self.manager.entry_ids()))
        pages = self.manager.entry(entry_id).table.all_pages()
        self.manager.drop_entry(entry_id)
        del self.entry_content[entry_id]
        self._released(pages)
        if entry_id in self.segments:  # its readers keep the whole prefix
            assert self.manager.take_segment_orders()[self.segments.pop(entry_id)] is None

    @precondition(lambda self: self.manager.entry_ids())
    @rule(data=st.data(), extra=st.integers(1, 6), share=st.booleans())
    def adopt(self, data, extra, share):
        entry_id = data.draw(st.sampled_from(self.manager.entry_ids()))
        entry = self.manager.entry(entry_id)
        self._adopt(entry_id, entry.best_hit(data.draw(st.integers(1, entry.logical_len))),
                    extra, share)

    @precondition(lambda self: self.manager.pending_ids())
    @rule(data=st.data(), extra=st.integers(1, 6))
    def read_segment(self, data, extra):
        """A reader of a pending segment: it adopts it whole, by share."""
        entry_id = data.draw(st.sampled_from(self.manager.pending_ids()))
        self._adopt(entry_id, self.manager.entry(entry_id).logical_len, extra, True)

    def _adopt(self, entry_id, hit, extra, share):
        entry = self.manager.entry(entry_id)
        if not hit or not self.manager.can_adopt(entry_id, hit, hit + extra, share):
            return
        request_id = f"r{self.next_id}"
        self.next_id += 1
        source = entry.table
        lengths = entry.lengths_at(hit)
        expected = [[self.pool[source.pages[row, page]] for page in range(-(-n // PAGE))]
                    for row, n in enumerate(lengths)]
        past_cut = source.pages_after(-(-lengths // PAGE))
        assert self.manager.adopt(request_id, entry_id, hit, share)
        assert self.manager.allocate(request_id, hit + extra)
        self.logical[request_id] = hit + extra
        self.prompt[request_id] = hit + extra  # until its own compaction says otherwise
        self._forget_evicted()
        if not share:
            del self.entry_content[entry_id]
            self._released(past_cut)
            if entry_id in self.segments:
                self.segments.pop(entry_id)
                self.manager.take_segment_orders()
        self._sync()
        table = self.worker.requests[request_id].table
        assert self.worker.requests[request_id].lengths.tolist() == lengths.tolist()
        for row, labels in enumerate(expected):
            assert [self.pool[page] for page in table.pages[row, : len(labels)]] == labels
        read = self.manager._requests[request_id].read_pages()
        self.read_content[request_id] = {int(p): int(self.pool[p]) for p in read}
        self._write_last_pages(request_id)

    def _forget_evicted(self):
        for entry_id in self.manager.take_evicted_entries():
            content = self.entry_content.pop(entry_id, None)  # (None: left the tier, below)
            if content is not None:
                self._released(np.array(list(content), dtype=np.int64))
            self.segments.pop(entry_id, None)

    @invariant()
    def every_reference_counted_and_no_held_page_free(self):
        self._forget_evicted()
        self.manager.check_invariants()
        assert accounted(self.manager) == self.layout.total_pages
        assert sorted(self.entry_content) == sorted(self.manager.entry_ids())

    @invariant()
    def shared_pages_keep_their_contents(self):
        for content in [*self.entry_content.values(), *self.read_content.values()]:
            for page, label in content.items():
                assert self.pool[page] == label

    @invariant()
    def worker_mirror_matches_the_scheduler(self):
        assert set(self.worker.requests) == set(self.logical)
        for request_id, mirror in self.worker.requests.items():
            original = self.manager._requests[request_id].table
            assert np.array_equal(mirror.table.all_pages(), original.all_pages())


TestReuseMachine = ReuseMachine.TestCase
TestReuseMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("share", [True, False])
def test_adoption_of_an_unknown_or_uncuttable_entry_is_refused(share):
    manager = make_manager()
    assert not manager.adopt("x", 7, 4, share)
    finished(manager, "a", 1, logical=12, prompt_len=12, physical=[5, 6, 7, 12])
    assert not manager.can_adopt(1, 6, 8, share) and not manager.adopt("x", 1, 6, share)
    assert "x" not in manager
    manager.check_invariants()


def test_entries_waiting_requests_adopt_are_evicted_last_the_latest_needed_first():
    """Belady's order over the known queue: an entry no waiting request adopts goes first
    (least recently used first), then the wanted ones, the one needed latest first."""
    manager = make_manager(total_pages=40)
    for entry_id in (1, 2, 3, 4):
        finished(manager, f"r{entry_id}", entry_id, logical=4, prompt_len=4)  # 4 pages each
    manager.plan_evictions({1: 0, 3: 5, 2: 1})  # 4 is nobody's: it goes first
    assert manager.cache.eviction_order() == [4, 3, 2, 1]
    assert manager.allocate("new", 4 * 7)  # 28 pages: 24 free, so one entry goes
    assert manager.take_evicted_entries() == [4]
    assert manager.allocate("more", 4 * 2)  # 8 pages: entry 3 (needed latest), then 2
    assert manager.take_evicted_entries() == [3, 2]
    assert manager.entry(1) is not None  # the next admitted request's cache survives
    manager.plan_evictions({})  # the queue moved on: least recently used again
    assert manager.cache.eviction_order() == [1]
    manager.check_invariants()
    assert accounted(manager) == 40


@pytest.mark.parametrize("readers", [1, 2, 5])
def test_readers_of_one_entry_hold_its_pages_once(readers):
    """N adopters of one entry (a shared system prompt): the pages held are the entry's once
    plus each adopter's own (each row's copied partial page and its growth), and the worker
    copies one page a row per adopter instead of the whole entry."""
    manager = make_manager(total_pages=200)
    finished(manager, "prompt", 1, logical=30, prompt_len=30)  # 7 whole pages + 2 tokens
    entry_pages = manager.entry(1).table.total_pages  # 8 a row, 32
    copied = 0
    for index in range(readers):
        assert manager.adopt(f"r{index}", 1, 30, share=True)
        assert manager.allocate(f"r{index}", 34)  # 9 pages a row
        copied += len(manager.take_deltas()[f"r{index}"].copies[0])
    own = 4 * (9 - 7)  # a copied partial page and a grown one, a row
    assert manager.total_pages - manager.num_free == entry_pages + readers * own
    assert manager.num_read == 4 * 7 and manager.owned_pages() == 4 * 7 + readers * own
    assert copied == readers * 4  # copying every row whole: readers * 32
    assert manager.entry(1) is not None
    manager.check_invariants()
    for index in range(readers):  # finish (or preemption, abort): the entry's pages stay
        manager.free(f"r{index}")
        manager.check_invariants()
    assert manager.num_free == 200 - entry_pages


def test_ranks_share_an_entry_each_with_its_own_cut():
    """Tensor parallelism: each rank's page manager shares its own rows of the entry (rank 1
    compacted more, so its cut has fewer whole pages); every rank's counts stay right."""
    layout = PageLayout(2, 2, head_size=8, page_size=PAGE, dtype_bytes=2, total_pages=40)
    pages = ShardedPageManager(layout, 2)
    assert pages.allocate("a", 12)
    pages.release_after_compression("a", 12, np.array([12, 12, 12, 12, 9, 9, 9, 9]))
    assert pages.retire("a", 1, 12, prompt_len=12)
    for name in ("b", "c"):
        assert pages.can_adopt(1, 12, 14, share=True)
        assert pages.adopt(name, 1, 12, share=True) and pages.allocate(name, 14)
    deltas = pages.take_deltas()
    assert deltas[0]["b"].copies is None  # 12 tokens: whole pages only
    assert len(deltas[1]["b"].copies[0]) == 4  # 9 tokens: a partial third page a row
    assert [shard.num_read for shard in pages.shards] == [12, 8]
    assert pages.num_read == 12
    pages.check_invariants()
    pages.free("b")
    pages.drop_entry(1)
    pages.free("c")
    assert pages.free_pages_all_ranks == 80
    pages.check_invariants()
