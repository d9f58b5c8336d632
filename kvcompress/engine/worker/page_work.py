"""The page work of a step on the worker before its forward reads the pool: the in-place
compaction of the shared segments the scheduler ordered compacted, then the page copies of
this step's adoptions (``PagedKVRuntime.begin_step``). No vLLM imports."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcompress.device_faults import raise_if_fatal
from kvcompress.engine.worker.moves import MoveBatch, copy_pages
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.log import get_logger
from kvcompress.step import KVMover

logger = get_logger(__name__)


def run_segment_plans(state: WorkerKVState, pool: torch.Tensor, mover: KVMover,
                  orders: dict[str, Any], deltas: dict[str, Any],
                  failures: dict[str, str]) -> dict[str, str]:
    """Compact the segments the scheduler ordered compacted (their plans were kept when
    their requests ended) in place, before anything reads them; forget the others. If
    the moves fail, the requests reading them (those whose tables drop pages in this
    step, and those that adopt any page the moves wrote) fail, the scheduler drops the
    entries holding them (``failures``: the segment, why); the engine goes on. Returns
    the failed readers, why."""
    readers_failed: dict[str, str] = {}
    for request_id, drops in orders.items():
        if drops is None:
            state.parked.pop(request_id, None)
            continue
        parked = state.take_parked(request_id, drops)
        moves = MoveBatch(state.layout.page_size)
        moves.add(request_id, parked.pages, parked.moves)
        try:
            moves.run(pool, mover)
        except Exception as error:
            raise_if_fatal(error, pool.device, "compacting a shared segment")
            logger.exception("kvcompress: compacting segment %s failed", request_id)
            # The scheduler drops the entries that hold it (their rows shrank already).
            failures[request_id] = (
                f"compacting the shared prefix in place failed: {error!r}")
            written = np.unique(moves.destination_pages(request_id))
            for reader, delta in deltas.items():
                if delta.removals or adopts_any(delta, written):
                    readers_failed[reader] = (
                        f"compacting the shared prefix it reads failed: {error!r}")
    return readers_failed

def copy_adopted_pages(state: WorkerKVState, pool: torch.Tensor) -> None:
    """Every adoption's page copies in one index copy on the pool; if that fails (and
    may be retried: ``raise_if_fatal``), each request's alone, and those that fail again
    fail their request (reported with the step, ``WorkerKVState.adoption_failures``).
    Re-running a copy is harmless: its sources are a cached entry's partial pages, which
    no copy of the step writes (the scheduler pins them until the step's deltas are
    taken). The entry's whole pages are read in place, not copied."""
    copies = state.take_copies()
    if not copies:
        return
    try:
        copy_pages(pool, np.concatenate([src for src, _ in copies.values()]),
                   np.concatenate([dst for _, dst in copies.values()]))
        return
    except Exception as error:
        raise_if_fatal(error, pool.device, "copying adopted pages")
        logger.exception("kvcompress: copying adopted pages failed; retrying request by "
                         "request")
    for request_id, (src, dst) in copies.items():
        try:
            copy_pages(pool, src, dst)
        except Exception as error:
            raise_if_fatal(error, pool.device, "copying adopted pages")
            logger.exception("kvcompress: copying the adopted pages of request %s failed",
                             request_id)
            state.adoption_failures[request_id] = (
                f"copying the adopted pages failed: {error!r}")


def adopts_any(delta: Any, pages: np.ndarray) -> bool:
    """Whether a fresh table's adopted pages (read in place or copied) include any of
    ``pages``."""
    if not delta.fresh or delta.adopted_lengths is None:
        return False
    adopted = [ids for _, ids in delta.appends]
    if delta.copies is not None:
        adopted.append(np.asarray(delta.copies[0]))
    return any(np.isin(ids, pages).any() for ids in adopted)
