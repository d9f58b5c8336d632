"""PageFormat's reads against its own token-level view, in both K layouts."""

from __future__ import annotations

import pytest
import torch

from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT


@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, GPU_PAGE_FORMAT],
                         ids=["cpu", "gpu"])
def test_key_pages_are_each_pages_keys_dimension_major(page_format):
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(11, 2, 4, 8, generator=generator)
    pages = torch.tensor([[3, 0, 7], [10, 3, 1]])
    keys = page_format.gather_key_pages(pool, pages)  # [2, 3, D, page]
    assert keys.shape == (2, 3, 8, 4)
    by_token = page_format.key_view(pool)  # [page, token, D]
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(keys[i, j], by_token[pages[i, j]].T, rtol=0, atol=0)


@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, GPU_PAGE_FORMAT],
                         ids=["cpu", "gpu"])
def test_gathered_keys_are_each_rows_first_tokens_dimension_major(page_format):
    generator = torch.Generator().manual_seed(1)
    pool = torch.randn(11, 2, 4, 8, generator=generator)
    tables = torch.tensor([[3, 0, 7, 9], [10, 3, 1, 2]])  # the last page is past 10 tokens
    keys = page_format.gather_keys(pool, tables, 10)
    assert keys.shape == (2, 8, 10)
    by_token = page_format.key_view(pool)
    for row in range(2):
        want = torch.cat([by_token[page] for page in tables[row, :3]])[:10]  # [10, D]
        torch.testing.assert_close(keys[row], want.T, rtol=0, atol=0)
