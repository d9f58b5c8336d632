"""vLLM's scheduler with a per-head page pool behind its KV-cache manager."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import RequestStatus

from kvcompress.engine.messages import (
    SEGMENT_READERS_AFTER_ARG,
    Compaction,
    DeferredCompactions,
    Fork,
    WorkerReport,
    attach_deferred_compactions,
    attach_page_deltas,
    attach_pass_grants,
    attach_segment_orders,
    worker_report,
)
from kvcompress.engine.metrics import STATS_FIELD, StepFigures
from kvcompress.engine.pass_schedule import PassSchedule, StepPasses
from kvcompress.engine.request_settings import resolve
from kvcompress.engine.sched.admission import AdmissionPlanner
from kvcompress.engine.sched.kv_cache_manager import PagedKVCacheManager, virtual_kv_cache_config
from kvcompress.engine.sched.prefix_cache import PrefixCachePolicy
from kvcompress.engine.sched.prefix_segments import (
    SEGMENT_LOOKAHEAD,
    Candidate,
    PrefixSegments,
    Segment,
    SharingView,
    may_segment,
    segment_boundary,
    segment_request,
)
from kvcompress.engine.scoring_memory import ScoringGate
from kvcompress.engine.vllm_layout import ScoringReserve, page_layout
from kvcompress.log import get_logger
from kvcompress.paging import ShardedPageManager
from kvcompress.paging.page_table import pages_for_lengths
from kvcompress.paging.prefix_index import PromptChains
from kvcompress.settings.config import KVCompressionConfig

logger = get_logger(__name__)

# Waiting requests whose cached prefixes the eviction order protects (a lookup each per step).
EVICTION_LOOKAHEAD = 64


# The private seams we override: a chunk's last size check, and preemption (to count it).
for _seam in ("_reserve_prefill_lookahead", "_preempt_request"):
    if not hasattr(Scheduler, _seam):
        raise ImportError(f"kvcompress: this vLLM's Scheduler lacks {_seam}; "
                          "kvcompress supports vLLM 0.32.x")


# Schedules a pending segment waits at most for the readers it was made for.
MAX_PENDING_SCHEDULES = 256
# Schedules between prunings of what is kept per waiting request (prompt chains, holds).
PRUNE_EVERY = 16
# Schedules within which the worker reports a segment's failed in-place compaction.
MAX_REPORT_SCHEDULES = 8


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
        # Tensor parallelism: every rank holds its own KV heads in its own pool.
        self.page_manager = ShardedPageManager(
            layout, vllm_config.parallel_config.tensor_parallel_size)
        self.admission = AdmissionPlanner(
            self.page_manager, self.compression_config,
            max_model_len=vllm_config.model_config.max_model_len,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            lookahead=self.compression_config.admission_lookahead,
            # Parked requests (waiting for reconstruction passes) hold pages and grow later.
            running=lambda: [*self.running, *self._parked_now],
        )
        # Prompts with their block hashes, made once per request (lookups and grouping).
        self.prompt_chains = PromptChains()
        self.reuse = PrefixCachePolicy(self.page_manager, self.compression_config,
                                       self.prompt_chains)
        if self.compression_config.reuse == "on" and not self.reuse.enabled:
            logger.info("kvcompress: the prefix cache (--kv-reuse) is off for models with "
                        "sliding-window layers")
        self.kv_cache_manager = PagedKVCacheManager(  # type: ignore[assignment]
            self.kv_cache_manager, self.page_manager, self.scheduler_config.watermark,
            self.admission, self.scheduler_config.max_num_batched_tokens, self.reuse,
            log_stats=self.log_stats, waiting=lambda: self.waiting,
        )
        self._cap_running_at_decode_reserve(layout)
        self.num_pages_freed_by_compression = 0
        self.scoring_gate = ScoringGate(reserve.scored_tokens)
        self._full_token_budget = self.max_num_scheduled_tokens
        self.passes = PassSchedule()
        self._parked_now: list[Any] = []  # out of self.running while vLLM schedules
        # Shared prefixes of waiting requests, each computed once by a request of its own
        # (``engine.sched.prefix_segments``); their readers are out of self.waiting meanwhile.
        self.segments = PrefixSegments(boundary=segment_boundary(layout.page_size),
                                       chains=self.prompt_chains)
        # Pending segment entries (filed uncompressed) -> the schedule that first saw them:
        # they are compacted from the next one on, once none of their readers is in prefill.
        self._pending_since: dict[int, int] = {}
        self._schedules = 0
        # Each segment request's readers, as grouped (the ones a pending segment waits for).
        self._segment_readers: dict[str, list[str]] = {}
        # A lone prompt's compaction waits a step (``_defer_lone_prompt``): the requests
        # deferred in the last schedule; and the forks ordered in this schedule, by the id of
        # the request they are made of (filed with the step's report, ``_file_forks``).
        self._deferred: set[str] = set()
        self._forks: dict[str, Segment] = {}
        # The last ``_reader_waits_to_fit`` question and its answer.
        self._fits_asked: tuple = ((), False)
        # The queue head and cache state the eviction order was last planned for.
        self._evictions_planned_for: tuple = ()
        # What the grouping reads of each waiting request, made once (``_sharing_view``).
        self._views: dict[str, SharingView] = {}
        # Waiting requests held for a shared prefix -> the schedule that first held them
        # (``_waited_enough``: a wait is bounded by --kv-sharing-wait).
        self._held_since: dict[str, int] = {}
        # Segments compacted in place -> (the schedule, the entries holding them): dropped if
        # the worker reports the compaction failed (``_drop_failed_segments``); a report
        # comes with the step that ran it, or the next one that runs a batch.
        self._compacting: dict[str, tuple[int, list[int]]] = {}
        self.figures = StepFigures()  # for /metrics, taken by make_stats
        # Tests and soak runs check the page invariants after every step.
        self.check_pages_every_step = os.environ.get("KVCOMPRESS_CHECK_PAGES") == "1"
        logger.info(
            "kvcompress: %d pages of %d tokens (one KV head of one layer each) for %d "
            "layers x %d KV heads; %d uncompressed tokens fit",
            layout.total_pages, layout.page_size, layout.num_layers, layout.num_kv_heads,
            layout.token_capacity,
        )

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
                and not self.segments.is_segment(request.request_id)):
            del extra_args[SEGMENT_READERS_AFTER_ARG]
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """Stage 1-2 of a step (``kvcompress.step``): admit in pages, ship the page deltas
        and the reconstruction pass chunks this step runs (``engine.pass_schedule``)."""
        self.passes.prune(self.requests)
        self._deferred = {request_id for request_id in self._deferred
                          if (request := self.requests.get(request_id)) is not None
                          and not request.is_finished()}
        self.scoring_gate.prune(self.requests, held=self._holding_scores())
        self.admission.prune(self.requests)
        self._order_running_by_recompute_cost()
        self._schedules += 1
        self._compact_segments()
        self._plan_cache_evictions()
        freed_before = self.kv_cache_manager.window_freed_pages
        # Deferred in the schedule before: compacted (and forked) in this step, parked.
        ready, self._deferred = sorted(self._deferred), set()
        held, positions = self._share_prefixes(ready)
        passes = self._grant_passes(ready)
        try:
            scheduler_output = super().schedule(*args, **kwargs)
        finally:
            self._unpark(passes)
            self._unhold(held, positions)
        self.figures.window_freed_pages += self.kv_cache_manager.window_freed_pages - freed_before
        attach_deferred_compactions(scheduler_output, DeferredCompactions(
            self._defer_lone_prompt(scheduler_output),
            {request_id: (None if (fork := self._forks.get(request_id)) is None
                          else Fork(fork.request_id, len(fork.tokens)))
             for request_id in ready}))
        attach_page_deltas(scheduler_output, self.page_manager.take_deltas())
        attach_segment_orders(scheduler_output, self.page_manager.take_segment_orders())
        attach_pass_grants(scheduler_output, passes.grants)
        return scheduler_output

    def _share_prefixes(self, deferred: list[str]) -> tuple[list[Any], dict[str, int]]:
        """Make a fork of each ``deferred`` request's first tokens that waiting requests
        share (``_fork``), queue a segment request for each prefix that other waiting
        requests share (``PrefixSegments.plan``), and take out of ``self.waiting`` the
        requests whose prompts start with a segment still being computed (or a fork): held
        while vLLM schedules, so that they adopt it once filed rather than prefill it again,
        without blocking the requests behind them. Those that share a pending segment but
        cannot adopt it whole are held until it is compacted
        (``PrefixCachePolicy.waits_for_compaction``). Returns the held requests and the
        queue positions (``_unhold``)."""
        segments = self.segments
        if not self.reuse.enabled:
            return [], {}
        def live(request_id: str) -> bool:
            return (request := self.requests.get(request_id)) is not None and (
                not request.is_finished())

        segments.prune(live)
        if self._schedules % PRUNE_EVERY == 0:  # (what it forgets costs nothing meanwhile)
            self.prompt_chains.prune(live)
            self._views = {r: view for r, view in self._views.items() if live(r)}
            self._held_since = {r: since for r, since in self._held_since.items()
                                if live(r) and self.requests[r].status != RequestStatus.RUNNING}
        if not self.waiting:
            return [], {}
        if len(self.waiting) < 2 and not segments.pending and not deferred:
            return [], {}
        held: list[Any] = []
        candidates: list[Candidate] = []
        pending_entries = self.page_manager.pending_ids()

        def may_share(request: Any) -> bool:
            view = self._sharing_view(request)
            return view.shares and not self._waited_enough(request.request_id)

        for request in itertools.islice(self.waiting, SEGMENT_LOOKAHEAD):
            if not may_share(request):
                continue
            view = self._sharing_view(request)
            chain, settings = view.chain, view.settings
            if ((segments.pending
                 and segments.holding(chain, request.num_prompt_tokens, settings))
                    or (pending_entries and self.reuse.waits_for_compaction(
                        request.request_id, pending_entries, chain, request.num_prompt_tokens,
                        settings, segments.min_tokens))):
                held.append(request)
            elif (view.segmentable and request.status == RequestStatus.WAITING
                  and not request.num_computed_tokens
                  and request.request_id not in segments.unshared):
                candidates.append(Candidate(request.request_id, chain.tokens, settings,
                                            chain=chain))

        def cached_of(request_id: str) -> int:
            match = self.reuse.lookup(self.requests[request_id])
            return 0 if match is None else match.hit

        for request_id in deferred:
            readers = self._fork(request_id, candidates, cached_of)
            held.extend(self.requests[reader] for reader in readers)
            candidates = [c for c in candidates if c.request_id not in readers]
        for segment, readers in segments.plan(candidates, cached_of,
                                              version=self.reuse.state_version()):
            first = self.requests[readers[0]]
            own = sorted(self.requests[request_id].num_prompt_tokens - len(segment.tokens)
                         for request_id in readers)
            request = segment_request(segment.request_id, segment.tokens, first,
                                      readers_after=own[len(own) // 2])
            self.add_request(request)
            # First in the queue: a short prefill that unblocks every reader.
            self.waiting.remove_request(request)
            self.waiting.prepend_request(request)
            self.reuse.count_segment(len(segment.tokens))
            self._segment_readers[segment.request_id] = list(readers)
            held.extend(self.requests[request_id] for request_id in readers)
            logger.debug("kvcompress: %d waiting requests share %d prompt tokens, computed "
                         "once by %s", len(readers), len(segment.tokens), segment.request_id)
        if segments.pending:  # readers queued beyond the lookahead wait for the segment too
            # (Segment requests queued first shifted the queue: some are held already.)
            seen = {request.request_id for request in held}
            for request in itertools.islice(self.waiting, SEGMENT_LOOKAHEAD, None):
                if (request.request_id not in seen
                        and segments.may_hold(request.request_id, request.prompt_token_ids)
                        and may_share(request)
                        and segments.holding(
                            segments.prompt_of(request.request_id, request.prompt_token_ids),
                            request.num_prompt_tokens,
                            resolve(self.compression_config, request.sampling_params))):
                    held.append(request)
        for request in held:
            self._held_since.setdefault(request.request_id, self._schedules)
        if not held:
            return [], {}
        positions = {request.request_id: index for index, request in enumerate(self.waiting)}
        self.waiting.remove_requests(held)
        return held, positions

    def _sharing_view(self, request: Any) -> SharingView:
        """What the grouping of shared prefixes reads of a waiting request that does not
        change while it lives (``SharingView``), made once."""
        view = self._views.get(request.request_id)
        if view is None:
            shares = (not self.segments.is_segment(request.request_id)
                      and request.sampling_params is not None and self.reuse.may_read(request))
            settings = resolve(self.compression_config, request.sampling_params)
            view = self._views[request.request_id] = SharingView(
                shares, self.segments.chain_of(request.request_id, request.prompt_token_ids),
                settings, may_segment(settings, request.num_prompt_tokens))
        return view

    def _waited_enough(self, request_id: str) -> bool:
        """Whether the request was held for shared prefixes ``--kv-sharing-wait`` schedules
        since it was first held: then it is held no more, shares no new segment, and
        prefills (and compresses) its own copy, adopting what the cache offers by then."""
        since = self._held_since.get(request_id)
        if since is None or self._schedules - since < self.compression_config.sharing_wait:
            return False
        self.segments.unshared.add(request_id)
        return True

    def _fork(self, request_id: str, candidates: list[Candidate],
              cached_of: Callable[[str], int]) -> list[str]:
        """A fork: the deferred request's first tokens that waiting ``candidates`` share
        (``PrefixSegments.choose``, the request first) become a segment without a request of its
        own. The scheduler allocates its pages as a pseudo-request's (the worker copies the
        request's uncompressed pages onto them and plans them, ``DeferredCompactions``);
        with the step's report it is filed pending, as a segment request's (``_file_forks``),
        and the readers, held meanwhile, adopt it. Returns the readers' ids (none: no
        fork)."""
        request = self.requests[request_id]
        segments = self.segments
        if not candidates or not request.sampling_params:
            return []
        settings = resolve(self.compression_config, request.sampling_params)
        chain = segments.chain_of(request_id, request.prompt_token_ids)
        tokens = chain.tokens
        first = segments.block_of(request_id, tokens)
        sharing = [candidate for candidate in candidates
                   if segments.block_of(candidate.request_id, candidate.tokens) == first]
        for candidate in sharing:
            if candidate.cached is None:
                candidate.cached = cached_of(candidate.request_id)
        length, readers = segments.choose(
            Candidate(request_id, tokens, settings, cached=0, chain=chain), sharing)
        if not length:
            return []
        fork = Segment(segments.next_id(), tokens[:length].copy(), settings)
        allocated = self.page_manager.allocate(fork.request_id, length)
        self.reuse.forget_evicted()  # entries whose pages the copy takes
        if not allocated:
            return []  # no room for a copy: the readers make a segment of their own
        segments.pending[fork.request_id] = fork
        segments.forks += 1
        segments.serve(readers, length)
        self._forks[request_id] = fork
        self._segment_readers[fork.request_id] = list(readers)
        logger.debug("kvcompress: %d waiting requests share %d prompt tokens with %s, forked "
                     "as %s", len(readers) - 1, length, request_id, fork.request_id)
        return readers[1:]

    def _defer_lone_prompt(self, scheduler_output: SchedulerOutput) -> frozenset[str]:
        """A prompt that completes in this step while nothing else runs or waits is compacted
        a step late, parked meanwhile (its first output is sampled as usual; its scores are
        kept): requests sent together with it, a burst's first arriving alone, are waiting
        by then, and what they share with it is forked off its pages (``_fork``) instead of
        being computed again by a segment request. Only for prompts that a segment could be
        made of (query-agnostic scores computed in their prefill, ``may_segment``) and that
        are compacted at all; the cost is the request's second token a step later."""
        if (not self.reuse.enabled or self.waiting or len(self.running) != 1
                or self.passes.pending):
            return frozenset()
        request = self.running[0]
        request_id = request.request_id
        scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
        prompt_len = request.num_prompt_tokens
        if not (scheduled and request.num_computed_tokens - scheduled < prompt_len
                == request.num_computed_tokens and not request.num_output_tokens):
            return frozenset()  # not completing a fresh prompt (nor resuming) in this step
        if (self.segments.is_segment(request_id) or request.sampling_params is None
                or not self.reuse.may_read(request)
                or request.num_output_tokens + 1 >= request.max_tokens
                or prompt_len <= self.segments.min_tokens + self.segments.boundary
                or self.page_manager.adoption(request_id) is not None):
            return frozenset()
        settings = resolve(self.compression_config, request.sampling_params)
        if (not settings.compresses(prompt_len) or settings.reconstructs(prompt_len)
                or not may_segment(settings, prompt_len)):
            return frozenset()
        self._deferred.add(request_id)
        return frozenset((request_id,))

    def _file_forks(self, report: WorkerReport, failed: dict[str, str]) -> None:
        """The forks ordered in this step: each filed pending (its plan reported, as a
        segment request's when it ends) and indexed by its tokens, or its pages freed (the
        worker reported no plan, or it failed). Their readers are held no longer."""
        for fork in self._forks.values():
            fork_id = fork.request_id
            self.segments.pending.pop(fork_id, None)
            compaction = report.compactions.get(fork_id)
            failure = failed.pop(fork_id, None)
            if failure is not None:
                logger.error("kvcompress: fork %s failed: %s", fork_id, failure)
                self._unshare(fork_id)
            planned = (failure is None and compaction is not None
                       and compaction.kind == "deferred")
            if not (planned and self.reuse.file_segment(fork_id, fork.tokens, fork.settings)):
                self.page_manager.free(fork_id)
                self._segment_readers.pop(fork_id, None)
        self._forks = {}

    def _drop_failed_segments(self, failed: dict[str, str]) -> None:
        """A segment whose in-place compaction failed on the worker: every entry holding it
        (its own, and those its readers retired into) was shrunk already and holds what the
        failed moves left, so each is dropped; its running readers fail on the worker."""
        for segment_id in [s for s in failed if s in self._compacting]:
            _, holders = self._compacting.pop(segment_id)
            logger.error("kvcompress: segment %s was not compacted (%s); dropping the %d "
                         "cached entries that hold it", segment_id, failed.pop(segment_id),
                         len(holders))
            self.reuse.drop(holders)

    def _unshare(self, segment_id: str) -> None:
        """A segment request or fork failed: the requests it was made for compress their own
        copies from now on (``PrefixSegments.unshared``)."""
        self.segments.unshared.update(self._segment_readers.pop(segment_id, ()))

    def _compact_segments(self) -> None:
        """Compact each pending segment entry in place (``paging.prefix_cache``) once none of
        the requests reading it is in prefill (they prefilled their own parts over the whole
        prefix, as a request compressing its own copy does) and none of the readers it was
        made for still waits to read it whole: after one schedule (its held readers were
        admitted then, as many as fit), those still waiting are waited for while they would
        fit beside it (they wait for a running request's slot: --max-num-seqs), at most
        ``MAX_PENDING_SCHEDULES``; one that does not fit gets the pages compaction frees,
        and reads it compacted."""
        manager = self.page_manager
        self._compacting = {segment_id: compacted for segment_id, compacted
                            in self._compacting.items()
                            if self._schedules - compacted[0] < MAX_REPORT_SCHEDULES}
        pending = manager.pending_ids()
        for entry_id in [entry_id for entry_id in self._pending_since if entry_id not in pending]:
            del self._pending_since[entry_id]
        live = {manager.pending_segment_id(entry_id) for entry_id in pending}
        forks = {fork.request_id for fork in self._forks.values()}
        for segment_id in [s for s in self._segment_readers
                           if s not in live and s not in self.requests and s not in forks]:
            del self._segment_readers[segment_id]
        if not pending:
            return
        parked = self.passes.parked()
        for entry_id in pending:
            since = self._pending_since.setdefault(entry_id, self._schedules)
            if since == self._schedules:
                continue
            if any(self._in_prefill(request_id, parked)
                   for request_id in manager.segment_readers(entry_id)):
                continue
            if (self._schedules - since < MAX_PENDING_SCHEDULES
                    and self._reader_waits_to_fit(entry_id)):
                continue
            segment_id = manager.pending_segment_id(entry_id)
            if segment_id is not None:
                self._compacting[segment_id] = (self._schedules,
                                                manager.entries_holding(entry_id))
            self.num_pages_freed_by_compression += manager.compact_segment(entry_id)
            del self._pending_since[entry_id]
            self._segment_readers.pop(manager.pending_segment_id(entry_id) or "", None)

    def _reader_waits_to_fit(self, entry_id: int) -> bool:
        """Whether the first reader the pending segment was made for that still waits would
        fit beside it, whole (so it waits for a slot, not for pages)."""
        manager = self.page_manager
        segment_id = manager.pending_segment_id(entry_id)
        entry = manager.shards[0].entry(entry_id)
        if entry is None:
            return False
        for reader_id in self._segment_readers.get(segment_id or "", ()):
            request = self.requests.get(reader_id)
            if request is None or reader_id in manager or request.is_finished():
                continue
            # Asked every schedule while it waits; the answer moves only with the pool.
            key = (entry_id, reader_id, manager.num_free, manager.num_available,
                   self.reuse.state_version())
            if self._fits_asked[0] != key:
                self._fits_asked = (key, manager.can_adopt(
                    entry_id, entry.logical_len, request.num_prompt_tokens, share=True))
            return self._fits_asked[1]
        return False

    def _holding_scores(self) -> frozenset[str]:
        """Requests past their prefill whose prompt scores live on: parked for
        reconstruction passes, or compacted a step late."""
        return self.passes.parked() | frozenset(self._deferred)

    def _in_prefill(self, request_id: str, parked: Any) -> bool:
        """Whether the request's prompt is not computed and compacted yet."""
        request = self.requests.get(request_id)
        return request is not None and (request_id in parked
                                        or request.num_computed_tokens < request.num_prompt_tokens)

    def _unhold(self, held: list[Any], positions: dict[str, int]) -> None:
        """Put the held requests back into ``self.waiting`` where they were (first come,
        first served: requests queued during the step, preempted ones, go first)."""
        if not held:
            return
        if self.policy != SchedulingPolicy.FCFS:
            for request in held:
                self.waiting.add_request(request)
            return
        rest = list(self.waiting)
        self.waiting.remove_requests(rest)
        new = [request for request in rest if request.request_id not in positions]
        old = sorted([*(request for request in rest if request.request_id in positions), *held],
                     key=lambda request: positions[request.request_id])
        for request in [*new, *old]:
            self.waiting.add_request(request)

    def _end_segment_requests(self, outputs: dict[int, Any]) -> None:
        """A segment request ends once its prompt is computed and compacted (not while it
        waits for reconstruction passes): finished as aborted, its pages are filed as an
        entry cut at its prompt's end. Its outputs never leave the engine."""
        segments = self.segments
        if not segments.pending and not self.segments.made:
            return
        done = [request_id for request_id in segments.pending
                if (request := self.requests.get(request_id)) is not None
                and not request.is_finished()
                and request.num_computed_tokens >= request.num_prompt_tokens
                and request_id not in self.passes.parked()]
        if done:
            self.finish_requests(done, RequestStatus.FINISHED_ABORTED)
            for request_id in done:
                segment = segments.pending.pop(request_id, None)
                if segment is not None:
                    segments.serve(self._segment_readers.get(request_id, ()),
                                   len(segment.tokens))
        for batch in outputs.values():
            batch.outputs = [output for output in batch.outputs
                             if not segments.is_segment(output.request_id)]
            finished = getattr(batch, "finished_requests", None)
            if finished:
                batch.finished_requests = {request_id for request_id in finished
                                           if not segments.is_segment(request_id)}

    def _plan_cache_evictions(self) -> None:
        """The prefix-cache entries the first waiting requests will adopt are evicted last,
        the one needed latest first (``PrefixCache.plan_evictions``): in a round of chat
        turns the first admitted no longer evict the caches of the turns queued behind."""
        if not self.reuse.enabled or not len(self.reuse.index):
            return
        first = list(itertools.islice(self.waiting, EVICTION_LOOKAHEAD))
        key = (self.reuse.state_version(), [request.request_id for request in first])
        if key == self._evictions_planned_for:
            return  # the same queue head against the same entries: the same order
        self._evictions_planned_for = key
        next_use: dict[int, int] = {}
        for position, request in enumerate(first):
            match = self.reuse.lookup(request)
            if match is not None:
                next_use.setdefault(match.entry_id, position)
        self.page_manager.plan_evictions(next_use)

    def _grant_passes(self, deferred: list[str]) -> StepPasses:
        """This step's pass chunks, out of the token budget after one token per decoding
        request; the parked requests (those waiting for passes, and the ``deferred`` ones,
        compacted in this step) leave ``running`` (and its limits) while vLLM schedules,
        so their decode waits and no victim is picked among them."""
        if not self.passes.pending and not deferred:
            return StepPasses({}, 0, frozenset())
        parked_ids = self.passes.parked() | frozenset(deferred)
        self._parked_now = [r for r in self.running if r.request_id in parked_ids]
        self.running = [r for r in self.running if r.request_id not in parked_ids]
        decoding = sum(1 for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens)
        passes = self.passes.grant(self._full_token_budget - decoding)
        passes = StepPasses(passes.grants, passes.tokens, parked_ids)
        parked = len(self._parked_now)
        self.max_num_running_reqs -= parked
        self.max_num_active_reqs -= parked
        self.max_num_scheduled_tokens = max(decoding, self._full_token_budget - passes.tokens)
        return passes

    def _unpark(self, passes: StepPasses) -> None:
        if not passes.parked:
            return
        parked = len(self._parked_now)
        self.max_num_running_reqs += parked
        self.max_num_active_reqs += parked
        self.max_num_scheduled_tokens = self._full_token_budget
        self.running.extend(self._parked_now)
        self._parked_now = []

    def _order_running_by_recompute_cost(self) -> None:
        """vLLM preempts the last running request (first-come-first-served): make it the
        cheapest to recompute. Decoding requests come first, then prompts still in
        prefill; each group by computed tokens, most first. The order is stable, so it
        only changes when the costs do."""
        if self.policy != SchedulingPolicy.FCFS:
            return  # priority scheduling picks its own victim
        self.running.sort(key=lambda r: (r.num_computed_tokens < r.num_prompt_tokens,
                                         -r.num_computed_tokens))

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        self.figures.preempted_tokens += request.num_computed_tokens
        super()._preempt_request(request, *args, **kwargs)

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        """vLLM's last say on a chunk's size before its slots are allocated (0: not this
        step, no preemption): here a chunk also stops short of its observation window while
        the window scores of other prompts fill their reserve (``scoring_memory``)."""
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
        failed = dict(report.failures)
        # Stage 8: release compacted pages first; requests finishing in this step free the rest.
        for request_id, compaction in report.compactions.items():
            try:
                self._release(request_id, compaction)
            except Exception as error:  # a bad report ends its request, not the engine
                logger.exception("kvcompress: compaction report of %s rejected", request_id)
                failed[request_id] = f"compaction report rejected: {error!r}"
        if self._forks:
            self._file_forks(report, failed)
        self._drop_failed_segments(failed)
        for request_id in failed:
            if self.segments.is_segment(request_id):
                self._unshare(request_id)
        if self.log_stats:
            self.figures.add_report(report)
            self.figures.failed_requests += len(failed)
        # vLLM frees (and kvcompress files) the requests that finish in this step before the
        # failed ones are ended: a failed one must not be filed on the way.
        self.kv_cache_manager.unfileable = set(failed)
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            self.passes.add(report.passes_pending, self.requests)
            self.scoring_gate.prune(self.requests, held=self._holding_scores())
            if failed:
                self._finish_with_error(failed, outputs)
            self._end_segment_requests(outputs)
        finally:
            self.kv_cache_manager.unfileable = set()
        if self.check_pages_every_step:
            self.check_pages()
        return outputs

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:  # vllm_hooks gave SchedulerStats this field
            manager = self.page_manager
            figures = self.figures.take(manager.free_pages_all_ranks,
                                        manager.total_pages_all_ranks)
            figures.update(self.reuse.figures.take(),
                           pages_cached=manager.cached_pages_all_ranks)
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
        index = self.reuse.index
        assert len(index) == len(entry_ids) and all(e in index for e in entry_ids), (
            f"cached entries {entry_ids} and the {len(index)} indexed ones differ")
        for rank, manager in enumerate(self.page_manager.shards):
            leaked = manager.request_ids() - set(self.requests)
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
