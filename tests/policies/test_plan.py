"""plan_keep: exact agreement with a head-by-head reference, and the plan's invariants."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.policies import (
    METHODS,
    PAD_INDEX,
    KeepPlan,
    PolicySettings,
    layer_budgets,
    observation_window_scores,
    plan_keep,
    resolve_budget,
)
from kvcompress.policies import plan as plan_module

from .reference import ref_plan

FAST = settings(max_examples=40, deadline=None)


def random_scores(lens, num_layers, num_kv_heads, seed, levels=None):
    """Raw window scores; integer levels create many ties."""
    gen = torch.Generator().manual_seed(seed)
    if levels:
        return [
            torch.randint(0, levels, (num_layers, num_kv_heads, q), generator=gen).float()
            for q in lens
        ]
    # Multiples of 2**-16: sums over a pooling kernel are exact in fp32 in any order, so two
    # windows over the same tokens tie exactly in the plan and in the reference alike.
    return [torch.randint(0, 1 << 16, (num_layers, num_kv_heads, q), generator=gen).float()
            / (1 << 16) for q in lens]


def kept_lists(plan: KeepPlan) -> list[list[list[list[int]]]]:
    counts = plan.counts.tolist()
    indices = plan.indices.tolist()
    return [
        [[row[: counts[r][li][h]] for h, row in enumerate(layer)] for li, layer in enumerate(req)]
        for r, req in enumerate(indices)
    ]


def check_invariants(plan: KeepPlan, policy: PolicySettings, lens, num_layers, num_kv_heads):
    """Shapes, budgets, window/sinks kept, indices unique/sorted/in range, padding."""
    method, budget, ratio, window = policy.method, policy.budget, policy.ratio, policy.window
    num_requests = len(lens)
    assert plan.counts.shape == (num_requests, num_layers, num_kv_heads)
    assert plan.counts.dtype == torch.long and plan.indices.dtype == torch.int32
    assert plan.indices.shape[:3] == plan.counts.shape
    assert plan.indices.shape[3] == (int(plan.counts.max()) if num_requests else 0)
    assert plan.prompt_lens.tolist() == lens
    for r, q in enumerate(lens):
        budgets = layer_budgets(method, num_layers, q, budget, ratio, window, policy.beta,
                                policy.budget_shape)
        win = min(window, q)
        assert bool(plan.compressed[r]) == (min(budgets) < q)
        model_wide = policy.budget_sharing == "model"
        if model_wide:  # the request's total is exact, shared by all its rows
            assert int(plan.counts[r].sum()) == num_kv_heads * sum(budgets)
        for layer in range(num_layers):
            counts = plan.counts[r, layer]
            if model_wide:
                assert bool((counts >= win).all()) and bool((counts <= q).all())
            elif method == "adakv":
                assert int(counts.sum()) == num_kv_heads * budgets[layer]  # layer total exact
                share = budgets[layer] - win
                floor = math.ceil(Fraction(repr(policy.adakv_floor)) * share)
                assert bool((counts >= win + floor).all())
                assert bool((counts <= q).all())
            else:
                assert counts.tolist() == [budgets[layer]] * num_kv_heads
            for h in range(num_kv_heads):
                count = int(counts[h])
                row = plan.indices[r, layer, h]
                kept = row[:count]
                assert bool((kept[1:] > kept[:-1]).all())  # sorted ascending, hence unique
                assert count == 0 or (int(kept[0]) >= 0 and int(kept[-1]) < q)
                assert bool((row[count:] == PAD_INDEX).all())
                kept_set = set(kept.tolist())
                assert set(range(q - win, q)) <= kept_set  # the window always survives
                if method == "streamingllm" and count < q:
                    sinks = min(policy.sink_tokens, count - win)
                    assert set(range(sinks)) <= kept_set
    if method != "adakv" and policy.budget_sharing != "model":
        for r, q in enumerate(lens):
            total = int(plan.counts[r, :, 0].sum())
            expected = num_layers * min(q, resolve_budget(q, budget, ratio, window))
            assert total == expected  # per-head totals over layers are exact


@FAST
@given(
    method=st.sampled_from(METHODS),
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=4),
    num_layers=st.integers(1, 5),
    num_kv_heads=st.integers(1, 4),
    window=st.integers(0, 10),
    extra=st.integers(0, 40),
    use_ratio=st.booleans(),
    ratio=st.floats(0.05, 0.95),
    pooling=st.sampled_from(["max", "avg", "none"]),
    kernel=st.sampled_from([1, 3, 7]),
    levels=st.sampled_from([None, 3]),
    floor=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    totals=st.sampled_from(["pyramid", "uniform"]),
    model_wide=st.booleans(),
    sinks=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_plan_matches_reference(
    method,
    lens,
    num_layers,
    num_kv_heads,
    window,
    extra,
    use_ratio,
    ratio,
    pooling,
    kernel,
    levels,
    floor,
    totals,
    model_wide,
    sinks,
    seed,
):
    budget = None if use_ratio else max(1, window + extra)
    ratio = ratio if use_ratio else None
    scores = random_scores(lens, num_layers, num_kv_heads, seed, levels)
    policy = PolicySettings(
        method,
        budget=budget,
        ratio=ratio,
        window=window,
        pooling=pooling,
        pooling_kernel=kernel,
        sink_tokens=sinks,
        adakv_floor=floor,
        adakv_totals=totals,
        budget_sharing="model" if model_wide and method != "streamingllm" else "layer",
    )
    shape = {"num_layers": num_layers, "num_kv_heads": num_kv_heads}
    plan = plan_keep(policy, lens, scores, **shape)
    assert kept_lists(plan) == ref_plan(policy, lens, scores, **shape)
    check_invariants(plan, policy, lens, num_layers, num_kv_heads)


@pytest.mark.parametrize("method", METHODS)
def test_llama_sized_plan(method):
    lens = [4000, 1500, 100]
    scores = random_scores(lens, 32, 8, seed=3)
    policy = PolicySettings(method, budget=128)
    plan = plan_keep(policy, lens, scores, num_layers=32, num_kv_heads=8)
    assert plan.counts[0].sum() == 32 * 8 * 128
    assert plan.counts[2].tolist() == [[100] * 8] * 32  # shorter than the budget: keep all
    assert plan.compressed.tolist() == [True, True, False]
    check_invariants(plan, policy, lens, 32, 8)
    if method == "adakv":
        assert (plan.counts[0].amax(-1) > plan.counts[0].amin(-1)).any()  # heads differ


def test_adakv_totals_and_floor_decide_what_its_heads_share():
    """Uniform totals give every layer SnapKV's total; a floor of 1 leaves nothing to share,
    so each head keeps its own top-k, exactly SnapKV's selection."""
    lens = [400]
    scores = random_scores(lens, 6, 4, seed=5)
    shape = {"num_layers": 6, "num_kv_heads": 4}
    snap = plan_keep(PolicySettings("snapkv", budget=48), lens, scores, **shape)
    pyramid = plan_keep(PolicySettings("adakv", budget=48), lens, scores, **shape)
    uniform = plan_keep(PolicySettings("adakv", budget=48, adakv_totals="uniform"), lens,
                        scores, **shape)
    assert pyramid.counts[0].sum(-1).tolist() != [4 * 48] * 6
    assert uniform.counts[0].sum(-1).tolist() == [4 * 48] * 6
    assert (uniform.counts[0].amax(-1) > uniform.counts[0].amin(-1)).any()  # still shared
    no_sharing = plan_keep(PolicySettings("adakv", budget=48, adakv_totals="uniform",
                                          adakv_floor=1.0), lens, scores, **shape)
    assert kept_lists(no_sharing) == kept_lists(snap)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_gqa_scores_from_queries_and_keys(group):
    """End to end: raw q/k -> per-KV-head scores -> plan, checked against the reference."""
    num_layers, num_kv_heads, lens, window = 2, 2, [40, 23], 8
    scores = []
    for q in lens:
        queries = torch.randn(num_layers, num_kv_heads * group, window, 16)
        keys = torch.randn(num_layers, num_kv_heads, q, 16)
        scores.append(observation_window_scores(queries, keys, group_reduce="mean"))
    shape = {"num_layers": num_layers, "num_kv_heads": num_kv_heads}
    for method in METHODS:
        policy = PolicySettings(method, budget=14, window=window)
        plan = plan_keep(policy, lens, scores, **shape)
        assert kept_lists(plan) == ref_plan(policy, lens, scores, **shape)


def test_keep_all_returns_arange_and_allows_missing_scores():
    policy = PolicySettings("pyramidkv", budget=12)
    plan = plan_keep(policy, [5, 12], [None, None], num_layers=3, num_kv_heads=2)
    assert plan.counts.tolist() == [[[5, 5]] * 3, [[12, 12]] * 3]
    assert plan.indices[1, 2, 1].tolist() == list(range(12))
    assert plan.indices[0, 0, 0].tolist() == list(range(5)) + [PAD_INDEX] * 7
    assert not plan.compressed.any()


def test_budget_equal_to_window_keeps_only_the_window():
    scores = random_scores([30], 2, 2, seed=0)
    policy = PolicySettings("pyramidkv", budget=8, window=8)
    plan = plan_keep(policy, [30], scores, num_layers=2, num_kv_heads=2)
    assert plan.indices[0].tolist() == [[list(range(22, 30))] * 2] * 2


def test_one_layer():
    scores = random_scores([50], 1, 3, seed=1)
    for method in METHODS:
        policy = PolicySettings(method, budget=20)
        plan = plan_keep(policy, [50], scores, num_layers=1, num_kv_heads=3)
        assert plan.counts.sum() == 60


def test_streamingllm_keeps_sinks_and_recent_without_scores():
    policy = PolicySettings("streamingllm", budget=16)
    plan = plan_keep(policy, [100, 10], None, num_layers=2, num_kv_heads=2)
    assert plan.indices[0, 1, 1].tolist() == [0, 1, 2, 3] + list(range(88, 100))
    assert plan.indices[1, 0, 0, :10].tolist() == list(range(10))
    # sinks are capped so that the window stays inside the recent part
    policy = PolicySettings("streamingllm", budget=10)
    plan = plan_keep(policy, [100], None, num_layers=1, num_kv_heads=1)
    assert plan.indices[0, 0, 0].tolist() == [0, 1] + list(range(92, 100))


def test_ties_resolve_to_lower_positions():
    scores = [torch.zeros(1, 1, 20)]
    policy = PolicySettings("snapkv", budget=11, window=8)
    plan = plan_keep(policy, [20], scores, num_layers=1, num_kv_heads=1)
    assert plan.indices[0, 0, 0].tolist() == [0, 1, 2] + list(range(12, 20))


def test_pooling_ignores_window_and_padding():
    # A huge score inside the window must not pull its prefix neighbours up through pooling.
    score = torch.zeros(1, 1, 30)
    score[0, 0, 25] = 100.0
    score[0, 0, 3] = 1.0
    policy = PolicySettings("snapkv", budget=9, window=8)
    plan = plan_keep(policy, [30], [score], num_layers=1, num_kv_heads=1)
    assert plan.indices[0, 0, 0].tolist() == [0] + list(range(22, 30))  # max-pool reaches 0..6
    policy = PolicySettings("snapkv", budget=9, window=8, pooling="none")
    plan = plan_keep(policy, [30], [score], num_layers=1, num_kv_heads=1)
    assert plan.indices[0, 0, 0].tolist() == [3] + list(range(22, 30))


def test_large_batches_split_into_blocks_with_the_same_result(monkeypatch):
    lens = [60, 7, 45, 90, 33]
    scores = random_scores(lens, 3, 2, seed=5)
    policy = PolicySettings("adakv", budget=20)
    whole = plan_keep(policy, lens, scores, num_layers=3, num_kv_heads=2)
    monkeypatch.setattr(plan_module, "MAX_BLOCK_ELEMENTS", 3 * 2 * 100)
    split = plan_keep(policy, lens, scores, num_layers=3, num_kv_heads=2)
    assert torch.equal(whole.counts, split.counts) and torch.equal(whole.indices, split.indices)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layers_at_once", [1, 2])
def test_a_request_larger_than_a_block_is_planned_in_layer_slices(monkeypatch, method,
                                                                   layers_at_once):
    lens = [90, 61]
    scores = random_scores(lens, 5, 2, seed=6)
    policy = PolicySettings(method, budget=24)
    whole = plan_keep(policy, lens, scores, num_layers=5, num_kv_heads=2)
    # One request's layer holds 2 * 90 scores: blocks of one request, `layers_at_once` layers.
    monkeypatch.setattr(plan_module, "MAX_BLOCK_ELEMENTS", layers_at_once * 2 * 90)
    split = plan_keep(policy, lens, scores, num_layers=5, num_kv_heads=2)
    assert torch.equal(whole.counts, split.counts) and torch.equal(whole.indices, split.indices)


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "adakv"])
@pytest.mark.parametrize("layers_at_once", [1, 2])
@pytest.mark.parametrize("levels", [None, 3], ids=["distinct", "ties"])
def test_model_wide_sharing_of_a_request_larger_than_a_block_is_exact(
        monkeypatch, method, layers_at_once, levels):
    """In layer slices, the request's cut-off key is found first (a digit per pass): the
    same plan as ranking its whole [L, H, S] at once, ties included."""
    lens, shape = [90, 61, 12], {"num_layers": 5, "num_kv_heads": 2}
    scores = random_scores(lens, 5, 2, seed=7, levels=levels)
    for budget in (24, 70):
        policy = PolicySettings(method, budget=budget, window=4, budget_sharing="model")
        whole = plan_keep(policy, lens, scores, **shape)
        monkeypatch.setattr(plan_module, "MAX_BLOCK_ELEMENTS", layers_at_once * 2 * 90)
        split = plan_keep(policy, lens, scores, **shape)
        monkeypatch.undo()
        assert torch.equal(whole.counts, split.counts)
        assert torch.equal(whole.indices, split.indices)
        assert kept_lists(split) == ref_plan(policy, lens, scores, **shape)


@pytest.mark.parametrize("layers_at_once", [1, 2])
@pytest.mark.parametrize("levels", [None, 3], ids=["distinct", "ties"])
@pytest.mark.parametrize("cap", [{"budget": 24}, {"budget": 70}, {"ratio": 0.4}, {}],
                         ids=["budget-24", "budget-70", "ratio", "uncapped"])
def test_a_score_threshold_shared_model_wide_is_planned_in_layer_slices_exactly(
        monkeypatch, layers_at_once, levels, cap):
    """A threshold's passing tokens compete for the request's cap in layer slices (their
    cut-off found first, past each head's sinks): the same plan as at once."""
    lens, shape = [90, 61, 12], {"num_layers": 5, "num_kv_heads": 2}
    scores = random_scores(lens, 5, 2, seed=11, levels=levels)
    for threshold in (-2.0, -0.7, -0.001):  # most pass, some pass, few pass
        policy = PolicySettings("snapkv", window=4, budget_sharing="model", sink_tokens=3,
                                score_threshold=threshold, **cap)
        whole = plan_keep(policy, lens, scores, **shape)
        monkeypatch.setattr(plan_module, "MAX_BLOCK_ELEMENTS", layers_at_once * 2 * 90)
        split = plan_keep(policy, lens, scores, **shape)
        monkeypatch.undo()
        assert torch.equal(whole.counts, split.counts), threshold
        assert torch.equal(whole.indices, split.indices), threshold


def test_empty_batch():
    plan = plan_keep(PolicySettings("snapkv", budget=8), [], [], num_layers=2, num_kv_heads=3)
    assert plan.counts.shape == (0, 2, 3) and plan.indices.shape == (0, 2, 3, 0)
    policy = PolicySettings("streamingllm", budget=8)
    plan = plan_keep(policy, [], None, num_layers=2, num_kv_heads=3)
    assert plan.counts.shape == (0, 2, 3) and plan.indices.shape == (0, 2, 3, 0)


def test_inputs_are_not_modified():
    scores = random_scores([50, 70], 2, 2, seed=4)
    before = [s.clone() for s in scores]
    for method in METHODS:
        policy = PolicySettings(method, budget=20)
        plan_keep(policy, [50, 70], scores, num_layers=2, num_kv_heads=2)
        plan_keep(policy, [50], scores[:1], num_layers=2, num_kv_heads=2)
    assert all(torch.equal(a, b) for a, b in zip(scores, before))


def test_low_precision_scores_are_accepted():
    scores = [s.half() for s in random_scores([40], 2, 2, seed=2)]
    policy = PolicySettings("snapkv", budget=16)
    plan = plan_keep(policy, [40], scores, num_layers=2, num_kv_heads=2)
    assert plan.counts.sum() == 64


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scores": None}, r"scores\[0\] is required"),
        ({"scores": [torch.rand(2, 2, 39)]}, r"scores\[0\] must have shape"),
        ({"scores": [torch.ones(2, 2, 40, dtype=torch.long)]}, "floating-point"),
        ({"scores": []}, "entries"),
        ({"prompt_lens": [0]}, r"prompt_lens\[0\]"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"num_layers": True}, "num_layers"),
    ],
)
def test_bad_plan_arguments_are_rejected(kwargs, message):
    args = {
        "prompt_lens": [40],
        "scores": [torch.rand(2, 2, 40)],
        "num_layers": 2,
        "num_kv_heads": 2,
    }
    args.update(kwargs)
    lens, scores = args.pop("prompt_lens"), args.pop("scores")
    with pytest.raises(ValueError, match=message):
        plan_keep(PolicySettings("snapkv", budget=16), lens, scores, **args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "h2o"}, "method must be one of pyramidkv, snapkv, streamingllm, adakv"),
        ({"budget": None}, "budget or ratio"),
        ({"ratio": 0.5}, "budget or ratio"),
        ({"budget": 7}, "budget"),
        ({"budget": None, "ratio": 1.0}, "ratio"),
        ({"window": -1}, "window"),
        ({"pooling": "median"}, "pooling"),
        ({"pooling_kernel": 6}, "pooling_kernel"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"sink_tokens": 2.0}, "sink_tokens"),
        ({"adakv_floor": 1.5}, "adakv_floor"),
        ({"beta": 0.0}, "beta"),
    ],
)
def test_bad_settings_are_rejected_on_construction(kwargs, message):
    args = {"method": "snapkv", "budget": 16, **kwargs}
    with pytest.raises(ValueError, match=message):
        PolicySettings(**args)


def test_settings_defaults_are_the_documented_ones():
    policy = PolicySettings("snapkv", budget=64)
    # measured defaults (docs/methods.md, "Defaults, by measurement")
    assert (policy.window, policy.beta, policy.pooling, policy.pooling_kernel) == (8, 2, "max", 15)
    assert (policy.sink_tokens, policy.adakv_floor, policy.adakv_totals) == (4, 0.2, "pyramid")
    assert policy.compression_method.name == "snapkv"
    assert METHODS == ("pyramidkv", "snapkv", "streamingllm", "adakv")  # the order users see
    assert policy.budget_sharing == "layer"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", METHODS)
def test_cuda_plan_equals_cpu_plan(method):
    lens = [300, 41, 129, 8]
    scores = random_scores(lens, 4, 4, seed=11, levels=4)
    policy, shape = PolicySettings(method, budget=32), {"num_layers": 4, "num_kv_heads": 4}
    cpu = plan_keep(policy, lens, scores, **shape)
    gpu = plan_keep(policy, lens, [s.cuda() for s in scores], **shape)
    if method != "streamingllm":
        assert gpu.indices.is_cuda
    assert torch.equal(cpu.counts, gpu.counts.cpu()) and torch.equal(cpu.indices, gpu.indices.cpu())
