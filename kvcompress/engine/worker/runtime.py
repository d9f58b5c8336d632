"""Worker-side paged-KV runtime: the pool, the page-table mirror, per-step metadata and
the compression step, bound to one vLLM model runner.

It runs stages 2-7 of a step (``kvcompress.step``): ``begin_step`` applies the page deltas
and copies the partial pages of adopted cached contexts (multi-turn reuse),
``build_attention_metadata`` prepares the batch the attention layers write and attend
over, ``end_step`` plans, moves and returns the worker's report (compactions, failed
requests, timings). The attention
metadata builder finds it through ``kvcompress.step.runtime_for``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch

from kvcompress.device_faults import raise_if_fatal
from kvcompress.device_timing import StageTimer
from kvcompress.engine import handoff
from kvcompress.engine.handoff import Handoff, Sweeper
from kvcompress.engine.messages import (
    FAILED_ON_ANOTHER_RANK,
    SEGMENT_READERS_AFTER_ARG,
    Compaction,
    DeferredCompactions,
    WorkerReport,
    deferred_compactions,
    page_deltas,
    pass_grants,
    segment_orders,
    tier_orders,
)
from kvcompress.engine.worker.compaction import CompactionStats, compact_completed_prompts
from kvcompress.engine.worker.compression import compress_step
from kvcompress.engine.worker.expected import ExpectedScorer
from kvcompress.engine.worker.offload import HostTier
from kvcompress.engine.worker.page_work import copy_adopted_pages, run_segment_plans
from kvcompress.engine.worker.reconstruction import (
    CompletedPasses,
    ReconstructionPass,
    Reconstructor,
)
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.faults import maybe_fail
from kvcompress.log import get_logger
from kvcompress.paging import PageLayout
from kvcompress.paging.page_table import pages_for_lengths
from kvcompress.profile_model.profiles import QueryProfile
from kvcompress.profile_model.surrogates import ScoreSurrogate
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import PagedAttentionMetadata, PlatformKernel, StepBatch

logger = get_logger(__name__)


class PagedKVRuntime:
    def __init__(
        self,
        config: KVCompressionConfig,
        layout: PageLayout,
        layer_names: list[str],
        kernel: PlatformKernel,
        dtype: torch.dtype,
        device: torch.device,
        rank: int = 0,
        handoff: Handoff | None = None,
        fingerprint: str = "",
    ) -> None:
        """``rank``: the tensor-parallel rank whose KV heads (and pool) this is; ``handoff``:
        this instance's side of a prefill/decode hand-off (``engine.handoff``), whose rows
        must mean the same on both sides (``fingerprint``)."""
        self.config = config
        self.rank = rank
        self.layout = layout
        self.kernel = kernel
        self.layer_index = {name: index for index, name in enumerate(layer_names)}
        # Scratch pages (reconstruction passes) follow the pages the scheduler hands out.
        self.pool = torch.zeros(
            (layout.total_pages + layout.scratch_pages, 2, layout.page_size, layout.head_size),
            dtype=dtype, device=device,
        )
        self.state = WorkerKVState(layout, device)
        self.step: StepBatch | None = None
        # vLLM builds attention metadata once per KV-cache group (a hybrid model has
        # several); every group of a step shares this one.
        self._metadata: PagedAttentionMetadata | None = None
        self.stats = CompactionStats()
        # Device time of the compaction after the forward (CUDA events, read lazily); the
        # scoring's timer is the state's, which every step's attention layers share.
        self.compaction_timer = StageTimer(device)
        # Requests whose own kv_* settings the worker rejected (id -> reason), until reported.
        self.rejected_settings: dict[str, str] = {}
        self._runner: Any = None
        self.reconstructor: Reconstructor | None = None
        self._reconstructing: list[str] = []  # this step's requests scored by a pass
        # Reconstruction passes as scheduled work (``engine.pass_schedule``): this step's
        # grants, and until the step's report the chunks registered, the requests whose
        # last chunk ran and those whose passes failed.
        self._pass_grants: dict[str, int] = {}
        self._passes_registered: dict[str, list[int]] = {}
        self._passes_done: list[str] = []
        self._pass_failures: dict[str, str] = {}
        # Segments whose in-place compaction failed in this step, by segment request id.
        self._segment_failures: dict[str, str] = {}
        # Prefill/decode hand-off: this step's completing prompts, the rows written this
        # step (described once the first token is sampled, by request), bytes written.
        self.handoff = handoff
        self.fingerprint = fingerprint
        self.exported_bytes = 0
        self._prompts_completing: list[str] = []
        self._unpublished: dict[str, tuple[str, handoff.Described]] = {}
        # The folder's bound, kept from a thread of each producer rank.
        self._sweeper = (Sweeper(self.handoff, rank)
                         if self.handoff is not None and self.handoff.produces else None)
        # Offloaded prefix-cache entries' K/V (``--kv-offloading-size``; hand-offs are
        # imported with its orders), and the entries whose save or load failed, until
        # reported.
        self.tier = HostTier(handoff.path if handoff and handoff.consumes else None, rank,
                             kernel.page_format)
        self._lost_entries: list[int] = []
        self._lost_chunks: list[tuple[int, int]] = []
        self._reload: set[str] = set()  # adopters of a failed load, until reported
        # Prompts compacted a step late (``DeferredCompactions``): this step's orders, and
        # the requests this worker deferred (prompt complete, scores kept) until compacted.
        self._deferred_orders = DeferredCompactions()
        self._deferred_here: set[str] = set()
        self.expected_scorer: ExpectedScorer | None = None
        self.surrogate: ScoreSurrogate | None = None
        # The requests that failed on any tensor-parallel rank, from this rank's: every
        # rank calls it at the same point of a step (the runner sets it under TP).
        self.agree_on_failures: Callable[[Collection[str]], set[str]] = set

    def enable_reconstruction(self, repeat_ids: list[int], chunk: int,
                              budget: int | None = None) -> None:
        """Score ``--kv-scoring reconstruct`` prompts by reconstruction passes of at most
        ``chunk`` prompt tokens after ``repeat_ids`` (the instruction, tokenized), fewer
        where a pass over a long prompt would count more than the step's token ``budget``.
        Without scratch pages (a model with sliding-window layers) they are scored by their
        window."""
        if self.layout.scratch_pages:
            self.reconstructor = Reconstructor(self.state, repeat_ids, chunk, budget)

    def enable_expected_scoring(self, profile: QueryProfile,
                                key_scales: tuple[float, ...] = ()) -> None:
        """Score ``--kv-scoring expected`` prompts from ``profile`` (this rank's heads);
        ``key_scales``: per layer, where pages hold fp8."""
        self.expected_scorer = ExpectedScorer(profile, self.layout, self.pool.device,
                                              key_scales)

    def enable_surrogate_scoring(self, surrogate: ScoreSurrogate) -> None:
        """Score ``--kv-scoring surrogate`` prompts inside their prefill with ``surrogate``
        (this rank's KV heads)."""
        self.surrogate = surrogate.to(self.pool.device)

    def bind_runner(self, runner: Any) -> None:
        """The vLLM model runner: its persistent batch gives the row order of each step,
        its request states the sampling params (per-request settings)."""
        self._runner = runner

    def request_config(self, request_id: str) -> KVCompressionConfig:
        """The engine config with the request's own ``kv_*`` overrides, resolved once.

        Settings are validated at admission; one that is invalid here means the front end
        was bypassed: the request is not compressed with other settings than it asked for,
        it fails (``rejected_settings``) and runs this step uncompressed."""
        request = self.state.requests[request_id]
        if request.config is None:
            request_state = self._runner.requests.get(request_id)
            sampling_params = getattr(request_state, "sampling_params", None)
            extra_args = getattr(sampling_params, "extra_args", None)
            request.readers_after = int((extra_args or {}).get(SEGMENT_READERS_AFTER_ARG, 0))
            request.is_segment = SEGMENT_READERS_AFTER_ARG in (extra_args or {})
            try:
                request.config = self.config.with_request_overrides(extra_args)
            except ValueError as error:
                logger.error("kvcompress: request %s: %s", request_id, error)
                self.rejected_settings[request_id] = f"invalid kvcompress settings: {error}"
                request.config = KVCompressionConfig()  # compression off
        return request.config

    # ------------------------------------------------------------ per step
    def begin_step(self, scheduler_output: Any) -> None:
        """Mirror the scheduler's page-table changes before the batch is prepared, and copy
        the pages of this step's adoptions before the forward reads them."""
        self.step, self._metadata = None, None
        self.state.drop(scheduler_output.finished_req_ids)
        self.state.drop(scheduler_output.preempted_req_ids or ())
        self._deferred_here -= set(scheduler_output.finished_req_ids)
        self._deferred_here -= set(scheduler_output.preempted_req_ids or ())
        self._deferred_orders = deferred_compactions(scheduler_output)
        if self.reconstructor is not None:
            self.reconstructor.forget(scheduler_output.finished_req_ids)
            self.reconstructor.forget(scheduler_output.preempted_req_ids or ())
        self._pass_grants = pass_grants(scheduler_output)
        deltas = page_deltas(scheduler_output, self.rank)
        readers_failed = run_segment_plans(
            self.state, self.pool, self.kernel, segment_orders(scheduler_output, self.rank),
            deltas, self._segment_failures)
        lost_chunks, lost_entries, tier_failed = self.tier.run(
            tier_orders(scheduler_output, self.rank), self.pool, deltas)
        self._lost_chunks += [(self.rank, chunk) for chunk in lost_chunks]
        self._lost_entries += lost_entries
        self._reload.update(tier_failed)
        readers_failed.update(tier_failed)  # (this step: an empty context, not compressed)
        self.state.apply_deltas(deltas)
        self.state.adoption_failures.update(readers_failed)  # (a fresh table clears them)
        self._start_forks()
        copy_adopted_pages(self.state, self.pool)

    def _start_forks(self) -> None:
        """Set up this step's forks (``WorkerKVState.fork``) before the page copies run: a
        fork whose source this worker did not defer, or that cannot be made, is dropped
        (reported without a plan: the scheduler frees its pages)."""
        for source_id, fork in self._deferred_orders.run.items():
            if fork is None or fork.segment_id not in self.state.requests:
                continue
            if source_id not in self._deferred_here or source_id not in self.state.requests:
                self.state.requests.pop(fork.segment_id)
                continue
            try:
                self.state.fork(source_id, fork.segment_id, fork.tokens)
            except Exception:
                logger.exception("kvcompress: forking %s off %s failed", fork.segment_id,
                                 source_id)
                self.state.requests.pop(fork.segment_id)

    def build_attention_metadata(self, common: Any) -> PagedAttentionMetadata:
        if self._metadata is not None:
            if self._metadata.step.num_reqs != common.num_reqs:
                raise RuntimeError("KV-cache groups of one step disagree on its requests")
            return self._metadata
        num_reqs = common.num_reqs
        batch = self._runner.input_batch
        req_ids = batch.req_ids[:num_reqs]
        query_start = common.query_start_loc_cpu.numpy()
        num_new = np.diff(query_start[: num_reqs + 1]).astype(np.int64)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        prompt_lens = batch.num_prompt_tokens[:num_reqs].astype(np.int64)
        configs = [self.request_config(request_id) for request_id in req_ids]
        # A model whose layers all slide has nothing for a policy to compress.
        policy_layers = bool(self.layout.compressed_layers)
        failed_adoptions = self.state.adoption_failures
        requests = [self.state.requests[request_id] for request_id in req_ids]
        reconstructs = [self._reconstructs(request_id, config, request.new_prompt_tokens(int(n)))
                        for request_id, request, config, n in zip(req_ids, requests, configs,
                                                                  prompt_lens)]
        expected = [self._scores_expected(config) for config in configs]
        step = self.state.prepare_step(
            req_ids,
            num_new,
            num_computed,
            prompt_lens,
            observation_windows=[config.window for config in configs],
            # An adopter compresses only its new prompt tokens: a short segment is kept whole.
            wants_compression=[
                policy_layers and config.compresses(request.new_prompt_tokens(int(n)))
                and request_id not in failed_adoptions
                # (a prefill instance's prompt is compressed for its decode instance)
                and (self._exports or not self._ends_this_step(request_id))
                for request_id, request, config, n in zip(req_ids, requests, configs,
                                                          prompt_lens)
            ],
            scored_after_forward=[a or b for a, b in zip(reconstructs, expected)],
            surrogate=self.surrogate,
            surrogate_scored=[self.surrogate is not None and config.loads_surrogate
                              for config in configs],
        )
        # Every prompt completing in this step, compressed or not (hand-offs).
        self._prompts_completing = [
            request_id for request_id, start, n, prompt_len
            in zip(req_ids, num_computed, num_new, prompt_lens)
            if start < prompt_len <= start + n]
        self._reconstructing = [req_ids[index] for index in step.completing_prompt
                                if reconstructs[index]]
        self.state.prepare_decode_scoring(step)
        for request_id in req_ids:
            if request_id in self.rejected_settings:
                step.fail([request_id], self.rejected_settings.pop(request_id))
            if request_id in failed_adoptions:
                step.fail([request_id], failed_adoptions.pop(request_id))
        self.step = step
        self._metadata = PagedAttentionMetadata(
            step=step,
            num_actual_tokens=int(query_start[num_reqs]),
            kernel=self.kernel,
            kernel_args=self.kernel.prepare(step),
            layer_index=self.layer_index,
        )
        return self._metadata

    def _reconstructs(self, request_id: str, config: KVCompressionConfig,
                      new_prompt: int) -> bool:
        """Whether a reconstruction pass scores this request's prompt: its settings ask for
        one, the engine has scratch pages and the prompt's token ids are at hand (a prompt
        given as embeddings is scored by its window)."""
        if self.reconstructor is None or not config.reconstructs(new_prompt):
            return False
        request_state = self._runner.requests.get(request_id)
        return getattr(request_state, "prompt_token_ids", None) is not None

    def _scores_expected(self, config: KVCompressionConfig) -> bool:
        return self.expected_scorer is not None and config.resolved_scoring == "expected"

    def _score_expected(self, step: StepBatch) -> None:
        """The expected-attention scores of the requests whose prompt completed with
        ``--kv-scoring expected``, before they are compacted; a failure fails its request."""
        for index in step.completing_prompt:
            request_id = step.req_ids[index]
            request = self.state.requests[request_id]
            config = request.config
            if (config is None or request_id in step.failures
                    or not self._scores_expected(config)
                    or not config.policy.compression_method.needs_scores):
                continue
            try:
                maybe_fail("score", [request.prompt_len])
                request.window_scores = self.expected_scorer.score(
                    request, self.pool, self.kernel.page_format)
            except Exception as error:
                raise_if_fatal(error, self.pool.device, "expected-attention scoring")
                logger.exception("kvcompress: expected-attention scoring failed for request %s",
                                 request_id)
                step.fail([request_id], f"expected-attention scoring failed: {error!r}")
        self.state.note_scores_held()

    def reconstruct(self, forward: Callable[[ReconstructionPass, PagedAttentionMetadata],
                                            None]) -> None:
        """After the step's forward, before ``end_step`` compacts: register the passes of the
        requests whose prompt completed with ``--kv-scoring reconstruct`` (they are compacted
        once their last pass ran, not in this step), then run the pass chunks the scheduler
        granted this step (``engine.pass_schedule``). ``forward(pass, metadata)`` runs the
        model over a pass with ``metadata`` for every attention layer. A request whose pass
        fails is failed alone (the scheduler ends it); the others go on."""
        reconstructor = self.reconstructor
        if reconstructor is None:
            return
        step = self.step
        if step is not None and self._reconstructing:
            # A pass holds the model's all-reduces: every rank must register (and so run)
            # the same passes, so a request that failed on one rank (a copy, its settings)
            # is left out on all.
            failed = self.agree_on_failures([request_id for request_id in self._reconstructing
                                             if request_id in step.failures])
            step.fail(sorted(failed), FAILED_ON_ANOTHER_RANK)  # no-op where it failed here
            requests = [request_id for request_id in self._reconstructing
                        if request_id not in failed]
            registered = reconstructor.register(
                step, requests,
                lambda request_id: self._runner.requests[request_id].prompt_token_ids)
            self._passes_registered.update(registered)
            step.completing_prompt = [index for index in step.completing_prompt
                                      if step.req_ids[index] not in registered]
        grants, self._pass_grants = self._pass_grants, {}
        for reconstruction in reconstructor.passes(grants):
            metadata = PagedAttentionMetadata(
                step=reconstruction.step,
                num_actual_tokens=len(reconstruction.input_ids),
                kernel=self.kernel,
                kernel_args=self.kernel.prepare(reconstruction.step),
                layer_index=self.layer_index,
            )
            forward(reconstruction, metadata)
            for request_id, reason in reconstruction.step.failures.items():  # its requests
                self._pass_failures.setdefault(request_id, reason)
        reconstructor.forget(self._pass_failures)
        self._passes_done += [request_id for request_id in grants
                              if reconstructor.done(request_id)]

    def _ends_this_step(self, request_id: str) -> bool:
        """Whether the request samples its last token (``max_tokens``) in this step: its
        pages are freed right after, so scoring and compacting its prompt would be wasted
        (e.g. ``max_tokens=1``, prompt scoring or embedding-like use)."""
        request_state = self._runner.requests.get(request_id)
        max_tokens = getattr(getattr(request_state, "sampling_params", None), "max_tokens", None)
        if max_tokens is None:
            return False
        return len(getattr(request_state, "output_token_ids", ())) + 1 >= max_tokens

    def end_step(self) -> WorkerReport:
        """After the forward: lengths advance, then completed prompts are compacted and
        generated parts over their decode budget evicted. The report also names the requests
        whose compression failed in this step, which the scheduler ends with an error."""
        step, self.step, self._metadata = self.step, None, None
        passes_done, self._passes_done = self._passes_done, []
        failures, self._pass_failures = self._pass_failures, {}
        failures.update(self._segment_failures)
        self._segment_failures = {}
        registered, self._passes_registered = self._passes_registered, {}
        orders, self._deferred_orders = self._deferred_orders, DeferredCompactions()
        lost, self._lost_entries = self._lost_entries, []
        lost_chunks, self._lost_chunks = self._lost_chunks, []
        reload, self._reload = sorted(self._reload), set()
        if step is None and not (passes_done or failures or registered or orders.run or lost
                                 or lost_chunks or reload):
            return WorkerReport(handoff_bytes=self._take_handoff_bytes())
        compactions = {}
        if step is not None:
            self.state.finish_step(step)
            if self.expected_scorer is not None:
                with step.score_timer.measure():
                    self._score_expected(step)
        with self.compaction_timer.measure() as measurement:
            if step is not None:
                self._defer_compactions(step, orders.defer)
                compactions = compress_step(self.state, step, self.pool, self.kernel,
                                            self.stats, self.kernel.page_format)
                failures.update(step.failures)
            if passes_done:
                compactions.update(self._compact_reconstructed(passes_done, failures))
            if orders.run:
                compactions.update(self._compact_deferred(orders, failures))
            if not compactions:
                measurement.discard()  # a step with nothing to compact reports no time
        if step is not None and self._exports:
            self._export_prompts(failures)
        # On CUDA these are the seconds of stages the device finished by now (this step's or
        # earlier ones'): reading the events does not wait for it.
        score_seconds = self.state.score_timer.take()
        seconds = self.compaction_timer.take()
        self.stats.score_seconds += score_seconds
        self.stats.seconds += seconds
        for request_id in reload:  # they prefill again: not a failure, nothing compacted
            failures.pop(request_id, None)
            compactions.pop(request_id, None)
        return WorkerReport(compactions, failures, score_seconds, seconds,
                            passes_pending=registered, lost_entries=lost,
                            lost_chunks=lost_chunks, reload=reload,
                            handoff_bytes=self._take_handoff_bytes())

    def _take_handoff_bytes(self) -> dict[str, int]:
        counts = {"exported": self.exported_bytes, "imported": self.tier.imported_bytes}
        self.exported_bytes = self.tier.imported_bytes = 0
        return {name: value for name, value in counts.items() if value}

    @property
    def _exports(self) -> bool:
        return self.handoff is not None and self.handoff.produces

    def _export_prompts(self, failures: Collection[str]) -> None:
        """A prefill instance hands every prompt completed (and compressed) in this step to
        its decode instance: the rows now (``handoff.write_rows``), what they are once the
        first token is sampled (``publish_exports``). A prompt whose compaction comes later
        (deferred, reconstruction passes) or failed is not handed off: the decode instance
        then prefills it itself. A failed write only loses the hand-off."""
        assert self.handoff is not None
        for request_id in self._prompts_completing:
            request = self.state.requests.get(request_id)
            request_state = self._runner.requests.get(request_id)
            if (request is None or request_state is None or request_id in failures
                    or request_id in self._deferred_here
                    or request_id in self._reconstructing):
                continue
            lengths = request.lengths.astype(np.int64)
            pages = request.table.leading_pages(
                pages_for_lengths(lengths, self.layout.page_size))
            key = handoff.prompt_key(request_state.prompt_token_ids)
            try:
                index = torch.from_numpy(pages.astype(np.int64)).to(self.pool.device)
                self.exported_bytes += handoff.write_rows(
                    self.handoff.path, key, self.rank, self.pool.index_select(0, index),
                    page_format=self.kernel.page_format)
            except Exception as error:
                raise_if_fatal(error, self.pool.device, "hand-off export")
                logger.exception("kvcompress: handing off request %s failed", request_id)
                continue
            self._unpublished[request_id] = (key, handoff.Described(
                lengths, request.prompt_len, -1, self.fingerprint,
                self.request_config(request_id).to_mapping()))

    def publish_exports(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """The step's hand-offs become visible with the token sampled after each prompt
        (``req_ids`` / ``sampled``: vLLM's output of the step); one without a token (its
        request failed) is removed."""
        unpublished, self._unpublished = self._unpublished, {}
        tokens = {request_id: ids[0] for request_id, ids in zip(req_ids, sampled) if ids}
        for request_id, (key, part) in unpublished.items():
            assert self.handoff is not None
            try:
                if request_id not in tokens:
                    handoff.discard_rank(self.handoff.path, key, self.rank)
                    continue
                handoff.publish(self.handoff.path, key, self.rank,
                                dataclasses.replace(part, first_token=int(tokens[request_id])))
            except OSError:
                logger.exception("kvcompress: handing off request %s failed", request_id)

    def close(self) -> None:
        """Stop what runs beside the engine (the hand-off folder's sweeper)."""
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None

    def _defer_compactions(self, step: Any, defer: frozenset[str]) -> None:
        """The prompts the scheduler deferred are not compacted in this step (their scores
        are kept: ``_compact_deferred`` plans them in the next)."""
        if not defer:
            return
        deferred = {index for index in step.completing_prompt
                    if step.req_ids[index] in defer and step.req_ids[index] not in step.failures}
        self._deferred_here.update(step.req_ids[index] for index in deferred)
        step.completing_prompt = [index for index in step.completing_prompt
                                  if index not in deferred]

    def _compact_deferred(self, orders: DeferredCompactions,
                          failures: dict[str, str]) -> dict[str, Compaction]:
        """Compact the prompts deferred in the step before (parked: not in this step's
        batch), and plan each one's fork as a segment request's prompt (its pages copied
        before the forward); failures join ``failures``. A fork's pseudo-request is gone
        after: its plan is kept (``ParkedSegment``) and its pages are the scheduler's."""
        request_ids, logical_after, forks = [], [], []
        for source_id, fork in orders.run.items():
            source = self.state.requests.get(source_id)
            if source_id not in self._deferred_here or source is None:
                continue
            self._deferred_here.discard(source_id)
            request_ids.append(source_id)
            logical_after.append(source.prompt_len)
            if fork is not None and fork.segment_id in self.state.requests:
                forks.append(fork.segment_id)
                failure = self.state.adoption_failures.pop(fork.segment_id, None)
                if failure is not None:  # its pages were not copied
                    failures[fork.segment_id] = failure
                    continue
                request_ids.append(fork.segment_id)
                logical_after.append(fork.tokens)
        completed = CompletedPasses(request_ids, np.asarray(logical_after, dtype=np.int64))
        compactions = compact_completed_prompts(self.state, completed, self.pool, self.kernel,
                                                self.stats)
        failures.update(completed.failures)
        self.state.drop(forks)
        return compactions

    def _compact_reconstructed(self, request_ids: list[str],
                               failures: dict[str, str]) -> dict[str, Compaction]:
        """Compact the prompts whose last reconstruction pass ran in this step (parked: not
        in the step's batch); failures join ``failures``."""
        assert self.reconstructor is not None
        completed = self.reconstructor.completed(request_ids)
        self.reconstructor.forget(request_ids)
        compactions = compact_completed_prompts(self.state, completed, self.pool, self.kernel,
                                                self.stats)
        failures.update(completed.failures)
        return compactions

    def collect_stats(self) -> CompactionStats:
        """``stats`` with every measured stage counted (waits for the device's pending
        ones: for benchmarks, between runs)."""
        self.stats.score_seconds += self.state.score_timer.take(wait=True)
        self.stats.seconds += self.compaction_timer.take(wait=True)
        return self.stats

