"""Compaction on a worker state: prompt compaction keeps the planned tokens, resumed
requests keep their generated tail in order, decode eviction keeps each policy's generated
tokens in order (and h2o's scores follow them)."""

import dataclasses

import numpy as np
import pytest
import torch

from kvcompress.engine.worker.compaction import CompactionStats, compact_completed_prompts
from kvcompress.engine.worker.decode_eviction import _generated_keys, evict_generated_tokens
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, PageFormat
from kvcompress.policies import plan_keep
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import KVScales
from tests.paged_cases import build_case, fp8_bytes

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


@pytest.mark.parametrize("sharing", ["layer", "model"])
def test_prompt_compaction_keeps_exactly_the_planned_tokens(sharing):
    settings = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 24,
                                                 "kv_budget_sharing": sharing})
    case, request = labelled_case(lengths=99, prompt_len=100, settings=settings)
    scores = request.window_scores.clone()
    if sharing == "model":  # one head the scores favour: it keeps more than the others
        scores[1, 0] += 1.0
        request.window_scores = scores.clone()
    case.step.completing_prompt = [0]
    compactions = compact_completed_prompts(case.state, case.step, case.pool, FORMAT)
    plan = plan_keep(settings.policy, [100], [scores], num_layers=2, num_kv_heads=2)
    counts = plan.counts[0].reshape(4).tolist()
    assert compactions["req0"].logical_len == 100
    assert compactions["req0"].physical_lengths.tolist() == counts
    assert sum(counts) == 4 * 24
    assert (counts == [24] * 4) == (sharing == "layer")
    for row in range(4):
        kept = plan.indices[0].reshape(4, -1)[row, :counts[row]].tolist()
        assert sorted(token_ids_in_slots(case, request, row)) == kept
    assert request.prompt_kept.tolist() == counts and request.window_scores is None


def test_resumed_request_keeps_generated_tail_after_prompt_in_order():
    # Preempted after 30 outputs: the recompute covers prompt (100) + 29 outputs.
    settings = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 24,
                                                 "kv_budget_sharing": "layer"})
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


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "rkv", "anchors"])
def test_a_request_without_decode_scores_keeps_its_newest_tokens(policy):
    # e.g. resumed after preemption: its recomputed outputs were never scored
    case, request = decode_case(policy, budget=10, interval=5, lengths=150)
    assert request.decode_scores is None
    compactions = evict_generated_tokens(case.state, case.step, case.pool, FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [130] * 4
    for row in range(4):
        assert token_ids_in_slots(case, request, row) == list(range(120)) + list(range(141, 151))
    assert request.decode_scores is None


def test_rkv_reads_the_generated_keys_from_the_pool():
    budget, interval, window = 10, 5, 4
    case, request = decode_case("rkv", budget, interval, lengths=134, window=window)
    scores = torch.rand(2, 2, budget + interval, generator=torch.Generator().manual_seed(4))
    request.decode_scores = scores.clone()
    rows = case.state.layout.compressed_rows
    keys = _generated_keys(case.state, request, rows, budget + interval, case.pool, FORMAT)
    # the labels: generated offset j of every row is token 120 + j
    assert keys[..., 0].round().long().tolist() == [list(range(120, 135))] * 4
    want = request.config.decode_eviction.keep(scores.reshape(4, -1), 4, budget + interval,
                                               keys=keys)
    compactions = evict_generated_tokens(case.state, case.step, case.pool, FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [120 + budget] * 4
    for row in range(4):
        assert token_ids_in_slots(case, request, row) == (
            list(range(120)) + [120 + offset for offset in want[row].tolist()])
    assert request.decode_scores is None  # as snapkv: the next window starts afresh


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_rkv_on_fp8_pages_ranks_the_decoded_keys(fp8):
    """fp8 pages hold byte codes of ``key / scale``: rkv's redundancy must be computed on the
    keys they stand for, so it keeps what it keeps on those keys in the model's dtype (a
    row-wide scale changes no centred cosine similarity)."""
    budget, interval, window, prompt_len, lengths = 10, 5, 4, 120, 134
    page_format = PageFormat("transposed", fp8)
    scale = 0.5  # a power of two: the scaled keys are exact, so the reference is too
    case = build_case(page_format, [[lengths] * 4], [1], num_layers=2, num_kv_heads=2, group=1,
                      head_size=32, page_size=16, dtype=torch.float32, seed=3,
                      prompt_lens=[prompt_len], wants_compression=[True],
                      kv_scales=KVScales(scale, scale))
    page_format.write_tokens(case.pool, fp8_bytes(case.new_keys[0], fp8, scale),
                             fp8_bytes(case.new_values[0], fp8, scale), case.step.slot_mapping[0])
    case.state.finish_step(case.step)
    request = case.state.requests["req0"]
    request.config = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 200, "kv_window": window,
         "kv_decode_policy": "rkv", "kv_decode_budget": budget,
         "kv_decode_interval": interval})
    request.window_scores = torch.rand(2, 2, prompt_len,
                                       generator=torch.Generator().manual_seed(0))
    generated = budget + interval
    # The keys of each row's generated tokens as the model computed them (before fp8).
    keys = torch.stack([torch.cat([case.old_keys[0, row][prompt_len:], case.new_keys[:, row]])
                        for row in range(4)])
    assert keys.shape[:2] == (4, generated)
    scores = torch.rand(2, 2, generated, generator=torch.Generator().manual_seed(4))
    request.decode_scores = scores.clone()
    eviction = request.config.decode_eviction
    want = eviction.keep(scores.reshape(4, -1), 4, generated, keys=keys)
    # The byte codes themselves rank otherwise: this case tells the two apart.
    codes = fp8_bytes(keys, fp8, scale)
    assert not torch.equal(eviction.keep(scores.reshape(4, -1), 4, generated, keys=codes), want)
    compactions = evict_generated_tokens(case.state, case.step, case.pool, page_format)
    assert compactions["req0"].physical_lengths.tolist() == [prompt_len + budget] * 4
    for row in range(4):
        positions = torch.arange(prompt_len, prompt_len + budget)
        slots = (torch.as_tensor(request.table.pages[row], dtype=torch.long)[positions // 16]
                 * 16 + positions % 16)
        held, _ = page_format.read_tokens(case.pool, slots)
        held = page_format.decode(held) * scale
        assert torch.equal(held, keys[row, want[row]]), f"row {row} kept other tokens"


def test_anchors_carry_both_accumulators_over_an_eviction():
    budget, interval, window = 10, 5, 4
    case, request = decode_case("anchors", budget, interval, lengths=134, window=window)
    gen = torch.Generator().manual_seed(5)
    scores = torch.rand(2, 2, budget + interval, generator=gen)
    anchor_scores = torch.rand(2, 2, budget + interval, generator=gen)
    request.decode_scores, request.anchor_scores = scores.clone(), anchor_scores.clone()
    want = request.config.decode_eviction.keep(
        scores.reshape(4, -1), 4, budget + interval, anchor_scores=anchor_scores.reshape(4, -1))
    evict_generated_tokens(case.state, case.step, case.pool, FORMAT)
    for row in range(4):
        kept = want[row].tolist()
        assert token_ids_in_slots(case, request, row) == (
            list(range(120)) + [120 + offset for offset in kept])
        for before, after in ((scores, request.decode_scores),
                              (anchor_scores, request.anchor_scores)):
            carried = after.reshape(4, -1)
            assert carried[row, :budget].tolist() == before.reshape(4, -1)[row, kept].tolist()
            assert not carried[row, budget:].any()


def test_a_failed_decode_eviction_fails_only_its_request(monkeypatch):
    case, request = decode_case("h2o", budget=10, interval=5, lengths=134)
    monkeypatch.setenv("KVCOMPRESS_FAULT_INJECTION", "plan:120")
    assert evict_generated_tokens(case.state, case.step, case.pool, FORMAT) == {}
    assert "decode eviction" in case.step.failures["req0"]
    assert request.lengths.tolist() == [135] * 4  # untouched


@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv", "rkv", "anchors"])
def test_a_resumed_request_is_compressed_then_evicted_to_its_newest_tokens(policy):
    # Preempted after 30 outputs, recomputed: prompt 100 -> 24 per head, then its 29-token
    # tail (>= 10 + 5, never scored) is cut to the newest 10 in the same step.
    settings = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 24, "kv_window": 4,
         "kv_budget_sharing": "layer", "kv_decode_policy": policy, "kv_decode_budget": 10,
         "kv_decode_interval": 5})
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


# ------------------------------------------------------------------ multi-turn reuse
ADOPTED_ROWS = [6, 20, 3, 8]  # per row: slots of the adopted context (each head its own)
ADOPTED_LEN = 20  # logical tokens they stand for


def adopted_label(slot: int) -> int:
    return 1000 + slot


def adopter_case(new_tokens, settings, after=0, chunk=1):
    """One request that adopted ``ADOPTED_ROWS`` and has ``new_tokens`` new prompt tokens:
    adopted slot s of a row is labelled ``1000 + s``, logical position p >= ADOPTED_LEN is
    labelled p. Its step ends ``after`` tokens past the prompt and holds its last ``chunk``
    tokens; then the step is finished."""
    adopted = np.array(ADOPTED_ROWS)
    totals = adopted + new_tokens + after
    prompt_len = ADOPTED_LEN + new_tokens
    case = build_case(FORMAT, [(totals - chunk).tolist()], [chunk], num_layers=2,
                      num_kv_heads=2, group=1, head_size=32, page_size=16,
                      dtype=torch.float32)
    request = case.state.requests["req0"]
    request.adopted_len, request.adopted_rows = ADOPTED_LEN, adopted.copy()
    request.config = settings
    case.step = case.state.prepare_step(
        ["req0"], np.array([chunk]), np.array([prompt_len + after - chunk]),
        np.array([prompt_len]), observation_windows=[settings.window],
        wants_compression=[after == 0 or chunk > after])
    for row in range(4):
        positions = torch.arange(int(totals[row]))
        labels = torch.where(positions < adopted[row], 1000 + positions,
                             ADOPTED_LEN + positions - adopted[row]).float()
        keys = torch.randn(len(positions), 32)
        keys[:, 0] = labels
        slots = (torch.as_tensor(request.table.pages[row], dtype=torch.long)[positions // 16]
                 * 16 + positions % 16)
        FORMAT.write_tokens(case.pool, keys, torch.randn(len(positions), 32), slots)
    case.state.finish_step(case.step)
    width = int(adopted.max()) + new_tokens
    request.window_scores = torch.rand(2, 2, width, generator=torch.Generator().manual_seed(1))
    return case, request


def segment_plan(settings, scores, new_tokens):
    """What the policy keeps of the new segment, by the scores at each row's segment slots,
    without attention sinks: counts [4], kept segment positions per row."""
    segment = torch.stack([scores.reshape(4, -1)[row, start : start + new_tokens]
                           for row, start in enumerate(ADOPTED_ROWS)]).reshape(2, 2, -1)
    plan = plan_keep(dataclasses.replace(settings.policy, sink_tokens=0), [new_tokens],
                     [segment], num_layers=2, num_kv_heads=2)
    counts = plan.counts[0].reshape(4)
    return counts, [plan.indices[0].reshape(4, -1)[row, : counts[row]].tolist()
                    for row in range(4)]


@pytest.mark.parametrize("tail", [0, 7], ids=["completed", "resumed"])
def test_an_adopter_keeps_its_context_and_compresses_its_new_prompt_tokens(tail):
    settings = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 16,
                                                 "kv_window": 4, "kv_budget_sharing": "layer"})
    new_tokens = 50
    case, request = adopter_case(new_tokens, settings, after=tail, chunk=tail + 1)
    assert request.prompt_kept.tolist() == [p + new_tokens for p in ADOPTED_ROWS]
    scores = request.window_scores.clone()
    assert case.step.completing_prompt == [0]
    compactions = compact_completed_prompts(case.state, case.step, case.pool, FORMAT)
    counts, kept = segment_plan(settings, scores, new_tokens)
    assert counts.tolist() == [16] * 4  # the budget applies to the segment
    assert len(set(map(tuple, kept))) > 1, "rows should choose differently"
    full_counts = [adopted + 16 for adopted in ADOPTED_ROWS]
    assert compactions["req0"].physical_lengths.tolist() == [c + tail for c in full_counts]
    assert compactions["req0"].logical_len == ADOPTED_LEN + new_tokens + tail
    assert request.lengths.tolist() == [c + tail for c in full_counts]
    assert request.prompt_kept.tolist() == full_counts
    for row, adopted in enumerate(ADOPTED_ROWS):
        slots = token_ids_in_slots(case, request, row)
        # the adopted context stays where it was, slot for slot
        assert slots[:adopted] == [adopted_label(slot) for slot in range(adopted)]
        segment = slots[adopted : adopted + 16]
        want = [ADOPTED_LEN + position for position in kept[row]]
        if tail:  # order kept, then the generated tail in order
            assert segment == want
            first_generated = ADOPTED_LEN + new_tokens
            assert slots[adopted + 16 :] == list(range(first_generated, first_generated + tail))
        else:
            assert sorted(segment) == want
    assert request.compressed and request.window_scores is None


def test_an_adopters_segment_gets_no_attention_sinks():
    # StreamingLLM on the segment: its newest tokens only; the sinks are in the context.
    settings = KVCompressionConfig.from_mapping(
        {"kv_compression": "streamingllm", "kv_budget": 16, "kv_window": 4})
    case, request = adopter_case(40, settings)
    compact_completed_prompts(case.state, case.step, case.pool, FORMAT)
    for row, adopted in enumerate(ADOPTED_ROWS):
        slots = token_ids_in_slots(case, request, row)
        assert slots[:adopted] == [adopted_label(slot) for slot in range(adopted)]
        assert sorted(slots[adopted:]) == list(range(ADOPTED_LEN + 24, ADOPTED_LEN + 40))


def test_an_adopter_with_a_short_segment_decodes_within_its_budget():
    # 6 new prompt tokens are within the budget: nothing compacted, the prompt part is the
    # context plus the segment; then the decode budget evicts only generated tokens.
    settings = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 16, "kv_window": 4,
         "kv_decode_policy": "window", "kv_decode_budget": 10, "kv_decode_interval": 5})
    case, request = adopter_case(6, settings, after=15, chunk=1)
    assert request.prompt_kept.tolist() == [p + 6 for p in ADOPTED_ROWS]
    assert case.step.completing_prompt == []
    compactions = evict_generated_tokens(case.state, case.step, case.pool, FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [p + 6 + 10 for p in ADOPTED_ROWS]
    first_generated = ADOPTED_LEN + 6
    for row, adopted in enumerate(ADOPTED_ROWS):
        assert token_ids_in_slots(case, request, row) == (
            [adopted_label(slot) for slot in range(adopted)]
            + list(range(ADOPTED_LEN, first_generated))
            + list(range(first_generated + 5, first_generated + 15)))


def test_a_failing_adopter_plan_fails_only_that_request():
    settings = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 16,
                                                 "kv_window": 4})
    case, request = adopter_case(50, settings)
    request.window_scores = request.window_scores[:, :, :30]  # too narrow for its rows
    lengths = request.lengths.copy()
    assert compact_completed_prompts(case.state, case.step, case.pool, FORMAT) == {}
    assert "planning the compression" in case.step.failures["req0"]
    assert request.lengths.tolist() == lengths.tolist() and not request.compressed


def test_auto_sharing_keeps_the_methods_split_for_a_prompt_no_reconstruction_scored():
    """Surrogate scoring resolves auto sharing to model-wide; a prompt the engine scored
    by its window after all (no query-agnostic scores) keeps the method's own split, and
    one a reconstruction or its surrogate scored shares the total model-wide."""
    settings = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 24,
                                                 "kv_scoring": "surrogate"})
    assert settings.resolved_budget_sharing == "model"
    for query_agnostic in (False, True):
        case, request = labelled_case(lengths=99, prompt_len=100, settings=settings)
        request.window_scores[1, 0] += 1.0  # one head the scores favour
        request.query_agnostic = query_agnostic
        case.step.completing_prompt = [0]
        compactions = compact_completed_prompts(case.state, case.step, case.pool, FORMAT)
        lengths = compactions["req0"].physical_lengths.tolist()
        assert sum(lengths) == 4 * 24
        assert (lengths == [24] * 4) == (not query_agnostic), (query_agnostic, lengths)


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_score_threshold_compacts_each_row_to_what_passes(hybrid):
    """Rows keep data-dependent numbers of tokens, reported to the scheduler as they are;
    with hybrid scoring a token passes when either source's score does."""
    settings = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_score_threshold": -4.0, "kv_window": 4,
         "kv_sink_tokens": 2, "kv_pooling": "none", "kv_min_prompt": 16})
    case, request = labelled_case(lengths=99, prompt_len=100, settings=settings)
    window = torch.full((2, 2, 100), 1e-4)
    window[0, 0, 10:20] = 0.5  # row 0: 10 passing tokens, the other rows fewer
    window[1, 1, 30] = 0.2
    request.window_scores = window.clone()
    passing = {0: set(range(10, 20)), 1: set(), 2: set(), 3: {30}}
    if hybrid:
        query = torch.full((2, 2, 100), 1e-6)
        query[0, 1, 50:53] = 0.3  # what only the reconstruction finds survives too
        request.query_scores = query
        passing[1] = {50, 51, 52}
    case.step.completing_prompt = [0]
    stats = CompactionStats()
    compactions = compact_completed_prompts(case.state, case.step, case.pool, FORMAT, stats)
    floor = {0, 1, *range(96, 100)}
    lengths = compactions["req0"].physical_lengths.tolist()
    assert lengths == [len(floor | passing[row]) for row in range(4)]
    for row in range(4):
        assert sorted(token_ids_in_slots(case, request, row)) == sorted(floor | passing[row])
    assert request.prompt_kept.tolist() == lengths
    # What benchmarks read as the measured kept fraction.
    assert (stats.prompt_rows_planned, stats.prompt_rows_kept) == (4 * 100, sum(lengths))
