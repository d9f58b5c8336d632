"""Memory vLLM's profiling never sees: observation-window score accumulators, bounded and
counted, and decode-score accumulators (bounded per request, see ``decode_reserved_bytes``).

A request whose prompt is scored holds a ``[layers, kv_heads, prompt_len]`` fp32
accumulator from the step its observation window begins until its prompt is compacted
(usually one step, two when the window straddles a chunk boundary); scored by a surrogate,
from its first chunk (``scored_from``). Summed over requests
it could grow without bound (many long prompts finishing in one step), so:

- the page pool gives up the bytes of ``scored_token_reserve`` prompt tokens of
  accumulators plus a planning workspace (``reserved_bytes``), in every process alike;
- the scheduler's ``ScoringGate`` lets a request's prefill chunk enter its window only
  while the prompts being scored, its own included, fit that reserve; otherwise the chunk
  stops short of the window and the request continues next step. One prompt of
  ``max_model_len`` always fits, and so does a step of short prompts scored whole.

No vLLM imports: the gate sees requests through the attributes it reads.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvcompress.policies.plan import INDEX_BYTES, PLAN_BYTES_PER_SCORE, workspace_scores
from kvcompress.settings.config import KVCompressionConfig

SCORE_BYTES = 4  # fp32 accumulators
COUNT_BYTES = 8  # KeepPlan.counts, int64 per (layer, KV head)
# Tokens of a reconstruction pass's instruction the scratch pages are sized for (longer
# instructions are cut; ``engine.worker.reconstruction``).
MAX_REPEAT_TOKENS = 32


def reconstruction_chunk(chunk: int, max_num_batched_tokens: int) -> int:
    """Prompt tokens per reconstruction pass: ``--kv-reconstruct-chunk``, capped so that a
    pass (instruction included) is no larger than the batches vLLM profiled activations for."""
    return max(1, min(chunk, max_num_batched_tokens - MAX_REPEAT_TOKENS))


def reconstruction_tokens(chunk: int, max_num_batched_tokens: int) -> int:
    """Most tokens one reconstruction pass writes per row: what its scratch pages hold."""
    return reconstruction_chunk(chunk, max_num_batched_tokens) + MAX_REPEAT_TOKENS


def scored_token_reserve(max_model_len: int, max_num_batched_tokens: int) -> int:
    """Prompt tokens whose window scores may be held at once: one prompt at
    ``max_model_len`` being chunked plus every prompt one step can schedule whole."""
    return max_model_len + max_num_batched_tokens


def workspace_bytes(num_kv_heads: int, longest_prompt: int) -> int:
    """The workspace reserved for the compression path's temporaries: PLAN_BYTES_PER_SCORE
    bytes per score of one layer of the longest prompt (at least MAX_BLOCK_ELEMENTS)."""
    return workspace_scores(num_kv_heads, longest_prompt) * PLAN_BYTES_PER_SCORE


def plan_output_bytes(num_layers: int, num_kv_heads: int, prompt_tokens: int,
                      accumulators: int = 1) -> int:
    """What planning ``prompt_tokens`` of prompts holds besides its workspace: the plan
    itself (``KeepPlan``: an int32 index per kept token of every (layer, KV head) row, at
    most the whole prompt, and the rows' counts), and with two score sources (hybrid) their
    rank union, one fp32 per score (``worker.compaction._request_scores``). They grow with
    the prompt times the layers like the accumulators, and are sized like them."""
    per_token = INDEX_BYTES + (SCORE_BYTES if accumulators > 1 else 0)
    return num_layers * num_kv_heads * (prompt_tokens * per_token + COUNT_BYTES)


def reserved_bytes(scored_tokens: int, num_layers: int, num_kv_heads: int,
                   longest_prompt: int, accumulators: int = 1,
                   scoring_workspace: int = 0) -> int:
    """Bytes taken from the KV-cache memory for ``scored_tokens`` prompt tokens of
    accumulators over every (layer, KV head) row (``accumulators`` of them per prompt:
    hybrid scoring keeps two), plus one workspace the compression path's temporaries share
    (they never run at once: scoring inside the forward, planning after it): plans run in
    padded blocks of at most MAX_BLOCK_ELEMENTS scores (padding at most doubles a block), or
    one layer of one request when that alone is larger; a reconstruction pass's scoring
    needs ``scoring_workspace`` bytes per layer, whatever the prompt
    (``attention.reconstruction_scores.scoring_workspace_bytes``). Planning also holds its
    outputs (``plan_output_bytes``) for every scored prompt token: each request's plan is
    as wide as its own rows (``policies.plan_keep_each``), hybrid scoring shared model-wide
    selects its union slice by slice (``policies.union``), and a score threshold shared
    model-wide is planned in layer slices like a budget."""
    scores = scored_tokens * num_layers * num_kv_heads
    planning = min(2 * scores * PLAN_BYTES_PER_SCORE,
                   workspace_bytes(num_kv_heads, longest_prompt))
    planning += plan_output_bytes(num_layers, num_kv_heads, scored_tokens, accumulators)
    return scores * SCORE_BYTES * accumulators + max(planning, scoring_workspace)


# Per generated offset of a request's decode scores: each of its fp32 accumulators (anchors
# keeps two), and the step's fp32 scores before they are added to them (the worker's
# ``step.DecodeScoring.mass`` buffer).
DECODE_STEP_SCORES = 1


def decode_reserved_bytes(max_num_seqs: int, num_layers: int, num_kv_heads: int,
                          capacity: int, accumulators: int = 1) -> int:
    """Bytes taken from the KV-cache memory for decode scores (h2o / snapkv / rkv /
    anchors): every running request (at most ``max_num_seqs``; a preempted or finished one
    drops its accumulators) may hold ``accumulators`` of ``[layers, kv_heads, capacity]``
    and its share of the step's scores, ``capacity`` the engine's decode budget + interval,
    which no request may exceed (``KVCompressionConfig.decode_score_capacity``). A policy
    without scores has no accumulators and reserves nothing."""
    if not accumulators:
        return 0
    per_offset = (accumulators + DECODE_STEP_SCORES) * SCORE_BYTES
    return max_num_seqs * num_layers * num_kv_heads * capacity * per_offset


def scores_prompt(config: KVCompressionConfig, prompt_len: int) -> bool:
    """Whether a prompt of this length is compacted with observation-window scores."""
    return config.compresses(prompt_len) and config.policy.compression_method.needs_scores


def scored_width(config: KVCompressionConfig, prompt_len: int, num_computed: int,
                 reads_segment: bool = False) -> int:
    """Tokens of accumulators the gate counts for a prompt entering its scoring with
    ``num_computed`` tokens computed: the whole prompt (scores by physical slot, adopted
    ones included). Scored by a surrogate alone, an adopter's accumulator holds its new
    tokens only (``WorkerKVState._add_surrogate_tokens``), so the whole prompt
    over-reserves; that is kept but for readers of a shared prefix still uncompressed
    (``reads_segment``), counted at their new tokens so that they prefill it together.
    (Counted so for every adopter, multi-turn chat lost a sixth of its cached tokens: more
    turns prefilling at once evicted the entries of the next ones; ``benchmarks.multi_turn``,
    2026-12-05.)"""
    if reads_segment and config.loads_surrogate and not config.scores_window:
        return max(1, prompt_len - num_computed)
    return prompt_len


def scored_from(config: KVCompressionConfig, prompt_len: int) -> int:
    """The first prompt position whose chunk needs the prompt's score accumulator: its
    observation window's, or 0 where a surrogate scores every prompt token as it is
    prefilled (the accumulator is held through the whole prefill)."""
    if config.loads_surrogate:
        return 0
    return max(0, prompt_len - config.window)


class ScoringGate:
    """Keeps the prompt tokens being scored at once within ``reserve_tokens``.

    ``limit`` is called for every request the scheduler is about to give a chunk; a
    request enters the scored set when its chunk reaches its window and leaves it when its
    prompt is complete, or it is preempted, finished or its chunk was not scheduled
    (``prune``, once per step, before scheduling).
    """

    def __init__(self, reserve_tokens: int) -> None:
        self.reserve_tokens = reserve_tokens
        # id -> (request, window start, tokens its accumulator holds)
        self.scoring: dict[str, tuple[Any, int, int]] = {}
        self.tokens_in_flight = 0
        self.peak_tokens = 0
        self.deferred_chunks = 0  # chunks cut short of a window (for tests and logs)

    def limit(self, request: Any, config: KVCompressionConfig, num_computed: int,
              num_new: int, reads_segment: bool = False) -> int:
        """``num_new`` or fewer tokens: a chunk enters a window only when its prompt fits."""
        request_id = request.request_id
        prompt_len = request.num_prompt_tokens
        if num_new <= 0 or request_id in self.scoring or num_computed >= prompt_len:
            return num_new
        if not scores_prompt(config, prompt_len):
            return num_new
        window_start = scored_from(config, prompt_len)
        if num_computed + num_new <= window_start:
            return num_new  # this chunk stays before the window
        width = scored_width(config, prompt_len, num_computed, reads_segment)
        if self.scoring and self.tokens_in_flight + width > self.reserve_tokens:
            self.deferred_chunks += 1
            return max(0, window_start - num_computed)
        self.scoring[request_id] = (request, window_start, width)
        self.tokens_in_flight += width
        self.peak_tokens = max(self.peak_tokens, self.tokens_in_flight)
        return num_new

    def prune(self, live_requests: dict[str, Any],
              held: Collection[str] = frozenset()) -> None:
        """Drop requests no longer mid-window: done with their prompt (and not ``held``:
        parked for reconstruction passes, their accumulators live on), gone, preempted
        (their computed tokens restart at 0) or whose granted chunk was not scheduled."""
        for request_id, (request, window_start, width) in list(self.scoring.items()):
            computed = request.num_computed_tokens
            if live_requests.get(request_id) is request and request_id in held:
                continue
            if (live_requests.get(request_id) is not request
                    or computed >= request.num_prompt_tokens or computed <= window_start):
                del self.scoring[request_id]
                self.tokens_in_flight -= width
