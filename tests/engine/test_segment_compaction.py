"""A shared prefix's segment compacted in place, later, while readers read it (issue 40's
quality: its first readers prefill over the whole prefix): the plan kept per row padded to
whole pages, the moves run on the entry's pages, and every reader's rows losing the pages
no longer needed, its own tokens shifted down by as many pages, nothing of theirs moved."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.engine.worker.moves import MoveBatch, plan_segment_compaction
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import PageLayout, PageManager
from kvcompress.paging.page_format import PageFormat

PAGE = 4


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 4), length=st.integers(1, 30),
       shared=st.integers(0, 3))
def test_the_plan_keeps_the_chosen_tokens_padded_to_whole_pages_in_order(data, rows, length,
                                                                           shared):
    shared = min(shared, length // PAGE)
    lengths = np.full(rows, length, dtype=np.int64)
    kept_rows = []
    for _ in range(rows):
        # The policy's choice: any subset, the shared run always (an adopter keeps it).
        chosen = data.draw(st.sets(st.integers(0, length - 1)))
        kept_rows.append(sorted(set(chosen) | set(range(shared * PAGE))))
    width = max(1, max(len(row) for row in kept_rows))
    indices = torch.full((rows, width), -1, dtype=torch.long)
    for row, kept in enumerate(kept_rows):
        indices[row, : len(kept)] = torch.tensor(kept, dtype=torch.long)
    counts = torch.tensor([len(kept) for kept in kept_rows])
    moves, new_lengths = plan_segment_compaction(counts, indices, lengths,
                                                 np.full(rows, shared), PAGE)
    whole = length // PAGE
    for row, kept in enumerate(kept_rows):
        held = list(range(length))
        picks = moves.rows == row
        for src, dst in zip(moves.src_positions[picks].tolist(),
                            moves.dst_positions[picks].tolist()):
            assert dst < src  # every move goes down: the region's front
            held[dst] = src
        region = [p for p in kept if shared * PAGE <= p < whole * PAGE]
        pages = -(-len(region) // PAGE)
        first = shared * PAGE
        now = held[first: first + pages * PAGE]
        assert set(region) <= set(now) and now == sorted(now)  # the chosen, padded, in order
        assert all(first <= p < whole * PAGE for p in now)
        dropped = whole - shared - pages
        assert new_lengths[row] == length - dropped * PAGE
        # The shared run and the partial last page are where they were.
        assert held[:first] == list(range(first))


def layout() -> PageLayout:
    return PageLayout(2, 2, head_size=8, page_size=PAGE, dtype_bytes=4, total_pages=64)


def test_readers_of_a_compacted_segment_read_its_kept_tokens_then_their_own():
    """The whole path without vLLM: a segment request of 18 tokens planned (kept positions
    per row), filed pending, read by two requests with tokens of their own; then compacted:
    the moves run on the entry's pages, the readers' tables drop the same pages, and each
    reader's rows hold the kept prefix tokens, the prefix's partial last page and its own
    tokens, in that order; the pages come back when everyone is gone."""
    pages = PageManager(layout())
    worker = WorkerKVState(pages.layout, torch.device("cpu"))
    pool = torch.zeros(64, 2, PAGE, 8)  # [page, K/V, slot, dim]: a label per slot
    rows = pages.layout.num_rows

    def write(request_id, start, stop, tag):
        """Label each new token: (tag, position) in every row."""
        table = worker.requests[request_id].table
        for row in range(rows):
            for position in range(start, stop):
                physical = worker.requests[request_id].lengths[row] + position - start
                page = table.pages[row, physical // PAGE]
                pool[page, 0, physical % PAGE, :2] = torch.tensor([tag, position])
        worker.requests[request_id].lengths = worker.requests[request_id].lengths + stop - start

    def read(request_id):
        state = worker.requests[request_id]
        return [[tuple(int(v) for v in pool[state.table.pages[row, slot // PAGE], 0,
                                            slot % PAGE, :2])
                 for slot in range(state.lengths[row])] for row in range(rows)]

    assert pages.allocate("seg", 18)
    worker.apply_deltas(pages.take_deltas())
    write("seg", 0, 18, tag=1)
    kept = [[0, 1, 5, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8], [3], [12, 13, 14, 15, 16, 17]]
    counts = torch.tensor([len(k) for k in kept])
    indices = torch.full((rows, 9), -1, dtype=torch.long)
    for row, positions in enumerate(kept):
        indices[row, : len(positions)] = torch.tensor(positions)
    moves, planned = plan_segment_compaction(counts, indices, worker.requests["seg"].lengths,
                                             np.zeros(rows, dtype=np.int64), PAGE)
    # 16 whole tokens (4 pages) + 2 in a partial page; kept pages 1, 3, 1, 1.
    assert planned.tolist() == [4 + 2, 12 + 2, 4 + 2, 4 + 2]
    worker.park_segment("seg", moves, (worker.requests["seg"].lengths - planned) // PAGE)
    pages.release_after_compression("seg", 18, planned, kind="deferred")
    assert pages.retire("seg", 1, 18, 18)
    worker.drop(["seg"])
    assert pages.pending_ids() == [1] and pages.entry(1).sealed
    for reader, own in (("a", 5), ("b", 3)):
        assert pages.adopt(reader, 1, 18, share=True) and pages.allocate(reader, 18 + own)
        worker.apply_deltas(pages.take_deltas())
        for src, dst in worker.take_copies().values():
            pool[torch.as_tensor(dst)] = pool[torch.as_tensor(src)]
        write(reader, 18, 18 + own, tag=2)
    before = {reader: read(reader) for reader in "ab"}
    assert set(pages.segment_readers(1)) == {"a", "b"}
    free_before = pages.num_free
    pages.compact_segment(1)
    assert pages.num_free == free_before + 3 + 1 + 3 + 3  # the dropped pages, once
    orders = pages.take_segment_orders()
    parked = worker.take_parked("seg", orders["seg"])
    batch = MoveBatch(PAGE)
    batch.add("seg", parked.pages, parked.moves)
    batch.run(pool, PageFormat("row"))  # as the labels are written
    worker.apply_deltas(pages.take_deltas())
    for reader in "ab":
        now = read(reader)
        for row in range(rows):
            region = [p for p in kept[row] if p < 16]
            pages_kept = -(-len(region) // PAGE)
            prefix = now[row][: pages_kept * PAGE]
            assert {(1, p) for p in region} <= set(prefix)
            # Then the prefix's last two tokens and the reader's own, as before.
            assert now[row][pages_kept * PAGE:] == before[reader][row][16:]
        assert worker.requests[reader].lengths.tolist() == pages.physical_lengths(
            reader).tolist()
        assert worker.requests[reader].adopted_rows.tolist() == pages.adoption(reader)[1].tolist()
    pages.check_invariants()
    entry = pages.entry(1)
    assert not entry.sealed and entry.lengths_at(18).tolist() == [6, 14, 6, 6]
    for reader in "ab":
        pages.free(reader)
    pages.drop_entry(1)
    assert pages.num_free == pages.layout.total_pages
    pages.check_invariants()


def test_a_plan_the_worker_does_not_hold_is_refused():
    worker = WorkerKVState(layout(), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="does not hold"):
        worker.take_parked("nobody", np.zeros(4, dtype=np.int32))
