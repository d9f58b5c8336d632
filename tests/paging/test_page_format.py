"""PageFormat in every K/V layout: tokens written come back, moves carry both K and V, and
the dimension-major key reads agree with token reads."""

from __future__ import annotations

import pytest
import torch

from kvcompress.paging.page_format import AMX_PAGE_FORMAT, CPU_PAGE_FORMAT, GPU_PAGE_FORMAT

FORMATS = pytest.mark.parametrize("page_format",
                                  [CPU_PAGE_FORMAT, AMX_PAGE_FORMAT, GPU_PAGE_FORMAT],
                                  ids=["cpu", "amx", "gpu"])
PAGES, PAGE_SIZE, HEAD_SIZE = 11, 32, 64  # amx needs multiples of 32


def token_keys(page_format, pool: torch.Tensor) -> torch.Tensor:
    """K of every slot, ``[page, token, D]``, read token by token."""
    keys, _ = page_format.read_tokens(pool, torch.arange(PAGES * PAGE_SIZE))
    return keys.view(PAGES, PAGE_SIZE, HEAD_SIZE)


@FORMATS
def test_written_tokens_read_back_and_moves_carry_k_and_v(page_format):
    generator = torch.Generator().manual_seed(2)
    pool = torch.zeros(PAGES, 2, PAGE_SIZE, HEAD_SIZE)
    slots = torch.randperm(PAGES * PAGE_SIZE, generator=generator)[:50]
    keys, values = torch.randn(2, 50, HEAD_SIZE, generator=generator)
    page_format.write_tokens(pool, keys, values, slots)
    read_keys, read_values = page_format.read_tokens(pool, slots)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    # every written slot's 2 * D values are in the pool once: layouts are permutations
    assert int((pool != 0).sum()) == int((keys != 0).sum() + (values != 0).sum())
    page_format.move(pool, slots[:10], slots[40:])  # overlapping moves read first
    moved_keys, moved_values = page_format.read_tokens(pool, slots[40:])
    assert torch.equal(moved_keys, keys[:10]) and torch.equal(moved_values, values[:10])
    empty_keys, _ = page_format.read_tokens(pool, slots[:0])
    assert empty_keys.shape == (0, HEAD_SIZE)


@FORMATS
def test_key_pages_are_each_pages_keys_dimension_major(page_format):
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(PAGES, 2, PAGE_SIZE, HEAD_SIZE, generator=generator)
    pages = torch.tensor([[3, 0, 7], [10, 3, 1]])
    keys = page_format.gather_key_pages(pool, pages)  # [2, 3, D, page]
    assert keys.shape == (2, 3, HEAD_SIZE, PAGE_SIZE)
    by_token = token_keys(page_format, pool)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(keys[i, j], by_token[pages[i, j]].T, rtol=0, atol=0)


@FORMATS
def test_gathered_keys_are_each_rows_first_tokens_dimension_major(page_format):
    generator = torch.Generator().manual_seed(1)
    pool = torch.randn(PAGES, 2, PAGE_SIZE, HEAD_SIZE, generator=generator)
    tables = torch.tensor([[3, 0, 7, 9], [10, 3, 1, 2]])  # the last page is past 70 tokens
    keys = page_format.gather_keys(pool, tables, 70)
    assert keys.shape == (2, HEAD_SIZE, 70)
    by_token = token_keys(page_format, pool)
    for row in range(2):
        want = torch.cat([by_token[page] for page in tables[row, :3]])[:70]  # [70, D]
        torch.testing.assert_close(keys[row], want.T, rtol=0, atol=0)


@FORMATS
def test_pages_in_the_row_layout_hold_the_same_tokens_and_convert_back(page_format):
    """A hand-off file holds pages in the row layout: read there, a page's tokens are those
    read from it in its own format, and converting back restores its bytes."""
    generator = torch.Generator().manual_seed(3)
    pool = torch.randn(PAGES, 2, PAGE_SIZE, HEAD_SIZE, generator=generator)
    slots = torch.arange(PAGES * PAGE_SIZE)
    rows = page_format.to_row_layout(pool)
    assert rows.shape == pool.shape
    for mine, theirs in zip(page_format.read_tokens(pool, slots),
                            GPU_PAGE_FORMAT.read_tokens(rows, slots), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(page_format.from_row_layout(rows), pool)
    for other in (CPU_PAGE_FORMAT, AMX_PAGE_FORMAT, GPU_PAGE_FORMAT):  # any to any
        converted = other.from_row_layout(rows)
        for mine, theirs in zip(page_format.read_tokens(pool, slots),
                                other.read_tokens(converted, slots), strict=True):
            assert torch.equal(mine, theirs)


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="key_layout must be one of"):
        type(CPU_PAGE_FORMAT)("columns")
