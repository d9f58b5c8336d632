"""The worker's step tables without vLLM: cached between steps yet always current, and a
scheduler/worker divergence named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import PageLayout, PageManager, PageTableDelta

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_size=8, page_size=4, dtype_bytes=4,
                    total_pages=200)


def assert_current(batch, state: WorkerKVState, req_ids: list[str], number: int) -> None:
    """Every row's pages, in order, as the table holds them now; beyond them only valid page
    ids (never read: reads stop at the row's length)."""
    width = max(1, max(int(state.requests[r].table.num_pages.max()) for r in req_ids))
    tables = batch.tables.gather(range(len(req_ids)), slice(None), width).numpy()
    assert tables.shape == (len(req_ids), LAYOUT.num_rows, width), number
    assert tables.min() >= 0 and tables.max() < LAYOUT.total_pages
    for index, request_id in enumerate(req_ids):
        table = state.requests[request_id].table
        for row in range(LAYOUT.num_rows):
            count = table.num_pages[row]
            assert tables[index, row, :count].tolist() == table.pages[row, :count].tolist(), (
                number, request_id, row)


def step(state: WorkerKVState, req_ids: list[str], logical: dict[str, int]):
    """One decode token for each request (``logical``: tokens before, advanced here)."""
    n = len(req_ids)
    computed = np.array([logical[r] for r in req_ids])
    batch = state.prepare_step(req_ids, np.ones(n, dtype=np.int64), computed, np.full(n, 1),
                               observation_windows=[1] * n, wants_compression=[False] * n)
    state.finish_step(batch)
    for request_id in req_ids:
        logical[request_id] += 1
    return batch


def test_cached_tables_follow_appends_truncations_order_and_new_requests():
    pages, worker = PageManager(LAYOUT), WorkerKVState(LAYOUT, torch.device("cpu"))
    rng = np.random.default_rng(0)
    live = ["a", "b", "c"]
    logical = dict.fromkeys(live, 0)
    worker.apply_deltas(pages.take_deltas())
    for number in range(40):
        if number == 10:  # one request replaced by a new one under a reused id
            pages.free("b")
            worker.drop(["b"])
            logical["b"] = 0
        if number == 20:  # compaction: trailing pages dropped on both sides
            kept = np.array([1, 2, 3, 1])
            worker.requests["a"].table.truncate(kept)
            worker.requests["a"].lengths = kept.copy()
            pages.release_after_compression("a", logical["a"], kept)
        order = list(rng.permutation(live)) if number % 7 == 0 else live
        for request_id in order:
            assert pages.allocate(request_id, logical[request_id] + 1)
        worker.apply_deltas(pages.take_deltas())
        assert_current(step(worker, order, logical), worker, order, number)


def test_a_row_without_a_page_for_its_new_token_names_its_request():
    pages, worker = PageManager(LAYOUT), WorkerKVState(LAYOUT, torch.device("cpu"))
    for request_id in ("ok", "short"):
        pages.allocate(request_id, 4)
    worker.apply_deltas(pages.take_deltas())
    worker.requests["short"].lengths[:] = 4  # a fifth token would need a second page
    worker.requests["ok"].lengths[:] = 3
    with pytest.raises(RuntimeError, match="request short: no page reserved"):
        worker.prepare_step(["ok", "short"], np.array([1, 1]), np.array([3, 4]),
                            np.array([1, 1]), observation_windows=[1, 1],
                            wants_compression=[False, False])


# ------------------------------------------------------------------ multi-turn reuse
PAGE = LAYOUT.page_size


def adopting_delta(adopted: list[int], adopted_len: int, new_tokens: int, first_page: int,
                   source_first_page: int | None = 100):
    """A fresh delta as the scheduler's adoption sends it: the adopted rows' pages first
    (copies of a cached entry's pages from ``source_first_page`` on, if given), then the
    pages the ``new_tokens`` need. Returns the delta and the adopted pages per row."""
    adopted_np = np.array(adopted, dtype=np.int64)
    first = (-(-adopted_np // PAGE)).astype(np.int32)
    grown = (-(-(adopted_np + new_tokens) // PAGE)).astype(np.int32) - first
    first_ids = np.arange(first_page, first_page + first.sum(), dtype=np.int32)
    grown_ids = np.arange(first_ids[-1] + 1, first_ids[-1] + 1 + grown.sum(), dtype=np.int32)
    copies = None
    if source_first_page is not None:
        source = np.arange(source_first_page, source_first_page + first.sum(), dtype=np.int32)
        copies = (source, first_ids.copy())
    delta = PageTableDelta(fresh=True, appends=[(first, first_ids), (grown, grown_ids)],
                           adopted_lengths=adopted_np, adopted_len=adopted_len, copies=copies)
    return delta


def test_an_adopting_delta_starts_the_request_from_its_adopted_rows():
    worker = WorkerKVState(LAYOUT, torch.device("cpu"))
    adopted, adopted_len, new = [5, 3, 9, 1], 12, 6  # each head kept its own share of 12
    delta = adopting_delta(adopted, adopted_len, new, first_page=0)
    worker.apply_deltas({"a": delta})
    request = worker.requests["a"]
    assert request.lengths.tolist() == adopted and request.adopted_rows.tolist() == adopted
    assert request.adopted_len == adopted_len
    copies = worker.take_copies()
    assert list(copies) == ["a"]
    src, dst = copies["a"]
    assert src.dtype == dst.dtype == np.int64
    assert src.tolist() == delta.copies[0].tolist() and dst.tolist() == delta.copies[1].tolist()
    assert worker.take_copies() == {}  # taken once

    # vLLM prefills the new prompt tokens from logical position 12; each row writes from
    # its own physical length on.
    batch = worker.prepare_step(["a"], np.array([new]), np.array([adopted_len]),
                                np.array([adopted_len + new]), observation_windows=[4],
                                wants_compression=[False])
    assert batch.host_lengths_before[0].tolist() == adopted
    positions = batch.slot_mapping[0] % PAGE + 0  # first new token of each row
    pages = batch.slot_mapping[0] // PAGE
    for row, length in enumerate(adopted):
        table = request.table.pages[row]
        assert pages[row] == table[length // PAGE] and positions[row] == length % PAGE
    worker.finish_step(batch)
    assert request.lengths.tolist() == [length + new for length in adopted]
    # the prompt part of an uncompacted adopter: its adopted slots and the new tokens
    assert request.prompt_kept.tolist() == [length + new for length in adopted]
    assert request.prompt_end().tolist() == request.prompt_kept.tolist()


def test_an_adopters_window_stays_in_its_new_prompt_tokens_across_chunks():
    worker = WorkerKVState(LAYOUT, torch.device("cpu"))
    adopted, adopted_len = [5, 3, 9, 1], 12
    worker.apply_deltas({"a": adopting_delta(adopted, adopted_len, 7, first_page=0)})
    prompt_len = adopted_len + 7
    # window 10 > 7 new tokens: it starts at the first new token, never in the adopted part
    first = worker.prepare_step(["a"], np.array([3]), np.array([adopted_len]),
                                np.array([prompt_len]), observation_windows=[10],
                                wants_compression=[True])
    (window,) = first.window_queries
    assert (window.first_query, window.num_queries) == (0, 3)
    assert window.scores.shape == (2, 2, max(adopted) + 7)  # by physical slot of the rows
    assert first.completing_prompt == []
    worker.finish_step(first)
    second = worker.prepare_step(["a"], np.array([4]), np.array([adopted_len + 3]),
                                 np.array([prompt_len]), observation_windows=[10],
                                 wants_compression=[True])
    (window2,) = second.window_queries
    assert (window2.first_query, window2.num_queries) == (0, 4)
    assert window2.scores is window.scores and not window2.starts_in_step
    assert second.completing_prompt == [0]


def test_the_window_of_a_long_new_segment_is_its_last_positions():
    worker = WorkerKVState(LAYOUT, torch.device("cpu"))
    worker.apply_deltas({"a": adopting_delta([5, 3, 9, 1], 12, 20, first_page=0)})
    batch = worker.prepare_step(["a"], np.array([20]), np.array([12]), np.array([32]),
                                observation_windows=[4], wants_compression=[True])
    (window,) = batch.window_queries
    assert (window.first_query, window.num_queries, window.prompt_len) == (16, 4, 32)
    assert window.scores.shape[-1] == 9 + 20


MALFORMED = {
    "rows": lambda d: setattr(d, "adopted_lengths", d.adopted_lengths[:3]),
    "longer_than_adopted": lambda d: setattr(d, "adopted_len", 4),
    "negative": lambda d: d.adopted_lengths.__setitem__(1, -1),
    "no_pages": lambda d: d.appends.pop(0) and setattr(d, "copies", None),
    "copy_outside_pool": lambda d: d.copies[0].__setitem__(0, LAYOUT.total_pages),
    "copy_into_foreign_page": lambda d: d.copies[1].__setitem__(0, 150),
    "copy_twice_into_a_page": lambda d: d.copies[1].__setitem__(1, d.copies[1][0]),
    "copy_from_own_page": lambda d: d.copies[0].__setitem__(2, d.appends[1][1][0]),
}


@pytest.mark.parametrize("problem", list(MALFORMED))
def test_a_malformed_adoption_fails_only_its_request(problem):
    worker = WorkerKVState(LAYOUT, torch.device("cpu"))
    good = adopting_delta([5, 3, 9, 1], 12, 6, first_page=0, source_first_page=100)
    bad = adopting_delta([6, 2, 8, 4], 12, 6, first_page=40, source_first_page=120)
    MALFORMED[problem](bad)
    worker.apply_deltas({"good": good, "bad": bad})
    assert list(worker.adoption_failures) == ["bad"]
    assert "adopting a cached context failed" in worker.adoption_failures["bad"]
    assert worker.requests["bad"].lengths.tolist() == [0] * 4  # an empty context meanwhile
    assert worker.requests["bad"].adopted_rows is None
    assert worker.requests["good"].lengths.tolist() == [5, 3, 9, 1]
    assert list(worker.take_copies()) == ["good"]
    # the same id readmitted afresh (e.g. after preemption) starts clean
    worker.apply_deltas({"bad": adopting_delta([6, 2, 8, 4], 12, 6, first_page=40)})
    assert worker.adoption_failures == {}
    assert worker.requests["bad"].lengths.tolist() == [6, 2, 8, 4]
