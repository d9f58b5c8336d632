"""Compaction on a worker state: prompt compaction keeps the planned tokens, resumed
requests keep their generated tail in order, the decode window keeps the newest tokens."""

import numpy as np
import torch

from kvcompress.config import KVCompressionConfig
from kvcompress.engine.worker_compaction import compact_completed_prompts, trim_generation_windows
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


def test_decode_window_keeps_prompt_part_and_newest_generated_tokens():
    settings = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 200, "kv_decode_window": 10,
         "kv_decode_margin": 5})
    case, request = labelled_case(lengths=150, prompt_len=120, settings=settings)
    request.prompt_kept = np.full(4, 120)  # prompt shorter than the budget: all kept
    # 151 tokens: 31 generated > 10 + 5 -> trim to the newest 10.
    compactions = trim_generation_windows(case.state, case.step, case.pool, FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [130] * 4
    assert compactions["req0"].logical_len == 151
    for row in range(4):
        slots = token_ids_in_slots(case, request, row)
        assert slots == list(range(120)) + list(range(141, 151))
    # Within the margin: nothing happens.
    assert trim_generation_windows(case.state, case.step, case.pool, FORMAT) == {}
