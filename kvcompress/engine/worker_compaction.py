"""The compression step: after a forward pass, compact requests whose prompt completed.

For every such request the policy picks the tokens each (layer, KV head) keeps, the
survivors are compacted into the head's first pages (only kept tokens above the new
length move, into the holes below it), and the new per-row lengths are reported to the
scheduler, which frees the trailing pages before the next step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.config import KVCompressionConfig
from kvcompress.engine.messages import Compaction
from kvcompress.engine.worker_moves import MoveBatch, plan_prompt_moves, plan_window_trim
from kvcompress.engine.worker_state import RequestKV, WorkerKVState
from kvcompress.faults import maybe_fail
from kvcompress.log import get_logger
from kvcompress.policies import KeepPlan, plan_keep
from kvcompress.step import KVMover, StepBatch

logger = get_logger(__name__)


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
    GPU) or a bare PageFormat (torch indexing). A request whose planning fails, or that
    already failed in this step, is left as it is and recorded in ``step.failures``; if the
    moves themselves fail, every request they were for is.
    """
    groups: dict[KVCompressionConfig, list[str]] = defaultdict(list)
    for index in step.completing_prompt:
        request_id = step.req_ids[index]
        if request_id in step.failures:
            continue
        config = state.requests[request_id].config
        assert config is not None, "configs are resolved when the step is prepared"
        groups[config].append(request_id)
    compactions: dict[str, Compaction] = {}
    moves = MoveBatch(state.layout.page_size)
    logical_after = dict(zip(step.req_ids, step.logical_after.tolist()))
    rows = state.layout.num_rows
    for config, req_ids in groups.items():
        for request_id, counts, indices in _plan_isolated(state, config, req_ids, step):
            request = state.requests[request_id]
            try:
                row_moves, new_lengths = plan_prompt_moves(
                    counts.reshape(rows), indices.reshape(rows, -1), request.lengths,
                    request.prompt_len,
                )
            except Exception as error:
                _record_failure(step, [request_id], "planning the moves", error)
                continue
            moves.add(request_id, request.table.pages, row_moves)
            if stats is not None:
                stats.requests += 1
                stats.tokens_moved += len(row_moves)
                stats.tokens_evicted += int((request.lengths - new_lengths).sum())
            compactions[request_id] = Compaction(logical_after[request_id], new_lengths)
            request.prompt_kept = counts.reshape(rows).numpy().astype(np.int64)
    _apply(state, step, compactions, moves, pool, mover)
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
    order-preserving shift of the newest ``decode_window`` tokens down to the prompt part's
    end; it runs once a head exceeds the window by the margin (amortized cost). Failures are
    recorded in ``step.failures`` as for prompt compaction.
    """
    compactions: dict[str, Compaction] = {}
    moves = MoveBatch(state.layout.page_size)
    for index, request_id in enumerate(step.req_ids):
        request = state.requests[request_id]
        config = request.config
        if (config is None or not config.enabled or config.decode_window is None
                or request.prompt_kept is None or request_id in step.failures):
            continue
        generated = request.lengths - request.prompt_kept
        if generated.max() <= config.decode_window + config.decode_margin:
            continue
        try:
            row_moves, new_lengths = plan_window_trim(
                request.lengths, request.prompt_kept, config.decode_window
            )
        except Exception as error:
            _record_failure(step, [request_id], "planning the decode-window trim", error)
            continue
        moves.add(request_id, request.table.pages, row_moves)
        compactions[request_id] = Compaction(int(step.logical_after[index]), new_lengths,
                                             kind="decode")
        if stats is not None:
            stats.tokens_moved += len(row_moves)
            stats.tokens_evicted += int((request.lengths - new_lengths).sum())
    _apply(state, step, compactions, moves, pool, mover)
    return compactions


def _apply(state: WorkerKVState, step: StepBatch, compactions: dict[str, Compaction],
           moves: MoveBatch, pool: torch.Tensor, mover: KVMover) -> None:
    """Run the moves, then shrink the tables; the scheduler frees the pages only after
    this step. If the batched moves fail, each request's run alone and only those that
    fail again fail (re-running a partly done disjoint list is harmless: no source was
    overwritten; an overlapping list is gathered whole before anything is written)."""
    if not compactions:
        return
    try:
        maybe_fail("moves", [state.requests[request_id].prompt_len for request_id in compactions])
        moves.run(pool, mover)
    except Exception:
        logger.exception("kvcompress: moving the kept tokens failed; retrying request by "
                         "request")
        for request_id in list(compactions):
            try:
                maybe_fail("moves", [state.requests[request_id].prompt_len])
                moves.run(pool, mover, [request_id])
            except Exception as error:
                _record_failure(step, [request_id], "moving the kept tokens", error)
                del compactions[request_id]
    for request_id, compaction in compactions.items():
        request = state.requests[request_id]
        request.table.truncate(compaction.physical_lengths)
        request.lengths = compaction.physical_lengths.copy()


def _plan_isolated(
    state: WorkerKVState, config: KVCompressionConfig, req_ids: list[str], step: StepBatch
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(request id, counts, indices) on the host for every request whose planning worked:
    the group in one policy call or, if that fails, each request alone, so that only the
    culprits fail."""
    layout = state.layout

    def plan_for(batch: list[str]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        requests = [state.requests[request_id] for request_id in batch]
        maybe_fail("plan", [request.prompt_len for request in requests])
        # The plan is made where the window scores live (the runner's device); moves are
        # planned on the host, next to the page tables: one transfer per plan.
        plan = _plan(config, requests, layout.num_layers, layout.num_kv_heads).to("cpu")
        return [(request_id, plan.counts[number], plan.indices[number])
                for number, request_id in enumerate(batch)]

    try:
        return plan_for(req_ids)
    except Exception as error:
        if len(req_ids) == 1:
            _record_failure(step, req_ids, "planning the compression", error)
            return []
    planned = []
    for request_id in req_ids:
        try:
            planned += plan_for([request_id])
        except Exception as error:
            _record_failure(step, [request_id], "planning the compression", error)
    return planned


def _record_failure(step: StepBatch, request_ids: list[str], stage: str,
                    error: Exception) -> None:
    logger.exception("kvcompress: %s failed for request(s) %s", stage, request_ids)
    step.fail(request_ids, f"{stage} failed: {error!r}")


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
