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
start with a segment being made are **held**: taken out of vLLM's waiting queue while it
schedules (so the requests behind them are not blocked) and put back after
(``held_requests``). Once the segment request is gone (filed, aborted, failed) nobody is held
any more: the requests adopt the entry by sharing (every one reads its whole pages in place,
``paging/prefix_cache.py``), prefill only their own part, compress it as an adopter's new
part, and report the prefix as cached.

A burst's first request often reaches an idle engine alone and completes its prompt before
the others arrive. Its compaction then waits a step, and what the waiting requests share
with it becomes a **fork**: a segment copied off its uncompacted pages by a pseudo-request
of the same id form (no prefill, no vLLM request), planned from its scores, filed as a
segment request's pages are (``KVCompressScheduler._fork``, docs/design.md).

No state beyond the pending segments; the scheduler (``engine/scheduler.py``) does the queue
work.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcompress.engine.messages import SEGMENT_READERS_AFTER_ARG
from kvcompress.paging.prefix_index import BLOCK_TOKENS, shared_prefix

# A shared prefix shorter than this (beyond what a cached entry already gives) is not worth
# a request of its own: four 16-token blocks.
MIN_SEGMENT_TOKENS = 64
# Waiting requests scanned for shared prefixes per step (as the eviction plan's lookahead).
SEGMENT_LOOKAHEAD = 64
SEGMENT_ID_PREFIX = "kvcompress-segment-"


@dataclass
class Segment:
    """A shared prefix being computed by the segment request ``request_id``."""

    request_id: str
    tokens: np.ndarray  # int64, the prefix
    settings: Hashable  # the resolved compression settings of its readers
    block: int = field(init=False)  # the hash of its first block, as ``_prompts`` keeps them

    def __post_init__(self) -> None:
        self.block = _block_hash(self.tokens)

    def covers(self, tokens: np.ndarray, prompt_len: int, settings: Hashable) -> bool:
        """Whether a request with these prompt tokens and settings would adopt it."""
        length = len(self.tokens)
        return (settings == self.settings and prompt_len > length
                and np.array_equal(tokens[:length], self.tokens))


@dataclass
class Candidate:
    """A waiting request, as the grouping reads it."""

    request_id: str
    tokens: np.ndarray  # int64, its prompt
    settings: Hashable
    # Tokens a cached entry already gives it (its lookup's hit); None: not looked up yet
    # (``PrefixSegments.plan`` looks up only requests that start like another).
    cached: int | None = None


def _block_hash(tokens: np.ndarray) -> int:
    """The grouping's key: a hash of the prompt's first block."""
    return hash(tokens[:BLOCK_TOKENS].tobytes())


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
                   boundary: int = BLOCK_TOKENS) -> tuple[int, list[str]]:
    """The prefix ``first`` should share with ``others``: ``(length, readers)`` (``(0, [])``:
    none). Among the lengths ``first`` shares with some other request (same settings), the
    one that saves the most prefill: length x readers who share at least that much, ties
    to the longer, each length cut to a multiple of ``boundary`` (``block_floor``). A stray
    request sharing little does not shorten everyone's segment, and a pair sharing more than
    the rest does not split it. It must exceed what a cached entry
    gives every reader by ``min_tokens``."""
    shared = {other.request_id: block_floor(shared_length(first.tokens, other.tokens), boundary)
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
    # Each waiting request's prompt tokens and the hash of their first block (requests are
    # grouped only with others starting alike), kept while it lives: prompts do not change.
    _prompts: dict[str, tuple[np.ndarray, int]] = field(default_factory=dict)
    # Segment requests queued and tokens they prefilled, since the start (tests, figures),
    # and forks made (segments copied off a request's pages: no prefill of their own).
    made: int = 0
    tokens: int = 0
    forks: int = 0
    # Requests a segment or fork was made for that failed: they compress their own copies
    # from now on (one made for them again could fail again, and hold them forever).
    unshared: set[str] = field(default_factory=set)
    # The segment requests this grouping made, while they live: known by id as made, never by
    # how an id looks (a client's own id may start like ours).
    _segment_ids: set[str] = field(default_factory=set)

    def prune(self, live: Callable[[str], bool]) -> None:
        """Forget segments whose request finished, was aborted or failed: their readers are
        held no longer."""
        for request_id in [rid for rid in self.pending if not live(rid)]:
            del self.pending[request_id]
        for request_id in [rid for rid in self._prompts if not live(rid)]:
            del self._prompts[request_id]
        self.unshared = {request_id for request_id in self.unshared if live(request_id)}
        self._segment_ids = {request_id for request_id in self._segment_ids
                             if request_id in self.pending or live(request_id)}

    def prompt_of(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        """The request's prompt as int64 tokens (converted once)."""
        known = self._prompts.get(request_id)
        if known is None:
            tokens = np.asarray(token_ids, dtype=np.int64)
            known = self._prompts[request_id] = (tokens, _block_hash(tokens))
        return known[0]

    def is_segment(self, request_id: str) -> bool:
        """Whether the request is one this grouping made (a segment request or a fork)."""
        return request_id in self._segment_ids

    def holding(self, tokens: np.ndarray, prompt_len: int, settings: Hashable) -> bool:
        """Whether a waiting request would adopt a segment still being computed."""
        return any(segment.covers(tokens, prompt_len, settings)
                   for segment in self.pending.values())

    def block_of(self, request_id: str, token_ids: Sequence[int]) -> int:
        """The hash of the request's first block, as ``Segment.block`` (computed once)."""
        self.prompt_of(request_id, token_ids)
        return self._prompts[request_id][1]

    def may_hold(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """A cheap first test of ``holding``: the prompt starts with a pending segment's first
        block."""
        if len(token_ids) <= BLOCK_TOKENS:
            return False
        block = self.block_of(request_id, token_ids)
        return any(segment.block == block for segment in self.pending.values())

    def choose(self, first: Candidate, others: Sequence[Candidate]) -> tuple[int, list[str]]:
        """``choose_segment`` under this grouping's minimum and boundary."""
        return choose_segment(first, others, self.min_tokens, self.boundary)

    def next_id(self) -> str:
        """A new segment request's id, known as one from now on (``is_segment``)."""
        request_id = f"{SEGMENT_ID_PREFIX}{next(self._ids)}"  # type: ignore[call-overload]
        self._segment_ids.add(request_id)
        return request_id

    def plan(self, candidates: Sequence[Candidate],
             cached_of: Callable[[str], int] = lambda request_id: 0,
             ) -> list[tuple[Segment, list[str]]]:
        """New segments among waiting ``candidates`` (in queue order, none held): for each
        request not yet in a group, ``choose_segment`` among those behind it that start with
        the same block (``cached_of`` gives what a cached entry gives a request, asked only
        of those). Returns each new segment (its id assigned, now pending) with its readers'
        request ids, in queue order."""
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
