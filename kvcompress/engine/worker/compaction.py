"""Prompt compaction: after a forward pass, compact the requests whose prompt completed
(the decode budget's evictions are ``decode_eviction``'s; both run in ``compression``).

For every request whose prompt completed the policy picks the tokens each (layer, KV head)
keeps, the survivors are compacted into the head's first pages (only kept tokens above the
new length move, into the holes below it). A request that adopted a cached context keeps
that context as it is and has only its new prompt tokens planned (the policy's budget for
that many tokens, no attention sinks: those are in the adopted part), so each turn of a
conversation adds at most a budget's worth per head. For every request whose generated
part reached its decode budget plus interval, its decode policy picks the generated tokens
each head keeps and they shift down in order. The plans and choices are made on the scores'
device and come to the host, where the moves are planned, in one transfer per step
(``compress_step``). The new per-row lengths are reported to the scheduler, which frees the
trailing pages before the next step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from kvcompress.device_faults import raise_if_fatal
from kvcompress.engine.messages import Compaction
from kvcompress.engine.worker.host_transfer import to_host
from kvcompress.engine.worker.moves import (
    MoveBatch,
    plan_prompt_moves,
    plan_segment_compaction,
)
from kvcompress.engine.worker.request_kv import RequestKV
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.faults import maybe_fail
from kvcompress.log import get_logger
from kvcompress.policies import KeepPlan, PolicySettings, plan_keep_each, pool_scores, rank_union
from kvcompress.policies.plan import PLAN_BYTES_PER_SCORE, model_wide_total, workspace_scores
from kvcompress.policies.selection import PAD_INDEX
from kvcompress.policies.union import UNION_POINT_BYTES, model_wide_union_selection
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import KVMover

logger = get_logger(__name__)


class CompletingPrompts(Protocol):
    """What compacting prompts reads of a batch: a ``StepBatch``, or the requests whose
    last reconstruction pass ran (``worker.reconstruction.CompletedPasses``)."""

    req_ids: list[str]
    logical_after: np.ndarray
    failures: dict[str, str]

    @property
    def completing_prompt(self) -> list[int]: ...

    def fail(self, request_ids: list[str], reason: str) -> None: ...


@dataclass
class CompactionStats:
    """Cumulative compression work of one worker (read by benchmarks)."""

    requests: int = 0
    tokens_moved: int = 0
    tokens_evicted: int = 0
    seconds: float = 0.0  # selection + moves, after the forward
    score_seconds: float = 0.0  # window and reconstruction scoring inside attention
    # Token-rows of the prompt parts planned (new prompt tokens x compressed rows) and of
    # those kept: their ratio is the measured kept fraction (a score threshold's is
    # data-dependent; benchmarks compare budgets at the same one).
    prompt_rows_planned: int = 0
    prompt_rows_kept: int = 0


@dataclass
class ChosenEviction:
    """A decode eviction chosen on the device: the generated offsets each compressed row of
    the request keeps (``kept``, on the scores' device; ``kept_host`` once brought over) and
    whether scores chose them (False: the newest were kept)."""

    index: int  # in the step's batch
    request_id: str
    kept: torch.Tensor
    scored: bool
    kept_host: torch.Tensor | None = None


def compact_completed_prompts(
    state: WorkerKVState,
    step: CompletingPrompts,
    pool: torch.Tensor,
    mover: KVMover,
    stats: CompactionStats | None = None,
    along: Sequence[ChosenEviction] = (),
) -> dict[str, Compaction]:
    """Compact every request of ``step.completing_prompt``; requests sharing a config
    are planned together (one policy call per distinct config).

    ``mover`` copies tokens between slots: the platform kernel (native CUDA / Triton on
    GPU) or a bare PageFormat (torch indexing). A request whose planning fails, or that
    already failed in this step, is left as it is and recorded in ``step.failures``; if the
    moves themselves fail, every request they were for is. The plans are made on the
    scores' device and come to the host in one transfer, together with the choices of the
    decode evictions ``along`` (``compress_step``).
    """
    # Adopters plan their new segment (other lengths, no sinks): a group of their own; so do
    # prompts a reconstruction scored (``auto`` budget sharing differs for them, see _plan).
    groups: dict[tuple[KVCompressionConfig, bool, bool], list[str]] = defaultdict(list)
    for index in step.completing_prompt:
        request_id = step.req_ids[index]
        if request_id in step.failures:
            continue
        request = state.requests[request_id]
        assert request.config is not None, "configs are resolved when the step is prepared"
        groups[request.config, request.adopted_rows is not None,
               request.query_agnostic].append(request_id)
    planned = [(adopters, request_id, plan)
               for (config, adopters, _query_agnostic), req_ids in groups.items()
               for request_id, plan in _plan_isolated(state, config, req_ids, step, adopters)]
    # The step's one device->host transfer: every request's plan, every chosen eviction. On
    # CUDA its wait is where an asynchronous fault of the step's kernels surfaces: raised.
    host = iter(to_host([*(tensor for *_, plan in planned for tensor in plan),
                         *(eviction.kept for eviction in along)]))
    planned = [(adopters, request_id, (next(host), next(host)))
               for adopters, request_id, _plan_tensors in planned]
    for eviction in along:
        eviction.kept_host = next(host)
    compactions: dict[str, Compaction] = {}
    deferred: dict[str, Compaction] = {}
    moves = MoveBatch(state.layout.page_size)
    logical_after = dict(zip(step.req_ids, step.logical_after.tolist()))
    # Only full-attention rows are planned; sliding-window rows stay as they are.
    rows = state.layout.compressed_rows
    for adopters, request_id, (counts, indices) in planned:
        request = state.requests[request_id]
        counts = counts.reshape(len(rows))
        indices = indices.reshape(len(rows), -1)
        segment_kept = int(counts.sum())
        try:
            if adopters:
                counts, indices = _after_adopted(counts, indices, request.adopted_rows[rows])
            if request.is_segment:
                page_size = state.layout.page_size
                shared = (np.zeros(len(rows), dtype=np.int64) if request.adopted_rows is None
                          else request.adopted_rows[rows] // page_size)
                row_moves, kept_lengths = plan_segment_compaction(
                    counts, indices, request.lengths[rows], shared, page_size)
            else:
                row_moves, kept_lengths = plan_prompt_moves(
                    counts, indices, request.lengths[rows], request.prompt_end()[rows],
                )
        except Exception as error:
            record_failure(step, [request_id], "planning the moves", error)
            continue
        row_moves.rows = rows[row_moves.rows]
        new_lengths = request.lengths.copy()
        new_lengths[rows] = kept_lengths
        if request.is_segment:
            # Run later, once its first readers prefilled over the whole prefix.
            state.park_segment(request_id, row_moves,
                               (request.lengths - new_lengths) // state.layout.page_size)
            deferred[request_id] = Compaction(logical_after[request_id], new_lengths,
                                              kind="deferred")
        else:
            moves.add(request_id, request.table.pages, row_moves)
        if stats is not None:
            stats.requests += 1
            stats.tokens_moved += len(row_moves)
            stats.tokens_evicted += int((request.lengths - new_lengths).sum())
            stats.prompt_rows_planned += (request.new_prompt_tokens(request.prompt_len)
                                          * len(rows))
            stats.prompt_rows_kept += segment_kept
        if request.is_segment:
            continue
        compactions[request_id] = Compaction(logical_after[request_id], new_lengths)
        request.prompt_kept = request.prompt_end()
        request.prompt_kept[rows] = counts.numpy()
    apply_moves(state, step, compactions, moves, pool, mover)
    compactions.update(deferred)
    for request_id in compactions:
        request = state.requests[request_id]
        request.compressed = True
        request.window_scores = request.query_scores = None
    return compactions


def apply_moves(state: WorkerKVState, step: CompletingPrompts, compactions: dict[str, Compaction],
           moves: MoveBatch, pool: torch.Tensor, mover: KVMover) -> None:
    """Run the moves, then shrink the tables; the scheduler frees the pages only after
    this step. If the batched moves fail (and may be retried: ``raise_if_fatal``), each
    request's run alone and only those that fail again fail (re-running a partly done
    disjoint list is harmless: no source was overwritten; an overlapping list is gathered
    whole before anything is written)."""
    if not compactions:
        return
    try:
        maybe_fail("moves", [state.requests[request_id].prompt_len for request_id in compactions])
        moves.run(pool, mover)
    except Exception as error:
        raise_if_fatal(error, state.device, "moving the kept tokens")
        logger.exception("kvcompress: moving the kept tokens failed; retrying request by "
                         "request")
        for request_id in list(compactions):
            try:
                maybe_fail("moves", [state.requests[request_id].prompt_len])
                moves.run(pool, mover, [request_id])
            except Exception as error:
                raise_if_fatal(error, state.device, "moving the kept tokens")
                record_failure(step, [request_id], "moving the kept tokens", error)
                del compactions[request_id]
    for request_id, compaction in compactions.items():
        request = state.requests[request_id]
        request.table.truncate(compaction.physical_lengths)
        request.lengths = compaction.physical_lengths.copy()


def _after_adopted(counts: torch.Tensor, indices: torch.Tensor,
                   adopted: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """An adopter's plan of its new segment (``counts [rows]``, ``indices [rows, K]``
    segment positions) as a plan of its whole rows: every adopted slot ``[0, adopted[row])``
    kept where it is, then the kept segment tokens, which sit after them."""
    adopted_t = torch.as_tensor(adopted, dtype=torch.long)[:, None]
    full_counts = adopted_t[:, 0] + counts
    column = torch.arange(int(full_counts.max()))[None, :]
    if indices.shape[1]:
        segment = indices.gather(1, (column - adopted_t).clamp(0, indices.shape[1] - 1))
    else:  # nothing kept of any segment
        segment = torch.zeros_like(column)
    full = torch.where(column < adopted_t, column,
                       torch.where(column < full_counts[:, None], adopted_t + segment,
                                   PAD_INDEX))
    return full_counts, full


def _shift_to_segment(request: RequestKV) -> None:
    """An adopter's accumulators become ``[L, H, N]`` views of its ``N`` new prompt tokens
    (``_segment_scores``), once: a group's planning retried request by request finds them
    shifted (``N`` wide already)."""
    segment = request.new_prompt_tokens(request.prompt_len)
    if request.window_scores is not None and request.window_scores.shape[-1] != segment:
        request.window_scores = _segment_scores(request, request.window_scores)
    if request.query_scores is not None and request.query_scores.shape[-1] != segment:
        request.query_scores = _segment_scores(request, request.query_scores)


def _keep_compressed_layers(request: RequestKV, layers: tuple[int, ...]) -> None:
    """A model with sliding-window layers: the accumulators become views of the compressed
    ``layers``' scores, moved to the front in place (layer ``layers[i]`` into ``i``, in
    order, so no score is overwritten before it is read): no copy of them all. Once:
    planned again, they are ``len(layers)`` deep already."""
    for name in ("window_scores", "query_scores"):
        scores = getattr(request, name)
        if scores is None or scores.shape[0] == len(layers):
            continue
        for position, layer in enumerate(layers):
            if position != layer:
                scores[position] = scores[layer]
        setattr(request, name, scores[: len(layers)])


def _segment_scores(request: RequestKV, scores: torch.Tensor) -> torch.Tensor:
    """``[L, H, N]`` of an accumulator of an adopter's ``N`` new prompt tokens: row
    ``(l, h)``'s token ``j`` sits at physical slot ``adopted_rows[l, h] + j``. Shifted to
    the row's start in place, a layer at a time, so the temporaries are one layer's (a
    whole copy would grow with the prompt beyond the reserve); the accumulator serves
    nothing else once its request is planned."""
    assert request.adopted_rows is not None
    segment = request.new_prompt_tokens(request.prompt_len)
    first = torch.as_tensor(request.adopted_rows, device=scores.device).view(*scores.shape[:2], 1)
    offsets = torch.arange(segment, device=scores.device)
    for layer in range(scores.shape[0]):
        scores[layer, :, :segment] = scores[layer].gather(-1, first[layer] + offsets)
    return scores[:, :, :segment]


def _request_scores(request: RequestKV, adopters: bool, policy: PolicySettings,
                    hybrid: bool, layers: tuple[int, ...]) -> torch.Tensor:
    """The scores the plan ranks the request's (new) prompt tokens by, over the compressed
    ``layers``: its accumulator, or with ``hybrid`` scoring (some request of the group kept
    its window's scores apart) each accumulator pooled, then the union of their rankings:
    pooling ranks instead would spread the top of either source over everything (under a
    score threshold the larger of the two pooled scores instead). Hybrid scores come
    pooled."""
    if adopters:
        _shift_to_segment(request)
    _keep_compressed_layers(request, layers)
    accumulators = [scores for scores in (request.window_scores, request.query_scores)
                    if scores is not None]
    if not hybrid:
        return accumulators[0]
    prompt = request.new_prompt_tokens(request.prompt_len)
    device = accumulators[0].device
    prefix = torch.tensor(max(0, prompt - policy.window), device=device)

    def combined(layers: slice) -> torch.Tensor:
        pooled = [pool_scores(scores[layers, :, :prompt], policy.pooling,
                              policy.pooling_kernel, lengths=prefix)
                  for scores in accumulators]
        if policy.score_threshold is not None:
            # A token passes if either source's score does: the larger of the two (ranks
            # would lose the scale the threshold is on).
            return torch.maximum(*pooled) if len(pooled) > 1 else pooled[0]
        # Shared model-wide, the ranks must compare across rows too.
        return rank_union(pooled, ranked_dims=3 if policy.budget_sharing == "model" else 1)

    num_layers = accumulators[0].shape[0]
    if policy.budget_sharing == "model" and policy.score_threshold is None:
        if num_layers * accumulators[0].shape[1] * prompt * UNION_BYTES_PER_SCORE <= (
                workspace_scores(accumulators[0].shape[1], prompt) * PLAN_BYTES_PER_SCORE):
            return combined(slice(0, num_layers))  # small enough to rank whole
        return _model_wide_union(accumulators, policy, prompt, prefix)
    # Rows are pooled and ranked apart: one layer at a time, into the one output, so the
    # temporaries are one layer's (the output is reserved: scoring_memory.plan_output_bytes).
    union = torch.empty((num_layers, accumulators[0].shape[1], prompt), device=device)
    for layer in range(num_layers):
        union[layer : layer + 1] = combined(slice(layer, layer + 1))
    return union


# Peak bytes per score of ranking two sources' union whole (``rank_union``, ranked_dims=3:
# two argsorts per source, their float ranks, the stacked maximum; 36 measured on CPU).
UNION_BYTES_PER_SCORE = 40


def _model_wide_union(accumulators: list[torch.Tensor], policy: PolicySettings, prompt: int,
                      prefix: torch.Tensor) -> torch.Tensor:
    """Hybrid scoring shared model-wide, a long prompt: what ``rank_union`` over the
    request's whole ``[L, H, prompt]`` would make the plan keep, found a slice of rows at a
    time (``policies.union``) and given as scores the plan keeps exactly: 1 where kept,
    0 elsewhere. The temporaries fit the planning workspace: slices and the keys gathered
    between the bracket's thresholds of a quarter of it each, the histograms of the
    bracket's points another quarter; the output is reserved (``plan_output_bytes``)."""
    num_layers, heads = accumulators[0].shape[:2]
    device = accumulators[0].device
    workspace = workspace_scores(heads, prompt)
    rows = [scores.reshape(num_layers * heads, scores.shape[-1]) for scores in accumulators]
    rows_at_once = max(1, workspace // 4 // prompt)

    def source_slices() -> Iterator[tuple[int, list[torch.Tensor]]]:
        for first_row in range(0, num_layers * heads, rows_at_once):
            yield first_row * prompt, [
                pool_scores(source[first_row:first_row + rows_at_once, :prompt],
                            policy.pooling, policy.pooling_kernel, lengths=prefix).view(-1)
                for source in rows]

    selection = model_wide_union_selection(
        source_slices, num_layers * heads * prompt,
        model_wide_total(policy, num_layers, heads, prompt), capacity=workspace // 4,
        points=max(1, workspace * PLAN_BYTES_PER_SCORE // 4 // UNION_POINT_BYTES - 2),
        device=device)
    union = torch.empty((num_layers, heads, prompt), device=device)
    flat = union.view(-1)
    for first, pooled in source_slices():
        kept = selection(first, pooled)
        del pooled
        flat[first:first + kept.numel()] = kept
        del kept
    return union


def _plan_isolated(
    state: WorkerKVState, config: KVCompressionConfig, req_ids: list[str],
    step: CompletingPrompts,
    adopters: bool = False,
) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(request id, (counts, indices)) of every request whose planning worked, on the
    scores' device, each plan as wide as its own rows (``policies.plan_keep_each``): the
    group in one policy call or, if that fails, each request alone, so that only the
    culprits fail (``raise_if_fatal``: not after a CUDA fault). ``adopters``: the requests
    adopted cached contexts, their new prompt tokens are planned (positions within that
    segment)."""
    layout = state.layout

    def plan_for(batch: list[str]) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
        requests = [state.requests[request_id] for request_id in batch]
        maybe_fail("plan", [request.prompt_len for request in requests])
        # The plan is made where the window scores live (the runner's device); the caller
        # brings it to the host with the step's other plans.
        plans = _plan(config, requests, layout.compressed_layers, layout.num_kv_heads,
                      adopters)
        return [(request_id, (plan.counts, plan.indices))
                for request_id, plan in zip(batch, plans)]

    try:
        return plan_for(req_ids)
    except Exception as error:
        raise_if_fatal(error, state.device, "planning the compression")
        if len(req_ids) == 1:
            record_failure(step, req_ids, "planning the compression", error)
            return []
    planned = []
    for request_id in req_ids:
        try:
            planned += plan_for([request_id])
        except Exception as error:
            raise_if_fatal(error, state.device, "planning the compression")
            record_failure(step, [request_id], "planning the compression", error)
    return planned


def record_failure(step: CompletingPrompts, request_ids: list[str], stage: str,
                    error: Exception) -> None:
    logger.exception("kvcompress: %s failed for request(s) %s", stage, request_ids)
    step.fail(request_ids, f"{stage} failed: {error!r}")


def _plan(config: KVCompressionConfig, requests: list[RequestKV],
          layers: tuple[int, ...], num_kv_heads: int,
          adopters: bool = False) -> list[KeepPlan]:
    """The policy's plan of each request over the compressed ``layers`` (full attention,
    depth order): their budgets follow the policy's schedule as if they were the only
    layers. ``adopters``: of the requests' new prompt tokens only, without attention sinks
    (the adopted context holds them). One plan per request, as wide as its own rows."""
    policy = config.policy
    if adopters:
        policy = replace(policy, sink_tokens=0)
    if config.budget_sharing == "auto" and not requests[0].query_agnostic:
        # Scored by a window after all (embeddings, a model without scratch pages): auto
        # shares only a reconstruction's scores model-wide. (Groups never mix the two.)
        policy = replace(policy, budget_sharing="layer")
    needs_scores = policy.compression_method.needs_scores
    scores = None
    if needs_scores:
        hybrid = any(request.query_scores is not None for request in requests)
        scores = [_request_scores(request, adopters, policy, hybrid, layers)
                  for request in requests]
        if hybrid:
            policy = replace(policy, pooling="none")  # pooled above
    return plan_keep_each(
        policy,
        [request.new_prompt_tokens(request.prompt_len) for request in requests],
        scores,
        num_layers=len(layers),
        num_kv_heads=num_kv_heads,
    )
