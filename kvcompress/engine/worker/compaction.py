"""The compression step: after a forward pass, compact requests whose prompt completed, and
evict generated tokens of requests over their decode budget.

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
from kvcompress.engine.messages import Compaction, merge_compactions
from kvcompress.engine.worker.host_transfer import to_host
from kvcompress.engine.worker.moves import (
    MoveBatch,
    plan_generated_keep,
    plan_prompt_moves,
    plan_segment_compaction,
)
from kvcompress.engine.worker.state import RequestKV, WorkerKVState
from kvcompress.faults import maybe_fail
from kvcompress.log import get_logger
from kvcompress.paging.page_format import PageFormat
from kvcompress.policies import KeepPlan, PolicySettings, plan_keep_each, pool_scores, rank_union
from kvcompress.policies.decode import DecodeEviction
from kvcompress.policies.plan import PLAN_BYTES_PER_SCORE, model_wide_total, workspace_scores
from kvcompress.policies.selection import PAD_INDEX
from kvcompress.policies.union import UNION_POINT_BYTES, model_wide_union_selection
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import KVMover, StepBatch

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


def compress_step(
    state: WorkerKVState,
    step: StepBatch,
    pool: torch.Tensor,
    mover: KVMover,
    stats: CompactionStats | None = None,
    page_format: PageFormat | None = None,
) -> dict[str, Compaction]:
    """The step's compression after its forward: completed prompts compacted
    (``compact_completed_prompts``), then generated parts over their decode budget evicted
    (``evict_generated_tokens``), with one device->host transfer for all of it.

    The decode evictions of the requests whose prompt did not complete in this step are
    chosen first and come over with the prompts' plans. A request whose prompt completed
    and that already holds more generated tokens than its decode budget allows (resumed
    after preemption) is chosen for after its compaction; it has no decode scores, its
    newest tokens are kept, chosen on the host.
    """
    completing = {step.req_ids[index] for index in step.completing_prompt}
    chosen = _choose_evictions(state, step, pool, mover, page_format, skip=completing)
    compactions = compact_completed_prompts(state, step, pool, mover, stats, along=chosen)
    # Its lengths are final: the prompt's eviction must reach the scheduler too.
    merge_compactions(compactions, evict_generated_tokens(state, step, pool, mover, stats,
                                                          page_format, chosen=chosen))
    return compactions


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
            _record_failure(step, [request_id], "planning the moves", error)
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
    _apply(state, step, compactions, moves, pool, mover)
    compactions.update(deferred)
    for request_id in compactions:
        request = state.requests[request_id]
        request.compressed = True
        request.window_scores = request.query_scores = None
    return compactions


def evict_generated_tokens(
    state: WorkerKVState,
    step: StepBatch,
    pool: torch.Tensor,
    mover: KVMover,
    stats: CompactionStats | None = None,
    page_format: PageFormat | None = None,
    chosen: Sequence[ChosenEviction] = (),
) -> dict[str, Compaction]:
    """--kv-decode-budget: keep each head's prompt part plus ``budget`` of its generated
    tokens once it holds ``budget + interval`` of them (amortized: at most every
    ``interval`` decode steps).

    Generated tokens sit after the prompt part in generation order; the request's decode
    policy picks the kept offsets per row (window: the newest; the others: the newest
    ``recent`` plus older ones by their scores, and rkv by the keys it reads from the pool
    through ``page_format``, by default ``mover`` itself) and they shift down in order. The
    decode scores follow the tokens: h2o's and anchors' kept tokens keep their mass (freed
    offsets restart at zero), snapkv's and rkv's are dropped (the next observation window
    starts afresh). A request
    without usable scores (resumed after preemption: its recomputed outputs were never
    scored) keeps its newest tokens. Failures are recorded in ``step.failures`` as for prompt
    compaction. ``chosen``: evictions already chosen and brought to the host
    (``compress_step``); the other requests' are chosen here and come over in one transfer.
    """
    done = {eviction.request_id for eviction in chosen}
    fresh = _choose_evictions(state, step, pool, mover, page_format, skip=done)
    for eviction, kept_host in zip(fresh, to_host([eviction.kept for eviction in fresh])):
        eviction.kept_host = kept_host
    compactions: dict[str, Compaction] = {}
    # Kept offsets on the scores' device, for requests whose scores follow their tokens.
    carried: dict[str, torch.Tensor] = {}
    moves = MoveBatch(state.layout.page_size)
    # Sliding-window rows bound themselves; the decode budget is for the others.
    rows = state.layout.compressed_rows
    for eviction in [*chosen, *fresh]:
        request_id = eviction.request_id
        request = state.requests[request_id]
        if request_id in step.failures:
            continue
        assert eviction.kept_host is not None
        try:
            # Planned on the host, next to the page tables.
            row_moves, kept_lengths = plan_generated_keep(
                request.lengths[rows], request.prompt_kept[rows], eviction.kept_host.numpy()
            )
        except Exception as error:
            _record_failure(step, [request_id], "planning the decode eviction", error)
            continue
        row_moves.rows = rows[row_moves.rows]
        new_lengths = request.lengths.copy()
        new_lengths[rows] = kept_lengths
        moves.add(request_id, request.table.pages, row_moves)
        compactions[request_id] = Compaction(int(step.logical_after[eviction.index]),
                                             new_lengths, kind="decode")
        if eviction.scored and request.config.decode_eviction.method.carries_scores:
            carried[request_id] = eviction.kept
        if stats is not None:
            stats.tokens_moved += len(row_moves)
            stats.tokens_evicted += int((request.lengths - new_lengths).sum())
    _apply(state, step, compactions, moves, pool, mover)
    for request_id in compactions:
        request = state.requests[request_id]
        kept = carried.get(request_id)
        request.decode_scores, request.anchor_scores = (
            None if kept is None or scores is None
            else _carry_scores(scores, kept, state.layout.compressed_rows)
            for scores in (request.decode_scores, request.anchor_scores)
        )
    return compactions


def _choose_evictions(state: WorkerKVState, step: StepBatch, pool: torch.Tensor,
                      mover: KVMover, page_format: PageFormat | None,
                      skip: set[str]) -> list[ChosenEviction]:
    """The decode evictions due in this step, except those of ``skip``, chosen on the
    scores' device (nothing is read back); a request whose choice fails is recorded in
    ``step.failures``."""
    chosen: list[ChosenEviction] = []
    rows = state.layout.compressed_rows
    for index, request_id in enumerate(step.req_ids):
        request = state.requests[request_id]
        eviction = request.config.decode_eviction if request.config is not None else None
        if (eviction is None or request.prompt_kept is None or request_id in step.failures
                or request_id in skip):
            continue
        generated = request.lengths[rows] - request.prompt_kept[rows]  # host lengths
        if not len(rows) or not eviction.due(int(generated.max())):
            continue
        try:
            maybe_fail("plan", [request.prompt_len])
            keys = (_generated_keys(state, request, rows, int(generated.max()), pool,
                                    page_format or _page_format_of(mover))
                    if eviction.method.needs_keys and request.decode_scores is not None
                    else None)
            kept, scored = _select_generated(eviction, request, generated, rows, keys)
        except Exception as error:
            raise_if_fatal(error, state.device, "choosing the decode eviction")
            _record_failure(step, [request_id], "planning the decode eviction", error)
            continue
        chosen.append(ChosenEviction(index, request_id, kept, scored))
    return chosen


def _select_generated(eviction: DecodeEviction, request: RequestKV, generated: np.ndarray,
                      rows: np.ndarray,
                      keys: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
    """Kept generated offsets ``[len(rows), budget]`` of the compressed ``rows`` (on the
    scores' device), and whether scores chose them (False: the newest were kept). ``keys``
    ``[len(rows), generated, D]``: the rows' generated keys, for methods that read them."""
    count = int(generated.max())
    if int(generated.min()) != count:
        # Every row gets every token and every eviction keeps `budget` in each: never uneven.
        raise ValueError(f"rows hold different numbers of generated tokens "
                         f"({int(generated.min())} to {count})")
    scores = request.decode_scores
    usable = (eviction.method.needs_scores and scores is not None
              and scores.shape[-1] >= count)
    if not usable:
        return eviction.keep(None, len(rows), count), False
    assert scores is not None

    def of_rows(accumulator: torch.Tensor) -> torch.Tensor:
        all_rows = accumulator.reshape(-1, accumulator.shape[-1])
        return (all_rows[:, :count] if len(rows) == all_rows.shape[0]
                else all_rows[torch.as_tensor(rows, device=accumulator.device), :count])

    anchors = request.anchor_scores
    return eviction.keep(of_rows(scores), len(rows), count, keys=keys,
                         anchor_scores=None if anchors is None else of_rows(anchors)), True


def _page_format_of(mover: KVMover) -> PageFormat:
    """The page format the keys are read with: the platform kernel's, or the mover itself
    when it is a bare PageFormat (tests)."""
    page_format = getattr(mover, "page_format", mover)
    if not isinstance(page_format, PageFormat):
        raise TypeError(f"cannot read keys through {type(mover).__name__}: pass page_format")
    return page_format


def _generated_keys(state: WorkerKVState, request: RequestKV, rows: np.ndarray, count: int,
                    pool: torch.Tensor, page_format: PageFormat) -> torch.Tensor:
    """K of the ``count`` generated tokens of each of ``rows``: ``[len(rows), count, D]``
    (they sit in generation order after each row's prompt part). fp8 pages' bytes come back
    decoded, unscaled: a row is one (layer, head), so its keys share one scale, which rkv's
    centred cosine similarities do not see."""
    page_size = state.layout.page_size
    positions = request.prompt_kept[rows][:, None] + np.arange(count)[None, :]
    pages = np.take_along_axis(request.table.pages[rows], positions // page_size, axis=1)
    slots = state.to_device(torch.as_tensor((pages.astype(np.int64) * page_size
                                             + positions % page_size).reshape(-1)))
    keys, _values = page_format.read_tokens(pool, slots)
    return page_format.decode(keys).view(len(rows), count, -1)


def _carry_scores(scores: torch.Tensor, kept: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """``scores [L, H, C]`` rearranged like the tokens: in each compressed row, kept offset
    ``kept[i, j]`` of ``rows[i]`` now sits at ``j``; the offsets freed by the eviction (and
    every other row) restart at zero."""
    flat = scores.reshape(-1, scores.shape[-1])
    index = torch.as_tensor(rows, device=scores.device)
    carried = torch.zeros_like(flat)
    carried[index, : kept.shape[-1]] = flat[index].gather(-1, kept)
    return carried.view_as(scores)


def _apply(state: WorkerKVState, step: CompletingPrompts, compactions: dict[str, Compaction],
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
                _record_failure(step, [request_id], "moving the kept tokens", error)
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
            _record_failure(step, req_ids, "planning the compression", error)
            return []
    planned = []
    for request_id in req_ids:
        try:
            planned += plan_for([request_id])
        except Exception as error:
            raise_if_fatal(error, state.device, "planning the compression")
            _record_failure(step, [request_id], "planning the compression", error)
    return planned


def _record_failure(step: CompletingPrompts, request_ids: list[str], stage: str,
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
