"""The offload tier's K/V on the worker (``HostTier``): saves pack an entry's new pages into
one chunk, loads gather from every chunk an entry uses and land on fresh pages byte for
byte, frees drop chunks, and a failed order loses only what it touched. On the CPU, and on
CUDA where there is one (pinned host chunks, non-blocking copies)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.engine.worker.offload import FAULT_ENV, HostTier
from kvcompress.paging import PageTableDelta
from kvcompress.paging.offload_tier import TierOrder

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pool_on(device: str, pages: int = 12) -> torch.Tensor:
    """A pool ``[pages, 2, page_size, head_size]`` whose every element says its page."""
    values = torch.arange(pages, dtype=torch.float32)[:, None, None, None]
    return values.expand(pages, 2, 4, 8).contiguous().to(torch.bfloat16).to(device)


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_saved_pages_come_back_from_several_chunks_in_row_order(device):
    pool, tier = pool_on(device), HostTier()
    before = pool.clone()
    # Turn 1 wrote pages 3, 5 (chunk 0: tier pages 0, 1); turn 2 its pages 7, 2 (chunk 2).
    lost = tier.run([TierOrder("save", 0, pages(3, 5)), TierOrder("save", 2, pages(7, 2))],
                    pool, {})
    assert lost == ([], [], {}) and len(tier) == 2
    pool.zero_()  # the pages went to others, who wrote them
    # The entry's rows in order: tier pages 2, 0, 3, 1 onto fresh pages 8, 9, 10, 11.
    tier.run([TierOrder("load", 9, pages(8, 9, 10, 11), pages(2, 0, 3, 1))], pool, {})
    for destination, source in zip((8, 9, 10, 11), (7, 3, 2, 5)):
        assert torch.equal(pool[destination], before[source])
    assert tier.__sizeof__() == 4 * pool[0].numel() * pool.element_size()
    tier.run([TierOrder("free", 0), TierOrder("free", 2)], pool, {})
    assert len(tier) == 0 and tier.__sizeof__() == 0


def test_a_failed_save_loses_its_chunk_and_a_failed_load_its_entry_and_adopters(monkeypatch):
    pool, tier = pool_on("cpu"), HostTier()
    monkeypatch.setenv(FAULT_ENV, "save")
    assert tier.run([TierOrder("save", 0, pages(1, 2))], pool, {})[0] == [0]
    monkeypatch.delenv(FAULT_ENV)
    tier.run([TierOrder("save", 5, pages(3))], pool, {})
    adopter = PageTableDelta(fresh=True, appends=[(np.array([1]), np.array([6]))],
                             adopted_lengths=np.array([4]), adopted_len=4)
    bystander = PageTableDelta(fresh=True, appends=[(np.array([1]), np.array([11]))],
                               adopted_lengths=np.array([4]), adopted_len=4)
    # Entry 4 used the lost chunk's tier page 0: its load fails, its adopter with it.
    lost_chunks, lost_entries, failed = tier.run(
        [TierOrder("load", 4, pages(6, 7), pages(5, 0))], pool,
        {"adopter": adopter, "bystander": bystander})
    assert (lost_chunks, lost_entries, list(failed)) == ([], [4], ["adopter"])
    assert "offload tier" in failed["adopter"]
