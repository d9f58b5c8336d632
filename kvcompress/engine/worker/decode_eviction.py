"""--kv-decode-budget on the worker: the generated tokens of a request over its decode
budget evicted by its decode policy, chosen on the scores' device and shifted down in order
(``evict_generated_tokens``). No vLLM imports."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvcompress.device_faults import raise_if_fatal
from kvcompress.engine.messages import Compaction
from kvcompress.engine.worker.compaction import (
    ChosenEviction,
    CompactionStats,
    apply_moves,
    record_failure,
)
from kvcompress.engine.worker.host_transfer import to_host
from kvcompress.engine.worker.moves import MoveBatch, plan_generated_keep
from kvcompress.engine.worker.request_kv import RequestKV
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.faults import maybe_fail
from kvcompress.paging.page_format import PageFormat
from kvcompress.policies.decode import DecodeEviction
from kvcompress.step import KVMover, StepBatch


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
    fresh = choose_evictions(state, step, pool, mover, page_format, skip=done)
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
            record_failure(step, [request_id], "planning the decode eviction", error)
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
    apply_moves(state, step, compactions, moves, pool, mover)
    for request_id in compactions:
        request = state.requests[request_id]
        kept = carried.get(request_id)
        request.decode_scores, request.anchor_scores = (
            None if kept is None or scores is None
            else _carry_scores(scores, kept, state.layout.compressed_rows)
            for scores in (request.decode_scores, request.anchor_scores)
        )
    return compactions


def choose_evictions(state: WorkerKVState, step: StepBatch, pool: torch.Tensor,
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
            record_failure(step, [request_id], "planning the decode eviction", error)
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
