"""The scheduler's ScoringGate, the window-score reserve and the decode-score reserve (against
what the worker allocates, and the per-request bound that keeps it exact)."""

from dataclasses import dataclass, fields
from types import SimpleNamespace

import pytest
import torch

from kvcompress.engine.scoring_memory import (
    COUNT_BYTES,
    SCORE_BYTES,
    ScoringGate,
    plan_output_bytes,
    reserved_bytes,
    scored_token_reserve,
    scores_prompt,
)
from kvcompress.engine.vllm_layout import ScoringReserve
from kvcompress.paging.page_format import GPU_PAGE_FORMAT
from kvcompress.policies.decode import DECODE_POLICIES
from kvcompress.policies.plan import INDEX_BYTES, MAX_BLOCK_ELEMENTS, PLAN_BYTES_PER_SCORE
from kvcompress.settings.config import KVCompressionConfig, KVCompressionConfigError
from tests.paged_cases import build_case

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
    # 4 layers x 2 heads: the planning workspace is that of every score held, padded, and
    # the plans of every scored token (an int32 index per score, int64 counts per row)
    plans = 100 * 8 * INDEX_BYTES + 8 * COUNT_BYTES
    assert plan_output_bytes(4, 2, 100) == plans
    assert reserved_bytes(100, 4, 2, 90) == (
        100 * 8 * 4 + 2 * 100 * 8 * PLAN_BYTES_PER_SCORE + plans)
    # ... hybrid: two accumulators, and the union of their ranks while planning
    assert plan_output_bytes(4, 2, 100, accumulators=2) == plans + 100 * 8 * SCORE_BYTES
    # ... but the workspace is never more than the largest block planned at once
    huge = reserved_bytes(1 << 20, 32, 2, MAX_BLOCK_ELEMENTS // 4)
    assert huge == ((1 << 26) * 4 + MAX_BLOCK_ELEMENTS * PLAN_BYTES_PER_SCORE
                    + plan_output_bytes(32, 2, 1 << 20))
    # ... which is one layer of one request when that alone is larger than a block
    longest = MAX_BLOCK_ELEMENTS
    assert reserved_bytes(1 << 20, 32, 8, longest) == (
        (1 << 28) * 4 + 8 * longest * PLAN_BYTES_PER_SCORE + plan_output_bytes(32, 8, 1 << 20))


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


def test_readers_of_a_shared_prefix_still_whole_count_their_own_tokens_only():
    """Scored by the surrogate alone, an adopter holds scores of its new tokens only; the
    gate counts so the readers of a pending segment (they prefill together over the whole
    prefix), any other adopter at its whole prompt, as a window-scored one holds."""
    surrogate = KVCompressionConfig.from_mapping(
        {"kv_compression": "pyramidkv", "kv_budget": 64, "kv_scoring": "surrogate"})
    gate = ScoringGate(reserve_tokens=1000)
    readers = [FakeRequest(f"r{i}", 720, 600) for i in range(4)]
    assert all(gate.limit(r, surrogate, 600, 120, reads_segment=True) == 120 for r in readers)
    assert gate.tokens_in_flight == 4 * 120
    other = FakeRequest("o", 720, 600)
    assert gate.limit(other, surrogate, 600, 120) == 0  # 480 + 720 > 1000: it waits
    gate.prune({})
    assert gate.limit(other, surrogate, 600, 120) == 120 and gate.tokens_in_flight == 720
    gate.prune({})
    # The window's scores are by slot, the adopted ones included: the whole prompt.
    assert gate.limit(other, SNAPKV, 600, 120, reads_segment=True) == 120
    assert gate.tokens_in_flight == 720


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


def engine_with_decode(policy: str) -> KVCompressionConfig:
    return KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 4,
         "kv_decode_policy": policy, "kv_decode_budget": 16, "kv_decode_interval": 8})


def fake_vllm_config(config: KVCompressionConfig, max_num_seqs: int) -> SimpleNamespace:
    """What ``ScoringReserve.of`` reads of vLLM's config."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=512),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256,
                                         max_num_seqs=max_num_seqs),
        additional_config=config.to_mapping())


def score_bytes_held(state, plan) -> int:
    """Bytes of every fp32 score tensor the worker holds for decode scoring: each request's
    accumulators and the step's buffers (whole storages, so a buffer larger than the view
    the step uses counts in full; shared storages once)."""
    tensors = [tensor for request in state.requests.values()
               for tensor in (request.decode_scores, request.anchor_scores)]
    if plan is not None:
        tensors += [getattr(plan, field.name) for field in fields(plan)]
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                for tensor in tensors
                if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32}
    return sum(storages.values())


@pytest.mark.parametrize("policy", DECODE_POLICIES)
def test_the_decode_reserve_is_what_the_worker_allocates_for_scored_requests(policy):
    """Every running request scored at once, its generated part at the capacity (the widest
    step): the reserve the engine takes from the KV memory equals the score memory the
    worker then holds, for every decode policy (anchors keeps a second accumulator; window
    scores nothing and reserves nothing)."""
    engine = engine_with_decode(policy)
    requests, layers, heads = 3, 2, 2
    reserve = ScoringReserve.of(fake_vllm_config(engine, max_num_seqs=requests))
    capacity = 16 + 8
    generated = capacity - 1  # this step's token brings it to the capacity
    lengths = [[40 + generated] * layers * heads] * requests
    case = build_case(GPU_PAGE_FORMAT, lengths, [1] * requests, num_layers=layers,
                      num_kv_heads=heads, group=2, head_size=8, page_size=16,
                      dtype=torch.float32)
    for request in case.state.requests.values():
        request.config = engine
        request.prompt_kept = request.lengths - generated
    case.state.prepare_decode_scoring(case.step)
    scored = len(case.step.decode_queries)
    assert scored == (0 if policy == "window" else requests)
    held = score_bytes_held(case.state, case.step.decode_scoring)
    assert held == requests * reserve.decode_request_bytes(layers, heads)
    assert (held == 0) == (policy == "window")


def test_a_request_cannot_score_beyond_what_its_engine_reserved():
    """The per-request policy must fit the engine's reserve: a window engine reserves no
    decode scores, an h2o engine one accumulator per request (anchors needs two)."""
    window = engine_with_decode("window")
    assert window.decode_score_capacity == 0
    with pytest.raises(KVCompressionConfigError, match="scoring --kv-decode-policy"):
        window.with_request_overrides({"kv_decode_policy": "h2o"})
    window.with_request_overrides({"kv_decode_budget": 500})  # unscored: unbounded
    h2o = engine_with_decode("h2o")
    assert h2o.decode_score_capacity == 24
    for policy in ("snapkv", "rkv"):
        h2o.with_request_overrides({"kv_decode_policy": policy})
    with pytest.raises(KVCompressionConfigError, match="--kv-decode-policy anchors") as error:
        h2o.with_request_overrides({"kv_decode_policy": "anchors"})
    assert error.value.key == "kv_decode_policy"
    anchors = engine_with_decode("anchors")
    for policy in DECODE_POLICIES:
        anchors.with_request_overrides({"kv_decode_policy": policy})


@pytest.mark.parametrize(("engine", "overrides", "message"), [
    ({"kv_decode_policy": "h2o", "kv_decode_budget": 100, "kv_decode_interval": 28},
     {"kv_decode_policy": "h2o", "kv_decode_budget": 101},
     r"'kv_decode_budget': got 101 \+ interval 28 .* allowed: kv_decode_budget \+ "
     r"kv_decode_interval <= 128"),
    ({"kv_decode_policy": "h2o", "kv_decode_budget": 100, "kv_decode_interval": 28},
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
