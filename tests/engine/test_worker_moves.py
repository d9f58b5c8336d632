"""Every move planner, through every mover, against a sequential reference of what each row
must hold afterwards; and overlapping move lists never reach a mover's in-place fast path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.engine.worker.moves import (
    MoveBatch,
    RowMoves,
    plan_generated_keep,
    plan_prompt_moves,
)
from kvcompress.kernels import has_triton
from kvcompress.paging import PageLayout
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from tests.triton_interpreter import use_interpreter

HEAD_SIZE = 8


class RacyMover:
    """What a parallel GPU kernel may do with a list it was told is disjoint: copy in place,
    in any order (here the last move first). Lists not promised disjoint are gathered first."""

    def __init__(self) -> None:
        self.fast_calls = 0

    def move(self, pool, src_slots, dst_slots, *, disjoint=False):
        if not disjoint:
            GPU_PAGE_FORMAT.move(pool, src_slots, dst_slots)
            return
        self.fast_calls += 1
        for src, dst in reversed(list(zip(src_slots.tolist(), dst_slots.tolist()))):
            GPU_PAGE_FORMAT.move(pool, torch.tensor([src]), torch.tensor([dst]))


def movers():
    layout = PageLayout(1, 1, HEAD_SIZE, 4, 4, 1)
    return {
        "page_format": GPU_PAGE_FORMAT,
        "kernel_torch": TritonPagedKernel(layout, torch.float32, use_triton=False),
        "racy": RacyMover(),
    }


def labelled_pool(num_pages: int, page_size: int) -> torch.Tensor:
    """Every slot's K[0] is its own slot number (V[0] its negative): tokens are traceable."""
    pool = torch.zeros(num_pages, 2, page_size, HEAD_SIZE)
    slots = torch.arange(num_pages * page_size, dtype=torch.float32).view(num_pages, page_size)
    pool[:, 0, :, 0], pool[:, 1, :, 0] = slots, -slots
    return pool


def row_tokens(pool: torch.Tensor, pages: np.ndarray, row: int, length: int) -> list[int]:
    """The labels held at positions [0, length) of a row (checking K and V agree)."""
    page_size = pool.shape[2]
    positions = torch.arange(length)
    slots = torch.as_tensor(pages[row].astype(np.int64))[positions // page_size] * page_size
    slots = slots + positions % page_size
    keys, values = GPU_PAGE_FORMAT.read_tokens(pool, slots)
    assert torch.equal(keys[:, 0], -values[:, 0])
    return keys[:, 0].long().tolist()


def random_pages(lengths: np.ndarray, page_size: int, rng: np.random.Generator):
    per_row = -(-lengths // page_size)
    width = max(1, int(per_row.max()))
    total = int(per_row.sum()) + 3
    ids = rng.permutation(total).astype(np.int32)
    pages = np.zeros((len(lengths), width), dtype=np.int32)
    used = 0
    for row, count in enumerate(per_row):
        pages[row, :count] = ids[used: used + count]
        used += count
    return pages, total


def run(moves: RowMoves, pages: np.ndarray, total_pages: int, page_size: int, mover):
    pool = labelled_pool(total_pages, page_size)
    before = pool.clone()
    batch = MoveBatch(page_size)
    batch.add("r", pages, moves)
    batch.run(pool, mover)
    return before, pool


def original(before, pages, row, positions):
    tokens = row_tokens(before, pages, row, max(positions, default=-1) + 1)
    return [tokens[p] for p in positions]


@st.composite
def prompt_cases(draw, resumed: bool):
    rows = draw(st.integers(1, 5))
    prompt_len = draw(st.integers(2, 70))
    tail = draw(st.integers(1, 25)) if resumed else 0
    kept = []
    for _ in range(rows):
        count = draw(st.integers(1, prompt_len))
        kept.append(sorted(draw(st.permutations(range(prompt_len)))[:count]))
    page_size = draw(st.sampled_from([4, 8, 16]))
    return prompt_len, tail, kept, page_size, draw(st.integers(0, 2**31))


@st.composite
def decode_eviction_cases(draw):
    """Rows with their own prompt parts and a generated part each; every row keeps ``budget``
    generated offsets: the newest (window) or any ascending choice (h2o, snapkv)."""
    rows = draw(st.integers(1, 5))
    budget = draw(st.integers(1, 40))
    prompt_kept = np.array([draw(st.integers(0, 40)) for _ in range(rows)])
    generated = budget + draw(st.integers(0, 50))
    if draw(st.booleans()):
        kept = [list(range(generated - budget, generated))] * rows
    else:
        kept = [sorted(draw(st.permutations(range(generated)))[:budget]) for _ in range(rows)]
    page_size = draw(st.sampled_from([4, 8, 16]))
    return prompt_kept, generated, np.array(kept), page_size, draw(st.integers(0, 2**31))


def newest(lengths, prompt_kept, budget):
    """The window policy's choice: each row's newest ``budget`` generated offsets."""
    generated = lengths - prompt_kept
    return generated[:, None] - budget + np.arange(budget)


def prompt_plan(prompt_len, tail, kept):
    width = max(map(len, kept))
    indices = torch.full((len(kept), width), 2**31 - 1)
    for row, positions in enumerate(kept):
        indices[row, : len(positions)] = torch.tensor(positions)
    counts = torch.tensor([len(positions) for positions in kept])
    lengths = np.full(len(kept), prompt_len + tail, dtype=np.int64)
    moves, new_lengths = plan_prompt_moves(counts, indices, lengths, prompt_len)
    return lengths, moves, new_lengths


@settings(max_examples=60, deadline=None)
@given(case=st.one_of(prompt_cases(resumed=False), prompt_cases(resumed=True)))
def test_prompt_compaction_keeps_the_planned_tokens_with_every_mover(case):
    prompt_len, tail, kept, page_size, seed = case
    lengths, moves, new_lengths = prompt_plan(prompt_len, tail, kept)
    pages, total = random_pages(lengths, page_size, np.random.default_rng(seed))
    for name, mover in movers().items():
        before, pool = run(moves, pages, total, page_size, mover)
        for row, positions in enumerate(kept):
            assert new_lengths[row] == len(positions) + tail
            got = row_tokens(pool, pages, row, int(new_lengths[row]))
            tail_tokens = original(before, pages, row, list(range(prompt_len, prompt_len + tail)))
            want = original(before, pages, row, positions)
            if tail:  # resumed: order-preserving, prompt part then the generated tail
                assert got == want + tail_tokens, name
            else:  # hole filling: the kept set, kept tokens below the new length stay put
                assert sorted(got) == sorted(want), name
                stay = [p for p in positions if p < len(positions)]
                assert [got[p] for p in stay] == original(before, pages, row, stay), name


@settings(max_examples=80, deadline=None)
@given(case=decode_eviction_cases())
def test_decode_eviction_keeps_the_prompt_part_and_the_chosen_tokens_in_order(case):
    prompt_kept, generated, kept, page_size, seed = case
    lengths = prompt_kept + generated
    moves, new_lengths = plan_generated_keep(lengths, prompt_kept, kept)
    pages, total = random_pages(lengths, page_size, np.random.default_rng(seed))
    for name, mover in movers().items():
        before, pool = run(moves, pages, total, page_size, mover)
        for row in range(len(lengths)):
            prompt = int(prompt_kept[row])
            chosen = [prompt + int(offset) for offset in kept[row]]
            want = original(before, pages, row, list(range(prompt)) + chosen)
            assert new_lengths[row] == len(want)
            assert row_tokens(pool, pages, row, len(want)) == want, name


@pytest.mark.parametrize(
    "kept",
    [[[0, 1, 5]], [[2, 1, 3]], [[1, 1, 2]], [[-1, 2, 3]], [[1, 2, 6]], [[1, 2]] * 2],
    ids=["ok", "unsorted", "repeated", "negative", "beyond", "rows"],
)
def test_decode_eviction_refuses_offsets_it_cannot_honour(kept):
    lengths, prompt_kept = np.array([16]), np.array([10])
    if kept == [[0, 1, 5]]:
        moves, new_lengths = plan_generated_keep(lengths, prompt_kept, np.array(kept))
        assert new_lengths.tolist() == [13]
        # 10 and 11 stay put: only the token at offset 5 moves
        assert (moves.src_positions.tolist(), moves.dst_positions.tolist()) == ([15], [12])
        return
    with pytest.raises(ValueError, match="kept offsets"):
        plan_generated_keep(lengths, prompt_kept, np.array(kept))


def test_hole_filling_takes_the_fast_path_and_overlapping_evictions_do_not():
    lengths, moves, _ = prompt_plan(40, 0, [[0, 5, 9, 30, 39], list(range(20, 40))])
    pages, total = random_pages(lengths, 8, np.random.default_rng(0))
    racy = RacyMover()
    run(moves, pages, total, 8, racy)
    assert racy.fast_calls == 1
    # budget 128, interval 64: a head 63 tokens over shifts its newest 128 down by 63
    lengths, prompt_kept = np.array([10 + 128 + 63]), np.array([10])
    moves, _ = plan_generated_keep(lengths, prompt_kept, newest(lengths, prompt_kept, 128))
    pages, total = random_pages(lengths, 16, np.random.default_rng(1))
    racy = RacyMover()
    run(moves, pages, total, 16, racy)
    assert racy.fast_calls == 0


def test_an_overlapping_list_on_the_fast_path_would_corrupt_the_cache():
    """Why the check matters: the in-place path on an overlapping eviction loses tokens."""
    lengths, prompt_kept = np.array([10 + 128 + 63]), np.array([10])
    moves, _ = plan_generated_keep(lengths, prompt_kept, newest(lengths, prompt_kept, 128))
    pages, total = random_pages(lengths, 16, np.random.default_rng(1))
    pool = labelled_pool(total, 16)
    before = pool.clone()
    batch = MoveBatch(16)
    batch.add("r", pages, moves)
    src, dst = batch._by_request["r"]
    RacyMover().move(pool, torch.from_numpy(src), torch.from_numpy(dst), disjoint=True)
    want = original(before, pages, 0, list(range(10)) + list(range(73, 201)))
    assert row_tokens(pool, pages, 0, 138) != want


@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, GPU_PAGE_FORMAT])
def test_page_formats_gather_before_scattering(page_format):
    pool = torch.randn(4, 2, 8, HEAD_SIZE)
    before = pool.clone()
    src, dst = torch.arange(1, 17), torch.arange(0, 16)  # a shift by one: every dst a src
    page_format.move(pool, src, dst)
    keys, _ = page_format.read_tokens(pool, dst)
    old_keys, _ = page_format.read_tokens(before, src)
    assert torch.equal(keys, old_keys)


@pytest.mark.skipif(not has_triton(), reason="triton is not installed")
@pytest.mark.parametrize("overlapping", [False, True], ids=["hole_filling", "decode"])
def test_triton_mover_under_the_interpreter(monkeypatch, overlapping):
    use_interpreter(monkeypatch)
    if overlapping:
        # row 0: the newest 40 of 47 generated tokens; row 1: 40 of 45 chosen by score
        lengths, prompt_kept = np.array([10 + 47, 12 + 45]), np.array([10, 12])
        scored = [offset for offset in range(45) if offset not in (0, 2, 4, 6, 30)]
        kept = np.array([list(range(7, 47)), scored])
        moves, new_lengths = plan_generated_keep(lengths, prompt_kept, kept)
        expected_rows = [list(range(10)) + list(range(17, 57)),
                         list(range(12)) + [12 + offset for offset in scored]]
    else:
        lengths, moves, new_lengths = prompt_plan(40, 0, [[1, 2, 30, 39], list(range(25, 40))])
        expected_rows = None
    pages, total = random_pages(lengths, 8, np.random.default_rng(2))
    layout = PageLayout(1, 1, HEAD_SIZE, 8, 4, total)
    kernel = TritonPagedKernel(layout, torch.float32, use_triton=True)
    before, pool = run(moves, pages, total, 8, kernel)
    _, reference = run(moves, pages, total, 8, GPU_PAGE_FORMAT)
    assert torch.equal(pool, reference)
    if expected_rows:
        for row, positions in enumerate(expected_rows):
            got = row_tokens(pool, pages, row, int(new_lengths[row]))
            assert got == original(before, pages, row, positions)


def rows_plan(kept: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, kept))
    indices = torch.full((len(kept), width), 2**31 - 1)
    for row, positions in enumerate(kept):
        indices[row, : len(positions)] = torch.tensor(positions)
    return torch.tensor([len(positions) for positions in kept]), indices


@pytest.mark.parametrize("tail", [0, 5], ids=["completed", "resumed"])
def test_prompt_moves_with_a_prompt_end_per_row(tail):
    # An adopter's rows: each its own adopted part (kept whole) plus 10 new prompt tokens,
    # of which each keeps its own; a resumed one also holds a tail after its prompt part.
    adopted = np.array([2, 20, 0])
    ends = adopted + 10
    kept = [[0, 1, 3, 7, 11], list(range(20)) + [21, 29], [1, 2, 6, 9]]
    counts, indices = rows_plan(kept)
    lengths = ends + tail
    moves, new_lengths = plan_prompt_moves(counts, indices, lengths, ends)
    assert new_lengths.tolist() == (counts.numpy() + tail).tolist()
    pages, total = random_pages(lengths, 4, np.random.default_rng(5))
    for name, mover in movers().items():
        before, pool = run(moves, pages, total, 4, mover)
        for row, positions in enumerate(kept):
            got = row_tokens(pool, pages, row, int(new_lengths[row]))
            want = original(before, pages, row, positions)
            tail_tokens = original(before, pages, row, list(range(ends[row], lengths[row])))
            # the adopted part never moves
            assert got[: adopted[row]] == want[: adopted[row]], name
            if tail:
                assert got == want + tail_tokens, name
            else:
                assert sorted(got) == sorted(want), name


def test_rows_shorter_than_their_prompt_part_are_refused():
    counts, indices = rows_plan([[0, 1], [0, 1]])
    with pytest.raises(ValueError, match="end before their prompt part"):
        plan_prompt_moves(counts, indices, np.array([12, 9]), np.array([12, 10]))


@pytest.mark.parametrize("slice_pages", [1, 3, 100])
def test_page_copies_copy_whole_pages_in_slices(monkeypatch, slice_pages):
    from kvcompress.engine.worker import moves as worker_moves

    pool = torch.randn(12, 2, 4, HEAD_SIZE)
    before = pool.clone()
    page_bytes = pool[0].numel() * pool.element_size()
    monkeypatch.setattr(worker_moves, "COPY_SLICE_BYTES", slice_pages * page_bytes)
    src, dst = np.array([7, 2, 9, 8, 11]), np.array([0, 4, 1, 5, 3])
    worker_moves.copy_pages(pool, src, dst)
    assert torch.equal(pool[dst], before[src])  # K and V, every token of the page
    untouched = [page for page in range(12) if page not in dst]
    assert torch.equal(pool[untouched], before[untouched])
