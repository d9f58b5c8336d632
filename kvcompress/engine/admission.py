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

A prefill is admitted when the peak of the sum over the running requests and itself stays
within the pool. Requests that stop early (EOS) only make the peak lower.

No vLLM imports: the planner reads requests through the attributes it names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcompress.config import KVCompressionConfig
from kvcompress.paging import PageManager, ShardedPageManager
from kvcompress.policies.budgets import layer_budgets


@dataclass(frozen=True)
class Trajectory:
    """One request's pages from now on, in engine steps."""

    held_pages: int  # pages held until the prompt is computed (decoding: pages now)
    prefill_steps: int  # steps until the prompt is computed (0: decoding)
    kept_lengths: np.ndarray  # per growing row: tokens once the prompt is compacted
    growth_tokens: int  # tokens each growing row may still add after that
    remaining_steps: int  # steps after the prompt until the request ends at the latest
    # Pages of rows that do not grow after the prompt (sliding-window rows at their bound).
    fixed_pages: int = 0


def growth_pages(kept_lengths: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each request (a row of ``kept_lengths [requests, rows]``): its pages, and
    ``free_below[r]``, how many of its rows have fewer than ``r`` free slots in their last
    page (``r`` in [0, page_size]).

    A row with ``s`` free slots needs ``ceil(max(0, d - s) / page_size)`` new pages after
    ``d`` more tokens, so a request's rows together need ``(d // page_size) * rows +
    free_below[d % page_size]``.
    """
    lengths = np.asarray(kept_lengths, dtype=np.int64)
    count = lengths.shape[0]
    pages = -(-lengths // page_size)
    slack = pages * page_size - lengths
    offsets = (np.arange(count) * page_size)[:, None]
    counts = np.bincount((slack + offsets).ravel(), minlength=count * page_size)
    free_below = np.zeros((count, page_size + 1), dtype=np.int64)
    np.cumsum(counts.reshape(count, page_size), axis=1, out=free_below[:, 1:])
    return pages.sum(axis=1), free_below


def peak_pages(trajectories: Sequence[Trajectory], page_size: int) -> int:
    """The most pages the requests will hold together at any coming step.

    Between two events (a prompt compacted, a request ended) the total only grows, so the
    peak is at one of the steps right before an event, or now. Every trajectory has the same
    number of growing rows.
    """
    if not trajectories:
        return 0
    held = np.array([t.held_pages for t in trajectories], dtype=np.int64)
    prefill = np.array([t.prefill_steps for t in trajectories], dtype=np.int64)
    growth = np.array([t.growth_tokens for t in trajectories], dtype=np.int64)
    ends = prefill + np.array([t.remaining_steps for t in trajectories], dtype=np.int64)
    lengths = np.stack([t.kept_lengths for t in trajectories])
    kept, free_below = growth_pages(lengths, page_size)
    kept = kept + np.array([t.fixed_pages for t in trajectories], dtype=np.int64)
    steps = np.unique(np.concatenate(([0], prefill, ends)))  # [K]
    grown = np.clip(steps[None, :] - prefill[:, None], 0, growth[:, None])  # [n, K]
    added = (grown // page_size) * lengths.shape[1] + np.take_along_axis(
        free_below, grown % page_size, axis=1
    )
    pages = np.where(steps[None, :] <= prefill[:, None], held[:, None], kept[:, None] + added)
    alive = steps[None, :] <= ends[:, None]
    return int((pages * alive).sum(axis=0).max())


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

    def admits(self, request: Any, reserve_pages: int = 0) -> bool:
        if self.lookahead == 0:
            return True
        others = [r for r in self.running() if r.request_id != request.request_id]
        if not others:
            return True  # alone it only has to fit now, which the caller checks
        trajectories = [self.trajectory(r) for r in others]
        trajectories.append(self.trajectory(request))
        limit = self.pages.total_pages - reserve_pages
        return peak_pages(trajectories, self.pages.layout.page_size) <= limit

    def trajectory(self, request: Any) -> Trajectory:
        layout = self.pages.layout
        config = self._config(request)
        tokens = min(request.num_tokens, self.max_model_len)
        computed = request.num_computed_tokens
        prompt_len = request.num_prompt_tokens
        remaining = max(0, min(request.max_tokens - request.num_output_tokens,
                               self.max_model_len - tokens))
        eviction = config.decode_eviction
        request_id = request.request_id
        if tokens - computed <= 1 and computed >= prompt_len and request_id in self.pages:
            # Decoding: its rows as they are now.
            lengths = self.pages.physical_lengths(request_id)
            generated = computed - prompt_len
            held = self.pages.owned_pages(request_id)
            prefill_steps = 0
        else:
            generated = tokens - prompt_len  # resumed after preemption: outputs kept whole
            adoption = self.pages.adoption(request_id)
            if adoption is None:
                lengths = self._kept_after_prompt(config, prompt_len) + generated
            else:  # the adopted rows stay; only the new part of the prompt is compacted
                hit, adopted_rows = adoption
                lengths = adopted_rows + self._kept_after_prompt(config, prompt_len - hit)
                lengths = lengths + generated
            held = self.pages.owned_pages(request_id) + self.pages.pages_needed_for_sequence(
                request_id, tokens, self.max_num_batched_tokens)
            prefill_steps = -(-(tokens - computed) // self.max_num_batched_tokens)
        growth = min(remaining, self.lookahead)
        if eviction is not None:
            growth = min(growth, eviction.headroom(generated))
        assert len(lengths) == layout.num_rows
        fixed = 0
        if layout.has_sliding_layers:
            # A decoding sliding row holds at most W - 1 visible tokens, < a page of dead
            # slack and the new one: it never grows past that.
            sliding = layout.row_windows > 0
            bound = layout.row_windows[sliding] + layout.page_size - 1
            fixed = int((-(-np.minimum(lengths[sliding], bound) // layout.page_size)).sum())
            lengths = lengths[~sliding]
        return Trajectory(held, prefill_steps, lengths, growth, remaining, fixed)

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

    def _kept_after_prompt(self, config: KVCompressionConfig, prompt_len: int) -> np.ndarray:
        """Per-row tokens of the prompt once it is compacted (its layer budgets)."""
        layout = self.pages.layout
        kept = np.full(layout.num_layers, prompt_len, dtype=np.int64)
        layers = layout.compressed_layers  # sliding-window layers: not the policy's
        if layers and config.compresses(prompt_len):
            per_layer = layer_budgets(config.method, len(layers), prompt_len, config.budget,
                                      config.ratio, config.window, config.beta,
                                      config.policy.budget_shape)
            kept[list(layers)] = np.minimum(np.asarray(per_layer, dtype=np.int64), prompt_len)
        return np.repeat(kept, layout.num_kv_heads)
