"""Compaction on a worker state: prompt compaction keeps the planned tokens, resumed
requests keep their generated tail in order, decode eviction keeps each policy's generated
tokens in order (and h2o's scores follow them)."""

import pytest
import torch

from kvcompress.config import KVCompressionConfig
from kvcompress.engine.worker_compaction import compact_completed_prompts, evict_generated_tokens
from kvcompress.paging.page_format import CPU_PAGE_FORMAT
from kvcompress.policies import plan_keep
from tests.paged_cases import build_case

FORMAT = CPU_PAGE_FORMAT


def token_ids_in_slots(case, request, row):
    """Which original token each slot of ``row`` holds (K values are unique per token)."""
    length = int(request.lengths[row])
    positions = torch.arange(length)
    pages = torch.as_tensor(request.table.pages[row], dtype=torch.long)
    slots = pages[positions // 16] * 16 + positions % 16
    keys, _ = FORMAT.read_tokens(case.pool, slots)
    return keys[:, 0].round().long().tolist()


def labelled_case(lengths, prompt_len, settings):
    """One request whose token t carries K[:, 0] == t in every row (all rows same length)."""
    rows = 4
    case = build_case(FORMAT, [[lengths] * rows], [1], num_layers=2, num_kv_heads=2, group=1,
                      head_size=32, page_size=16, dtype=torch.float32,
                      prompt_lens=[prompt_len], wants_compression=[True])
    request = case.state.requests["req0"]
    for row in range(rows):
        case.old_keys[0, row][:, 0] = torch.arange(lengths, dtype=torch.float32)
        positions = torch.arange(lengths)
        slots = (torch.as_tensor(request.table.pages[row], dtype=torch.long)[positions // 16]
                 * 16 + positions % 16)
        FORMAT.write_tokens(case.pool, case.old_keys[0, row], case.old_values[0, row], slots)
    # the step's new token (index `lengths`) also gets its label
    new_key = case.new_keys.clone()
    new_key[:, :, 0] = float(lengths)
    FORMAT.write_tokens(case.pool, new_key[0], case.new_values[0], case.step.slot_mapping[0])
    case.state.finish_step(case.step)
    request.config = settings
    request.window_scores = torch.rand(2, 2, prompt_len, generator=torch.Generator().manual_seed(0))
    return case, request


def test_prompt_compaction_keeps_exactly_the_planned_tokens():
    settings = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 24})
    case, request = labelled_case(lengths=99, prompt_len=100, settings=settings)
    scores = request.window_scores.clone()
    case.step.completing_prompt = [0]
    compactions = compact_completed_prompts(case.state, case.step, case.pool, FORMAT)
    plan = plan_keep(settings.policy, [100], [scores], num_layers=2, num_kv_heads=2)
    assert compactions["req0"].logical_len == 100
    assert compactions["req0"].physical_lengths.tolist() == [24] * 4
    for row in range(4):
        kept = plan.indices[0].reshape(4, -1)[row, :24].tolist()
        assert sorted(token_ids_in_slots(case, request, row)) == kept
    assert request.prompt_kept.tolist() == [24] * 4 and request.window_scores is None


def test_resumed_request_keeps_generated_tail_after_prompt_in_order():
    # Preempted after 30 outputs: the recompute covers prompt (100) + 29 outputs.
    settings = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 24})
    case, request = labelled_case(lengths=128, prompt_len=100, settings=settings)
    case.step.completing_prompt = [0]
    compactions = compact_completed_prompts(case.state, case.step, case.pool, FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [24 + 29] * 4
    for row in range(4):
        slots = token_ids_in_slots(case, request, row)
        assert all(token < 100 for token in slots[:24])
        assert slots[24:] == list(range(100, 129))


def decode_case(policy, budget, interval, lengths, prompt_len=120, window=4):
    """A request past its prompt whose rows hold ``lengths + 1 - prompt_len`` generated
    tokens (the step's token included), under decode eviction ``policy``."""
    settings = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 200, "kv_window": window,
         "kv_decode_policy": policy, "kv_decode_budget": budget,
         "kv_decode_interval": interval})
    case, request = labelled_case(lengths=lengths, prompt_len=prompt_len, settings=settings)
    assert request.prompt_kept.tolist() == [prompt_len] * 4  # prompt within budget: all kept
    return case, request


def test_window_policy_keeps_prompt_part_and_newest_generated_tokens():
    case, request = decode_case("window", budget=10, interval=5, lengths=150)
    # 151 tokens: 31 generated >= 10 + 5 -> keep the newest 10.
    compactions = evict_generated_tokens(case.state, case.step, case.pool, FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [130] * 4
    assert compactions["req0"].logical_len == 151 and compactions["req0"].kind == "decode"
    for row in range(4):
        slots = token_ids_in_slots(case, request, row)
        assert slots == list(range(120)) + list(range(141, 151))
    assert request.decode_scores is None
    # Under budget + interval: nothing happens.
    assert evict_generated_tokens(case.state, case.step, case.pool, FORMAT) == {}


def test_decode_eviction_waits_for_budget_plus_interval():
    case, request = decode_case("window", budget=10, interval=5, lengths=133)
    # 14 generated tokens: one short of 10 + 5.
    assert evict_generated_tokens(case.state, case.step, case.pool, FORMAT) == {}
    assert request.lengths.tolist() == [134] * 4


def scored_keep(scores, budget, recent):
    """Reference: per row, the newest ``recent`` offsets plus the best-scored older ones."""
    generated = scores.shape[-1]
    kept = []
    for row in scores.tolist():
        older = sorted(range(generated - recent), key=lambda offset: -row[offset])
        kept.append(sorted(older[: budget - recent]
                           + list(range(generated - recent, generated))))
    return kept


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_scored_policies_keep_the_chosen_tokens_in_order_and_update_their_scores(policy):
    budget, interval, window = 10, 5, 4
    case, request = decode_case(policy, budget, interval, lengths=134, window=window)
    # 15 generated tokens = budget + interval: the accumulator is full.
    scores = torch.rand(2, 2, budget + interval, generator=torch.Generator().manual_seed(3))
    request.decode_scores = scores.clone()
    compactions = evict_generated_tokens(case.state, case.step, case.pool, FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [120 + budget] * 4
    kept = scored_keep(scores.reshape(4, -1), budget, window)
    for row in range(4):
        assert token_ids_in_slots(case, request, row) == (
            list(range(120)) + [120 + offset for offset in kept[row]])
    if policy == "h2o":
        # kept tokens keep their mass at their new offsets; freed offsets restart at zero
        carried = request.decode_scores.reshape(4, -1)
        for row in range(4):
            assert carried[row, :budget].tolist() == scores.reshape(4, -1)[row, kept[row]].tolist()
        assert not carried[:, budget:].any()
    else:  # snapkv: the next observation window starts afresh
        assert request.decode_scores is None
    assert len(set(map(tuple, kept))) > 1, "rows should choose differently"


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_a_request_without_decode_scores_keeps_its_newest_tokens(policy):
    # e.g. resumed after preemption: its recomputed outputs were never scored
    case, request = decode_case(policy, budget=10, interval=5, lengths=150)
    assert request.decode_scores is None
    compactions = evict_generated_tokens(case.state, case.step, case.pool, FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [130] * 4
    for row in range(4):
        assert token_ids_in_slots(case, request, row) == list(range(120)) + list(range(141, 151))
    assert request.decode_scores is None


def test_a_failed_decode_eviction_fails_only_its_request(monkeypatch):
    case, request = decode_case("h2o", budget=10, interval=5, lengths=134)
    monkeypatch.setenv("KVCOMPRESS_FAULT_INJECTION", "plan:120")
    assert evict_generated_tokens(case.state, case.step, case.pool, FORMAT) == {}
    assert "decode eviction" in case.step.failures["req0"]
    assert request.lengths.tolist() == [135] * 4  # untouched


@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv"])
def test_a_resumed_request_is_compressed_then_evicted_to_its_newest_tokens(policy):
    # Preempted after 30 outputs, recomputed: prompt 100 -> 24 per head, then its 29-token
    # tail (>= 10 + 5, never scored) is cut to the newest 10 in the same step.
    settings = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 24, "kv_window": 4,
         "kv_decode_policy": policy, "kv_decode_budget": 10, "kv_decode_interval": 5})
    case, request = labelled_case(lengths=128, prompt_len=100, settings=settings)
    case.step.completing_prompt = [0]
    compact_completed_prompts(case.state, case.step, case.pool, FORMAT)
    compactions = evict_generated_tokens(case.state, case.step, case.pool, FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [24 + 10] * 4
    for row in range(4):
        slots = token_ids_in_slots(case, request, row)
        assert all(token < 100 for token in slots[:24])
        assert slots[24:] == list(range(119, 129))
    assert request.decode_scores is None
