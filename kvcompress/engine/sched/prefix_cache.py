"""The prefix cache, engine side (``--kv-reuse``): who may read and who is kept.

When a request ends, its pages become a prefix-cache entry (``PageManager.retire``, the
words are defined in ``kvcompress.paging.prefix_cache``) filed by its tokens
(``PrefixIndex``). vLLM asks the KV-cache manager for a waiting request's cached prefix;
this answers with the longest hit among the entries the prompt starts with (``lookup``),
and the adoption happens when vLLM allocates the request's slots: the entry's whole pages
are read in place and only each row's partial last page is copied (it stays cached for
other requests, which may read the same pages at once) when free pages take the copies and
the growth, or a waiting branch starts with it too; else it is handed over, so that no other
conversation's entry is evicted for an adopter's own pages (``sched.kv_cache_manager``). vLLM
then prefills only the rest of the prompt, and reports the adopted tokens as cached
(``num_cached_tokens``, prefix-cache metrics).

Who may adopt an entry: no request ends up holding more than it asked to keep, and the
adopted part is kept as it is (the worker compresses only the new part of the prompt with
the request's policy, ``worker.compaction``). So a compressed entry is adopted only under
the same compression settings. An exact entry (its prompt part kept every token: its rows
are what a full cache holds) is adopted by a request whose own settings would not compress
a prompt as long as the adopted part (``none``, or a budget above it); under the same
settings, as long as the entry's prompt part, since its generated part is what those
settings hold anyway. That rule also covers a prompt that ended before it could be
compacted (``max_tokens=1``: the worker does not compress a request in the step it ends;
aborted during its prefill): filed uncompressed, it is not adopted by a request that would
compress it, which prefills and compresses it instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.v1.request import RequestStatus

from kvcompress.engine.handoff import Described, Handoff, claim, discard, prompt_key
from kvcompress.engine.request_settings import resolve
from kvcompress.log import get_logger
from kvcompress.paging import ShardedPageManager
from kvcompress.paging.prefix_index import BLOCK_TOKENS, PrefixIndex, PromptChains, TokenChain
from kvcompress.settings.config import KVCompressionConfig

logger = get_logger(__name__)

# A finished request's cache is worth keeping when it ended this way (an error may have
# left its rows half compacted).
_RETIRED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
                     RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class Match:
    entry_id: int
    hit: int  # logical tokens adopted


@dataclass
class PrefixCacheFigures:
    """Since the last take: adoptions and what they saved (for /metrics)."""

    adopted_tokens: int = 0
    shares: int = 0
    handovers: int = 0
    evicted_entries: int = 0
    # Shared prefixes computed once by a segment request (``prefix_segments``) and their
    # prompt tokens (prefilled by no client request).
    segments: int = 0
    segment_tokens: int = 0
    # Adoptions of a segment still uncompressed (pending): readers that prefill their own
    # part over the whole prefix, as a request compressing its own copy does.
    whole_segment_reads: int = 0
    # Shared prefixes copied off a lone request's pages (forks) and their tokens: computed
    # once, within that request's prompt.
    forks: int = 0
    fork_tokens: int = 0
    # Requests continued from a prefill instance's hand-off (``engine.handoff``).
    handoffs: int = 0

    def take(self) -> dict[str, int]:
        figures = dataclasses.asdict(self)
        self.__init__()  # type: ignore[misc]
        return figures


class UntilChanged:
    """Answers by key, all forgotten when the state they were computed in (a version)
    changes."""

    def __init__(self) -> None:
        self._answers: dict[Any, Any] = {}
        self._version: Any = None

    def get(self, version: Any, key: Any, compute: Callable[[], Any]) -> Any:
        if version != self._version:
            self._answers, self._version = {}, version
        if key not in self._answers:
            self._answers[key] = compute()
        return self._answers[key]


class PrefixCachePolicy:
    """The engine's prefix cache over every rank's pages: lookup, retire, adopt, clear."""

    def __init__(self, pages: ShardedPageManager, engine_config: KVCompressionConfig,
                 chains: PromptChains | None = None, handoff: Handoff | None = None,
                 fingerprint: str = "") -> None:
        self.pages = pages
        # A decode instance's hand-offs (``engine.handoff``): each request looks once.
        self.handoff = handoff if handoff is not None and handoff.consumes else None
        self.fingerprint = fingerprint
        self._handoff_looked: set[str] = set()
        # Requests continued from a hand-off -> the first token, until it is reported; and
        # those the worker knows with that token as their prompt's last (for life).
        self.continuing: dict[str, int] = {}
        self.continued: set[str] = set()
        self.engine_config = engine_config
        self.enabled = engine_config.reuse != "off" and not pages.layout.has_sliding_layers
        self.index = PrefixIndex()
        self.figures = PrefixCacheFigures()  # since the last /metrics update
        self.totals = PrefixCacheFigures()  # since the start
        self._entry_ids = itertools.count(1)
        # Each live request's prompt with its block hashes, made once (``PromptChains``):
        # a lookup every schedule then hashes none of its tokens. The scheduler shares it
        # with the grouping of shared prefixes and prunes it.
        self.chains = chains if chains is not None else PromptChains()
        # Each request's last answers (lookup, waits_for_compaction) while no entry changed.
        self._lookups = UntilChanged()
        self._waits = UntilChanged()

    def chain_of(self, request: Any) -> TokenChain:
        """The request's prompt tokens and their block hashes."""
        length = request.num_prompt_tokens
        return self.chains.get(request.request_id, length,
                               lambda: request.all_token_ids[:length])

    def lookup(self, request: Any) -> Match | None:
        """The longest hit among the entries the request's prompt starts with (its last
        prompt token is always computed: vLLM needs its logits)."""
        if not self.enabled or not self._may_read(request):
            return None
        if self.handoff is not None and request.request_id not in self._handoff_looked:
            self._handoff_looked.add(request.request_id)
            self._import_handoff(request)
        self.forget_evicted()
        if not len(self.index):
            return None
        return self._lookups.get(self.state_version(), request.request_id,
                                 lambda: self._best_match(request))

    def _import_handoff(self, request: Any) -> None:
        """File the prefill instance's hand-off of the request's prompt, if there is one, as
        an entry of the whole prompt (``PrefixCache.import_entry``), and continue the
        request from the token the prefill instance sampled (``continuing``): it is the
        request's first output token, reported with its next (the scheduler's
        ``_report_first_tokens``). One made under other settings or for another model, with
        no room, or for a request that cannot start from a given token, is discarded: the
        request prefills itself."""
        assert self.handoff is not None
        if request.num_computed_tokens or request.num_output_tokens:
            return
        chain = self.chain_of(request)
        key = prompt_key(chain.tokens)
        ranks = len(self.pages.shards)
        described = claim(self.handoff.path, key, ranks)
        if described is None:
            return
        settings = resolve(self.engine_config, request.sampling_params)
        problem = next((problem for part in described
                        if (problem := self._handoff_problem(part, settings, request))), None)
        entry_id = next(self._entry_ids)
        if problem is None and not self.pages.import_entry(
                entry_id, [part.lengths for part in described], request.num_prompt_tokens,
                key):
            problem = "no room for its pages"
        if problem is not None:
            logger.warning("kvcompress: request %s prefills itself: its hand-off %s was not "
                           "used (%s)", request.request_id, key, problem)
            discard(self.handoff.path, key, ranks)
            return
        exact = not any((request.num_prompt_tokens - part.lengths).any() for part in described)
        filed = self.index.add(entry_id, chain.tokens, 1 if exact else request.num_prompt_tokens,
                               settings, exact)
        assert filed, "a hand-off longer than a block is filed"
        request.append_output_token_ids(described[0].first_token)
        self.continuing[request.request_id] = described[0].first_token
        self._count(handoffs=1)

    def _handoff_problem(self, part: Described, settings: KVCompressionConfig,
                         request: Any) -> str | None:
        params = request.sampling_params
        if part.fingerprint != self.fingerprint:
            return f"made for {part.fingerprint}, this instance is {self.fingerprint}"
        if part.prompt_len != request.num_prompt_tokens:
            return f"{part.prompt_len} prompt tokens, the request has {request.num_prompt_tokens}"
        if part.settings != json.loads(json.dumps(settings.to_mapping())):  # (as written)
            return "made under other compression settings"
        if request.num_prompt_tokens <= BLOCK_TOKENS:
            return "a prompt shorter than a block is not filed"
        if params is None or params.logprobs is not None or params.prompt_logprobs is not None:
            return "the request asks for logprobs, which the given first token has none of"
        if params.max_tokens is not None and params.max_tokens < 2:
            return "the request asks for one token, which the prefill instance sampled"
        if request.use_structured_output:
            return "structured output starts from the first token itself"
        if part.first_token in (params.stop_token_ids or ()) or (
                not params.ignore_eos and part.first_token == params.eos_token_id):
            return "its first token ends the request"
        return None

    def forget_handoff(self, request_id: str, finished: bool) -> None:
        """The request left or was preempted (its hand-off, if any, was looked up once). A
        finished one is no longer continued (its first token, if not reported yet, still is
        with the outputs of the step it ended in)."""
        self._handoff_looked.discard(request_id)
        if finished:
            self.continued.discard(request_id)

    def state_version(self) -> tuple:
        """Changes whenever an entry is filed, dropped, adopted whole or compacted: what
        ``lookup`` answers (and what the grouping of shared prefixes reads) depends only on
        the entries' states and the request's own prompt and settings."""
        return (self.index.version, self.pages.cache_version)

    def _best_match(self, request: Any) -> Match | None:
        settings = resolve(self.engine_config, request.sampling_params)
        best: Match | None = None
        # vLLM computes a prompt's last token (for its logits); a request continued from a
        # hand-off computes its first output token instead.
        limit = request.num_prompt_tokens - (request.request_id not in self.continuing)
        for entry_id, shared, same in self.index.candidates(self.chain_of(request), limit,
                                                            settings):
            entries = self.pages.known_entries(entry_id)  # (resident or offloaded)
            if any(entry is None for entry in entries):
                continue
            hit = min(entry.best_hit(shared) for entry in entries)
            # (A segment's entry is read by many: kept whole where its plan dropped no page.)
            if all(entry.exact_prompt and not entry.segment for entry in entries) and (
                    settings.compresses(min(hit, entries[0].prompt_len) if same else hit)):
                continue  # an uncompressed context longer than this request would keep
            # Longest hit; among equals the most recent entry (ids grow).
            if hit and (best is None or (hit, entry_id) > (best.hit, best.entry_id)):
                best = Match(entry_id, hit)
        return best

    def waits_for_compaction(self, request_id: str, pending: Sequence[int], chain: TokenChain,
                             prompt_len: int, settings: Any, min_tokens: int) -> bool:
        """Whether a waiting request shares at least ``min_tokens`` with a pending segment
        (one of the entries ``pending``, ``ShardedPageManager.pending_ids`` asked once per
        schedule; filed uncompressed: adopted only whole until it is compacted in place)
        under equal settings, yet cannot adopt it whole. It waits for that compaction rather
        than have a segment of its own made: that one's pages would evict the pending one
        before its readers adopt it, and its readers' next segment would evict that one in
        turn (two groups recomputing their prefixes forever, seen over HTTP)."""
        return self._waits.get(self.state_version(), (request_id, min_tokens),
                               lambda: self._shares_less_than_pending(
                                   pending, chain, prompt_len, settings, min_tokens))

    def _shares_less_than_pending(self, pending: Sequence[int], chain: TokenChain,
                                  prompt_len: int, settings: Any, min_tokens: int) -> bool:
        for entry_id in pending:
            filed = self.index.filed(entry_id)
            if filed is None:
                continue
            segment_tokens, segment_settings = filed
            if (segment_settings == settings and min_tokens
                    <= self.index.shared_with(entry_id, chain, prompt_len - 1)
                    < len(segment_tokens)):
                return True
        return False

    def retire(self, request: Any) -> bool:
        """Retire a finished request into an entry; False when its pages were freed."""
        request_id = request.request_id
        computed = request.num_computed_tokens
        if (not self.enabled or request.status not in _RETIRED_STATUSES
                or request_id not in self.pages or computed <= 0
                or not self._keyed_by_tokens(request)):
            return False
        if self.engine_config.reuse == "prompts":
            # The answer is computed again by the next turn and compressed with it.
            computed = min(computed, request.num_prompt_tokens)
        tokens = np.asarray(request.all_token_ids[:computed], dtype=np.int64)
        return self._file(request_id, tokens, request.num_prompt_tokens,
                          resolve(self.engine_config, request.sampling_params))

    def file_segment(self, fork_id: str, tokens: np.ndarray, settings: Any) -> bool:
        """A fork (``KVCompressScheduler._fork``): the pseudo-request ``fork_id``, its plan
        reported, filed as a segment request is when it ends, pending; False when its pages
        were freed."""
        if not self.enabled or not self._file(fork_id, tokens, len(tokens), settings):
            return False
        self._count(forks=1, fork_tokens=len(tokens))
        return True

    def _file(self, request_id: str, tokens: np.ndarray, prompt_len: int,
              settings: Any) -> bool:
        """The request's pages as a new entry of ``tokens`` (its computed ones), indexed."""
        entry_id = next(self._entry_ids)
        if not self.pages.retire(request_id, entry_id, len(tokens), prompt_len):
            return False
        entry = self.pages.shards[0].entry(entry_id)
        exact = all(shard.entry(entry_id).exact_prompt for shard in self.pages.shards)
        if not self.index.add(entry_id, tokens, 1 if exact else entry.first_cut, settings,
                              exact):
            self.pages.drop_entry(entry_id)  # too short to be worth a lookup
            return False
        return True

    def adopt(self, request_id: str, match: Match, share: bool) -> None:
        """Start the request from the entry (``ShardedPageManager.can_adopt`` said it fits)."""
        whole = self.pages.is_pending(match.entry_id)
        adopted = self.pages.adopt(request_id, match.entry_id, match.hit, share)
        assert adopted, "adoption check and adoption disagree"
        self._count(adopted_tokens=match.hit, shares=int(share), handovers=int(not share),
                    whole_segment_reads=int(whole))
        if not share:
            self.index.remove(match.entry_id)  # its pages are the request's now
        self.forget_evicted()

    def forget_evicted(self) -> None:
        """Entries whose pages went to running requests leave the index."""
        evicted = self.pages.take_evicted_entries()
        self._count(evicted_entries=len(evicted))
        for entry_id in evicted:
            self.index.remove(entry_id)

    def drop(self, entry_ids: list[int]) -> None:
        """Drop entries whose pages can no longer be trusted (a failed in-place compaction
        left them shrunk): gone from the pages and the index."""
        for entry_id in entry_ids:
            self.pages.drop_entry(entry_id)  # (nothing where it is gone already)
            self.index.remove(entry_id)

    def restore(self, match: Match) -> None:
        """Bring the match's offloaded entry back into pages (``can_restore`` said it fits)."""
        restored = self.pages.restore(match.entry_id)
        assert restored, "restore check and restore disagree"
        self.forget_evicted()

    def clear(self) -> None:
        """vLLM's reset_prefix_cache: every entry's pages are freed, the tier emptied."""
        for entry_id in self.pages.entry_ids() + self.pages.offloaded_ids():
            self.pages.drop_entry(entry_id)
            self.index.remove(entry_id)
        self.pages.sweep_tier()  # (chunks the dropped entries' pages kept alive)

    def count_segment(self, tokens: int) -> None:
        """A segment request of ``tokens`` prompt tokens was queued (``prefix_segments``)."""
        self._count(segments=1, segment_tokens=tokens)

    def may_read(self, request: Any) -> bool:
        """Whether the request may look up (and so adopt) an entry."""
        return self.enabled and self._may_read(request)

    def _count(self, **figures: int) -> None:
        for counts in (self.figures, self.totals):
            for name, value in figures.items():
                setattr(counts, name, getattr(counts, name) + value)

    @staticmethod
    def _keyed_by_tokens(request: Any) -> bool:
        """Whether the request's tokens alone say what its cache holds: not with LoRA
        adapters, multimodal inputs, prompt embeddings or a cache salt."""
        return not (request.lora_request is not None or request.has_encoder_inputs
                    or getattr(request, "prompt_embeds", None) is not None
                    or getattr(request, "cache_salt", None))

    def _may_read(self, request: Any) -> bool:
        """vLLM's own rule (prompt logprobs, pooling) and entries keyed by tokens only."""
        return not request.skip_reading_prefix_cache and self._keyed_by_tokens(request)
