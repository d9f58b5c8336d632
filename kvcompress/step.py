"""One engine step with compression on: its stages, and the contract between the worker's
runtime, the attention backend and the platform kernels.

One step, in order (scheduler and workers are separate processes; vLLM carries the two
hand-offs on its own step messages, see ``kvcompress.engine.messages``):

1. admit (scheduler, ``engine/sched/scheduler``): vLLM's scheduler picks the requests; the page
   manager grows every (layer, KV head) row of each by the pages its new tokens need, or
   refuses (vLLM then queues or preempts). Decided in pages.
2. page deltas (scheduler -> worker): the pages appended since the worker last heard ride
   on the SchedulerOutput; the worker's mirror applies them (``WorkerKVState``).
3. write (worker, attention backend, per layer): each new token's K/V goes to its own slot
   in every head's row (``StepBatch.slot_mapping``; ``PlatformKernel.write``).
4. attend + scores (per layer): attention over each head's own pages
   (``PlatformKernel.attend``); on a request's last prefill chunk the observation-window
   queries also add their probabilities into the request's score accumulator
   (``PlatformKernel.accumulate_window_scores``); a decoding request whose decode policy
   scores this step adds its query's probabilities over its generated tokens into its
   decode-score accumulator (``StepBatch.decode_queries``, torch path on every platform).
5. plan (worker, after the forward): the request's policy (``kvcompress.policies``) picks the
   tokens each (layer, KV head) keeps: of the prompt when it completes, of the generated
   part once it outgrows the decode budget.
6. moves: kept tokens above the new length fill the holes below it (prompt), or kept
   generated tokens shift down in order (decode) (``PlatformKernel.move``); nothing is freed
   yet.
7. report (worker -> scheduler): the new per-row lengths ride on the ModelRunnerOutput.
8. free (scheduler): trailing pages return to the free pool before the next step plans.

This module is the leaf both sides import: it holds what one forward pass needs
(``StepBatch``, ``WindowQueries``, ``DecodeQueries``, ``PagedAttentionMetadata``), the
platform kernel's declared interface (``PlatformKernel``), and the lookup by which vLLM's
attention metadata builder finds the runtime of its engine. No vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from kvcompress.device_timing import StageTimer
from kvcompress.paging import PageLayout
from kvcompress.paging.batch_tables import BatchPageTables
from kvcompress.paging.page_format import PageFormat

if TYPE_CHECKING:
    from kvcompress.profile_model.surrogates import ScoreSurrogate


@dataclass
class WindowQueries:
    """Queries of one request that fall inside its observation window in this step."""

    batch_index: int
    first_query: int  # offset within the request's queries in this step
    num_queries: int
    prompt_len: int
    # The request's accumulator [L, H, width] by physical slot of each row: width is the
    # prompt length, or for an adopter of a cached context its longest adopted row plus
    # its new prompt tokens (RequestKV.score_width). Keys past the width are not scored.
    scores: torch.Tensor
    # Whether the whole window is in this step (else earlier chunks already added to scores).
    starts_in_step: bool = True
    # How the query heads of a KV head combine (the request's --kv-gqa-reduce).
    group_reduce: str = "mean"
    # Decode policy 'anchors': a second accumulator like ``scores`` that only the newest
    # ``anchor_steps`` offsets add to (the mass a token gets right after it is written).
    anchor_scores: torch.Tensor | None = None
    anchor_steps: int = 0


@dataclass
class DecodeQueries:
    """A request decoding one token in this step whose decode policy scores it: the query's
    attention over the request's generated tokens is added to ``scores``."""

    batch_index: int
    prompt_len: int
    # The request's accumulator, [L, H, decode budget + interval] fp32 on the device, indexed
    # by generated offset (position - prompt_kept of the row).
    scores: torch.Tensor
    # Host: generated tokens of the longest row once this step's token is in (<= the
    # accumulator's width): how many offsets this step scores.
    num_generated: int
    # How the query heads of a KV head combine (the request's --kv-gqa-reduce).
    group_reduce: str = "mean"
    # Decode policy 'anchors': a second accumulator like ``scores`` that only the newest
    # ``anchor_steps`` offsets add to (the mass a token gets right after it is written).
    anchor_scores: torch.Tensor | None = None
    anchor_steps: int = 0
    # What this step's scores count for: K when only every K-th step is scored
    # (--kv-decode-score-every), so the sampled mass estimates the summed one.
    weight: float = 1.0


@dataclass
class SurrogateTokens:
    """The prompt tokens of one request that its score surrogate scores in this step
    (``--kv-scoring surrogate``): ``num_tokens`` consecutive ones, entries
    ``[first, first + num_tokens)`` of ``SurrogatePlan.token_index``."""

    batch_index: int
    prompt_len: int
    first: int
    num_tokens: int
    # The request's accumulator [L, H, width] by physical slot, as WindowQueries.scores.
    scores: torch.Tensor
    # The slot of the first token, the same in every row (no adopted context); else None
    # and ``slot_base [rows]`` int64 on the device holds it per row.
    first_slot: int | None
    slot_base: torch.Tensor | None = None


@dataclass
class SurrogatePlan:
    """What every layer's surrogate scoring needs, built once per step on the device."""

    surrogate: ScoreSurrogate
    token_index: torch.Tensor  # [N] int64: each scored token's index in the step
    place_features: torch.Tensor  # [N, 4] fp32: surrogates.position_features of each
    entries: list[SurrogateTokens]


# DecodeScoring.reduce_codes: a request's --kv-gqa-reduce by its index here.
GQA_REDUCE_CODES = ("mean", "max", "sum")


@dataclass
class DecodeClassGroup:
    """The scored requests of one page-table class of the step
    (``BatchPageTables.classes[table]``), in plan order."""

    table: int
    numbers: torch.Tensor  # [m] int64 on the device: their requests in the plan, ascending
    positions: torch.Tensor  # [m] int64 on the device: their columns in the class's table
    host_numbers: np.ndarray  # [m] int64: ``numbers`` on the host
    host_pages: np.ndarray  # [L, m] int64: pages each holds over its H rows of each layer


@dataclass
class DecodeScoring:
    """What every layer's decode scoring needs, built once per step on the device
    (``engine.worker.decode_plan``) so that no layer copies from the host or indexes by a mask:
    request ``i`` is ``StepBatch.decode_queries[i]``, ``W`` the most generated offsets any
    of them scores. Ragged: nothing is padded to the longest row; the rows' pages are read
    from the step's own page tables. Each layer writes its scores into ``mass``; ``commit``
    adds them into the accumulators once the forward is done."""

    tokens: torch.Tensor  # [n] int64: each request's query token in the step
    lengths: torch.Tensor  # [L, n, H] int32: each row's keys, this step's token included
    prompt_kept: torch.Tensor  # [L, n, H] int32: each row's prompt part (its first generated key)
    # The requests' --kv-gqa-reduce, or "mixed": then ``reduce_codes [n]`` int64 holds each
    # one's index in GQA_REDUCE_CODES.
    group_reduce: str
    reduce_codes: torch.Tensor | None
    # [n, L, H, W] fp32: this step's scores, zero where not scored (a view of the worker's
    # buffer, kept between steps)
    mass: torch.Tensor
    tables: BatchPageTables  # the step's page tables (the torch pass reads the rows' pages)
    groups: list[DecodeClassGroup]  # the requests by page-table class

    def subset(self, numbers: list[int]) -> DecodeScoring:
        """The plan of requests ``numbers`` only (after some failed), in that order."""
        device = self.tokens.device
        index = torch.as_tensor(numbers, dtype=torch.int64).to(device)
        renumbered = {old: new for new, old in enumerate(numbers)}
        groups = []
        for group in self.groups:
            kept = [member for member, number in enumerate(group.host_numbers.tolist())
                    if number in renumbered]
            if not kept:
                continue
            host = np.array([renumbered[int(group.host_numbers[m])] for m in kept])
            order = np.argsort(host, kind="stable")  # plan order stays ascending
            kept_index = torch.as_tensor(np.asarray(kept)[order]).to(device)
            groups.append(DecodeClassGroup(
                group.table, torch.as_tensor(host[order]).to(device),
                group.positions.index_select(0, kept_index), host[order],
                group.host_pages[:, np.asarray(kept)[order]]))
        return DecodeScoring(
            self.tokens.index_select(0, index), self.lengths.index_select(1, index),
            self.prompt_kept.index_select(1, index), self.group_reduce,
            None if self.reduce_codes is None else self.reduce_codes.index_select(0, index),
            self.mass.index_select(0, index), self.tables, groups)

    def commit(self, decodes: list[DecodeQueries]) -> None:
        """Add this step's scores into each request's accumulator (``decodes[i]`` is request
        ``i``): once per step, not per layer."""
        for number, decode in enumerate(decodes):
            width = decode.num_generated
            decode.scores[:, :, :width].add_(self.mass[number, :, :, :width],
                                             alpha=decode.weight)
            if decode.anchor_scores is not None:
                # Only the newest offsets: evictions keep order, so they are the youngest.
                young = max(0, width - decode.anchor_steps)
                decode.anchor_scores[:, :, young:width].add_(
                    self.mass[number, :, :, young:width], alpha=decode.weight)


@dataclass
class StepBatch:
    """Everything the attention backend needs for one forward pass, in batch order."""

    layout: PageLayout
    req_ids: list[str]
    query_start_loc: list[int]
    num_new_tokens: torch.Tensor  # [R] int64
    lengths_before: torch.Tensor  # [R, rows] int64, before this step's tokens
    tables: BatchPageTables  # every request's page ids, by width class
    slot_mapping: torch.Tensor  # [T, rows] int64, where each new token goes per row
    logical_after: np.ndarray  # [R] vLLM's computed tokens once this step is done
    # Host copies of lengths_before / lengths_after [R, rows]: what host code reads, so no
    # step waits on a device->host copy of what the host computed in the first place.
    host_lengths_before: np.ndarray
    host_lengths_after: np.ndarray
    window_queries: list[WindowQueries] = field(default_factory=list)
    decode_queries: list[DecodeQueries] = field(default_factory=list)
    decode_scoring: DecodeScoring | None = None  # their index tensors, None without any
    # Requests whose prompt completes in this step and need compaction afterwards.
    completing_prompt: list[int] = field(default_factory=list)
    # Prompt tokens scored by a score surrogate in this step (None: none).
    surrogate_plan: SurrogatePlan | None = None
    # Times the attention backend's scoring (observation windows, decode queries,
    # reconstruction passes): the worker's one timer, kept across steps (on CUDA its events
    # are read once the device finished them).
    score_timer: StageTimer = field(default_factory=StageTimer)
    # A reconstruction pass (``engine.worker.reconstruction``): one request, its window entry
    # covering every query, scored by ``attention.reconstruction_scores``; nothing compacts.
    reconstruction: bool = False
    # Requests whose compression failed in this step (request id -> reason): they are not
    # compacted, and the scheduler ends them with an error.
    failures: dict[str, str] = field(default_factory=dict)

    def fail(self, request_ids: list[str], reason: str) -> None:
        for request_id in request_ids:
            self.failures.setdefault(request_id, reason)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def layer_rows(self, layer: int) -> slice:
        heads = self.layout.num_kv_heads
        return slice(layer * heads, (layer + 1) * heads)

    @property
    def lengths_after(self) -> torch.Tensor:
        return self.lengths_before + self.num_new_tokens[:, None]


@dataclass(frozen=True)
class KVScales:
    """One layer's fp8 scales (vLLM's ``layer._k_scale_float`` / ``_v_scale_float``): an fp8
    page element stores ``x / scale``. 1.0 where vLLM has none (a checkpoint without scales);
    unused on pages in the model's dtype."""

    key: float = 1.0
    value: float = 1.0


UNSCALED = KVScales()  # the default: scales of 1 (and pages in the model's dtype ignore them)


@runtime_checkable
class KVMover(Protocol):
    """Copies K and V between pool slots with parallel-move semantics (every source is read
    before any destination is written), whatever the overlap. ``disjoint=True`` is the
    caller's promise that no destination is also a source: a mover may then copy in
    parallel, in place (the fast path of the GPU kernels)."""

    def move(self, pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
             *, disjoint: bool = False) -> None: ...


@runtime_checkable
class PlatformKernel(KVMover, Protocol):
    """The arithmetic of one platform over the page pool (CPU: vLLM's C++ kernel re-indexed;
    GPU: Triton). ``prepare`` runs once per step; its result is handed back to the
    per-layer calls unchanged, so each platform keeps its own launch arguments."""

    page_format: PageFormat

    def prepare(self, step: StepBatch) -> Any: ...

    def write(self, pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, *, kv_scales: KVScales = UNSCALED) -> None:
        """``key``/``value`` ``[T, H, D]`` to per-head ``slots [T, H]``; fp8 pages
        (``page_format.fp8_dtype``) store them divided by the layer's ``kv_scales``."""
        ...

    def attend(self, args: Any, layer: int, query: torch.Tensor, pool: torch.Tensor,
               output: torch.Tensor, scale: float, *, soft_cap: float | None = None,
               sinks: torch.Tensor | None = None, sliding_window: int | None = None,
               kv_scales: KVScales = UNSCALED,
               decode_scoring: DecodeScoring | None = None) -> None:
        """``soft_cap`` / ``sinks [Hq]``: the layer's softmax (``kvcompress.kernels.logits``:
        logit soft-capping, attention-sink logits in the denominator); None: plain softmax.
        ``kv_scales``: the layer's fp8 scales, applied to fp8 pages' K and V.
        ``decode_scoring``: passed only where ``fuses_decode_scores`` said yes; then this
        layer's decode scores go into ``decode_scoring.mass[:, layer]`` from the attention's
        own softmax (as ``attention.decode_scores.score_decode_layer`` computes them).

        ``sliding_window``: the layer's window W (vLLM's ``sliding_window``), None or 0 for
        full attention. Per (request, KV head) row, with the row's own length: its query i
        (0-based among the request's new tokens) sits at row position ``q = len_before + i``
        and sees the positions ``q - W + 1 <= k <= q`` (causal, W keys including itself).
        Positions count within the row, so a row whose leading pages were dropped sees the
        same keys (the mask is shift-invariant)."""
        ...

    def fuses_decode_scores(self, args: Any, plan: DecodeScoring) -> bool:
        """True when ``attend`` writes ``plan``'s scores of a full-attention layer itself
        (no second pass over the keys)."""
        ...

    def accumulate_window_scores(self, args: Any, layer: int, query: torch.Tensor,
                                 key: torch.Tensor | None, pool: torch.Tensor, step: StepBatch,
                                 scale: float, *,
                                 soft_cap: float | None = None,
                                 sinks: torch.Tensor | None = None) -> None:
        """Add ``layer``'s observation-window probabilities (under the layer's softmax) into
        each window's accumulator (``step.window_queries``), its query heads combined as the
        window says (``WindowQueries.group_reduce``); ``key`` is the step's own ``[T, H, D]``
        keys (None: read every key from the pool, as with fp8 pages, whose ``scale``
        already carries the layer's K scale)."""
        ...


@dataclass
class PagedAttentionMetadata:
    """What vLLM's metadata builder hands every attention layer for one step."""

    step: StepBatch
    num_actual_tokens: int
    kernel: PlatformKernel
    kernel_args: Any  # what kernel.prepare(step) returned
    layer_index: dict[str, int]


class StepRuntime(Protocol):
    """The worker-side runtime of one engine, as the attention metadata builder sees it."""

    def build_attention_metadata(self, common: Any) -> PagedAttentionMetadata: ...


# vLLM creates metadata builders with the engine's config but no reference to the runner,
# and several engines may share one process (uniproc executor): key by the config object.
_RUNTIMES: dict[int, StepRuntime] = {}


def runtime_for(vllm_config: Any) -> StepRuntime | None:
    return _RUNTIMES.get(id(vllm_config))


def register_runtime(vllm_config: Any, runtime: StepRuntime | None) -> None:
    if runtime is None:
        _RUNTIMES.pop(id(vllm_config), None)
    else:
        _RUNTIMES[id(vllm_config)] = runtime
