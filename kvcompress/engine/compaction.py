"""The compression step: after a forward pass, compact requests whose prompt completed.

For every such request the policy picks the tokens each (layer, KV head) keeps, the
survivors are compacted into the head's first pages (only kept tokens above the new
length move, into the holes below it), and the new per-row lengths are reported to the
scheduler, which frees the trailing pages before the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.attention.page_format import PageFormat
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


def wants_compression(config: KVCompressionConfig, prompt_len: int) -> bool:
    """Whether a prompt of this length will be compacted (so its window is scored)."""
    if not config.enabled:
        return False
    return config.ratio is not None or prompt_len > (config.budget or 0)


def compact_completed_prompts(
    state: WorkerKVState,
    step: StepBatch,
    pool: torch.Tensor,
    page_format: PageFormat,
    config: KVCompressionConfig,
    stats: CompactionStats | None = None,
) -> dict[str, Compaction]:
    if not step.completing_prompt:
        return {}
    layout = state.layout
    req_ids = [step.req_ids[index] for index in step.completing_prompt]
    requests = [state.requests[request_id] for request_id in req_ids]
    needs_scores = config.method not in SCORELESS_METHODS
    plan = plan_keep(
        config.method,
        [request.prompt_len for request in requests],
        [request.window_scores for request in requests] if needs_scores else None,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        budget=config.budget,
        ratio=config.ratio,
        window=config.window,
        beta=config.pyramid_beta,
        pooling=config.pooling,
        pooling_kernel=config.pooling_kernel,
        sink_tokens=config.sink_tokens,
    )
    compactions: dict[str, Compaction] = {}
    sources, destinations = [], []
    for number, (request_id, request) in enumerate(zip(req_ids, requests)):
        counts = plan.counts[number].reshape(layout.num_rows)
        indices = plan.indices[number].reshape(layout.num_rows, -1)
        src, dst, new_lengths = _moves_for_request(request, counts, indices, layout.page_size)
        sources.append(src)
        destinations.append(dst)
        logical_len = int(request.lengths[0])
        if stats is not None:
            stats.requests += 1
            stats.tokens_moved += len(src)
            stats.tokens_evicted += int((request.lengths - new_lengths).sum())
        compactions[request_id] = Compaction(logical_len, new_lengths)
    # Every move reads before any write, so one batched move is safe.
    src, dst = torch.cat(sources).to(pool.device), torch.cat(destinations).to(pool.device)
    # A platform kernel passed here moves with its own hook (native CUDA / Triton on GPU);
    # a bare PageFormat moves with torch indexing (what CpuPagedKernel.move does too).
    move = getattr(page_format, "move", None) or page_format.move_tokens
    move(pool, src, dst)
    for request_id, request in zip(req_ids, requests):
        new_lengths = compactions[request_id].physical_lengths
        request.table.truncate(new_lengths)
        request.lengths = new_lengths.copy()
        request.compressed = True
        request.window_scores = None
    return compactions


def _moves_for_request(
    request: RequestKV, counts: torch.Tensor, indices: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Slots to move for one request, and its new per-row lengths.

    Tokens past the prompt (a request resumed after preemption recomputes its outputs too)
    are all kept: only the prompt is subject to the policy.
    """
    lengths = torch.as_tensor(request.lengths)
    tail = lengths - request.prompt_len  # >= 0, equal in every row
    num_rows = len(lengths)
    max_tail = int(tail.max())
    if max_tail:
        extra = request.prompt_len + torch.arange(max_tail)[None, :].expand(num_rows, -1)
        indices = torch.cat([indices[:, : int(counts.max())], extra], dim=1)
        # Place the tail right after each row's kept prompt tokens.
        column = torch.arange(indices.shape[1])[None, :]
        kept_prompt = column < counts[:, None]
        is_tail = (column >= counts[:, None]) & (column < (counts + tail)[:, None])
        tail_values = request.prompt_len + (column - counts[:, None])
        indices = torch.where(kept_prompt, indices, torch.where(is_tail, tail_values, 0))
    new_lengths = counts + tail
    plan = plan_hole_filling_moves(indices, new_lengths)
    rows, src_pos, dst_pos = plan.flat_moves()
    pages = torch.as_tensor(request.table.pages, dtype=torch.long)
    src = pages[rows, src_pos // page_size] * page_size + src_pos % page_size
    dst = pages[rows, dst_pos // page_size] * page_size + dst_pos % page_size
    return src, dst, new_lengths.numpy().astype(np.int64)
