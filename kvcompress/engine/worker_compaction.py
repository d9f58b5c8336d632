"""The compression step: after a forward pass, compact requests whose prompt completed.

For every such request the policy picks the tokens each (layer, KV head) keeps, the
survivors are compacted into the head's first pages (only kept tokens above the new
length move, into the holes below it), and the new per-row lengths are reported to the
scheduler, which frees the trailing pages before the next step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcompress.config import KVCompressionConfig
from kvcompress.engine.messages import Compaction
from kvcompress.engine.worker_state import RequestKV, WorkerKVState
from kvcompress.kernels.hole_filling import plan_hole_filling_moves
from kvcompress.policies import KeepPlan, plan_keep
from kvcompress.step import KVMover, StepBatch


@dataclass
class CompactionStats:
    """Cumulative compression work of one worker (read by benchmarks)."""

    requests: int = 0
    tokens_moved: int = 0
    tokens_evicted: int = 0
    seconds: float = 0.0  # selection + moves, after the forward
    score_seconds: float = 0.0  # observation-window scoring inside attention


def wants_compression(config: KVCompressionConfig, prompt_len: int) -> bool:
    """Whether a prompt of this length will be compacted (so its window is scored)."""
    if not config.enabled:
        return False
    return config.ratio is not None or prompt_len > (config.budget or 0)


def compact_completed_prompts(
    state: WorkerKVState,
    step: StepBatch,
    pool: torch.Tensor,
    mover: KVMover,
    stats: CompactionStats | None = None,
) -> dict[str, Compaction]:
    """Compact every request of ``step.completing_prompt``; requests sharing a config
    are planned together (one policy call per distinct config).

    ``mover`` copies tokens between slots: the platform kernel (native CUDA / Triton on
    GPU) or a bare PageFormat (torch indexing).
    """
    groups: dict[KVCompressionConfig, list[str]] = defaultdict(list)
    for index in step.completing_prompt:
        request_id = step.req_ids[index]
        config = state.requests[request_id].config
        assert config is not None, "configs are resolved when the step is prepared"
        groups[config].append(request_id)
    compactions: dict[str, Compaction] = {}
    sources, destinations = [], []
    logical_after = dict(zip(step.req_ids, step.logical_after.tolist()))
    for config, req_ids in groups.items():
        requests = [state.requests[request_id] for request_id in req_ids]
        plan = _plan(config, requests, state.layout.num_layers, state.layout.num_kv_heads)
        rows = state.layout.num_rows
        for number, (request_id, request) in enumerate(zip(req_ids, requests)):
            counts = plan.counts[number].reshape(rows)
            indices = plan.indices[number].reshape(rows, -1)
            src, dst, new_lengths = _moves_for_request(
                request, counts, indices, state.layout.page_size
            )
            sources.append(src)
            destinations.append(dst)
            if stats is not None:
                stats.requests += 1
                stats.tokens_moved += len(src)
                stats.tokens_evicted += int((request.lengths - new_lengths).sum())
            compactions[request_id] = Compaction(logical_after[request_id], new_lengths)
            request.prompt_kept = counts.numpy().astype(np.int64)
    _apply(state, compactions, sources, destinations, pool, mover)
    for request_id in compactions:
        request = state.requests[request_id]
        request.compressed = True
        request.window_scores = None
    return compactions


def trim_generation_windows(
    state: WorkerKVState,
    step: StepBatch,
    pool: torch.Tensor,
    mover: KVMover,
    stats: CompactionStats | None = None,
) -> dict[str, Compaction]:
    """--kv-decode-window: keep each head's prompt part plus its newest generated tokens.

    Generated tokens sit after the prompt part in generation order, so trimming is an
    order-preserving shift of the newest ``decode_window`` tokens down to the prompt part's end;
    it runs once a head exceeds the window by the margin (amortized cost).
    """
    compactions: dict[str, Compaction] = {}
    sources, destinations = [], []
    page_size = state.layout.page_size
    for index, request_id in enumerate(step.req_ids):
        request = state.requests[request_id]
        config = request.config
        if (config is None or not config.enabled or config.decode_window is None
                or request.prompt_kept is None):
            continue
        decode_window = config.decode_window
        generated = request.lengths - request.prompt_kept
        trimmed = generated > decode_window
        if generated.max() <= decode_window + config.decode_margin:
            continue
        rows = np.nonzero(trimmed)[0]
        offsets = np.arange(decode_window)
        src_pos = (request.lengths[rows] - decode_window)[:, None] + offsets
        dst_pos = request.prompt_kept[rows][:, None] + offsets
        pages = request.table.pages[rows].astype(np.int64)
        row_index = np.arange(len(rows))[:, None]
        src = _slots(pages, row_index, src_pos, page_size)
        dst = _slots(pages, row_index, dst_pos, page_size)
        sources.append(torch.as_tensor(src.reshape(-1), dtype=torch.long))
        destinations.append(torch.as_tensor(dst.reshape(-1), dtype=torch.long))
        new_lengths = np.where(trimmed, request.prompt_kept + decode_window, request.lengths)
        compactions[request_id] = Compaction(int(step.logical_after[index]), new_lengths)
        if stats is not None:
            stats.tokens_moved += int(src.size)
            stats.tokens_evicted += int((request.lengths - new_lengths).sum())
    _apply(state, compactions, sources, destinations, pool, mover)
    return compactions


def _apply(state: WorkerKVState, compactions: dict[str, Compaction], sources: list,
           destinations: list, pool: torch.Tensor, mover: KVMover) -> None:
    """Run the moves, then shrink the tables. Every move reads before any write, so one
    batched move is safe; the scheduler frees the pages only after this step."""
    if not compactions:
        return
    src, dst = torch.cat(sources).to(pool.device), torch.cat(destinations).to(pool.device)
    mover.move(pool, src, dst)
    for request_id, compaction in compactions.items():
        request = state.requests[request_id]
        request.table.truncate(compaction.physical_lengths)
        request.lengths = compaction.physical_lengths.copy()


def _plan(config: KVCompressionConfig, requests: list[RequestKV], num_layers: int,
          num_kv_heads: int) -> KeepPlan:
    policy = config.policy
    needs_scores = policy.compression_method.needs_scores
    return plan_keep(
        policy,
        [request.prompt_len for request in requests],
        [request.window_scores for request in requests] if needs_scores else None,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
    )


def _moves_for_request(
    request: RequestKV, counts: torch.Tensor, indices: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Slots to move for one request, and its new per-row lengths.

    Tokens past the prompt (a request resumed after preemption recomputes its outputs too)
    are all kept: only the prompt is subject to the policy.
    """
    lengths = torch.as_tensor(request.lengths)
    tail = lengths - request.prompt_len  # >= 0, equal in every row
    max_tail = int(tail.max())
    pages = torch.as_tensor(request.table.pages, dtype=torch.long)
    if max_tail:
        width = int(counts.max()) + max_tail
        column = torch.arange(width)[None, :]
        prompt_part = torch.zeros(len(lengths), width, dtype=indices.dtype)
        prompt_part[:, : indices.shape[1]] = indices[:, :width]
        # Each row: its kept prompt positions, then the whole tail after them.
        tail_values = request.prompt_len + (column - counts[:, None])
        is_tail = (column >= counts[:, None]) & (column < (counts + tail)[:, None])
        indices = torch.where(column < counts[:, None], prompt_part,
                              torch.where(is_tail, tail_values, 0))
        new_lengths = counts + tail
        # Keep generated tokens after the prompt part and in order (the decode window
        # relies on it): an order-preserving compaction, only for resumed requests.
        valid = column < new_lengths[:, None]
        moving = valid & (indices != column)
        rows, dst_pos = moving.nonzero(as_tuple=True)
        src_pos = indices[rows, dst_pos]
    else:
        new_lengths = counts
        rows, src_pos, dst_pos = plan_hole_filling_moves(indices, new_lengths).flat_moves()
    src = _slots(pages, rows, src_pos, page_size)
    dst = _slots(pages, rows, dst_pos, page_size)
    return src, dst, new_lengths.numpy().astype(np.int64)


def _slots(pages: Any, rows: Any, positions: Any, page_size: int) -> Any:
    """Pool slots of positions in one request's rows (numpy or torch, broadcasting alike).

    Indexes the page table directly instead of kernels.positions_to_slots, which would first
    gather a whole page-table row for every one of the (many) moves.
    """
    return pages[rows, positions // page_size] * page_size + positions % page_size
