"""Shared prefixes over the scheduler's queues: segments, forks, holds, and the in-place
compaction of a pending segment (docs/design.md, "Sharing").

Before vLLM schedules, ``before_schedule`` compacts the pending segments no reader needs
whole any more, orders the prefix cache's evictions after the queue head, makes a fork of
each deferred prompt's first tokens that waiting requests share, queues a segment request
for each prefix that other waiting requests share (``prefix_segments``), and holds the
requests that would adopt a segment or fork being made (``request_life``: vLLM skips them
in its waiting loop). After the step, ``file_forks`` files the step's forks,
``drop_failed_segments`` drops the entries of a segment whose compaction failed, and
``end_segment_requests`` ends the segment requests whose prompt is compacted.

Every change to vLLM's scheduler itself is in ``scheduler``; this module reads its queues
and requests and adds requests through its public methods.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from vllm.v1.request import RequestStatus

from kvcompress.engine.messages import WorkerReport
from kvcompress.engine.request_settings import resolve
from kvcompress.engine.sched.prefix_cache import PrefixCachePolicy
from kvcompress.engine.sched.prefix_segments import (
    SEGMENT_LOOKAHEAD,
    Candidate,
    PrefixSegments,
    Segment,
    SharingView,
    may_segment,
    segment_request,
)
from kvcompress.engine.sched.request_life import Life, RequestLives
from kvcompress.log import get_logger
from kvcompress.paging import ShardedPageManager
from kvcompress.paging.prefix_index import PromptChains

logger = get_logger(__name__)

# Waiting requests whose cached prefixes the eviction order protects (a lookup each per step).
EVICTION_LOOKAHEAD = 64
# Schedules a pending segment waits at most for the readers it was made for.
MAX_PENDING_SCHEDULES = 256
# Schedules between prunings of what is kept per waiting request (prompt chains, views).
PRUNE_EVERY = 16
# Schedules within which the worker reports a segment's failed in-place compaction.
MAX_REPORT_SCHEDULES = 8


class PrefixSharing:
    """The sharing of prefixes among the requests of ``scheduler`` (``KVCompressScheduler``:
    its ``requests``, ``waiting``, ``running``, ``passes`` and ``add_request`` /
    ``finish_requests`` are read and called, nothing of vLLM's is changed here)."""

    def __init__(self, scheduler: Any, page_manager: ShardedPageManager,
                 reuse: PrefixCachePolicy, segments: PrefixSegments,
                 sharing_wait: int) -> None:
        self.scheduler = scheduler
        self.page_manager = page_manager
        self.reuse = reuse
        self.segments = segments
        self.lives: RequestLives = segments.lives
        # Shared with the prefix cache's lookups (``PrefixCachePolicy.chains``).
        self.prompt_chains: PromptChains = segments.chains
        self.sharing_wait = sharing_wait
        self.schedules = 0
        # Pending segment entries (filed uncompressed) -> the schedule that first saw them:
        # they are compacted from the next one on, once none of their readers is in prefill.
        self._pending_since: dict[int, int] = {}
        # The forks ordered in this schedule, by the id of the request they are made of
        # (filed with the step's report, ``file_forks``).
        self.forks: dict[str, Segment] = {}
        # The last ``_reader_waits_to_fit`` question and its answer.
        self._fits_asked: tuple = ((), False)
        # The queue head and cache state the eviction order was last planned for.
        self._evictions_planned_for: tuple = ()
        # What the grouping reads of each waiting request, made once (``_sharing_view``).
        self._views: dict[str, SharingView] = {}
        # Segments compacted in place -> (the schedule, the entries holding them): dropped if
        # the worker reports the compaction failed (``drop_failed_segments``); a report
        # comes with the step that ran it, or the next one that runs a batch.
        self._compacting: dict[str, tuple[int, list[int]]] = {}
        self.pages_freed = 0  # by compacting segments in place

    def before_schedule(self, deferred: list[str]) -> None:
        """Stage 1 for shared prefixes, before vLLM schedules (module docstring)."""
        self.schedules += 1
        self.compact_segments()
        self.plan_cache_evictions()
        self.lives.hold_exactly(self.share_prefixes(deferred), self.schedules)

    def share_prefixes(self, deferred: list[str]) -> list[str]:
        """Make a fork of each ``deferred`` request's first tokens that waiting requests
        share (``_fork``), queue a segment request for each prefix that other waiting
        requests share (``PrefixSegments.plan``), and hold the requests whose prompts start
        with a segment still being computed (or a fork): vLLM skips them while it schedules,
        so that they adopt it once filed rather than prefill it again, without blocking the
        requests behind them. Those that share a pending segment but cannot adopt it whole
        are held until it is compacted (``PrefixCachePolicy.waits_for_compaction``).
        Returns the ids of the requests held in this schedule."""
        segments, scheduler = self.segments, self.scheduler
        if not self.reuse.enabled:
            return []

        def live(request_id: str) -> bool:
            return (request := scheduler.requests.get(request_id)) is not None and (
                not request.is_finished())

        segments.prune(live)
        if self.schedules % PRUNE_EVERY == 0:  # (what it forgets costs nothing meanwhile)
            self.prompt_chains.prune(live)
            self._views = {r: view for r, view in self._views.items() if live(r)}
        waiting = scheduler.waiting
        if not waiting or (len(waiting) < 2 and not segments.pending and not deferred):
            return []
        held: list[Any] = []
        candidates: list[Candidate] = []
        pending_entries = self.page_manager.pending_ids()

        def may_share(request: Any) -> bool:
            view = self._sharing_view(request)
            return view.shares and not self._waited_enough(request.request_id)

        for request in itertools.islice(waiting, SEGMENT_LOOKAHEAD):
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
                  and not self.lives.on_own_copy(request.request_id)):
                candidates.append(Candidate(request.request_id, chain.tokens, settings,
                                            chain=chain))

        def cached_of(request_id: str) -> int:
            match = self.reuse.lookup(scheduler.requests[request_id])
            return 0 if match is None else match.hit

        for request_id in deferred:
            readers = self._fork(request_id, candidates, cached_of)
            held.extend(scheduler.requests[reader] for reader in readers)
            candidates = [c for c in candidates if c.request_id not in readers]
        for segment, readers in segments.plan(candidates, cached_of,
                                              version=self.reuse.state_version()):
            self._queue_segment(segment, readers)
            held.extend(scheduler.requests[request_id] for request_id in readers)
        if segments.pending:  # readers queued beyond the lookahead wait for the segment too
            # (Segment requests queued first shifted the queue: some are held already.)
            seen = {request.request_id for request in held}
            for request in itertools.islice(waiting, SEGMENT_LOOKAHEAD, None):
                if (request.request_id not in seen
                        and segments.may_hold(request.request_id, request.prompt_token_ids)
                        and may_share(request)):
                    view = self._sharing_view(request)  # (made by may_share)
                    if segments.holding(view.chain, request.num_prompt_tokens, view.settings):
                        held.append(request)
        return [request.request_id for request in held]

    def _queue_segment(self, segment: Segment, readers: list[str]) -> None:
        """A segment request for ``readers``, first in the queue: a short prefill that
        unblocks every reader."""
        scheduler = self.scheduler
        first = scheduler.requests[readers[0]]
        own = sorted(scheduler.requests[request_id].num_prompt_tokens - len(segment.tokens)
                     for request_id in readers)
        request = segment_request(segment.request_id, segment.tokens, first,
                                  readers_after=own[len(own) // 2])
        scheduler.add_request(request)
        scheduler.waiting.remove_request(request)
        scheduler.waiting.prepend_request(request)
        self.reuse.count_segment(len(segment.tokens))
        logger.debug("kvcompress: %d waiting requests share %d prompt tokens, computed "
                     "once by %s", len(readers), len(segment.tokens), segment.request_id)

    def _sharing_view(self, request: Any) -> SharingView:
        """What the grouping of shared prefixes reads of a waiting request that does not
        change while it lives (``SharingView``), made once."""
        view = self._views.get(request.request_id)
        if view is None:
            shares = (not self.lives.is_segment(request.request_id)
                      and request.sampling_params is not None and self.reuse.may_read(request))
            settings = resolve(self.scheduler.compression_config, request.sampling_params)
            view = self._views[request.request_id] = SharingView(
                shares, self.segments.chain_of(request.request_id, request.prompt_token_ids),
                settings, may_segment(settings, request.num_prompt_tokens))
        return view

    def _waited_enough(self, request_id: str) -> bool:
        """Whether the request was held for shared prefixes ``--kv-sharing-wait`` schedules
        since it was first held: then it is held no more, shares no new segment, and
        prefills (and compresses) its own copy, adopting what the cache offers by then."""
        since = self.lives.waited_since(request_id)
        if since is None or self.schedules - since < self.sharing_wait:
            return False
        self.lives.own_copy((request_id,))
        return True

    def _fork(self, request_id: str, candidates: list[Candidate],
              cached_of: Callable[[str], int]) -> list[str]:
        """A fork: the deferred request's first tokens that waiting ``candidates`` share
        (``PrefixSegments.choose``, the request first) become a segment without a request of
        its own. Its pages are allocated as a pseudo-request's (the worker copies the
        request's uncompressed pages onto them and plans them, ``DeferredCompactions``);
        with the step's report it is filed pending, as a segment request's (``file_forks``),
        and the readers, held meanwhile, adopt it. Returns the readers' ids (none: no
        fork)."""
        request = self.scheduler.requests[request_id]
        segments = self.segments
        if not candidates or not request.sampling_params:
            return []
        settings = resolve(self.scheduler.compression_config, request.sampling_params)
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
        self.lives.begin(fork.request_id, readers, fork=True)
        self.lives.serve(readers, length)
        self.forks[request_id] = fork
        logger.debug("kvcompress: %d waiting requests share %d prompt tokens with %s, forked "
                     "as %s", len(readers) - 1, length, request_id, fork.request_id)
        return readers[1:]

    def defer_lone_prompt(self, scheduler_output: Any) -> frozenset[str]:
        """A prompt that completes in this step while nothing else runs or waits is compacted
        a step late, given no tokens meanwhile (its first output is sampled as usual; its
        scores are kept): requests sent together with it, a burst's first arriving alone,
        are waiting by then, and what they share with it is forked off its pages (``_fork``)
        instead of being computed again by a segment request. Only for prompts that a
        segment could be made of (query-agnostic scores computed in their prefill,
        ``may_segment``) and that are compacted at all; the cost is the request's second
        token a step later."""
        scheduler = self.scheduler
        if (not self.reuse.enabled or scheduler.waiting or len(scheduler.running) != 1
                or scheduler.passes.pending):
            return frozenset()
        request = scheduler.running[0]
        request_id = request.request_id
        scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
        prompt_len = request.num_prompt_tokens
        if not (scheduled and request.num_computed_tokens - scheduled < prompt_len
                == request.num_computed_tokens and not request.num_output_tokens):
            return frozenset()  # not completing a fresh prompt (nor resuming) in this step
        if (self.lives.state(request_id) is not Life.FREE
                or request.sampling_params is None or not self.reuse.may_read(request)
                or request.num_output_tokens + 1 >= request.max_tokens
                or prompt_len <= self.segments.min_tokens + self.segments.boundary
                or self.page_manager.adoption(request_id) is not None):
            return frozenset()
        settings = resolve(scheduler.compression_config, request.sampling_params)
        if (not settings.compresses(prompt_len) or settings.reconstructs(prompt_len)
                or not may_segment(settings, prompt_len)):
            return frozenset()
        self.lives.move(request_id, Life.DEFERRED)
        return frozenset((request_id,))

    def file_forks(self, report: WorkerReport, failed: dict[str, str]) -> None:
        """The forks ordered in this step: each filed pending (its plan reported, as a
        segment request's when it ends) and indexed by its tokens, or its pages freed (the
        worker reported no plan, or it failed). Their readers are held no longer."""
        for fork in self.forks.values():
            fork_id = fork.request_id
            self.segments.pending.pop(fork_id, None)
            compaction = report.compactions.get(fork_id)
            failure = failed.pop(fork_id, None)
            if failure is not None:
                logger.error("kvcompress: fork %s failed: %s", fork_id, failure)
                self.unshare(fork_id)
            planned = (failure is None and compaction is not None
                       and compaction.kind == "deferred")
            if planned and self.reuse.file_segment(fork_id, fork.tokens, fork.settings):
                self.lives.move(fork_id, Life.FILED)
            else:
                self.page_manager.free(fork_id)
                self.lives.end(fork_id)
        self.forks = {}

    def drop_failed_segments(self, failed: dict[str, str]) -> None:
        """A segment whose in-place compaction failed on the worker: every entry holding it
        (its own, and those its readers retired into) was shrunk already and holds what the
        failed moves left, so each is dropped; its running readers fail on the worker."""
        for segment_id in [s for s in failed if s in self._compacting]:
            _, holders = self._compacting.pop(segment_id)
            logger.error("kvcompress: segment %s was not compacted (%s); dropping the %d "
                         "cached entries that hold it", segment_id, failed.pop(segment_id),
                         len(holders))
            self.reuse.drop(holders)

    def unshare(self, segment_id: str) -> None:
        """A segment request or fork failed: the requests it was made for compress their own
        copies from now on."""
        self.lives.own_copy(request_id for request_id in self.lives.readers_of(segment_id)
                            if request_id in self.scheduler.requests)

    def compact_segments(self) -> None:
        """Compact each pending segment entry in place (``paging.prefix_cache``) once none of
        the requests reading it is in prefill (they prefilled their own parts over the whole
        prefix, as a request compressing its own copy does) and none of the readers it was
        made for still waits to read it whole: after one schedule (its held readers were
        admitted then, as many as fit), those still waiting are waited for while they would
        fit beside it (they wait for a running request's slot: --max-num-seqs), at most
        ``MAX_PENDING_SCHEDULES``; one that does not fit gets the pages compaction frees,
        and reads it compacted."""
        manager, schedules = self.page_manager, self.schedules
        self._compacting = {segment_id: compacted for segment_id, compacted
                            in self._compacting.items()
                            if schedules - compacted[0] < MAX_REPORT_SCHEDULES}
        pending = manager.pending_ids()
        for entry_id in [entry_id for entry_id in self._pending_since if entry_id not in pending]:
            del self._pending_since[entry_id]
        live = {manager.pending_segment_id(entry_id) for entry_id in pending}
        for segment_id in self.lives.in_state(Life.FILED) - live:
            self.lives.end(segment_id)  # its entry was evicted or dropped
        if not pending:
            return
        for entry_id in pending:
            since = self._pending_since.setdefault(entry_id, schedules)
            if since == schedules:
                continue
            if any(self._in_prefill(request_id)
                   for request_id in manager.segment_readers(entry_id)):
                continue
            if (schedules - since < MAX_PENDING_SCHEDULES
                    and self._reader_waits_to_fit(entry_id)):
                continue
            segment_id = manager.pending_segment_id(entry_id)
            if segment_id is not None:
                self._compacting[segment_id] = (schedules, manager.entries_holding(entry_id))
                self.lives.end(segment_id)
            self.pages_freed += manager.compact_segment(entry_id)
            del self._pending_since[entry_id]

    def _in_prefill(self, request_id: str) -> bool:
        """Whether the request's prompt is not computed and compacted yet."""
        request = self.scheduler.requests.get(request_id)
        return request is not None and (
            request_id in self.scheduler.passes.pending
            or request.num_computed_tokens < request.num_prompt_tokens)

    def _reader_waits_to_fit(self, entry_id: int) -> bool:
        """Whether the first reader the pending segment was made for that still waits would
        fit beside it, whole (so it waits for a slot, not for pages)."""
        manager = self.page_manager
        segment_id = manager.pending_segment_id(entry_id)
        entry = manager.shards[0].entry(entry_id)
        if entry is None:
            return False
        for reader_id in self.lives.readers_of(segment_id or ""):
            request = self.scheduler.requests.get(reader_id)
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

    def end_segment_requests(self, outputs: dict[int, Any], known: frozenset[str]) -> None:
        """A segment request ends once its prompt is computed and compacted (not while it
        waits for reconstruction passes): finished as aborted, its pages are filed as an
        entry cut at its prompt's end. Its outputs never leave the engine (nor those of the
        ``known`` segment requests, which this step may have ended otherwise)."""
        segments, scheduler = self.segments, self.scheduler
        if not segments.pending and not known:
            return
        done = [request_id for request_id in segments.pending
                if (request := scheduler.requests.get(request_id)) is not None
                and not request.is_finished()
                and request.num_computed_tokens >= request.num_prompt_tokens
                and request_id not in scheduler.passes.pending]
        if done:
            for request_id in done:
                self.lives.move(request_id, Life.FILED)  # (before vLLM frees it)
            scheduler.finish_requests(done, RequestStatus.FINISHED_ABORTED)
            for request_id in done:
                segment = segments.pending.pop(request_id, None)
                if segment is not None:
                    self.lives.serve((r for r in self.lives.readers_of(request_id)
                                      if r in scheduler.requests), len(segment.tokens))
        ours = known | frozenset(done)
        for batch in outputs.values():
            batch.outputs = [output for output in batch.outputs
                             if output.request_id not in ours]
            finished = getattr(batch, "finished_requests", None)
            if finished:
                batch.finished_requests = {request_id for request_id in finished
                                           if request_id not in ours}

    def plan_cache_evictions(self) -> None:
        """The prefix-cache entries the first waiting requests will adopt are evicted last,
        the one needed latest first (``PrefixCache.plan_evictions``): in a round of chat
        turns the first admitted no longer evict the caches of the turns queued behind."""
        if not self.reuse.enabled or not len(self.reuse.index):
            return
        first = list(itertools.islice(self.scheduler.waiting, EVICTION_LOOKAHEAD))
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
