"""vLLM's scheduler with a per-head page pool behind its KV-cache manager: every change to
vLLM's ``Scheduler`` is in this module, each through the narrowest seam it offers.

- ``schedule``: stage 1-2 of a step (``kvcompress.step``) around vLLM's own; shared
  prefixes are decided before it (``sharing``), and what the worker needs rides on its
  output (``messages``). Reconstruction passes take their tokens out of the step's budget
  (``max_num_scheduled_tokens``, restored after).
- ``_handle_blocked_waiting_request``: a request held for a shared prefix
  (``request_life``) is skipped in vLLM's waiting loop, in its place.
- ``_reserve_prefill_lookahead``: a request parked for reconstruction passes, or deferred
  a step, gets no tokens (it stays in ``running``, first, so that no other request's
  growth preempts it); a chunk stops short of its observation window while window scores
  fill their reserve (``scoring_memory``).
- ``_preempt_request``, ``_free_request``: a request's kvcompress state follows it.
- ``update_from_output``: stage 8, the worker's report (pages freed, failures).
- ``add_request``: a client cannot pose as a segment request.
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import RequestStatus

from kvcompress.engine.engine_args import OFFLOAD_BYTES_KEY
from kvcompress.engine.handoff import Handoff, handoff_fingerprint
from kvcompress.engine.messages import (
    SEGMENT_READERS_AFTER_ARG,
    Compaction,
    DeferredCompactions,
    Fork,
    attach_deferred_compactions,
    attach_page_deltas,
    attach_pass_grants,
    attach_segment_orders,
    attach_tier_orders,
    worker_report,
)
from kvcompress.engine.metrics import STATS_FIELD, StepFigures, TierFigures
from kvcompress.engine.pass_schedule import PassSchedule, StepPasses
from kvcompress.engine.request_settings import resolve
from kvcompress.engine.sched.admission import AdmissionPlanner
from kvcompress.engine.sched.kv_cache_manager import (
    PagedKVCacheManager,
    virtual_kv_cache_config,
)
from kvcompress.engine.sched.prefix_cache import PrefixCachePolicy
from kvcompress.engine.sched.prefix_segments import PrefixSegments, segment_boundary
from kvcompress.engine.sched.request_life import Life, RequestLives
from kvcompress.engine.sched.sharing import PrefixSharing
from kvcompress.engine.scoring_memory import ScoringGate
from kvcompress.engine.vllm_layout import ScoringReserve, page_layout
from kvcompress.log import get_logger
from kvcompress.paging import ShardedPageManager
from kvcompress.paging.page_table import pages_for_lengths
from kvcompress.paging.prefix_index import PromptChains
from kvcompress.settings.config import KVCompressionConfig

logger = get_logger(__name__)

# The private seams we override (module docstring).
SEAMS = ("_reserve_prefill_lookahead", "_preempt_request", "_handle_blocked_waiting_request",
         "_free_request")
for _seam in SEAMS:
    if not hasattr(Scheduler, _seam):
        raise ImportError(f"kvcompress: this vLLM's Scheduler lacks {_seam}; "
                          "kvcompress supports vLLM 0.32.x")


class KVCompressScheduler(Scheduler):
    def __init__(self, vllm_config: Any, kv_cache_config: KVCacheConfig, *args: Any,
                 **kwargs: Any) -> None:
        self.compression_config = KVCompressionConfig.from_mapping(vllm_config.additional_config)
        reserve = ScoringReserve.of(vllm_config)
        layout = page_layout(kv_cache_config, self.compression_config.page_size, reserve)
        layout.check_holds_one_request(vllm_config.model_config.max_model_len,
                                       vllm_config.scheduler_config.max_num_batched_tokens)
        virtual_config = virtual_kv_cache_config(
            kv_cache_config,
            max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
            max_model_len=vllm_config.model_config.max_model_len,
        )
        super().__init__(vllm_config, virtual_config, *args, **kwargs)
        # Tensor parallelism: every rank holds its own KV heads in its own pool (and its
        # share of the offload tier, --kv-offloading-size being the ranks' total).
        ranks = vllm_config.parallel_config.tensor_parallel_size
        tier_bytes = int((vllm_config.additional_config or {}).get(OFFLOAD_BYTES_KEY, 0))
        tier_pages = tier_bytes // ranks // layout.page_bytes
        self.page_manager = ShardedPageManager(layout, ranks, tier_pages)
        self.admission = AdmissionPlanner(
            self.page_manager, self.compression_config,
            max_model_len=vllm_config.model_config.max_model_len,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            lookahead=self.compression_config.admission_lookahead,
            running=lambda: self.running,
        )
        # Prompts with their block hashes, made once per request (lookups and grouping).
        self.prompt_chains = PromptChains()
        handoff = Handoff.from_additional_config(vllm_config.additional_config)
        self.reuse = PrefixCachePolicy(
            self.page_manager, self.compression_config, self.prompt_chains, handoff,
            handoff_fingerprint(vllm_config.model_config.model, layout,
                                kv_cache_config.kv_cache_groups[0].kv_cache_spec.dtype,
                                vllm_config.cache_config.cache_dtype, ranks))
        if self.compression_config.reuse != "off" and not self.reuse.enabled:
            logger.info("kvcompress: the prefix cache (--kv-reuse) is off for models with "
                        "sliding-window layers")
        # Each request's sharing state (``request_life``), and the sharing itself.
        self.lives = RequestLives()
        self.segments = PrefixSegments(boundary=segment_boundary(layout.page_size),
                                       chains=self.prompt_chains, lives=self.lives)
        self.sharing = PrefixSharing(self, self.page_manager, self.reuse, self.segments,
                                     self.compression_config.sharing_wait)
        self.kv_cache_manager = PagedKVCacheManager(  # type: ignore[assignment]
            self.kv_cache_manager, self.page_manager, self.scheduler_config.watermark,
            self.admission, self.scheduler_config.max_num_batched_tokens, self.reuse,
            log_stats=self.log_stats,
            # (held requests will read the entry too, but do not branch it this step)
            waiting=lambda: (request for request in self.waiting
                             if self.lives.state(request.request_id) is not Life.HELD),
        )
        self._cap_running_at_decode_reserve(layout)
        self.num_pages_freed_by_compression = 0
        self.scoring_gate = ScoringGate(reserve.scored_tokens)
        self._full_token_budget = self.max_num_scheduled_tokens
        self.passes = PassSchedule()
        # Requests given no tokens in the schedule under way (parked, deferred).
        self._resting: frozenset[str] = frozenset()
        self.figures = StepFigures()  # for /metrics, taken by make_stats
        self.tier_figures = TierFigures()
        # Tests and soak runs check the page invariants after every step.
        self.check_pages_every_step = os.environ.get("KVCOMPRESS_CHECK_PAGES") == "1"
        logger.info(
            "kvcompress: %d pages of %d tokens (one KV head of one layer each) for %d "
            "layers x %d KV heads; %d uncompressed tokens fit",
            layout.total_pages, layout.page_size, layout.num_layers, layout.num_kv_heads,
            layout.token_capacity,
        )
        if tier_pages and not self.reuse.enabled:
            logger.warning("kvcompress: --kv-offloading-size has nothing to keep: the prefix "
                           "cache (--kv-reuse) is off")
        elif tier_pages:
            logger.info("kvcompress: offload tier of %d pages per rank (%.2f GiB in all) for "
                        "evicted prefix-cache entries", tier_pages,
                        tier_pages * ranks * layout.page_bytes / (1 << 30))

    def _cap_running_at_decode_reserve(self, layout: Any) -> None:
        """A running request may hold decode scores, and a small pool reserves them for fewer
        requests than --max-num-seqs (``vllm_layout.page_layout``): no more run at once."""
        reserved = layout.decode_score_requests
        if layout.decode_score_request_bytes and reserved < self.max_num_running_reqs:
            logger.warning(
                "kvcompress: decode scores (--kv-decode-budget %d) are reserved for %d running "
                "requests, so at most %d run at once (--max-num-seqs %d); give the KV cache "
                "more memory or lower --kv-decode-budget to run more",
                self.compression_config.decode_budget, reserved, reserved,
                self.max_num_running_reqs)
            self.max_num_running_reqs = reserved
            self.max_num_active_reqs = min(self.max_num_active_reqs, reserved)

    def add_request(self, request: Any) -> None:
        """A client's request may not pass itself off as a segment request: the argument
        that marks one on the worker is ours (``prefix_segments.segment_request``)."""
        extra_args = getattr(request.sampling_params, "extra_args", None)
        if (extra_args and SEGMENT_READERS_AFTER_ARG in extra_args
                and not self.lives.is_segment(request.request_id)):
            del extra_args[SEGMENT_READERS_AFTER_ARG]
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """Stage 1-2 of a step (``kvcompress.step``): admit in pages, ship the page deltas
        and the reconstruction pass chunks this step runs (``engine.pass_schedule``)."""
        self.passes.prune(self.requests)
        self.scoring_gate.prune(self.requests, held=self._holding_scores())
        self.admission.prune(self.requests)
        # Deferred in the schedule before: compacted (and forked) in this step, no tokens.
        ready = sorted(self.lives.in_state(Life.DEFERRED))
        self._resting = self.passes.parked() | frozenset(ready)
        self._order_running_by_recompute_cost()
        sharing = self.sharing
        sharing.before_schedule(ready)
        self.num_pages_freed_by_compression += sharing.pages_freed
        sharing.pages_freed = 0
        freed_before = self.kv_cache_manager.window_freed_pages
        passes = self._grant_passes()
        try:
            scheduler_output = super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = self._full_token_budget
            self._resting = frozenset()
        self._continue_handoffs(scheduler_output)
        for request_id in ready:
            if self.lives.state(request_id) is Life.DEFERRED:  # (not preempted meanwhile)
                self.lives.move(request_id, Life.FREE)
        self.figures.window_freed_pages += self.kv_cache_manager.window_freed_pages - freed_before
        attach_deferred_compactions(scheduler_output, DeferredCompactions(
            sharing.defer_lone_prompt(scheduler_output),
            {request_id: (None if (fork := sharing.forks.get(request_id)) is None
                          else Fork(fork.request_id, len(fork.tokens)))
             for request_id in ready}))
        attach_page_deltas(scheduler_output, self.page_manager.take_deltas())
        attach_segment_orders(scheduler_output, self.page_manager.take_segment_orders())
        attach_tier_orders(scheduler_output, self.page_manager.take_tier_orders())
        attach_pass_grants(scheduler_output, passes.grants)
        return scheduler_output

    def _continue_handoffs(self, scheduler_output: SchedulerOutput) -> None:
        """A request continued from a hand-off (``PrefixCachePolicy.continuing``) reaches the
        worker with the prefill instance's token as its prompt's last: the worker computes
        it over the adopted rows (as a decode step) and samples the next."""
        continuing, continued = self.reuse.continuing, self.reuse.continued
        if not (continuing or continued):
            return  # (no hand-off: nothing to do on each step)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in continuing and new.prompt_token_ids is not None:
                request = self.requests[new.req_id]
                new.prompt_token_ids = request.all_token_ids[:request.num_prompt_tokens + 1]
                continued.add(new.req_id)
        # The worker counts that token in the prompt: its output is one token shorter (it
        # drops what it sampled past the scheduler's count, after a preemption).
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            if request_id in continued:
                cached.num_output_tokens[index] -= 1
        for request_id in [r for r in continued if r not in self.requests]:
            continued.discard(request_id)

    def _report_first_tokens(self, outputs: dict[int, Any]) -> None:
        """The first output of a request continued from a hand-off carries the prefill
        instance's token before the one sampled here (the client sees both)."""
        continuing = self.reuse.continuing
        if not continuing:
            return
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.new_token_ids and output.request_id in continuing:
                    first = continuing.pop(output.request_id)
                    output.new_token_ids = [first, *output.new_token_ids]
        for request_id in [r for r in continuing if r not in self.requests]:
            del continuing[request_id]  # (ended before any output)

    def _grant_passes(self) -> StepPasses:
        """This step's pass chunks, out of the token budget after one token per decoding
        request (the resting ones, parked and deferred, get none:
        ``_reserve_prefill_lookahead``)."""
        if not self.passes.pending:
            return StepPasses({}, 0)
        decoding = sum(1 for r in self.running if r.request_id not in self._resting
                       and r.num_computed_tokens >= r.num_prompt_tokens)
        passes = self.passes.grant(self._full_token_budget - decoding)
        self.max_num_scheduled_tokens = max(decoding, self._full_token_budget - passes.tokens)
        return passes

    def _holding_scores(self) -> frozenset[str]:
        """Requests past their prefill whose prompt scores live on: parked for
        reconstruction passes, or compacted a step late."""
        return self.passes.parked() | self.lives.in_state(Life.DEFERRED)

    def _order_running_by_recompute_cost(self) -> None:
        """vLLM preempts the last running request (first-come-first-served): make it the
        cheapest to recompute. The resting requests come first (never a victim: the request
        vLLM schedules comes after them), then decoding requests, then prompts still in
        prefill; each group by computed tokens, most first. The order is stable, so it
        only changes when the costs do."""
        if self.policy != SchedulingPolicy.FCFS:
            return  # priority scheduling picks its own victim
        resting = self._resting
        self.running.sort(key=lambda r: (r.request_id not in resting,
                                         r.num_computed_tokens < r.num_prompt_tokens,
                                         -r.num_computed_tokens))

    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        """vLLM asks whether a waiting request may be scheduled in this step: not while it
        is held for a shared prefix (``request_life``); vLLM keeps its place."""
        if self.lives.state(request.request_id) is Life.HELD:
            return False
        return super()._handle_blocked_waiting_request(request)

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        """(Priority scheduling may pick a resting request.) Its passes or its deferral
        are dropped with its pages; the worker forgets them too."""
        self.figures.preempted_tokens += request.num_computed_tokens
        self.passes.pending.pop(request.request_id, None)
        self.lives.preempted(request.request_id)
        super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """A finished request's sharing state ends with it (a segment request's filed pages
        keep theirs until compacted)."""
        if self.lives.state(request.request_id) is not Life.FILED:
            self.lives.end(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        """vLLM's last say on a chunk's size before its slots are allocated (0: not this
        step, no preemption): a resting request gets none, and a chunk stops short of its
        observation window while the window scores of other prompts fill their reserve
        (``scoring_memory``)."""
        if request.request_id in self._resting:
            return 0
        num_new_tokens = super()._reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        if num_computed_tokens >= request.num_prompt_tokens:
            return num_new_tokens  # decoding: no window to score
        if request.num_output_tokens + 1 >= request.max_tokens:
            return num_new_tokens  # ends in its prefill step: the worker does not score it
        config = resolve(self.compression_config, request.sampling_params)
        return self.scoring_gate.limit(request, config, num_computed_tokens, num_new_tokens,
                                       reads_segment=self._reads_pending_segment(request))

    def _reads_pending_segment(self, request: Any) -> bool:
        """Whether the request adopts (or adopted) a shared prefix still uncompressed."""
        match = self.kv_cache_manager._matches.get(request.request_id)
        if match is not None:
            return self.page_manager.is_pending(match.entry_id)
        state = self.page_manager.shards[0].tables.states.get(request.request_id)
        return state is not None and state.sealed > 0

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any) -> Any:
        report = worker_report(model_runner_output)
        self._reload(report.reload)
        failed = dict(report.failures)
        sharing = self.sharing
        known_segments = self.lives.in_state(Life.SEGMENT)
        # Stage 8: release compacted pages first; requests finishing in this step free the rest.
        for request_id, compaction in report.compactions.items():
            try:
                self._release(request_id, compaction)
            except Exception as error:  # a bad report ends its request, not the engine
                logger.exception("kvcompress: compaction report of %s rejected", request_id)
                failed[request_id] = f"compaction report rejected: {error!r}"
        if report.lost_entries or report.lost_chunks:  # (their readers reload: _reload)
            lost = list(report.lost_entries)
            for rank, chunk in report.lost_chunks:
                lost += self.page_manager.shards[rank].forget_tier_chunk(chunk)
            logger.error("kvcompress: the offload tier lost prefix-cache entries %s", lost)
            self.reuse.drop(lost)
        if sharing.forks:
            sharing.file_forks(report, failed)
        sharing.drop_failed_segments(failed)
        for request_id in failed:
            if self.lives.is_segment(request_id):
                sharing.unshare(request_id)
        if self.log_stats:
            self.figures.add_report(report)
            self.figures.failed_requests += len(failed)
        # vLLM frees (and kvcompress files) the requests that finish in this step before the
        # failed ones are ended: a failed one must not be filed on the way.
        self.kv_cache_manager.unfileable = set(failed)
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            self._report_first_tokens(outputs)
            self.passes.add(report.passes_pending, self.requests)
            self.scoring_gate.prune(self.requests, held=self._holding_scores())
            if failed:
                self._finish_with_error(failed, outputs)
            sharing.end_segment_requests(outputs, known_segments)
        finally:
            self.kv_cache_manager.unfileable = set()
        if self.check_pages_every_step:
            self.check_pages()
        return outputs

    def _reload(self, request_ids: list[str]) -> None:
        """Requests whose adopted cache failed to load from the offload tier ran this step
        on an empty context: preempted with their output dropped, they prefill again (the
        entry is gone: ``lost_entries``)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            logger.warning("kvcompress: request %s prefills again: its cached context failed "
                           "to load from the offload tier", request_id)
            self.running.remove(request)
            self._preempt_request(request, time.monotonic(), drop_stale_output=True)

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:  # vllm_hooks gave SchedulerStats this field
            manager = self.page_manager
            figures = self.figures.take(manager.free_pages_all_ranks,
                                        manager.total_pages_all_ranks)
            figures.update(self.reuse.figures.take(),
                           pages_cached=manager.cached_pages_all_ranks)
            if manager.has_tier:
                figures["offload"] = self.tier_figures.take(manager.tier_totals())
            setattr(stats, STATS_FIELD, figures)
        return stats

    def _release(self, request_id: str, compaction: Compaction) -> None:
        manager = self.page_manager
        if request_id not in manager:
            return  # finished or aborted while the step ran: its pages are free already
        before = manager.all_physical_lengths(request_id)
        self.num_pages_freed_by_compression += manager.release_after_compression(
            request_id, compaction.logical_len, compaction.physical_lengths, compaction.kind,
            compaction.prompt_evicted,
        )
        if self.log_stats:
            self.figures.add_compaction(compaction, before)

    def _finish_with_error(self, failed: dict[str, str], outputs: dict[int, Any]) -> None:
        """End each failed request with an error (its pages are freed) in this step's
        outputs; the engine and every other request go on."""
        for request in self.finish_requests(failed, RequestStatus.FINISHED_ERROR):
            logger.error("kvcompress: request %s ended with an error: %s",
                         request.request_id, failed[request.request_id])
            batch = outputs.get(request.client_index)
            if batch is None:
                batch = outputs[request.client_index] = EngineCoreOutputs()
            batch.outputs.append(EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            ))

    def check_pages(self) -> None:
        """On every rank: every page's reference count right (free iff 0), pages held only
        by requests the scheduler still knows and entries its index can find, and each
        request or entry holding exactly ceil(length / page_size) pages per row."""
        self.page_manager.check_invariants()
        entry_ids = self.page_manager.entry_ids()
        known = entry_ids + self.page_manager.offloaded_ids()
        index = self.reuse.index
        assert len(index) == len(known) and all(e in index for e in known), (
            f"cached entries {entry_ids}, offloaded {known[len(entry_ids):]} and the "
            f"{len(index)} indexed ones differ")
        for rank, manager in enumerate(self.page_manager.shards):
            forks = {fork.request_id for fork in self.sharing.forks.values()}  # (in flight)
            leaked = manager.request_ids() - set(self.requests) - forks
            assert not leaked, f"pages held by requests the scheduler forgot: {sorted(leaked)}"
            for request_id in manager.request_ids():
                needed = int(pages_for_lengths(manager.physical_lengths(request_id),
                                               manager.layout.page_size).sum())
                held = manager.owned_pages(request_id)
                assert held == needed, (f"request {request_id} holds {held} pages on rank "
                                        f"{rank}, needs {needed}")
            for entry_id in entry_ids:
                entry = manager.entry(entry_id)
                needed = int(pages_for_lengths(entry.logical_len - entry.evicted,
                                               manager.layout.page_size).sum())
                assert entry.table.total_pages == needed, (
                    f"cached entry {entry_id} holds {entry.table.total_pages} pages on rank "
                    f"{rank}, needs {needed}")
        self.lives.check()
