"""Threshold eviction (``PolicySettings.score_threshold``): what passes is kept, the floor
always, a cap bounds it the method's way, and nothing below the threshold beats a passing
token."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.policies import (
    METHODS,
    PAD_INDEX,
    PolicySettings,
    get_method,
    layer_budgets,
    plan_keep,
    pool_scores,
)
from kvcompress.policies.threshold import passes_threshold

FAST = settings(max_examples=60, deadline=None)
SCORED_METHODS = [name for name in METHODS if get_method(name).needs_scores]


def probability_scores(lens, num_layers, num_kv_heads, seed):
    """Attention-probability-like scores: spread over many orders of magnitude (so a
    threshold splits them unevenly per head), a quarter exactly zero, multiples of 2**-24
    (pooled sums exact in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    scores = []
    for q in lens:
        exponent = torch.randint(0, 20, (num_layers, num_kv_heads, q), generator=gen)
        mantissa = torch.randint(1, 16, (num_layers, num_kv_heads, q), generator=gen)
        score = (mantissa.float() * 2.0 ** (-4 - exponent.float())).clamp(min=2.0 ** -24)
        score = torch.where(torch.rand(score.shape, generator=gen) < 0.25, 0.0, score)
        scores.append((score * 2**24).round() / 2**24)
    return scores


def layer_caps(policy: PolicySettings, num_layers: int, q: int) -> list[int]:
    if not policy.capped:
        return [q] * num_layers
    return layer_budgets(policy.method, num_layers, q, policy.budget, policy.ratio,
                         policy.window, policy.beta, policy.budget_shape)


def kept_rows(plan, r):
    counts, indices = plan.counts[r].tolist(), plan.indices[r].tolist()
    return [[set(row[: counts[layer][h]]) for h, row in enumerate(rows)]
            for layer, rows in enumerate(indices)]


def assert_best_are_kept(pooled, extras, passings, rows):
    """Among ``rows`` (flat layer * heads + head), no dropped passing token scores above a
    kept one (ties may go either way)."""
    flat = pooled.view(-1, pooled.shape[-1])
    kept = [float(flat[i, p]) for i in rows for p in extras[i]]
    dropped = [float(flat[i, p]) for i in rows for p in passings[i] - extras[i]]
    if kept and dropped:
        assert min(kept) >= max(dropped)


def check_threshold_plan(plan, policy, lens, scores, num_layers, num_kv_heads):
    """Every property of a threshold plan, per request, checked row by row."""
    window, threshold = policy.window, policy.score_threshold
    for r, q in enumerate(lens):
        kept = kept_rows(plan, r)
        if q <= window:
            assert all(rows == set(range(q)) for layer in kept for rows in [*layer])
            continue
        prefix = q - window
        pooled = pool_scores(scores[r], policy.pooling, policy.pooling_kernel,
                             lengths=torch.tensor(prefix))
        passing_mask = passes_threshold(pooled, threshold)
        caps = layer_caps(policy, num_layers, q)
        extras, passings, quotas_left = [], [], []  # per (layer, head)
        for layer in range(num_layers):
            quota = caps[layer] - window
            sinks = min(policy.sink_tokens, quota)
            for h in range(num_kv_heads):
                row = kept[layer][h]
                assert all(0 <= p < q for p in row)
                assert set(range(prefix, q)) <= row, "the window is always kept"
                assert set(range(sinks)) <= row, "the sinks are the floor"
                passing = {p for p in range(sinks, prefix) if passing_mask[layer, h, p]}
                extra = row - set(range(prefix, q)) - set(range(sinks))
                # Below the threshold only the floor survives.
                assert extra <= passing, (layer, h, sorted(extra - passing))
                extras.append(extra)
                passings.append(passing)
                quotas_left.append(quota - sinks)
                if not policy.capped:
                    assert extra == passing, "without a cap every passing token is kept"
                elif policy.budget_sharing == "layer" and policy.method != "adakv":
                    assert len(row) <= caps[layer], "a head keeps at most its budget"

        if not policy.capped:
            continue
        heads = range(num_layers * num_kv_heads)
        for i in heads:  # whatever the sharing, a head keeps its own best
            assert_best_are_kept(pooled, extras, passings, [i])
        if policy.budget_sharing == "model":
            total = sum(len(passing) for passing in passings)
            assert sum(map(len, extras)) == min(total, sum(quotas_left))
            assert_best_are_kept(pooled, extras, passings, heads)
        elif policy.method == "adakv":
            for layer in range(num_layers):
                row_ids = range(layer * num_kv_heads, (layer + 1) * num_kv_heads)
                total = sum(len(passings[i]) for i in row_ids)
                kept_total = sum(len(extras[i]) for i in row_ids)
                assert kept_total == min(total, sum(quotas_left[i] for i in row_ids))
        else:
            for i in heads:
                assert len(extras[i]) == min(len(passings[i]), quotas_left[i])


@FAST
@given(
    method=st.sampled_from(SCORED_METHODS),
    lens=st.lists(st.integers(1, 80), min_size=1, max_size=3),
    num_layers=st.integers(1, 4),
    num_kv_heads=st.integers(1, 3),
    window=st.integers(0, 8),
    cap=st.sampled_from(["none", "budget", "ratio"]),
    extra=st.integers(0, 30),
    ratio=st.floats(0.05, 0.95),
    threshold=st.sampled_from([-30.0, -9.0, -6.0, -4.0, -2.5, -1e-3]),
    pooling=st.sampled_from(["none", "max", "avg"]),
    kernel=st.sampled_from([1, 3, 5]),
    floor=st.sampled_from([0.0, 0.5, 1.0]),
    model_wide=st.booleans(),
    sinks=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_threshold_plan_keeps_what_passes_within_its_cap(
    method, lens, num_layers, num_kv_heads, window, cap, extra, ratio, threshold, pooling,
    kernel, floor, model_wide, sinks, seed,
):
    policy = PolicySettings(
        method,
        budget=max(1, window + extra) if cap == "budget" else None,
        ratio=ratio if cap == "ratio" else None,
        window=window, pooling=pooling, pooling_kernel=kernel, sink_tokens=sinks,
        adakv_floor=floor, budget_sharing="model" if model_wide else "layer",
        score_threshold=threshold,
    )
    scores = probability_scores(lens, num_layers, num_kv_heads, seed)
    plan = plan_keep(policy, lens, scores, num_layers=num_layers, num_kv_heads=num_kv_heads)
    # The plan's own invariants: sorted unique positions, padding after each count.
    for r in range(len(lens)):
        for layer in range(num_layers):
            for h in range(num_kv_heads):
                count = int(plan.counts[r, layer, h])
                row = plan.indices[r, layer, h]
                kept = row[:count]
                assert bool((kept[1:] > kept[:-1]).all())
                assert bool((row[count:] == PAD_INDEX).all())
    check_threshold_plan(plan, policy, lens, scores, num_layers, num_kv_heads)


def test_kept_counts_follow_the_scores_not_a_budget():
    """Concentrated heads keep few tokens, spread-out ones many: the counts differ per head
    and per request, which no budget does."""
    q, window = 64, 4
    peaked = torch.full((1, 2, q), 1e-6)
    peaked[0, 0, 10] = 0.9  # one head reads one token
    peaked[0, 1, :] = 1.0 / q  # the other spreads evenly: every token passes
    policy = PolicySettings("snapkv", window=window, pooling="none", sink_tokens=2,
                            score_threshold=math.log(1e-3))
    plan = plan_keep(policy, [q], [peaked], num_layers=1, num_kv_heads=2)
    assert plan.counts.tolist() == [[[window + 2 + 1, q]]]
    assert plan.indices[0, 0, 0, :7].tolist() == [0, 1, 10, 60, 61, 62, 63]
    assert bool(plan.compressed[0])


def test_a_cap_keeps_the_best_passing_tokens_and_the_sinks_count_against_it():
    q, window = 40, 2
    scores = torch.zeros((1, 1, q))
    scores[0, 0, 5:15] = torch.linspace(0.1, 0.5, 10)  # 10 tokens pass, 14 the best
    policy = PolicySettings("snapkv", budget=window + 5, window=window, pooling="none",
                            sink_tokens=2, score_threshold=-6.0)
    plan = plan_keep(policy, [q], [scores], num_layers=1, num_kv_heads=1)
    # 5 selected: 2 sinks, then the 3 best passing tokens; 7 in all = the budget.
    assert plan.indices[0, 0, 0].tolist() == [0, 1, 12, 13, 14, 38, 39]


def test_a_short_prompt_under_its_budget_is_still_thresholded():
    """The cap only bounds: below it, the threshold decides (the budget alone would have kept
    this prompt whole)."""
    q = 30
    scores = torch.full((2, 2, q), 1e-5)
    scores[:, :, 7] = 0.5
    policy = PolicySettings("pyramidkv", budget=64, window=4, pooling="none", sink_tokens=1,
                            score_threshold=-6.0)
    plan = plan_keep(policy, [q], [scores], num_layers=2, num_kv_heads=2)
    assert plan.counts.flatten().tolist() == [1 + 1 + 4] * 4
    # A prompt inside the window is kept whole, no scores needed.
    whole = plan_keep(policy, [4], [None], num_layers=2, num_kv_heads=2)
    assert whole.counts.flatten().tolist() == [4] * 4 and not bool(whole.compressed[0])


def test_a_very_low_threshold_keeps_every_scored_token_and_zero_scores_never_pass():
    q = 20
    scores = torch.rand((1, 1, q)) + 1e-3
    scores[0, 0, 3] = 0.0
    policy = PolicySettings("snapkv", window=2, pooling="none", sink_tokens=0,
                            score_threshold=-100.0)
    plan = plan_keep(policy, [q], [scores], num_layers=1, num_kv_heads=1)
    assert plan.indices[0, 0, 0].tolist() == [p for p in range(q) if p != 3]


def test_adakv_heads_without_candidates_leave_their_floor_to_the_others():
    """A head with nothing passing must not spend the layer's shared quota on -inf picks."""
    q, window = 30, 2
    scores = torch.zeros((1, 2, q))
    scores[0, 1, :20] = torch.linspace(0.2, 0.6, 20)  # head 1: 20 passing, head 0: none
    policy = PolicySettings("adakv", budget=window + 6, window=window, pooling="none",
                            sink_tokens=0, adakv_floor=1.0 / 3, adakv_totals="uniform",
                            score_threshold=-6.0)
    plan = plan_keep(policy, [q], [scores], num_layers=1, num_kv_heads=2)
    assert plan.counts.tolist() == [[[window, window + 12]]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"score_threshold": 0.0}, r"score_threshold must be in \[-inf, 0\)"),
        ({"score_threshold": 2.0}, "score_threshold"),
        ({"score_threshold": float("nan")}, "score_threshold"),
        ({"score_threshold": float("-inf")}, "score_threshold"),
        ({"method": "streamingllm", "score_threshold": -6.0}, "scores tokens"),
        ({"budget": None}, "budget or ratio"),  # no threshold: an amount is required
    ],
)
def test_bad_threshold_settings_are_rejected(kwargs, message):
    args = {"method": "snapkv", "budget": 16, **kwargs}
    with pytest.raises(ValueError, match=message):
        PolicySettings(**args)


def test_a_threshold_needs_no_amount():
    policy = PolicySettings("pyramidkv", score_threshold=-6.0)
    assert not policy.capped and policy.budget is None and policy.ratio is None
    assert PolicySettings("pyramidkv", ratio=0.5, score_threshold=-6.0).capped
