"""A prefix that waiting requests share, computed and compressed once, as a segment of its
own (issue 40: "compress once, share everywhere").

Requests that arrive together with one long prefix (a system prompt, a document with many
questions, vLLM's parallel samples) would each prefill and compress it: only finished
requests are prefix-cache entries. So before vLLM schedules, the waiting requests are
grouped by the tokens they actually share (``choose_segment``): when two or more with the
same compression settings share at least ``MIN_SEGMENT_TOKENS`` more than any cached entry
gives them, a **segment request** is queued whose prompt is exactly that shared prefix
(``segment_request``). It is an ordinary request to vLLM and to the worker: its prompt is
scored (query-agnostic scores only, see ``may_segment``) and compacted at the policy's budget
for that many tokens, sinks included, and it ends as soon as its prompt is compacted (the
scheduler finishes it; its outputs never leave the engine), which retires its pages into a
prefix-cache entry cut exactly at the prefix's end. Meanwhile the requests whose prompts
start with a segment being made are **held**: skipped by vLLM's waiting loop while it
schedules, in their places (so the requests behind them are not blocked; ``request_life``).
Once the segment request is gone (filed, aborted, failed) nobody is held any more: the
requests adopt the entry by sharing (every one reads its whole pages in place,
``paging/prefix_cache.py``), prefill only their own part, compress it as an adopter's new
part, and report the prefix as cached.

A burst's first request often reaches an idle engine alone and completes its prompt before
the others arrive. Its compaction then waits a step, and what the waiting requests share
with it becomes a **fork**: a segment copied off its uncompacted pages by a pseudo-request
of the same id form (no prefill, no vLLM request), planned from its scores, filed as a
segment request's pages are (``PrefixSharing._fork``, docs/design.md).

State: the pending segments; each request's sharing state is its record in
``request_life`` (segment requests are known as made, what was made for a reader); the
queue work is ``sharing``'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcompress.engine.messages import SEGMENT_READERS_AFTER_ARG
from kvcompress.engine.sched.request_life import RequestLives
from kvcompress.paging.prefix_index import (
    BLOCK_TOKENS,
    PromptChains,
    TokenChain,
    shared_prefix,
)

# A shared prefix shorter than this (beyond what a cached entry already gives) is not worth
# a request of its own: four 16-token blocks.
MIN_SEGMENT_TOKENS = 64
# Waiting requests scanned for shared prefixes per step (as the eviction plan's lookahead).
SEGMENT_LOOKAHEAD = 64
SEGMENT_ID_PREFIX = "kvcompress-segment-"
# Pairs of waiting requests whose shared length the grouping remembers (then it starts over):
# the lookahead's 64 requests make 4,032 ordered pairs.
MAX_REMEMBERED_PAIRS = 16384


@dataclass
class Segment:
    """A shared prefix being computed by the segment request ``request_id``."""

    request_id: str
    tokens: np.ndarray  # int64, the prefix
    settings: Hashable  # the resolved compression settings of its readers
    block: int = field(init=False)  # the hash of its first block, as ``_prompts`` keeps them
    chain: TokenChain = field(init=False)  # its block hashes

    def __post_init__(self) -> None:
        self.chain = TokenChain(self.tokens)
        self.block = first_block_hash(self.chain)

    def covers(self, tokens: np.ndarray | TokenChain, prompt_len: int,
               settings: Hashable) -> bool:
        """Whether a request with these prompt tokens (or their chain) and settings would
        adopt it. A segment of whole blocks is compared by its last block's chained hash."""
        length = len(self.tokens)
        if settings != self.settings or prompt_len <= length:
            return False
        if isinstance(tokens, TokenChain):
            if length % BLOCK_TOKENS == 0 and length:
                blocks = length // BLOCK_TOKENS
                return (len(tokens.hashes) >= blocks
                        and tokens.hashes[blocks - 1] == self.chain.hashes[-1])
            tokens = tokens.tokens
        return np.array_equal(tokens[:length], self.tokens)


@dataclass
class Candidate:
    """A waiting request, as the grouping reads it."""

    request_id: str
    tokens: np.ndarray  # int64, its prompt
    settings: Hashable
    # Tokens a cached entry already gives it (its lookup's hit); None: not looked up yet
    # (``PrefixSegments.plan`` looks up only requests that start like another).
    cached: int | None = None
    chain: TokenChain | None = None  # its prompt's block hashes, where known

    def shared_with(self, other: Candidate) -> int:
        """``shared_length`` of the two prompts (by block hashes where both have them)."""
        if self.chain is not None and other.chain is not None:
            limit = min(len(self.tokens), len(other.tokens)) - 1
            return self.chain.shared_with(other.chain, limit) if limit > 0 else 0
        return shared_length(self.tokens, other.tokens)


@dataclass(frozen=True)
class SharingView:
    """What the grouping reads of a waiting request and does not change while it lives."""

    shares: bool  # it may read a shared prefix (a client's request that may look up)
    chain: TokenChain  # its prompt with its block hashes
    settings: Hashable  # its resolved compression settings
    segmentable: bool  # a segment may be made of its prefix (``may_segment``)


def first_block_hash(chain: TokenChain) -> int:
    """The grouping's key: the chained hash of the prompt's first block, or of its tokens
    when it has no whole block."""
    return chain.hashes[0] if chain.hashes else hash(chain.tokens.tobytes())


def shared_length(first: np.ndarray, second: np.ndarray) -> int:
    """Tokens the two prompts share, at most each one's length minus one (a reader's last
    prompt token is always its own: vLLM needs its logits)."""
    limit = min(len(first), len(second)) - 1
    return shared_prefix(first, second, limit) if limit > 0 else 0


def segment_boundary(page_size: int) -> int:
    """Tokens a segment's length is a multiple of: whole 16-token blocks and whole pages. A
    segment of whole pages has none that a reader must copy (each reads them all in place),
    so a filed segment that running readers read holds no page of its own, and is not
    evicted while they run for the one page a row it would free (see docs/design.md,
    "Where a segment ends")."""
    return math.lcm(BLOCK_TOKENS, page_size)


def block_floor(length: int, boundary: int = BLOCK_TOKENS) -> int:
    """A segment ends on a block boundary within the shared prefix: a tokenizer merges the
    last shared characters with what follows, so the requests that arrive first may share a
    token more among themselves than with those that arrive later, who could then not adopt
    the segment whole (see docs/design.md, "Where a segment ends")."""
    return length // boundary * boundary


def choose_segment(first: Candidate, others: Sequence[Candidate],
                   min_tokens: int = MIN_SEGMENT_TOKENS,
                   boundary: int = BLOCK_TOKENS,
                   shared_of: Callable[[Candidate, Candidate], int] | None = None,
                   ) -> tuple[int, list[str]]:
    """The prefix ``first`` should share with ``others``: ``(length, readers)`` (``(0, [])``:
    none). Among the lengths ``first`` shares with some other request (same settings), the
    one that saves the most prefill: length x readers who share at least that much, ties
    to the longer, each length cut to a multiple of ``boundary`` (``block_floor``). A stray
    request sharing little does not shorten everyone's segment, and a pair sharing more than
    the rest does not split it. It must exceed what a cached entry
    gives every reader by ``min_tokens``."""
    shared_of = shared_of or Candidate.shared_with
    shared = {other.request_id: block_floor(shared_of(first, other), boundary)
              for other in others if other.settings == first.settings}
    best, readers = 0, []
    for length in sorted(set(shared.values()), reverse=True):
        members = [first, *(other for other in others if shared.get(other.request_id, 0) >= length)]
        if len(members) < 2 or length < min_tokens + max(member.cached or 0
                                                         for member in members):
            continue
        if length * len(members) > best * len(readers):
            best, readers = length, [member.request_id for member in members]
    return best, readers


@dataclass
class PrefixSegments:
    """The segments being computed, by segment request id."""

    pending: dict[str, Segment] = field(default_factory=dict)
    min_tokens: int = MIN_SEGMENT_TOKENS
    boundary: int = BLOCK_TOKENS  # a segment's length is a multiple (``segment_boundary``)
    _ids: Iterable[int] = field(default_factory=lambda: itertools.count(1))
    # Each waiting request's prompt tokens and their block hashes (requests are grouped only
    # with others starting alike), kept while it lives: prompts do not change. Shared with
    # the prefix cache's lookups (``PrefixCachePolicy.chains``).
    chains: PromptChains = field(default_factory=PromptChains)
    # Segment requests queued and tokens they prefilled, since the start (tests, figures),
    # and forks made (segments copied off a request's pages: no prefill of their own).
    made: int = 0
    tokens: int = 0
    forks: int = 0
    # Each request's sharing state: segment requests as made, the length of what was made
    # for each reader (``choose``: another only if longer by ``min_tokens``, as for a cached
    # hit, so a segment its readers could not adopt is not made again every step).
    lives: RequestLives = field(default_factory=RequestLives)
    # Tokens two waiting requests share, by (first, other) id (``_shared_of``).
    _pairs: dict[tuple[str, str], int] = field(default_factory=dict)
    # The candidates of the last plan and the cache state it saw (``plan``).
    _planned: set[str] = field(default_factory=set)
    _planned_at: Hashable = None

    def prune(self, live: Callable[[str], bool]) -> None:
        """Forget segments whose request finished, was aborted or failed: their readers are
        held no longer."""
        for request_id in [rid for rid in self.pending if not live(rid)]:
            del self.pending[request_id]

    def chain_of(self, request_id: str, token_ids: Sequence[int]) -> TokenChain:
        """The request's prompt with its block hashes (made once)."""
        return self.chains.get(request_id, len(token_ids), lambda: token_ids)

    def is_segment(self, request_id: str) -> bool:
        """Whether the request is a segment request or fork of ours (``RequestLives``)."""
        return self.lives.is_segment(request_id)

    def holding(self, tokens: np.ndarray | TokenChain, prompt_len: int,
                settings: Hashable) -> bool:
        """Whether a waiting request would adopt a segment still being computed."""
        return any(segment.covers(tokens, prompt_len, settings)
                   for segment in self.pending.values())

    def block_of(self, request_id: str, token_ids: Sequence[int]) -> int:
        """The hash of the request's first block, as ``Segment.block`` (computed once)."""
        return first_block_hash(self.chain_of(request_id, token_ids))

    def may_hold(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """A cheap first test of ``holding``: the prompt starts with a pending segment's first
        block."""
        if len(token_ids) <= BLOCK_TOKENS:
            return False
        block = self.block_of(request_id, token_ids)
        return any(segment.block == block for segment in self.pending.values())

    def choose(self, first: Candidate, others: Sequence[Candidate]) -> tuple[int, list[str]]:
        """``choose_segment`` under this grouping's minimum and boundary, each request's
        earlier segment counting as a cached hit (``served``)."""
        for candidate in (first, *others):
            served = self.lives.served(candidate.request_id)
            if served:
                candidate.cached = max(candidate.cached or 0, served)
        return choose_segment(first, others, self.min_tokens, self.boundary, self._shared_of)

    def _shared_of(self, first: Candidate, other: Candidate) -> int:
        """``Candidate.shared_with``, once per pair of requests while both live: a long
        queue regrouped as it moves compares only the pairs it has not seen."""
        key = (first.request_id, other.request_id)
        shared = self._pairs.get(key)
        if shared is None:
            if len(self._pairs) > MAX_REMEMBERED_PAIRS:
                self._pairs = {}
            shared = self._pairs[key] = first.shared_with(other)
        return shared

    def next_id(self) -> str:
        """A new segment request's id (known as one once ``lives.begin`` records it)."""
        return f"{SEGMENT_ID_PREFIX}{next(self._ids)}"  # type: ignore[call-overload]

    def plan(self, candidates: Sequence[Candidate],
             cached_of: Callable[[str], int] = lambda request_id: 0,
             version: Hashable = None) -> list[tuple[Segment, list[str]]]:
        """New segments among waiting ``candidates`` (in queue order, none held): for each
        request not yet in a group, ``choose_segment`` among those behind it that start with
        the same block (``cached_of`` gives what a cached entry gives a request, asked only
        of those). Returns each new segment (its id assigned, now pending) with its readers'
        request ids, in queue order.

        ``version``: the state of the prefix cache (``PrefixCachePolicy.state_version``).
        While it is unchanged and no candidate is new since the last plan, the grouping
        would find nothing new (the same requests, or fewer, against the same entries), so
        it is not run again: a long waiting queue costs a set comparison per schedule, not
        a comparison of every pair."""
        ids = {candidate.request_id for candidate in candidates}
        if version is not None and version == self._planned_at and ids <= self._planned:
            return []
        self._planned, self._planned_at = ids, version
        by_block: dict[int, list[Candidate]] = {}
        for candidate in candidates:
            if len(candidate.tokens) <= self.min_tokens:
                continue
            block = self.block_of(candidate.request_id, candidate.tokens)
            by_block.setdefault(block, []).append(candidate)
        for group in by_block.values():
            if len(group) > 1:
                for candidate in group:
                    if candidate.cached is None:
                        candidate.cached = cached_of(candidate.request_id)
        made: list[tuple[Segment, list[str]]] = []
        grouped: set[str] = set()
        for group in by_block.values():
            for position, first in enumerate(group):
                if first.request_id in grouped:
                    continue
                others = [other for other in group[position + 1:]
                          if other.request_id not in grouped]
                if not others:
                    break
                length, readers = self.choose(first, others)
                if not length:
                    continue
                segment = Segment(self.next_id(), first.tokens[:length].copy(), first.settings)
                self.lives.begin(segment.request_id, readers)
                self.pending[segment.request_id] = segment
                self.made += 1
                self.tokens += length
                grouped.update(readers)
                made.append((segment, readers))
        return made


def may_segment(settings: Any, prompt_len: int) -> bool:
    """Whether a reader under ``settings`` with a prompt of ``prompt_len`` tokens may share a
    prefix of it compressed once: its tokens must be chosen without depending on any
    reader's question. The observation window's scores do (window, hybrid,
    hybrid-surrogate): then every request keeps compressing its own copy (today's
    behaviour). A prompt kept whole (so any prefix of it), a method without scores, and
    query-agnostic scores (surrogate, reconstruct, expected) qualify."""
    if not settings.compresses(prompt_len):
        return True
    return not (settings.scores_window and settings.policy.compression_method.needs_scores)


def segment_request(request_id: str, tokens: np.ndarray, reader: Any,
                    readers_after: int = 0) -> Any:
    """A vLLM request whose prompt is the segment's tokens, with the reader's compression
    settings and sampling defaults: two output tokens (a request that ends in its prefill
    step is not compressed; the scheduler ends it once its prompt is compacted), no logprobs,
    no structured output, one sample, no KV connector transfer. ``readers_after``: the
    tokens of their own its readers have after it (``SEGMENT_READERS_AFTER_ARG``)."""
    from vllm.v1.request import Request

    params = reader.sampling_params.clone()
    params.n = 1
    params.max_tokens = params.min_tokens = 2
    params.logprobs = params.prompt_logprobs = None
    params.structured_outputs = None
    # Its compression settings, not a KV connector's transfer.
    params.extra_args = {key: value for key, value in (params.extra_args or {}).items()
                         if key not in ("kv_transfer_params", "ec_transfer_params")}
    params.extra_args[SEGMENT_READERS_AFTER_ARG] = int(readers_after)
    return Request(request_id, [int(token) for token in tokens], params, None,
                   client_index=reader.client_index, arrival_time=reader.arrival_time,
                   priority=reader.priority)
