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
from kvcompress.engine.kv_state import RequestKV, StepBatch, WorkerKVState
from kvcompress.engine.messages import Compaction
from kvcompress.kernels.hole_filling import plan_hole_filling_moves
from kvcompress.policies import plan_keep

SCORELESS_METHODS = frozenset({"streamingllm"})


@dataclass
class CompactionStats:
    requests: int = 0
    tokens_moved: int = 0
    tokens_evicted: int = 0
    seconds: float = 0.0


def wants_compression(settings: KVCompressionConfig, prompt_len: int) -> bool:
    """Whether a prompt of this length will be compacted (so its window is scored)."""
    if not settings.enabled:
        return False
    return settings.ratio is not None or prompt_len > (settings.budget or 0)


def compact_completed_prompts(
    state: WorkerKVState,
    step: StepBatch,
    pool: torch.Tensor,
    mover: Any,
    stats: CompactionStats | None = None,
) -> dict[str, Compaction]:
    """Compact every request of ``step.completing_prompt``; requests sharing settings
    are planned together (one policy call per distinct setting).

    ``mover`` copies tokens between slots: a platform kernel with a ``move`` hook (native
    CUDA / Triton on GPU) or a bare PageFormat (torch indexing).
    """
    groups: dict[KVCompressionConfig, list[str]] = defaultdict(list)
    for index in step.completing_prompt:
        request_id = step.req_ids[index]
        settings = state.requests[request_id].settings
        assert settings is not None, "settings are resolved when the step is prepared"
        groups[settings].append(request_id)
    compactions: dict[str, Compaction] = {}
    sources, destinations = [], []
    for settings, req_ids in groups.items():
        requests = [state.requests[request_id] for request_id in req_ids]
        plan = _plan(settings, requests, state.layout.num_layers, state.layout.num_kv_heads)
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
            compactions[request_id] = Compaction(int(request.lengths[0]), new_lengths)
    if not compactions:
        return {}
    # Every move reads before any write, so one batched move is safe; pages are only
    # released (by the scheduler, next step) after it is done.
    src, dst = torch.cat(sources).to(pool.device), torch.cat(destinations).to(pool.device)
    move = getattr(mover, "move", None) or mover.move_tokens
    move(pool, src, dst)
    for request_id, compaction in compactions.items():
        request = state.requests[request_id]
        request.table.truncate(compaction.physical_lengths)
        request.lengths = compaction.physical_lengths.copy()
        request.compressed = True
        request.window_scores = None
    return compactions


def _plan(settings: KVCompressionConfig, requests: list[RequestKV], num_layers: int,
          num_kv_heads: int):
    needs_scores = settings.method not in SCORELESS_METHODS
    return plan_keep(
        settings.method,
        [request.prompt_len for request in requests],
        [request.window_scores for request in requests] if needs_scores else None,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        budget=settings.budget,
        ratio=settings.ratio,
        window=settings.window,
        beta=settings.pyramid_beta,
        pooling=settings.pooling,
        pooling_kernel=settings.pooling_kernel,
        sink_tokens=settings.sink_tokens,
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
    plan = plan_hole_filling_moves(indices, new_lengths)
    rows, src_pos, dst_pos = plan.flat_moves()
    pages = torch.as_tensor(request.table.pages, dtype=torch.long)
    src = pages[rows, src_pos // page_size] * page_size + src_pos % page_size
    dst = pages[rows, dst_pos // page_size] * page_size + dst_pos % page_size
    return src, dst, new_lengths.numpy().astype(np.int64)
