"""The scheduler's ScoringGate, the window-score reserve and the decode-score reserve (and
the per-request bound that keeps it exact), without vLLM."""

from dataclasses import dataclass

import pytest

from kvcompress.config import KVCompressionConfig, KVCompressionConfigError
from kvcompress.engine.scoring_memory import (
    DECODE_SCORE_BYTES,
    ScoringGate,
    decode_reserved_bytes,
    reserved_bytes,
    scored_token_reserve,
    scores_prompt,
)
from kvcompress.policies.plan import MAX_BLOCK_ELEMENTS, PLAN_BYTES_PER_SCORE

SNAPKV = KVCompressionConfig.from_mapping(
    {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 16}
)


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int = 0


def test_scored_prompts_are_those_compacted_with_window_scores():
    assert scores_prompt(SNAPKV, 65) and not scores_prompt(SNAPKV, 64)
    streaming = KVCompressionConfig.from_mapping({"kv_compression": "streamingllm"})
    assert not scores_prompt(streaming, 10_000)
    assert not scores_prompt(KVCompressionConfig(), 10_000)
    ratio = KVCompressionConfig.from_mapping({"kv_compression": "adakv",
                                              "kv_compression_ratio": 0.5})
    assert scores_prompt(ratio, 129) and not scores_prompt(ratio, 128)  # --kv-min-prompt
    assert scores_prompt(ratio.with_request_overrides({"kv_min_prompt": 0}), 20)


def test_reserve_counts_accumulators_and_a_bounded_planning_workspace():
    assert scored_token_reserve(4096, 512) == 4608
    # 4 layers x 2 heads: the planning workspace is that of every score held, padded
    assert reserved_bytes(100, 4, 2, 90) == 100 * 8 * 4 + 2 * 100 * 8 * PLAN_BYTES_PER_SCORE
    # ... but never more than the largest block planned at once
    huge = reserved_bytes(1 << 20, 32, 2, MAX_BLOCK_ELEMENTS // 4)
    assert huge == (1 << 26) * 4 + MAX_BLOCK_ELEMENTS * PLAN_BYTES_PER_SCORE
    # ... which is one layer of one request when that alone is larger than a block
    longest = MAX_BLOCK_ELEMENTS
    assert reserved_bytes(1 << 20, 32, 8, longest) == (
        (1 << 28) * 4 + 8 * longest * PLAN_BYTES_PER_SCORE)


def test_a_chunk_stops_short_of_its_window_while_others_fill_the_reserve():
    gate = ScoringGate(reserve_tokens=1000)
    first, second = FakeRequest("a", 600), FakeRequest("b", 600)
    # Chunks before the window pass untouched; the first to reach its window enters.
    assert gate.limit(first, SNAPKV, 0, 500) == 500
    assert gate.limit(first, SNAPKV, 500, 100) == 100
    assert gate.tokens_in_flight == 600
    # 600 + 600 > 1000: the second stops at its window start (584) and waits.
    assert gate.limit(second, SNAPKV, 500, 100) == 84
    assert gate.deferred_chunks == 1 and "b" not in gate.scoring
    # Already at its window start: nothing this step.
    assert gate.limit(second, SNAPKV, 584, 16) == 0
    # The first completes its prompt; the next prune frees its share.
    first.num_computed_tokens = 600
    gate.prune({"a": first, "b": second})
    assert gate.tokens_in_flight == 0
    assert gate.limit(second, SNAPKV, 584, 16) == 16
    assert gate.peak_tokens == 600


def test_one_prompt_always_enters_even_beyond_the_reserve():
    gate = ScoringGate(reserve_tokens=100)
    assert gate.limit(FakeRequest("a", 600), SNAPKV, 0, 600) == 600


@pytest.mark.parametrize("reason", ["finished", "preempted", "not scheduled"])
def test_prune_drops_requests_no_longer_mid_window(reason):
    gate = ScoringGate(reserve_tokens=1000)
    request = FakeRequest("a", 600)
    assert gate.limit(request, SNAPKV, 580, 10) == 10
    request.num_computed_tokens = 590  # mid-window: still held
    gate.prune({"a": request})
    assert gate.tokens_in_flight == 600
    live = {"a": request}
    if reason == "finished":
        live = {}
    elif reason == "preempted":
        request.num_computed_tokens = 0
    else:
        request.num_computed_tokens = 584  # the granted chunk never ran
    gate.prune(live)
    assert not gate.scoring and gate.tokens_in_flight == 0


def test_decoding_and_unscored_requests_pass_untouched():
    gate = ScoringGate(reserve_tokens=10)
    gate.limit(FakeRequest("big", 600), SNAPKV, 590, 10)
    assert gate.limit(FakeRequest("short", 40), SNAPKV, 0, 40) == 40  # keeps its whole prompt
    assert gate.limit(FakeRequest("done", 600, 600), SNAPKV, 600, 1) == 1
    streaming = KVCompressionConfig.from_mapping({"kv_compression": "streamingllm"})
    assert gate.limit(FakeRequest("s", 600), streaming, 0, 600) == 600


def test_decode_scores_are_reserved_per_running_request_at_the_engine_capacity():
    engine = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 8,
         "kv_decode_policy": "h2o", "kv_decode_budget": 100, "kv_decode_interval": 28})
    assert engine.decode_score_capacity == 128
    assert KVCompressionConfig.from_mapping({"kv_compression": "snapkv"}).decode_score_capacity == 0
    # 16 requests x 4 layers x 2 heads x 128 offsets: the accumulator and the step's workspace
    assert decode_reserved_bytes(16, 4, 2, 128) == 16 * 4 * 2 * 128 * DECODE_SCORE_BYTES
    assert decode_reserved_bytes(16, 4, 2, 0) == 0
    # requests fit in the engine's capacity whatever their split of it ...
    fits = engine.with_request_overrides({"kv_decode_policy": "snapkv", "kv_decode_budget": 64,
                                          "kv_decode_interval": 64})
    assert fits.decode_eviction.capacity == 128
    # ... the window policy holds no scores, so it is not bounded
    window = engine.with_request_overrides({"kv_decode_policy": "window",
                                            "kv_decode_budget": 500})
    assert window.decode_eviction.capacity == 528


@pytest.mark.parametrize(("engine", "overrides", "message"), [
    ({"kv_decode_budget": 100, "kv_decode_interval": 28},
     {"kv_decode_policy": "h2o", "kv_decode_budget": 101},
     r"'kv_decode_budget': got 101 \+ interval 28 .* allowed: kv_decode_budget \+ "
     r"kv_decode_interval <= 128"),
    ({"kv_decode_budget": 100, "kv_decode_interval": 28},
     {"kv_decode_policy": "snapkv", "kv_decode_interval": 29},
     r"'kv_decode_budget'.*<= 128"),
    ({}, {"kv_decode_policy": "h2o", "kv_decode_budget": 16},
     r"'kv_decode_budget'.*needs a server started with --kv-decode-budget"),
])
def test_a_request_scoring_beyond_the_decode_reserve_is_refused_naming_the_field(
        engine, overrides, message):
    config = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 8, **engine})
    with pytest.raises(KVCompressionConfigError, match=message) as error:
        config.with_request_overrides(overrides)
    assert error.value.key == "kv_decode_budget"
