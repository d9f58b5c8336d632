"""Compaction: hole-filling plans vs a naive planner; move_kv Triton vs reference; end to end."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcompress.kernels import (
    move_kv,
    move_kv_ref,
    move_kv_triton,
    plan_hole_filling_moves,
    positions_to_slots,
)


def naive_plan(keep: list[int]) -> list[tuple[int, int]]:
    count = len(keep)
    holes = sorted(set(range(count)) - set(keep))
    tails = sorted(k for k in keep if k >= count)
    assert len(holes) == len(tails)
    return list(zip(tails, holes, strict=True))


def random_keep_sets(num_rows: int, max_keep: int, seed: int) -> list[list[int]]:
    """Keep sets of random size out of random old lengths, including the edge cases."""
    generator = torch.Generator().manual_seed(seed)
    rows = [[], list(range(max_keep)), list(range(3)), [max_keep + 5]]
    while len(rows) < num_rows:
        old_len = int(torch.randint(1, 3 * max_keep, (1,), generator=generator))
        count = int(torch.randint(0, min(old_len, max_keep) + 1, (1,), generator=generator))
        rows.append(sorted(torch.randperm(old_len, generator=generator)[:count].tolist()))
    return rows


def padded(
    rows: list[list[int]], max_keep: int, shuffle: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    keep = torch.full((len(rows), max_keep), 999_999, dtype=torch.int64)  # garbage padding
    for n, row in enumerate(rows):
        values = torch.tensor(row, dtype=torch.int64)
        if shuffle:
            values = values[torch.randperm(len(row))]
        keep[n, : len(row)] = values
    return keep, torch.tensor([len(r) for r in rows], dtype=torch.int32)


@pytest.mark.parametrize("shuffle", [False, True])
def test_plan_matches_naive_planner(shuffle):
    max_keep = 12
    rows = random_keep_sets(40, max_keep, seed=1)
    keep, counts = padded(rows, max_keep, shuffle)
    plan = plan_hole_filling_moves(keep, counts)
    for n, row in enumerate(rows):
        moves = naive_plan(row)
        m = len(moves)
        assert int(plan.num_moves[n]) == m
        assert plan.src_positions[n, :m].tolist() == [s for s, _ in moves]
        assert plan.dst_positions[n, :m].tolist() == [d for _, d in moves]
        assert torch.all(plan.src_positions[n, m:] == -1)
        assert torch.all(plan.dst_positions[n, m:] == -1)
        new_of_old = dict(zip(row, row, strict=True)) | dict(moves)
        count = len(row)
        for k in range(count):
            old = int(keep[n, k])
            assert int(plan.new_position_of_kept[n, k]) == new_of_old[old]
            assert int(plan.source_of_new_position[n, new_of_old[old]]) == old
        assert torch.all(plan.new_position_of_kept[n, count:] == -1)
        assert torch.all(plan.source_of_new_position[n, count:] == -1)
    rows_flat, src_flat, dst_flat = plan.flat_moves()
    assert rows_flat.numel() == int(plan.num_moves.sum())
    for r, s, d in zip(rows_flat.tolist(), src_flat.tolist(), dst_flat.tolist(), strict=True):
        assert s >= int(counts[r]) > d


def test_positions_to_slots():
    page_rows = torch.tensor([[5, 2, 9], [1, 0, 3]])
    positions = torch.tensor([[0, 9, 17, -1], [23, 8, -1, 7]])
    slots = positions_to_slots(page_rows, positions, page_size=8)
    assert slots.tolist() == [[40, 17, 73, -1], [31, 0, -1, 15]]


def make_pool(num_pages: int, page_size: int, head_size: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (num_pages, 2, page_size, head_size)
    if dtype == torch.uint8:  # fp8 pages: any byte (NaN codes included) moves unchanged
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    "page_size, head_size, dtype",
    [(8, 64, torch.float32), (16, 128, torch.bfloat16), (32, 96, torch.float16),
     (32, 64, torch.uint8)],  # fp8 pages: the pool holds their bytes
)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_triton_move_matches_reference(device, page_size, head_size, dtype, slot_dtype):
    pool = make_pool(12, page_size, head_size, dtype)
    slots = torch.randperm(12 * page_size, generator=torch.Generator().manual_seed(3))
    src, dst = slots[:37].clone(), slots[37:74].clone()  # disjoint, as the plan guarantees
    src[5] = -1
    dst[11] = -1  # skipped entries
    src, dst = src.to(device, slot_dtype), dst.to(device, slot_dtype)
    expected = pool.to(device).clone()
    move_kv_ref(expected, src, dst)
    result = pool.to(device).clone()
    move_kv_triton(result, src, dst)
    assert torch.equal(result, expected)
    assert not torch.equal(result.cpu(), pool)


def test_reference_is_gather_then_scatter():
    """Chained moves (a dst that is another move's src) read the values from before the call."""
    pool = make_pool(2, 8, 64, torch.float32)
    before = pool.clone()
    move_kv_ref(pool, torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert torch.equal(pool[0, :, 1], before[0, :, 0])
    assert torch.equal(pool[0, :, 2], before[0, :, 1])


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    "page_size, dtype, use_triton",
    [*itertools.product([8, 16, 32], [torch.float32, torch.bfloat16], [False, True]),
     (32, torch.uint8, True)],
)
def test_end_to_end_compaction(device, page_size, dtype, use_triton):
    """Plan + slots + one move launch over several layers/heads leave each head's survivors in
    its first keep_count positions, in the order the plan reports, and moves metadata alongside."""
    num_layers, num_kv_heads, head_size = 2, 3, 64
    generator = torch.Generator().manual_seed(7)
    old_lens = torch.randint(1, 70, (num_layers * num_kv_heads,), generator=generator)
    max_pages = -(-int(old_lens.max()) // page_size)
    num_pages = num_layers * num_kv_heads * max_pages + 2
    num_rows = num_layers * num_kv_heads
    page_rows = torch.randperm(num_pages, generator=generator)[: num_rows * max_pages]
    page_rows = page_rows.view(num_rows, max_pages)
    pool = make_pool(num_pages, page_size, head_size, dtype, seed=1)
    original = pool.clone()

    max_keep = int(old_lens.max())
    rows = []
    for old_len in old_lens.tolist():
        count = int(torch.randint(0, old_len + 1, (1,), generator=generator))
        rows.append(sorted(torch.randperm(old_len, generator=generator)[:count].tolist()))
    keep, counts = padded(rows, max_keep, shuffle=False)
    plan = plan_hole_filling_moves(keep.to(device), counts.to(device))
    src = positions_to_slots(page_rows.to(device), plan.src_positions, page_size)
    dst = positions_to_slots(page_rows.to(device), plan.dst_positions, page_size)
    pool = pool.to(device)
    move_kv(pool, src.flatten(), dst.flatten(), use_triton=use_triton)  # padded -1 entries skip

    pool, original = pool.cpu(), original
    metadata = torch.arange(max_keep * 10).repeat(len(rows), 1)  # e.g. original positions
    moved_metadata = metadata.gather(1, plan.source_of_new_position.cpu().clamp_min(0))
    for n, row in enumerate(rows):
        source = plan.source_of_new_position[n].cpu()
        for new_pos in range(len(row)):
            old_pos = int(source[new_pos])
            assert old_pos in row
            assert int(moved_metadata[n, new_pos]) == old_pos
            new_page, old_page = int(page_rows[n, new_pos // page_size]), int(
                page_rows[n, old_pos // page_size]
            )
            assert torch.equal(
                pool[new_page, :, new_pos % page_size], original[old_page, :, old_pos % page_size]
            )
        assert sorted(int(source[p]) for p in range(len(row))) == row
