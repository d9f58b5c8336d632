"""The worker's step tables without vLLM: cached between steps yet always current, and a
scheduler/worker divergence named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.engine.worker_state import WorkerKVState
from kvcompress.paging import PageLayout, PageManager

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_size=8, page_size=4, dtype_bytes=4,
                    total_pages=200)


def assert_current(batch, state: WorkerKVState, req_ids: list[str], number: int) -> None:
    """Every row's pages, in order, as the table holds them now; beyond them only valid page
    ids (never read: reads stop at the row's length)."""
    tables = batch.page_tables.numpy()
    width = max(1, max(int(state.requests[r].table.num_pages.max()) for r in req_ids))
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
