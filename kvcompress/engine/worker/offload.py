"""The offload tier's K/V on the worker: evicted prefix-cache entries' pages, packed per
entry in host memory (``paging.offload_tier`` keeps what they are, on the scheduler).

A save gathers an entry's pages (row order) from the pool into one contiguous tensor and
brings it to the host: one gather and one copy per entry, not one per page. A load scatters
it back onto the fresh pages the scheduler gave the entry. On CUDA the host tensors are
pinned and the copies queued on the current stream: the forward that overwrites a saved
entry's freed pages, or reads a loaded one, is queued after them. On a CPU the gather is
the copy. The orders run in the scheduler's order, after the step's in-place segment
compactions (a restore may be given pages they freed) and before its adoptions' page copies
(which may read a loaded entry's pages). No vLLM imports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvcompress.device_faults import raise_if_fatal
from kvcompress.engine import handoff
from kvcompress.engine.worker.page_work import adopts_any
from kvcompress.log import get_logger
from kvcompress.paging.offload_tier import TierOrder
from kvcompress.paging.page_format import GPU_PAGE_FORMAT, PageFormat

logger = get_logger(__name__)

# Fault injection for the tests (the value: "save", "load" or "import"), read at each order.
FAULT_ENV = "KVCOMPRESS_TIER_FAULT"


class TierFault(RuntimeError):
    pass


class HostTier:
    """The tier's chunks (``paging.offload_tier``): each a packed tensor of the pages one
    save wrote, in order; tier page ``t`` is row ``t - start`` of the chunk starting at
    ``start``."""

    def __init__(self, handoff_folder: str | None = None, rank: int = 0,
                 page_format: PageFormat = GPU_PAGE_FORMAT) -> None:
        self._chunks: dict[int, torch.Tensor] = {}
        self._starts = np.zeros(0, dtype=np.int64)  # sorted
        # Where a prefill instance's hand-offs are read from (``engine.handoff``), as which
        # tensor-parallel rank, and how this instance's pages lay K/V out (files hold rows).
        self.handoff_folder = handoff_folder
        self.rank = rank
        self.page_format = page_format
        self.imported_bytes = 0

    def __len__(self) -> int:
        """Chunks held."""
        return len(self._chunks)

    def __sizeof__(self) -> int:
        """Bytes of K/V held."""
        return sum(chunk.numel() * chunk.element_size() for chunk in self._chunks.values())

    def run(self, orders: Sequence[TierOrder], pool: torch.Tensor,
            deltas: Mapping[str, Any]) -> tuple[list[int], list[int], dict[str, str]]:
        """Run the step's orders on ``pool``. Returns the chunks lost (a save failed: the
        scheduler drops the entries using them), the entries lost (a load failed: the
        scheduler drops the restored entry) and the requests of this step (``deltas``) that
        adopt a failed load's pages (they fail: those pages hold nothing)."""
        lost_chunks: list[int] = []
        lost_entries: list[int] = []
        readers_failed: dict[str, str] = {}
        for order in orders:
            try:
                if order.kind == "save":
                    self._save(order.key, order.pages, pool)
                elif order.kind == "load":
                    self._load(order.tier_pages, order.pages, pool)
                elif order.kind == "import":
                    self._import(order.source, order.pages, pool)
                else:
                    self._free(order.key)
            except Exception as error:
                raise_if_fatal(error, pool.device, f"offload tier {order.kind}")
                logger.exception("kvcompress: offload tier %s (%d) failed", order.kind,
                                 order.key)
                if order.kind == "save":
                    self._free(order.key)
                    lost_chunks.append(order.key)
                elif order.kind in ("load", "import"):
                    lost_entries.append(order.key)
                    for request_id in [r for r, delta in deltas.items()
                                       if adopts_any(delta, order.pages)]:
                        source = ("the offload tier" if order.kind == "load"
                                  else "its prefill instance's hand-off")
                        readers_failed[request_id] = (
                            f"loading its cached context from {source} failed: {error!r}")
        return lost_chunks, lost_entries, readers_failed

    def _save(self, start: int, pages: np.ndarray, pool: torch.Tensor) -> None:
        _maybe_fail("save")
        index = torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(pool.device)
        packed = pool.index_select(0, index)  # one gather: the chunk, contiguous
        if pool.device.type != "cpu":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)  # (queued before any later write)
            packed = host
        self._chunks[start] = packed
        self._starts = np.sort(np.append(self._starts, start))

    def _load(self, tier_pages: np.ndarray, pages: np.ndarray, pool: torch.Tensor) -> None:
        """Tier pages into pool pages: one gather per chunk they come from (a turn's worth
        of a conversation each), one scatter."""
        _maybe_fail("load")
        tier_pages = np.asarray(tier_pages, dtype=np.int64)
        starts = self._starts[np.searchsorted(self._starts, tier_pages, side="right") - 1]
        parts, order = [], []
        for start in np.unique(starts).tolist():
            chunk = self._chunks.get(start)
            mine = np.flatnonzero(starts == start)
            rows = tier_pages[mine] - start
            if chunk is None or rows.max() >= chunk.shape[0] or rows.min() < 0:
                raise KeyError(f"tier pages {tier_pages[mine][:4].tolist()}... are not held")
            parts.append(chunk[torch.from_numpy(rows)])
            order.append(mine)
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        destination = np.asarray(pages, dtype=np.int64)[np.concatenate(order)]
        index = torch.from_numpy(destination).to(pool.device)
        pool.index_copy_(0, index, packed.to(pool.device, non_blocking=True))

    def _import(self, source: str, pages: np.ndarray, pool: torch.Tensor) -> None:
        """A prefill instance's handed-off rows onto the entry's fresh pages."""
        if self.handoff_folder is None:
            raise RuntimeError("a hand-off import without a hand-off folder")
        try:
            _maybe_fail("import")
        except TierFault:
            handoff.discard_rank(self.handoff_folder, source, self.rank)
            raise
        self.imported_bytes += handoff.load(  # (its file removed, read or not)
            self.handoff_folder, source, self.rank, pages, pool, page_format=self.page_format)

    def _free(self, start: int) -> None:
        if self._chunks.pop(start, None) is not None:
            self._starts = self._starts[self._starts != start]


def _maybe_fail(kind: str) -> None:
    if os.environ.get(FAULT_ENV) == kind:
        raise TierFault(f"injected offload tier {kind} fault ({FAULT_ENV}={kind})")
