"""vLLM's KV-cache manager with admission and preemption decided in per-head pages.

vLLM's own manager is kept, wrapped, over a *virtual* block pool that is large enough
never to be the limit: it keeps doing the logical bookkeeping the scheduler relies on
(block ids, per-request block lists), but no memory stands behind those blocks. Memory
lives in the page pool, and whether a request may run is decided here, in pages.

vLLM's prefix-cache questions are answered here too, from kvcompress's own prefix cache of
finished requests' pages (``kvcompress.engine.sched.prefix_cache``): a lookup returns the hit's
tokens with no vLLM blocks; the adoption happens in ``allocate_slots``, which hands the
inner manager those tokens as already computed ("external") so it keeps its logical blocks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from kvcompress.engine.sched.admission import AdmissionPlanner
from kvcompress.engine.sched.prefix_cache import Match, PrefixCachePolicy
from kvcompress.log import get_logger
from kvcompress.paging import ShardedPageManager

logger = get_logger(__name__)

# Enough virtual blocks for every running request at max length, within reason: each
# is a small Python object on the scheduler side.
_MAX_VIRTUAL_BLOCKS = 1 << 21


def virtual_kv_cache_config(
    kv_cache_config: KVCacheConfig, max_num_seqs: int, max_model_len: int
) -> KVCacheConfig:
    """A copy of ``kv_cache_config`` whose block count is never the admission limit."""
    # Every group (one per layer type of a hybrid model) draws from the same block pool.
    per_request = sum(cdiv(max_model_len, group.kv_cache_spec.block_size)
                      for group in kv_cache_config.kv_cache_groups)
    wanted = max_num_seqs * per_request + 1  # + vLLM's null block
    virtual = copy.deepcopy(kv_cache_config)
    virtual.num_blocks = max(kv_cache_config.num_blocks, min(wanted, _MAX_VIRTUAL_BLOCKS))
    if wanted > _MAX_VIRTUAL_BLOCKS:
        logger.warning(
            "kvcompress: capping logical KV blocks at %d; with --max-num-seqs %d and "
            "--max-model-len %d the logical pool, not the page pool, may limit admission",
            _MAX_VIRTUAL_BLOCKS, max_num_seqs, max_model_len,
        )
    return virtual


class PagedKVCacheManager:
    """Wraps a vLLM KVCacheManager; everything not overridden here goes to it."""

    def __init__(self, inner: KVCacheManager, pages: ShardedPageManager, watermark: float,
                 admission: AdmissionPlanner, max_num_batched_tokens: int,
                 reuse: PrefixCachePolicy, log_stats: bool = False,
                 waiting: Callable[[], Iterable[Request]] = tuple) -> None:
        self.inner = inner
        self.waiting = waiting  # the scheduler's waiting requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pages = pages
        self.watermark_pages = int(watermark * pages.total_pages)
        self.admission = admission
        self.reuse = reuse
        self.window_freed_pages = 0  # sliding-window pages freed (cumulative)
        # Lookups waiting for their request's allocation, by request id.
        self._matches: dict[str, Match] = {}
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        # Requests whose compression failed in the step being processed: their rows may be
        # half moved, so when they finish their pages are freed, never filed.
        self.unfileable: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def usage(self) -> float:
        return self.pages.usage

    # ------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """The hit's tokens of the longest prefix-cache entry the request starts with; no
        vLLM blocks (the pages are adopted in ``allocate_slots``)."""
        match = self.reuse.lookup(request)
        if match is None:
            self._matches.pop(request.request_id, None)
            return self.inner.empty_kv_cache_blocks, 0, 0
        self._matches[request.request_id] = match
        return self.inner.empty_kv_cache_blocks, match.hit, 0

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.prefix_cache_stats is None or not self.reuse.enabled:
            return
        if request.skip_reading_prefix_cache:
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        stats = self.prefix_cache_stats
        if stats is not None:
            self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        self.reuse.clear()
        return self.inner.reset_prefix_cache()

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        *args: Any,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
        **kwargs: Any,
    ) -> KVCacheBlocks | None:
        match = self._matches.pop(request.request_id, None)
        if num_new_computed_tokens:
            if match is None or match.hit != num_new_computed_tokens:
                raise RuntimeError(f"request {request.request_id}: vLLM adopts "
                                   f"{num_new_computed_tokens} cached tokens kvcompress did "
                                   "not offer")
            # vLLM's blocks for them are new ones (no vLLM block holds them): "external".
            num_external_computed_tokens += num_new_computed_tokens
            num_new_computed_tokens, new_computed_blocks = 0, None
        else:
            match = None
        computed = request.num_computed_tokens + num_external_computed_tokens
        logical_len = min(
            computed + num_new_tokens + num_lookahead_tokens, self.inner.max_model_len
        )
        admitting = has_scheduled_reqs and request.status in (
            RequestStatus.WAITING, RequestStatus.PREEMPTED
        )
        reserve = self.watermark_pages if admitting else 0
        request_id = request.request_id
        # Like vLLM's remove_skipped_blocks: what left a sliding window is freed before the
        # new tokens are counted (async scheduling is off: computed tokens are processed).
        self.window_freed_pages += self.pages.drop_outside_window(
            request_id, request.num_computed_tokens)
        # vLLM's full-sequence check (scheduler_reserve_full_isl); an adopter's is its
        # adoption's, below: its prefix is a cache hit, read in place, not pages it needs.
        full_len = min(request.num_tokens, self.inner.max_model_len)
        if full_sequence_must_fit and match is None:
            needed = self.pages.pages_needed_for_sequence(request_id, full_len,
                                                          self.max_num_batched_tokens)
            if needed + reserve > self.pages.num_available:
                return None
        if match is not None and self.pages.is_offloaded(match.entry_id):
            # Its pages come back from the offload tier first (the worker loads them before
            # the step's forward), then it is adopted as a resident entry.
            if not self.pages.can_restore(match.entry_id, match.hit, logical_len, reserve):
                return None
            self.reuse.restore(match)
        share = False
        if match is not None:
            # A share keeps the entry for other adopters (now or later), reading its whole
            # pages in place; but the adopter's own pages (each row's copied partial page,
            # its growth) and the entry kept whole evict other entries when the free pages
            # fall short: under memory pressure each turn fewer conversations found their
            # cache (issue 30 item 5). So it shares from free pages, or for a waiting branch
            # of the same context; otherwise the entry is handed over (its partial pages
            # taken as they are, what lies past the cut freed), and its adopter files a
            # longer one when it finishes.
            # A pending segment is shared too: handed over, it would never be compacted.
            share = self.pages.can_share_from_free(match.entry_id, match.hit, logical_len,
                                                   reserve) or (
                (self._branch_waits(request, match.hit)
                 or self.pages.is_pending(match.entry_id))
                and self.pages.can_adopt(match.entry_id, match.hit, logical_len, True,
                                         reserve))
            if not share and not self.pages.can_adopt(match.entry_id, match.hit, logical_len,
                                                      False, reserve):
                return None
            if full_sequence_must_fit and full_len > logical_len and not self.pages.can_adopt(
                    match.entry_id, match.hit, full_len, share, reserve):
                return None
        elif (self.pages.pages_needed(request_id, logical_len) + reserve
              > self.pages.num_available):
            return None
        # An adopter is planned from what it will hold: the entry's rows, then its new part;
        # the entry's pages running requests read already are counted once, with theirs.
        adoption = None
        if match is not None:
            rows = self.pages.entry_lengths(match.entry_id, match.hit)
            adoption = None if rows is None else (
                match.hit, rows, self.pages.pages_read_already(match.entry_id, match.hit))
        if admitting and not self.admission.admits(request, reserve, adoption):
            return None  # fits now, but not beside the running requests' growth
        blocks = self.inner.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            *args,
            full_sequence_must_fit=full_sequence_must_fit,
            has_scheduled_reqs=has_scheduled_reqs,
            **kwargs,
        )
        if blocks is None:
            return None
        if match is not None:
            self.reuse.adopt(request_id, match, share)
        allocated = self.pages.allocate(request_id, logical_len, reserve=0)
        assert allocated, "page check and allocation disagree"
        self.reuse.forget_evicted()
        return blocks

    def _branch_waits(self, request: Request, hit: int) -> bool:
        """Whether another waiting request starts with the same ``hit`` tokens (parallel
        samples, retries, several questions on one context): the entry would serve it too."""
        prefix = request.all_token_ids[:hit]
        return any(other is not request and other.num_prompt_tokens > hit
                   and other.all_token_ids[:hit] == prefix for other in self.waiting())

    def free(self, request: Request) -> None:
        self.inner.free(request)
        self._release_pages(request)

    def pop_blocks_for_free(self, request: Request) -> Any:
        self._release_pages(request)
        return self.inner.pop_blocks_for_free(request)

    def _release_pages(self, request: Request) -> None:
        """A finished request's pages become a prefix-cache entry (when the cache is on and
        they are worth it); a preempted or failed one's are freed."""
        self._matches.pop(request.request_id, None)
        self.reuse.forget_handoff(request.request_id, request.is_finished())
        if (request.request_id in self.unfileable or not request.is_finished()
                or not self.reuse.retire(request)):
            self.pages.free(request.request_id)
