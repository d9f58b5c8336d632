"""Admission by future page peak: a new prefill runs only when it fits beside what the
running requests will still grow to.

A compressed request resumed after preemption recomputes its prompt uncompressed, so
preempting one to make room costs far more pages and compute than it freed. vLLM admits a
prompt whenever its pages are free *now*; the running requests then grow by one token
per row per step and someone is preempted. Here every request is seen as a trajectory of
pages over the coming steps:

- until its prompt completes it holds its whole sequence uncompressed (``held_pages``);
- then its compacted rows (``kept_lengths``) grow by one token per step, for at most
  ``growth_tokens`` tokens (its answer's remaining length, its decode budget's headroom
  and the admission lookahead, whichever is smallest);
- it frees everything when it ends, ``remaining_steps`` after its prompt at the latest.

What a prompt keeps per row is known before its scores only where each row keeps its
layer's budget. Where the policy spreads a total over rows by score (model-wide sharing,
Ada-KV's heads), each row keeping at least its window and rounded up to whole pages, the
request is counted at the worst spread (``budget_spread``); where tensor-parallel ranks
compacted differently, at the rank that holds most at each step. Those are the
trajectory's ``alternatives``: its pages at each step are the most any of them takes.

A prefill is admitted when the peak of the sum over the running requests and itself stays
within the pool. Requests that stop early (EOS) only make the peak lower.

Pages running requests read in shared runs (an adopted entry's whole pages, read in place
by every adopter) are counted once, apart: each trajectory counts its request's own pages,
and the pool they must fit in is what the read pages leave. Read pages never grow and are
freed only when their last reader ends, so counting them as held throughout is an upper
bound.

The check runs every step over the whole running set, so it reads it in one batch
(``AdmissionPlanner.trajectories``): the decoding requests' pages come from the page
manager's ``page_fill`` without per-row work, and the peak is summed over ranges of steps.
``trajectory`` and ``Trajectory`` state the same per request, one by one.

No vLLM imports: the planner reads requests through the attributes it names.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from kvcompress.engine.sched.budget_spread import worst_spreads
from kvcompress.paging import PageManager, ShardedPageManager
from kvcompress.paging.page_table import fill_of_lengths, most_of_fills, pages_for_lengths
from kvcompress.policies.budgets import layer_budgets
from kvcompress.settings.config import KVCompressionConfig

# What ``trajectories`` reads of every request, in one pass.
_READ_COUNTS = operator.attrgetter("num_tokens", "num_computed_tokens", "num_prompt_tokens",
                                   "max_tokens", "num_output_tokens")


@dataclass(frozen=True)
class Trajectory:
    """One request's pages from now on, in engine steps."""

    held_pages: int  # pages held until the prompt is computed (decoding: pages now)
    prefill_steps: int  # steps until the prompt is computed (0: decoding)
    kept_lengths: np.ndarray  # per growing row: tokens once the prompt is compacted
    growth_tokens: int  # tokens each growing row may still add after that
    remaining_steps: int  # steps after the prompt until the request ends at the latest
    # Pages of rows that do not grow after the prompt (sliding-window rows at their bound),
    # less the pages of its shared runs (counted once for all their readers).
    fixed_pages: int = 0
    # [k, growing rows]: other rows the request may hold instead of ``kept_lengths`` (other
    # ranks' compactions, other spreads of a shared budget); it is counted at the most
    # pages any of them takes at each step.
    alternatives: np.ndarray | None = None

    def fill(self, page_size: int) -> tuple[int, np.ndarray]:
        """``fill_of_lengths`` of the growing rows, at each growth the most any outcome
        takes."""
        outcomes = self.kept_lengths[None]
        if self.alternatives is not None:
            outcomes = np.concatenate([outcomes, self.alternatives])
        pages, free_below = most_of_fills(*fill_of_lengths(outcomes, page_size))
        return int(pages), free_below


@dataclass(frozen=True)
class Trajectories:
    """Many requests' trajectories, entry ``i`` for request ``i``: ``Trajectory``'s numbers
    as arrays, with the growing rows reduced to what their growth costs (``fill_of_lengths``)."""

    held_pages: np.ndarray  # [n]
    prefill_steps: np.ndarray  # [n]
    growth_tokens: np.ndarray  # [n]
    remaining_steps: np.ndarray  # [n]
    kept_pages: np.ndarray  # [n] pages once the prompt is compacted, fixed pages included
    free_below: np.ndarray  # [n, page_size + 1], see fill_of_lengths
    growing_rows: int

    @classmethod
    def stack(cls, trajectories: Sequence[Trajectory], page_size: int) -> Trajectories:
        """At least one trajectory (the number of growing rows comes from them)."""
        def column(name: str) -> np.ndarray:
            return np.array([getattr(t, name) for t in trajectories], dtype=np.int64)

        fills = [t.fill(page_size) for t in trajectories]
        kept = np.array([pages + t.fixed_pages for (pages, _), t in zip(fills, trajectories)],
                        dtype=np.int64)
        return cls(column("held_pages"), column("prefill_steps"), column("growth_tokens"),
                   column("remaining_steps"), kept,
                   np.stack([free_below for _, free_below in fills]),
                   len(trajectories[0].kept_lengths))

    @classmethod
    def concat(cls, parts: Sequence[Trajectories]) -> Trajectories:
        return cls(*(np.concatenate([getattr(part, f.name) for part in parts])
                     for f in fields(cls) if f.name != "growing_rows"),
                   growing_rows=parts[0].growing_rows)

    def take(self, order: np.ndarray) -> Trajectories:
        """Entries ``order[0], order[1], ...``."""
        return Trajectories(*(getattr(self, f.name)[order]
                              for f in fields(self) if f.name != "growing_rows"),
                            growing_rows=self.growing_rows)

    def grown_pages(self, grown: np.ndarray) -> np.ndarray:
        """Pages request ``i``'s growing rows gain with ``grown[i]`` more tokens each."""
        page_size = self.free_below.shape[1] - 1
        last_page = self.free_below[np.arange(len(self)), grown % page_size]
        return (grown // page_size) * self.growing_rows + last_page

    def __len__(self) -> int:
        return len(self.held_pages)


def peak_pages(trajectories: Trajectories) -> int:
    """The most pages the requests will hold together at any coming step.

    Between two events (a prompt compacted, a request ended) the total only grows, so the
    peak is at one of the steps right before an event, or now. A request holds
    ``held_pages`` up to its prompt's end ``p``; then ``kept_pages`` and what its rows grew
    until it ends at ``e``: one token a step up to ``q``, then what they reached. Each phase
    is summed over whole ranges of steps at once, so the cost grows with requests + steps,
    not requests x steps.
    """
    t = trajectories
    if not len(t):
        return 0
    page_size = t.free_below.shape[1] - 1
    prefill = t.prefill_steps
    ends = prefill + t.remaining_steps
    grows_until = np.minimum(prefill + t.growth_tokens, ends)
    steps = np.sort(np.concatenate(([0], prefill, ends)))  # a step twice is harmless
    # The phases where a request's pages stay put: (after, until, pages) for its prompt,
    # its compacted rows, and what they grew once they stopped growing.
    total = _sum_over_steps(
        steps,
        np.concatenate((np.full_like(prefill, -1), prefill, grows_until)),
        np.concatenate((prefill, ends, ends)),
        np.concatenate((t.held_pages, t.kept_pages, t.grown_pages(grows_until - prefill))))
    # Still growing (p < step <= q): rows hold step - p tokens more, so which slot of the
    # last page they reach depends on p. Sorted by (p, q), the requests of one p still
    # growing at a step are a run [first, last) of that order (q >= step up to the last of
    # that p): sums over them are differences of prefix sums, for every p and step at once.
    span = int(grows_until.max()) + 2  # p * span + q sorts like (p, q)
    keys = prefill * span + grows_until
    order = np.argsort(keys)
    free_below = np.zeros((len(t) + 1, page_size + 1), dtype=np.int64)
    np.cumsum(t.free_below[order], axis=0, out=free_below[1:])
    starts = np.unique(prefill)[:, None]  # [p, 1]: few values, 0 for every decoding request
    keys = keys[order]
    last = np.searchsorted(keys, (starts + 1) * span)
    first = np.minimum(np.searchsorted(keys, starts * span + steps), last)  # [p, steps]
    grown = steps - starts
    slot = grown % page_size
    pages = ((last - first) * (grown // page_size) * t.growing_rows
             + free_below[last, slot] - free_below[first, slot])
    total += np.where(grown > 0, pages, 0).sum(axis=0)
    return int(total.max())


def _sum_over_steps(steps: np.ndarray, after: np.ndarray, until: np.ndarray,
                    values: np.ndarray) -> np.ndarray:
    """For each of the ascending ``steps``: the sum of ``values[r]`` over the ``r`` with
    ``after[r] < step <= until[r]`` (``after <= until``)."""
    changes = np.zeros(len(steps) + 1, dtype=np.int64)
    np.add.at(changes, np.searchsorted(steps, after, side="right"), values)
    np.subtract.at(changes, np.searchsorted(steps, until, side="right"), values)
    return np.cumsum(changes[:-1])


class AdmissionPlanner:
    """Decides, in pages, whether a waiting request may start its prefill now.

    ``lookahead`` caps the decode growth reserved per request (0: admit whenever the pages
    are free now, as vLLM does); ``running`` returns the scheduler's running requests.
    """

    def __init__(
        self,
        pages: PageManager | ShardedPageManager,
        engine_config: KVCompressionConfig,
        *,
        max_model_len: int,
        max_num_batched_tokens: int,
        lookahead: int,
        running: Callable[[], Iterable[Any]],
    ) -> None:
        self.pages = pages
        self.engine_config = engine_config
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead
        self.running = running
        self._configs: dict[str, KVCompressionConfig] = {}

    def admits(self, request: Any, reserve_pages: int = 0,
               adoption: tuple[int, np.ndarray, int] | None = None) -> bool:
        """``adoption``: (logical tokens, per-row physical tokens, pages of it running
        requests read already) the request is about to adopt from a cached entry (it is
        admitted before it adopts)."""
        if self.lookahead == 0:
            return True
        request_id = request.request_id
        others = [r for r in self.running() if r.request_id != request_id]
        if not others:
            return True  # alone it only has to fit now, which the caller checks
        planned = Trajectories.concat([
            self.trajectories(others),
            Trajectories.stack([self.trajectory(request, adoption)], self.pages.layout.page_size),
        ])
        return peak_pages(planned) <= (self.pages.total_pages - reserve_pages
                                       - self.pages.num_read)

    def trajectories(self, requests: Sequence[Any]) -> Trajectories:
        """``trajectory`` of each request, as arrays. Most of a running set decodes: those
        are read from the page manager in one batch (admission runs every step, over
        hundreds of requests), the rest one by one."""
        count = len(requests)
        request_ids = [r.request_id for r in requests]
        scalars = np.fromiter(itertools.chain.from_iterable(map(_READ_COUNTS, requests)),
                              dtype=np.int64, count=count * 5).reshape(count, 5)
        tokens, computed, prompt_len = scalars[:, :3].T
        tokens = np.minimum(tokens, self.max_model_len)
        known = self.pages.request_ids()
        paged = np.array([request_id in known for request_id in request_ids], dtype=bool)
        # What ``trajectory`` calls decoding.
        is_decoding = (tokens - computed <= 1) & (computed >= prompt_len) & paged
        decoding = np.flatnonzero(is_decoding)
        others = np.flatnonzero(~is_decoding)

        decoding_ids = list(itertools.compress(request_ids, is_decoding))
        fill = self.pages.page_fill(decoding_ids)
        tokens, computed, prompt_len = tokens[decoding], computed[decoding], prompt_len[decoding]
        max_tokens, num_output = scalars[decoding, 3:].T
        remaining = np.maximum(0, np.minimum(max_tokens - num_output,
                                             self.max_model_len - tokens))
        growth = np.minimum(remaining, self.lookahead)
        self._bound_by_decode_budgets(growth, list(itertools.compress(requests, is_decoding)),
                                      decoding_ids, computed - prompt_len)
        page_size = self.pages.layout.page_size
        shared = self.pages.shared_pages(decoding_ids)  # counted once, in num_read
        parts = [Trajectories(
            fill.owned_pages - shared, np.zeros(len(decoding), dtype=np.int64), growth,
            remaining, fill.full_pages + self._sliding_pages(fill.sliding_lengths) - shared,
            fill.free_below, len(self.pages.layout.compressed_rows))]
        if len(others):
            parts.append(Trajectories.stack([self.trajectory(requests[i]) for i in others],
                                            page_size))
        batch = Trajectories.concat(parts)
        # Entry k of the parts is request order[k]; most often already in order (running
        # requests all decoding, the new one last).
        order = np.concatenate([decoding, others])
        return batch if np.array_equal(order, np.arange(count)) else batch.take(
            np.argsort(order))

    def trajectory(self, request: Any,
                   adoption: tuple[int, np.ndarray, int] | None = None) -> Trajectory:
        """One request's trajectory, whatever its state (``trajectories`` for many), of its
        own pages: the pages of its shared runs are counted once for all their readers
        (``admits``). ``adoption``: what a request not yet admitted will adopt (``admits``)."""
        layout = self.pages.layout
        config = self._config(request)
        tokens = min(request.num_tokens, self.max_model_len)
        computed = request.num_computed_tokens
        prompt_len = request.num_prompt_tokens
        remaining = max(0, min(request.max_tokens - request.num_output_tokens,
                               self.max_model_len - tokens))
        eviction = config.decode_eviction
        request_id = request.request_id
        # Pages of its shared runs, which ``num_read`` counts (or will, once it adopts).
        shared = 0
        if request_id in self.pages:
            shared = int(self.pages.shared_pages([request_id])[0])
        elif adoption is not None:
            shared = adoption[2]
        if tokens - computed <= 1 and computed >= prompt_len and request_id in self.pages:
            # Decoding: its rows as they are now, on each rank.
            outcomes = self.pages.physical_lengths_by_rank(request_id)
            generated = computed - prompt_len
            held = self.pages.owned_pages(request_id)
            prefill_steps = 0
        else:
            generated = tokens - prompt_len  # resumed after preemption: outputs kept whole
            if request_id in self.pages:
                adopted = self.pages.adoption(request_id)  # adopted already, or not at all
                adoption = None if adopted is None else (*adopted, shared)
                held = self.pages.owned_pages(request_id) + self.pages.pages_needed_for_sequence(
                    request_id, tokens, self.max_num_batched_tokens)
            elif adoption is not None:
                # To adopt: its rows will hold the adopted tokens and the rest of the prompt.
                held = int(pages_for_lengths(adoption[1] + (tokens - adoption[0]),
                                             layout.page_size).sum())
            else:
                held = self.pages.pages_needed_for_sequence(request_id, tokens,
                                                            self.max_num_batched_tokens)
            if adoption is None:
                outcomes = self._kept_after_prompt(config, prompt_len, generated)
            else:  # the adopted rows stay; only the new part of the prompt is compacted
                hit, adopted_rows, _ = adoption
                outcomes = self._kept_after_prompt(config, prompt_len - hit,
                                                   adopted_rows + generated)
                computed = max(computed, hit)  # vLLM counts the adopted tokens as computed
            prefill_steps = -(-(tokens - computed) // self.max_num_batched_tokens)
        growth = min(remaining, self.lookahead)
        if eviction is not None:
            growth = min(growth, eviction.headroom(generated))
        assert outcomes.shape[1] == layout.num_rows
        sliding = layout.row_windows > 0
        growing = outcomes[:, ~sliding]
        return Trajectory(held - shared, prefill_steps, growing[0], int(growth), remaining,
                          int(self._sliding_pages(outcomes[:, sliding].max(axis=0))) - shared,
                          growing[1:] if len(outcomes) > 1 else None)

    def _sliding_pages(self, sliding_lengths: np.ndarray) -> np.ndarray:
        """Pages of the sliding-window rows (the last axis of ``sliding_lengths``) from now
        on: a decoding sliding row holds at most W - 1 visible tokens, < a page of dead
        slack and the new one, and never grows past that."""
        layout = self.pages.layout
        if not layout.has_sliding_layers:
            return np.zeros(sliding_lengths.shape[:-1], dtype=np.int64)
        windows = layout.row_windows[layout.row_windows > 0]
        bound = windows + layout.page_size - 1
        return pages_for_lengths(np.minimum(sliding_lengths, bound),
                                 layout.page_size).sum(axis=-1)

    def _bound_by_decode_budgets(self, growth: np.ndarray, requests: Sequence[Any],
                                 request_ids: Sequence[str], generated: np.ndarray) -> None:
        """Cap ``growth`` (in place) by each request's decode-budget headroom, one
        vectorized call per distinct eviction setting (most requests share the engine's)."""
        configs = self._configs  # read directly: this runs for every decoding request
        evictions = [(configs.get(request_id) or self._config(r)).decode_eviction
                     for request_id, r in zip(request_ids, requests)]
        distinct = {id(e): e for e in evictions if e is not None}
        for key, eviction in distinct.items():
            rows = np.array([id(e) == key for e in evictions], dtype=bool)
            growth[rows] = np.minimum(growth[rows], eviction.headroom(generated[rows]))

    def prune(self, live_request_ids: Iterable[str]) -> None:
        """Forget the configs of requests that are gone."""
        live = set(live_request_ids)
        for request_id in [r for r in self._configs if r not in live]:
            del self._configs[request_id]

    def _config(self, request: Any) -> KVCompressionConfig:
        config = self._configs.get(request.request_id)
        if config is None:
            extra_args = getattr(request.sampling_params, "extra_args", None)
            config = self.engine_config.with_request_overrides(extra_args)
            self._configs[request.request_id] = config
        return config

    def _kept_after_prompt(self, config: KVCompressionConfig, prompt_len: int,
                           offsets: np.ndarray | int) -> np.ndarray:
        """``[outcomes, rows]``: per-row tokens once the prompt is compacted, ``offsets``
        (what the rows hold besides: adopted context, generated tokens) included. The first
        outcome keeps the layer budgets; where the policy spreads a total over rows by
        score, the worst spreads follow (``budget_spread``). A score threshold keeps a
        number no one knows before the scores: under a budget or ratio the budgets bound
        it, without one the whole prompt is counted (the worker's report of what it kept
        frees the rest after the step, as for every compaction)."""
        layout = self.pages.layout
        heads = layout.num_kv_heads
        offsets = np.broadcast_to(np.asarray(offsets, dtype=np.int64), (layout.num_rows,))
        kept = np.full(layout.num_layers, prompt_len, dtype=np.int64)
        layers = layout.compressed_layers  # sliding-window layers: not the policy's
        if not (layers and config.compresses(prompt_len) and config.policy.capped):
            return (np.repeat(kept, heads) + offsets)[None]
        policy = config.policy
        per_layer = np.minimum(np.asarray(layer_budgets(
            config.method, len(layers), prompt_len, config.budget, config.ratio, config.window,
            config.beta, policy.budget_shape), dtype=np.int64), prompt_len)
        kept[list(layers)] = per_layer
        budgets = np.repeat(kept, heads) + offsets
        if policy.budget_sharing == "model":  # (auto: a window-scored prompt shares less)
            totals = np.array([heads * per_layer.sum()])
        elif policy.compression_method.shares_layer_budget:
            totals = heads * per_layer
        else:
            return budgets[None]  # every row keeps its layer's budget
        # Each row keeps its window (Ada-KV's head floor is more: counted at the window).
        floors = np.full(len(totals), min(config.window, prompt_len))
        rows = layout.compressed_rows
        spreads = np.repeat(budgets[None], layout.page_size, axis=0)
        spreads[:, rows] = worst_spreads(offsets[rows].reshape(len(totals), -1), floors,
                                         prompt_len, totals, layout.page_size)
        return np.concatenate([budgets[None], spreads])
