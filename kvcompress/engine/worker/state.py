"""Worker-side mirror of the page tables, and the batch of each step built from it.

The worker holds, per request: the page table (identical to the scheduler's), how many
tokens each (layer, KV head) row physically stores, while its observation window is being
processed, the window-score accumulator, and with h2o / snapkv decode eviction, the
decode-score accumulator. ``prepare_step`` (then ``prepare_decode_scoring``) turns it into the
step's ``kvcompress.step.StepBatch``. No vLLM imports: testable alone.

Multi-turn reuse: a request may start from a cached context (``PageTableDelta.adopted_lengths``):
its rows already hold ``adopted_rows[row]`` physical tokens standing for its first
``adopted_len`` logical ones, vLLM prefills only the rest of the prompt (the *new segment*,
``new_prompt_tokens``), and only that segment is scored and compressed. Pages to copy for an
adoption wait in ``take_copies`` for the runtime, which copies them before the forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from kvcompress.device_timing import StageTimer
from kvcompress.engine.scoring_memory import scores_prompt
from kvcompress.engine.worker.decode_plan import plan_decode_scoring
from kvcompress.engine.worker.moves import RowMoves
from kvcompress.engine.worker.request_kv import ParkedSegment, RequestKV
from kvcompress.paging import HeadPageTable, PageLayout, PageTableDelta
from kvcompress.paging.batch_tables import CLASS_SPREAD, MIN_CLASS_PAGES, PageTableCache
from kvcompress.policies.decode import DecodeEviction
from kvcompress.policies.settings import DEFAULT_GROUP_REDUCE
from kvcompress.profile_model.surrogates import ScoreSurrogate, position_features
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import (
    DecodeQueries,
    StepBatch,
    SurrogatePlan,
    SurrogateTokens,
    WindowQueries,
)


class WorkerKVState:
    """Per-request page tables and lengths on one worker, keyed by request id."""

    def __init__(self, layout: PageLayout, device: torch.device, *,
                 min_class_pages: int = MIN_CLASS_PAGES, class_spread: int = CLASS_SPREAD) -> None:
        """``min_class_pages`` / ``class_spread``: how the step's page tables group requests
        by width (``kvcompress.paging.batch_tables``); tests narrow them to split batches."""
        self.layout = layout
        self.device = device
        self.requests: dict[str, RequestKV] = {}
        self.peak_scored_tokens = 0  # most key slots holding window scores at once
        # Adopters whose adoption failed (id -> reason) until the runtime reports them: they
        # run uncompressed from an empty context and the scheduler ends them.
        self.adoption_failures: dict[str, str] = {}
        # The scoring time of every step it prepares (the attention layers' and the
        # reconstruction passes'), kept across steps: on CUDA it is read once done.
        self.score_timer = StageTimer(device)
        # Adopters' page copies (src, dst page ids, int64) not yet run on the pool.
        self._copies: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # Segment requests' plans, by request id, until run or forgotten.
        self.parked: dict[str, ParkedSegment] = {}
        # The decode scoring's per-step scores (``_step_mass``), kept between steps.
        self._mass_buffer: torch.Tensor | None = None
        self.tables = PageTableCache(layout.num_rows, layout.page_size,
                                     lambda tensor: self.to_device(tensor),
                                     min_class_pages=min_class_pages, class_spread=class_spread)

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.adoption_failures.pop(request_id, None)
            self._copies.pop(request_id, None)

    def take_copies(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The page copies of the adoptions applied since the last call, by request:
        ``(src_page_ids, dst_page_ids)`` int64, ``pool[dst[i]] = pool[src[i]]``, to run
        before the next forward. Checked against the pool and the request's table."""
        copies, self._copies = self._copies, {}
        return copies

    def apply_deltas(self, deltas: Mapping[str, PageTableDelta]) -> None:
        """Mirror the scheduler's page-table changes. A delta that extends a table this worker
        does not hold means the two sides diverged: fail with the request id, never guess."""
        rows = self.layout.num_rows
        for request_id, delta in deltas.items():
            state = self.requests.get(request_id)
            if state is None and not delta.fresh:
                raise RuntimeError(
                    f"request {request_id}: the scheduler extends a page table this worker "
                    "does not hold (scheduler and worker page tables diverged)"
                )
            if delta.fresh:
                state = RequestKV(
                    table=HeadPageTable(rows, self.layout.page_size),
                    lengths=np.zeros(rows, dtype=np.int64),
                )
                self.requests[request_id] = state
                self.adoption_failures.pop(request_id, None)
                self._copies.pop(request_id, None)
            if delta.drops is not None:
                state.table.drop_leading(delta.drops)
                state.lengths = state.lengths - delta.drops.astype(np.int64) * self.layout.page_size
                if (state.lengths < 0).any():
                    raise RuntimeError(
                        f"request {request_id}: the scheduler dropped window pages this "
                        "worker never filled (scheduler and worker page tables diverged)"
                    )
            for counts, page_ids in delta.appends:
                state.table.append(counts, page_ids)
            for start, stop in delta.removals:
                self._drop_compacted(request_id, state, start, stop)
            if delta.fresh and delta.adopted_lengths is not None:
                self._adopt(request_id, state, delta)

    def _drop_compacted(self, request_id: str, state: RequestKV, start: np.ndarray,
                        stop: np.ndarray) -> None:
        """A segment the request reads was compacted in place: its rows lose pages ``[start,
        stop)`` and every slot after them moves down by as many pages (decode scores are
        kept by offset past ``prompt_kept``, so they follow). Only a request out of prefill
        reads a segment compacted (the scheduler waits for it)."""
        if state.window_scores is not None or state.query_scores is not None:
            raise RuntimeError(f"request {request_id}: a segment it reads was compacted while "
                               "its prompt is being scored (scheduler and worker disagree)")
        state.table.drop_between(start, stop)
        tokens = (np.asarray(stop) - np.asarray(start)).astype(np.int64) * self.layout.page_size
        state.lengths = state.lengths - tokens
        if state.adopted_rows is not None:
            state.adopted_rows = state.adopted_rows - tokens
        if state.prompt_kept is not None:
            state.prompt_kept = state.prompt_kept - tokens
        if (state.lengths < 0).any():
            raise RuntimeError(f"request {request_id}: compacted segment pages it never "
                               "filled (scheduler and worker page tables diverged)")

    def fork(self, source_id: str, fork_id: str, tokens: int) -> None:
        """Make the fresh pseudo-request ``fork_id`` (its pages appended by the scheduler) a
        segment of ``source_id``'s first ``tokens`` prompt tokens: their pages are copied
        onto its own before the next forward (``take_copies``; whole pages, the tokens of a
        last partial one past ``tokens`` are never read), their scores taken over, and it
        is planned as a segment request's prompt once ``source_id`` is compacted. The source
        must hold its prompt uncompacted, without an adopted context."""
        source, fork = self.requests[source_id], self.requests[fork_id]
        page_size = self.layout.page_size
        pages = -(-tokens // page_size)
        if (source.compressed or source.adopted_rows is not None
                or (source.lengths < tokens).any() or (fork.table.num_pages != pages).any()):
            raise RuntimeError(f"fork {fork_id} of {source_id}: the rows do not hold "
                               f"{tokens} uncompacted tokens (scheduler and worker diverged)")
        per_row = np.full(self.layout.num_rows, pages, dtype=np.int32)
        self._copies[fork_id] = (source.table.leading_pages(per_row).astype(np.int64),
                                 fork.table.all_pages().astype(np.int64))
        fork.lengths = np.full_like(source.lengths, tokens)
        fork.prompt_len = tokens
        fork.config = source.config
        fork.query_agnostic = source.query_agnostic
        fork.is_segment = True
        fork.readers_after = source.prompt_len - tokens
        for name in ("window_scores", "query_scores"):
            scores = getattr(source, name)
            setattr(fork, name, None if scores is None else scores[..., :tokens].clone())

    def park_segment(self, request_id: str, moves: RowMoves, drops: np.ndarray) -> None:
        """Keep a segment request's plan after it ends (``ParkedSegment``)."""
        request = self.requests[request_id]
        self.parked[request_id] = ParkedSegment(request.table.pages.copy(), moves,
                                                np.asarray(drops, dtype=np.int32))

    def take_parked(self, request_id: str, drops: np.ndarray) -> ParkedSegment:
        """The plan the scheduler ordered run, checked against the pages it drops."""
        parked = self.parked.pop(request_id, None)
        if parked is None or not np.array_equal(parked.drops, np.asarray(drops)):
            raise RuntimeError(f"segment {request_id}: the scheduler runs a plan this worker "
                               "does not hold (scheduler and worker diverged)")
        return parked

    def _adopt(self, request_id: str, state: RequestKV, delta: PageTableDelta) -> None:
        """Start a fresh request from a cached context. A malformed adoption fails only this
        request (``adoption_failures``): it keeps an empty context meanwhile."""
        problem = _adoption_problem(state, delta, self.layout)
        if problem is not None:
            self.adoption_failures[request_id] = f"adopting a cached context failed: {problem}"
            return
        state.lengths = np.asarray(delta.adopted_lengths, dtype=np.int64).copy()
        state.adopted_len = int(delta.adopted_len)
        state.adopted_rows = state.lengths.copy()
        if delta.copies is not None and len(delta.copies[0]):
            src, dst = (np.asarray(ids, dtype=np.int64) for ids in delta.copies)
            self._copies[request_id] = (src, dst)

    def prepare_step(
        self,
        req_ids: Sequence[str],
        num_new_tokens: np.ndarray,
        num_computed_before: np.ndarray,
        prompt_lens: np.ndarray,
        observation_windows: Sequence[int],
        wants_compression: Sequence[bool],
        scored_after_forward: Sequence[bool] | None = None,
        surrogate: ScoreSurrogate | None = None,
        surrogate_scored: Sequence[bool] | None = None,
    ) -> StepBatch:
        """Metadata for one step. ``wants_compression[i]``: request i is to be compacted
        when its prompt completes, so the queries of its last ``observation_windows[i]``
        prompt positions score the prompt, unless ``scored_after_forward[i]``: then a
        reconstruction pass (``worker.reconstruction``) or its query profile
        (``worker.expected``) scores it after the forward, and with hybrid scoring the
        window too; unless ``surrogate_scored[i]``: then ``surrogate`` scores every prompt
        token of its new segment in the step that prefills it (``SurrogatePlan``)."""
        layout = self.layout
        states = [self.requests[request_id] for request_id in req_ids]
        num_new = torch.as_tensor(np.asarray(num_new_tokens, dtype=np.int64))
        lengths_before_np = np.stack([state.lengths for state in states])
        lengths_after_np = lengths_before_np + np.asarray(num_new_tokens)[:, None]
        num_pages = np.stack([state.table.num_pages for state in states])
        needed = (lengths_after_np + layout.page_size - 1) // layout.page_size
        short = np.flatnonzero((needed > num_pages).any(axis=1))
        if len(short):
            raise RuntimeError(
                f"request {req_ids[short[0]]}: no page reserved for its new tokens "
                f"(scheduler and worker page tables disagree)"
            )
        query_start_loc = np.concatenate([[0], np.cumsum(num_new_tokens)]).tolist()
        tables = self.tables.build(req_ids, [state.table for state in states], query_start_loc,
                                   num_pages.max(axis=1))
        lengths_before = torch.as_tensor(lengths_before_np)
        slot_mapping = self.tables.slot_mapping(tables, lengths_before_np,
                                                np.asarray(num_new_tokens, dtype=np.int64))

        window_queries: list[WindowQueries] = []
        completing: list[int] = []
        surrogate_tokens: list[SurrogateTokens] = []
        for index, state in enumerate(states):
            prompt_len = int(prompt_lens[index])
            start = int(num_computed_before[index])
            stop = start + int(num_new_tokens[index])
            if state.prompt_len != prompt_len:
                state.prompt_len = prompt_len
            if state.compressed or not wants_compression[index]:
                continue
            if start < prompt_len <= stop:
                completing.append(index)
            new_prompt = state.new_prompt_tokens(prompt_len)
            if state.config is not None and not scores_prompt(state.config, new_prompt):
                continue  # compacted without window scores (StreamingLLM)
            window_scores = state.window_scores
            if surrogate_scored is not None and surrogate_scored[index]:
                self._add_surrogate_tokens(state, index, start, stop, lengths_before_np[index],
                                           query_start_loc[index], surrogate_tokens)
                if state.config is None or not state.config.scores_window:
                    continue  # scored by the surrogate alone
                # hybrid-surrogate: the window's scores in an accumulator of their own
                if state.query_scores is None:
                    state.query_scores = self._new_accumulator(state)
                window_scores = state.query_scores
            if (scored_after_forward is not None and scored_after_forward[index]
                    and (state.config is None or not state.config.scores_window)):
                continue  # scored after the forward alone
            # An adopter's window lies in its new segment: the adopted queries are gone.
            window_start = max(state.adopted_len, prompt_len - observation_windows[index])
            first = max(start, window_start)
            last = min(stop, prompt_len)
            if first < last:
                if window_scores is None:
                    state.window_scores = window_scores = self._new_accumulator(state)
                window_queries.append(
                    WindowQueries(index, first - start, last - first, prompt_len,
                                  window_scores, starts_in_step=window_start >= start,
                                  group_reduce=_gqa_reduce(state.config))
                )

        surrogate_plan = None
        if surrogate_tokens:
            assert surrogate is not None, "surrogate-scored requests need the surrogate"
            surrogate_plan = self._surrogate_plan(surrogate, surrogate_tokens, query_start_loc,
                                                  num_computed_before)
        if window_queries or surrogate_tokens:  # bounded by the scheduler's ScoringGate
            self.note_scores_held()
        return StepBatch(
            layout=layout,
            req_ids=list(req_ids),
            query_start_loc=query_start_loc,
            num_new_tokens=self.to_device(num_new),
            lengths_before=self.to_device(lengths_before),
            tables=tables,
            slot_mapping=self.to_device(slot_mapping),
            logical_after=np.asarray(num_computed_before, dtype=np.int64)
            + np.asarray(num_new_tokens, dtype=np.int64),
            host_lengths_before=lengths_before_np,
            host_lengths_after=lengths_after_np,
            window_queries=window_queries,
            completing_prompt=completing,
            surrogate_plan=surrogate_plan,
            score_timer=self.score_timer,
        )

    def _add_surrogate_tokens(self, state: RequestKV, index: int, start: int, stop: int,
                              lengths_before: np.ndarray, first_token: int,
                              entries: list[SurrogateTokens]) -> None:
        """The prompt tokens of request ``index``'s new segment among this step's
        ``[start, stop)``: an entry of the step's surrogate plan, the request's
        accumulator allocated on its first chunk."""
        state.query_agnostic = True
        first, last = max(start, state.adopted_len), min(stop, state.prompt_len)
        if first >= last:
            return
        alone = state.config is not None and not state.config.scores_window
        if state.window_scores is None:
            # Scored by the surrogate alone, an adopter's accumulator holds its new tokens
            # only (the adopted ones are never scored): a reader of a whole shared prefix
            # holds its question's scores, not the prefix's (``ScoringGate`` counts alike).
            state.window_scores = self._new_accumulator(
                state, state.new_prompt_tokens(state.prompt_len) if alone else None)
        if alone:  # by position in the new segment: the same in every row
            base = np.full_like(lengths_before, first - state.adopted_len)
        else:
            base = lengths_before + (first - start)  # each row's slot of the first token
        uniform = bool((base == base[0]).all())
        entries.append(SurrogateTokens(
            index, state.prompt_len + state.readers_after, first_token + (first - start),
            last - first,
            state.window_scores, first_slot=int(base[0]) if uniform else None,
            slot_base=None if uniform else self.to_device(torch.from_numpy(base))))

    def _surrogate_plan(self, surrogate: ScoreSurrogate, entries: list[SurrogateTokens],
                        query_start_loc: list[int],
                        num_computed_before: np.ndarray) -> SurrogatePlan:
        """The step's surrogate plan: every entry's tokens and their place features, on the
        device in one copy each; entries renumbered into the plan's token list."""
        tokens, positions, prompts = [], [], []
        offset = 0
        for entry in entries:
            step_offset = entry.first - query_start_loc[entry.batch_index]
            logical = int(num_computed_before[entry.batch_index]) + step_offset
            tokens.append(np.arange(entry.first, entry.first + entry.num_tokens))
            positions.append(np.arange(logical, logical + entry.num_tokens))
            prompts.append(np.full(entry.num_tokens, entry.prompt_len))
            entry.first, offset = offset, offset + entry.num_tokens
        places = position_features(self.to_device(torch.from_numpy(np.concatenate(positions))),
                                   self.to_device(torch.from_numpy(np.concatenate(prompts))))
        return SurrogatePlan(surrogate,
                             self.to_device(torch.from_numpy(np.concatenate(tokens))),
                             places, entries)

    def _new_accumulator(self, state: RequestKV, width: int | None = None) -> torch.Tensor:
        """A zeroed ``[L, H, width]`` fp32 score accumulator on the device (by default
        ``score_width``: by physical slot)."""
        layout = self.layout
        return self.to_device(torch.zeros(layout.num_layers, layout.num_kv_heads,
                                          state.score_width() if width is None else width,
                                          dtype=torch.float32))

    def note_scores_held(self) -> None:
        """Keep ``peak_scored_tokens`` up to date after allocating score accumulators."""
        held = sum(scores.shape[-1] for state in self.requests.values()
                   for scores in (state.window_scores, state.query_scores) if scores is not None)
        self.peak_scored_tokens = max(self.peak_scored_tokens, held)

    def finish_step(self, batch: StepBatch) -> None:
        """The forward wrote every new token: advance the physical lengths, and add the
        step's decode scores into their accumulators."""
        if batch.decode_scoring is not None:
            batch.decode_scoring.commit(batch.decode_queries)
        for index, request_id in enumerate(batch.req_ids):
            request = self.requests[request_id]
            request.lengths = batch.host_lengths_after[index].copy()
            if request.prompt_kept is None and batch.logical_after[index] >= request.prompt_len:
                # Prompt complete and not compacted (yet): every prompt token is kept.
                request.prompt_kept = request.prompt_end()

    def prepare_decode_scoring(self, step: StepBatch) -> None:
        """Fill ``step.decode_queries``: every request decoding one token whose decode policy
        scores this step (h2o: every decode step, or every K-th with
        --kv-decode-score-every K; anchors: every decode step; snapkv, rkv: those of the
        newest --kv-window tokens before an eviction), with its accumulators, allocated on
        first use, and ``step.decode_scoring``: the index tensors every layer reads, copied
        to the device once here."""
        layout = self.layout
        picked: list[tuple[int, RequestKV, int, int]] = []
        for index, request_id in enumerate(step.req_ids):
            request = self.requests[request_id]
            eviction = request.config.decode_eviction if request.config is not None else None
            new_tokens = step.host_lengths_after[index] - step.host_lengths_before[index]
            # prompt_kept is set once the prompt is complete; a single new token after it is
            # a decode step (a resumed request's recompute chunks are not scored).
            if eviction is None or request.prompt_kept is None or new_tokens.max() != 1:
                continue
            generated_after = int((step.host_lengths_after[index] - request.prompt_kept).max())
            every = _score_every(request.config, eviction)
            if not eviction.scores_step(generated_after) or generated_after % every:
                continue
            if request.decode_scores is None:
                request.decode_scores = self.to_device(torch.zeros(
                    layout.num_layers, layout.num_kv_heads, eviction.capacity,
                    dtype=torch.float32,
                ))
            if eviction.method.scores_anchors and request.anchor_scores is None:
                request.anchor_scores = torch.zeros_like(request.decode_scores)
            picked.append((index, request, generated_after, every))
        if not picked:
            return
        step.decode_queries = [
            DecodeQueries(index, request.prompt_len, request.decode_scores, generated_after,
                          group_reduce=_gqa_reduce(request.config), weight=every,
                          anchor_scores=request.anchor_scores,
                          anchor_steps=request.config.decode_eviction.recent)
            for index, request, generated_after, every in picked
        ]
        width = max(decode.num_generated for decode in step.decode_queries)
        capacity = max(request.decode_scores.shape[-1] for _, request, _, _ in picked)
        step.decode_scoring = plan_decode_scoring(
            layout, step, step.decode_queries,
            np.stack([request.prompt_kept for _, request, _, _ in picked]),
            self._step_mass(len(picked), width, capacity), self.to_device)

    def _step_mass(self, count: int, width: int, capacity: int) -> torch.Tensor:
        """The step's zeroed ``[count, L, H, width]`` fp32 scores: a view of a device buffer
        kept between steps (made on the device, never copied from the host), grown to
        ``count`` requests at ``capacity`` offsets when smaller: the decode-score reserve
        counts that much per running request (``engine.scoring_memory``)."""
        shape = (count, self.layout.num_layers, self.layout.num_kv_heads, width)
        needed = count * self.layout.num_layers * self.layout.num_kv_heads
        if self._mass_buffer is None or self._mass_buffer.numel() < needed * width:
            self._mass_buffer = None  # let go of the old one first
            self._mass_buffer = torch.empty(needed * capacity, dtype=torch.float32,
                                            device=self.device)
        return self._mass_buffer[:needed * width].view(shape).zero_()

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host tensor -> the runner's device (the only host->device path of a step)."""
        return tensor.to(self.device)


def _adoption_problem(state: RequestKV, delta: PageTableDelta,
                      layout: PageLayout) -> str | None:
    """Why ``delta``'s adoption cannot be applied to the fresh ``state`` (None: it can)."""
    adopted = np.asarray(delta.adopted_lengths)
    if adopted.shape != (layout.num_rows,) or adopted.dtype.kind not in "iu":
        return (f"expected {layout.num_rows} integer adopted lengths, got "
                f"{adopted.dtype} {list(adopted.shape)}")
    if delta.adopted_len < 1 or (adopted < 0).any() or (adopted > delta.adopted_len).any():
        return (f"adopted lengths {int(adopted.min())}..{int(adopted.max())} do not fit "
                f"{delta.adopted_len} adopted logical tokens")
    if state.table.pages_missing(adopted.astype(np.int64)).any():
        return "the adopted tokens have no pages (scheduler and worker tables disagree)"
    if delta.copies is None:
        return None
    src, dst = (np.asarray(ids) for ids in delta.copies)
    if src.ndim != 1 or src.shape != dst.shape:
        return f"page copies of shapes {list(src.shape)} -> {list(dst.shape)}"
    if len(src) and (min(src.min(), dst.min()) < 0
                     or max(src.max(), dst.max()) >= layout.total_pages):
        return f"page copies outside the pool of {layout.total_pages} pages"
    # A copy may only write the request's own pages, each once, from pages it does not own
    # (a cached entry's): anything else overwrites other tokens or reads half-copied pages.
    own = state.table.all_pages()
    if len(np.unique(dst)) != len(dst) or not np.isin(dst, own).all():
        return "page copies write pages the request does not own"
    if np.isin(src, own).any():
        return "page copies read pages the request itself holds"
    return None


def _score_every(config: KVCompressionConfig, eviction: DecodeEviction) -> int:
    """Decode steps per scored one (--kv-decode-score-every): sampling applies to h2o only
    (``DecodeMethod.samples_scores``); a last-window method (snapkv, rkv) scores its few
    steps each, and anchors every step (its anchor mass goes to the newest offsets only)."""
    return config.decode_score_every if eviction.method.samples_scores else 1


def _gqa_reduce(config: KVCompressionConfig | None) -> str:
    return DEFAULT_GROUP_REDUCE if config is None else config.gqa_reduce
