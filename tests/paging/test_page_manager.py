"""Page accounting: every page free or owned once, and the worker mirror stays identical."""

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import HeadPageTable, PageLayout, PageManager, PageTableDelta
from kvcompress.paging.page_manager import PageFill


def make_layout(total_pages=64, layers=2, heads=2, page_size=4):
    return PageLayout(layers, heads, head_size=8, page_size=page_size, dtype_bytes=2,
                      total_pages=total_pages)


def test_layout_fits_the_bytes_vanilla_vllm_would_use():
    layout = PageLayout.for_memory(kv_cache_bytes=1 << 20, num_layers=4, num_kv_heads=2,
                                   head_size=64, page_size=16, dtype_bytes=2)
    assert layout.total_pages == (1 << 20) // (2 * 16 * 64 * 2)
    assert layout.total_pages * layout.page_bytes <= 1 << 20
    with pytest.raises(ValueError, match="--kv-page-size"):
        PageLayout.for_memory(kv_cache_bytes=100, num_layers=4, num_kv_heads=2, head_size=64,
                              page_size=16, dtype_bytes=2)


def test_a_max_model_len_request_must_fit_with_rows_rounded_up_to_pages():
    # 2048 B per token over all rows: bytes for 1100 tokens, but at 256 tokens a page each of
    # the 8 rows of a 1030-token request takes 5 pages (40 > the 34 there are).
    layout = PageLayout.for_memory(kv_cache_bytes=1100 * 2048, num_layers=4, num_kv_heads=2,
                                   head_size=32, page_size=256, dtype_bytes=4)
    assert layout.total_pages == 34
    layout.check_holds_one_request(1024)
    with pytest.raises(ValueError, match=r"--max-model-len 1030 needs 40.*--kv-page-size"):
        layout.check_holds_one_request(1030)


def test_worker_refuses_a_delta_extending_a_table_it_does_not_hold():
    state = WorkerKVState(make_layout(total_pages=10), torch.device("cpu"))
    grow = PageTableDelta(fresh=False, appends=[(np.ones(4, dtype=np.int32),
                                                 np.arange(4, dtype=np.int32))])
    with pytest.raises(RuntimeError, match="request ghost: .*diverged"):
        state.apply_deltas({"ghost": grow})
    state.apply_deltas({"known": PageTableDelta(fresh=True, appends=grow.appends)})
    state.apply_deltas({"known": grow})
    assert state.requests["known"].table.total_pages == 8


def test_table_append_and_truncate_return_exact_pages():
    table = HeadPageTable(num_rows=3, page_size=4, initial_capacity=1)
    table.append(np.array([2, 0, 3], dtype=np.int32), np.array([10, 11, 20, 21, 22]))
    assert table.pages[0, :2].tolist() == [10, 11]
    assert table.pages[2, :3].tolist() == [20, 21, 22]
    dropped = table.truncate(np.array([1, 0, 5]))
    assert sorted(dropped.tolist()) == [11, 22]
    assert table.num_pages.tolist() == [1, 0, 2]


def test_allocation_is_all_or_nothing():
    manager = PageManager(make_layout(total_pages=10))
    assert manager.allocate("a", 8)  # 2 pages per row x 4 rows
    assert not manager.allocate("b", 8)  # needs 8, 2 free
    assert manager.num_free == 2 and "b" not in manager.request_ids()
    manager.check_invariants()


def test_compaction_frees_trailing_pages_and_later_tokens_reuse_them():
    manager = PageManager(make_layout(total_pages=40))
    assert manager.allocate("a", 16)  # 4 pages per row
    assert manager.num_free == 40 - 16
    freed = manager.release_after_compression("a", 16, np.array([5, 3, 9, 16]))
    assert freed == (4 - 2) + (4 - 1) + (4 - 3) + 0
    assert manager.owned_pages("a") == 2 + 1 + 3 + 4
    # One more logical token: every row grows by one physical slot.
    assert manager.allocate("a", 17)
    assert manager.physical_lengths("a").tolist() == [6, 4, 10, 17]
    assert manager.owned_pages("a") == 2 + 1 + 3 + 5
    manager.check_invariants()


def test_report_for_unknown_request_is_ignored_and_bad_report_rejected():
    manager = PageManager(make_layout())
    assert manager.release_after_compression("gone", 8, np.zeros(4)) == 0
    manager.allocate("a", 8)
    with pytest.raises(ValueError):
        manager.release_after_compression("a", 9, np.zeros(4))


class PagingMachine(RuleBasedStateMachine):
    """Random allocate / compact / free sequences, mirrored into a worker state."""

    def __init__(self):
        super().__init__()
        self.layout = make_layout(total_pages=48, layers=2, heads=2, page_size=4)
        self.manager = PageManager(self.layout)
        self.worker = WorkerKVState(self.layout, torch.device("cpu"))
        self.logical: dict[str, int] = {}
        self.next_id = 0

    def _sync_worker(self):
        self.worker.apply_deltas(self.manager.take_deltas())

    @rule(length=st.integers(1, 30))
    def add_request(self, length):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        if self.manager.allocate(request_id, length):
            self.logical[request_id] = length
        self._sync_worker()

    @precondition(lambda self: self.logical)
    @rule(data=st.data(), extra=st.integers(1, 9))
    def grow(self, data, extra):
        request_id = data.draw(st.sampled_from(sorted(self.logical)))
        if self.manager.allocate(request_id, self.logical[request_id] + extra):
            self.logical[request_id] += extra
        self._sync_worker()

    @precondition(lambda self: self.logical)
    @rule(data=st.data())
    def compact(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.logical)))
        logical = self.logical[request_id]
        current = self.manager.physical_lengths(request_id)
        lengths = np.array(
            [data.draw(st.integers(0, int(length))) for length in current], dtype=np.int64
        )
        self.manager.release_after_compression(request_id, logical, lengths)
        # The worker applies the same truncation after its moves.
        self.worker.requests[request_id].table.truncate(lengths)
        assert self.manager.physical_lengths(request_id).tolist() == lengths.tolist()

    @precondition(lambda self: self.logical)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.logical)))
        self.manager.free(request_id)
        self.worker.drop([request_id])
        del self.logical[request_id]

    @invariant()
    def every_page_free_or_owned_once(self):
        self.manager.check_invariants()
        owned = self.manager.owned_pages()
        assert self.manager.num_free + owned == self.layout.total_pages

    @invariant()
    def rows_hold_exactly_the_pages_their_lengths_need(self):
        size = self.layout.page_size
        for request_id in self.logical:
            lengths = self.manager.physical_lengths(request_id)
            table = self.worker.requests[request_id].table
            assert table.num_pages.tolist() == ((lengths + size - 1) // size).tolist()

    @invariant()
    def page_fill_matches_the_rows_it_does_not_read(self):
        # page_fill answers from a summary each request keeps of its evicted tokens; after
        # every step it must agree with the rows' lengths counted one by one.
        request_ids = sorted(self.logical)
        fill = self.manager.page_fill(request_ids)
        lengths, owned = self.manager.lengths_and_owned_pages(request_ids)
        expected = PageFill.of_lengths(lengths, owned, self.layout)
        for name in ("owned_pages", "full_pages", "free_below", "sliding_lengths"):
            assert np.array_equal(getattr(fill, name), getattr(expected, name)), name

    @invariant()
    def worker_mirror_matches_the_scheduler(self):
        assert set(self.worker.requests) == set(self.logical)
        for request_id, mirror in self.worker.requests.items():
            original = self.manager._requests[request_id].table
            assert np.array_equal(mirror.table.num_pages, original.num_pages)
            assert np.array_equal(mirror.table.all_pages(), original.all_pages())


TestPagingMachine = PagingMachine.TestCase
TestPagingMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------ sliding-window rows
def sliding_layout(total_pages=64, windows=(5, 0), heads=2, page_size=4):
    return PageLayout(len(windows), heads, head_size=8, page_size=page_size, dtype_bytes=2,
                      total_pages=total_pages, layer_windows=windows)


def test_layout_knows_which_rows_slide_and_bounds_them():
    layout = sliding_layout(windows=(5, 0, 9, 0))
    assert layout.compressed_layers == (1, 3)
    assert layout.compressed_rows.tolist() == [2, 3, 6, 7]
    assert layout.row_windows.tolist() == [5, 5, 0, 0, 9, 9, 0, 0]
    # A sliding row holds at most W - 1 + (P - 1) + a chunk; a full row everything.
    assert layout.row_tokens_bound(100, 8).tolist() == [15, 15, 100, 100, 19, 19, 100, 100]
    assert PageLayout(2, 1, 8, 4, 2, 10).compressed_layers == (0, 1)
    with pytest.raises(ValueError, match="3 layer windows for 2 layers"):
        PageLayout(2, 1, 8, 4, 2, 10, layer_windows=(1, 0, 0))


def test_sliding_rows_need_only_their_window_to_fit_one_request():
    # 4 rows: a 1024-token request needs 4 x 64 pages of 16 if every row is full, but its
    # two sliding rows (W = 32, chunks of 64) never hold more than 31 + 15 + 64 tokens.
    layout = PageLayout(2, 1, 8, 16, 2, total_pages=64 + 7, layer_windows=(32, 0))
    layout.check_holds_one_request(1024, max_chunk=64)
    with pytest.raises(ValueError, match="sliding-window rows"):
        layout.check_holds_one_request(1024, max_chunk=96)


def test_table_drop_leading_shifts_the_rest_to_the_front():
    table = HeadPageTable(num_rows=2, page_size=4)
    table.append(np.array([3, 2]), np.array([10, 11, 12, 20, 21]))
    version = table.version
    assert table.drop_leading(np.array([2, 0])).tolist() == [10, 11]
    assert table.num_pages.tolist() == [1, 2] and table.version != version
    assert table.pages[0, 0] == 12 and table.pages[1, :2].tolist() == [20, 21]
    with pytest.raises(ValueError, match="cannot drop"):
        table.drop_leading(np.array([2, 0]))


def test_drop_outside_window_frees_whole_dead_pages_only():
    layout = sliding_layout(windows=(5, 0), heads=1, page_size=4)
    manager = PageManager(layout)
    assert manager.allocate("a", 16)
    manager.take_deltas()
    # Processed 8: a query at position 8 sees 4..8, so positions 0..3 (one page) are dead.
    assert manager.drop_outside_window("a", 8) == 1
    assert manager.physical_lengths("a").tolist() == [12, 16]
    assert manager.drop_outside_window("a", 8) == 0  # idempotent
    assert manager.drop_outside_window("a", 11) == 0  # 6 dead: not yet a second whole page
    assert manager.drop_outside_window("a", 12) == 1
    delta = manager.take_deltas()["a"]
    assert delta.drops.tolist() == [2, 0] and not delta.appends  # both drops, summed
    manager.check_invariants()
    assert manager.num_free + manager.owned_pages() == layout.total_pages
    # Growing after a drop needs pages only for what the rows still hold.
    assert manager.pages_needed("a", 20) == 2
    # Without sliding layers nothing is ever dropped.
    plain = PageManager(make_layout())
    assert plain.allocate("b", 16) and plain.drop_outside_window("b", 16) == 0


def test_worker_mirror_applies_drops_before_appends():
    layout = sliding_layout(windows=(5, 0), heads=1, page_size=4)
    manager = PageManager(layout)
    worker = WorkerKVState(layout, torch.device("cpu"))
    assert manager.allocate("a", 16)
    worker.apply_deltas(manager.take_deltas())
    worker.requests["a"].lengths = np.array([16, 16])  # the forward wrote them
    manager.drop_outside_window("a", 16)  # positions < 12 dead: 3 pages
    assert manager.allocate("a", 20)
    worker.apply_deltas(manager.take_deltas())
    mirror, original = worker.requests["a"].table, manager._requests["a"].table
    assert np.array_equal(mirror.all_pages(), original.all_pages())
    assert worker.requests["a"].lengths.tolist() == [4, 16]
    assert manager.physical_lengths("a").tolist() == [8, 20]


def test_sequence_pages_count_sliding_rows_at_their_window():
    layout = sliding_layout(windows=(5, 0), heads=1, page_size=4)
    manager = PageManager(layout)
    # 40 tokens in chunks of 8: the sliding row peaks at 4 + 3 + 8 = 15 tokens (4 pages).
    assert manager.pages_needed_for_sequence("a", 40, max_chunk=8) == 4 + 10
    assert manager.pages_needed("a", 40) == 20


class SlidingPagingMachine(PagingMachine):
    """The same, on a layout with sliding-window rows that drop dead leading pages."""

    def __init__(self):
        super().__init__()
        self.layout = sliding_layout(total_pages=48, windows=(5, 0), heads=2, page_size=4)
        self.manager = PageManager(self.layout)
        self.worker = WorkerKVState(self.layout, torch.device("cpu"))

    @precondition(lambda self: self.logical)
    @rule(data=st.data())
    def slide(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.logical)))
        processed = data.draw(st.integers(0, self.logical[request_id]))
        state = self.manager._requests[request_id]
        before = state.evicted.copy()
        # The worker stored every reserved slot (its forward ran).
        self.worker.requests[request_id].lengths = self.manager.physical_lengths(request_id)
        self.manager.drop_outside_window(request_id, processed)
        self._sync_worker()
        windows, size = self.layout.row_windows, self.layout.page_size
        dead = np.maximum(0, processed - windows + 1)
        sliding = windows > 0
        # Never a visible token; whole pages only; full rows untouched.
        assert (state.evicted[sliding] <= np.maximum(before, dead)[sliding]).all()
        assert ((state.evicted - before) % size == 0).all()
        assert (state.evicted[~sliding] == before[~sliding]).all()
        empty = state.table.num_pages == 0
        assert ((dead - state.evicted < size) | empty | ~sliding).all()
        assert (self.worker.requests[request_id].lengths
                == self.manager.physical_lengths(request_id)).all()


TestSlidingPagingMachine = SlidingPagingMachine.TestCase
TestSlidingPagingMachine.settings = settings(max_examples=60, stateful_step_count=40,
                                             deadline=None)
