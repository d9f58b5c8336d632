"""Layer budgets: PyramidKV schedule with exact totals, uniform budgets, ratios, validation."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.policies import distribute_exactly, layer_budgets, resolve_budget
from kvcompress.policies.budgets import pyramid_selected_schedule, uses_pyramid

FAST = settings(max_examples=150, deadline=None)


def reference_floored_budgets(num_layers: int, prompt_len: int, budget: int, window: int, beta):
    """The published implementation's per-layer budgets (integer division on min and step)."""
    min_num = (budget - window) // beta
    max_num = (budget - window) * 2 - min_num
    if max_num >= prompt_len - window:
        max_num = prompt_len - window
        min_num = (budget - window) * 2 - max_num
    steps = (max_num - min_num) // (num_layers - 1)
    return [max_num - layer * steps + window for layer in range(num_layers)]


def test_llama8b_anchor_sums_exactly_and_shrinks_with_depth():
    budgets = layer_budgets("pyramidkv", 32, 4000, budget=128, window=8, beta=20)
    assert sum(budgets) == 32 * 128
    assert budgets[-1] < budgets[0]
    # bottom = 2 * 120 - 120 / 20 = 234 selected, top = 6 selected, plus the window of 8
    assert budgets[0] == 242 and budgets[-1] == 14
    assert all(a >= b for a, b in itertools.pairwise(budgets))


def test_reference_rounding_overshoots_and_ours_does_not():
    floored = reference_floored_budgets(32, 4000, 128, 8, 20)
    assert sum(floored) == 4272  # +176 tokens per head: +4.3% of 4096, +4.6% of the 3840 selected
    assert sum(layer_budgets("pyramidkv", 32, 4000, budget=128, beta=20)) == 4096


@pytest.mark.parametrize("method", ["snapkv", "streamingllm"])
def test_uniform_methods_keep_the_budget_in_every_layer(method):
    assert layer_budgets(method, 5, 1000, budget=64) == [64] * 5


def test_adakv_layer_totals_follow_the_pyramid():
    assert layer_budgets("adakv", 32, 4000, budget=128) == layer_budgets(
        "pyramidkv", 32, 4000, budget=128
    )


def test_prompt_not_longer_than_budget_keeps_everything():
    assert layer_budgets("pyramidkv", 4, 100, budget=128) == [100] * 4
    assert layer_budgets("pyramidkv", 4, 128, budget=128) == [128] * 4
    assert layer_budgets("snapkv", 3, 7, budget=8) == [7] * 3


def test_short_prompts_fall_back_to_uniform_like_the_reference():
    # q < 2 * (C - w) = 240: uniform; q = 240: pyramid
    assert layer_budgets("pyramidkv", 32, 239, budget=128) == [128] * 32
    pyramid = layer_budgets("pyramidkv", 32, 240, budget=128)
    assert pyramid[0] > 128 > pyramid[-1] and sum(pyramid) == 4096


def test_bottom_is_clamped_to_the_prompt():
    # B = 120, q = 241 >= 2B: bottom would be 234 selected but only q - w = 233 exist
    budgets = layer_budgets("pyramidkv", 32, 241, budget=128, window=8, beta=20)
    assert budgets[0] == 241
    assert sum(budgets) == 32 * 128


def test_one_layer_and_budget_equal_to_window():
    assert layer_budgets("pyramidkv", 1, 4000, budget=128) == [128]
    assert layer_budgets("pyramidkv", 6, 4000, budget=8, window=8) == [8] * 6


def test_ratio_rounds_half_up_and_keeps_more_than_the_window():
    assert resolve_budget(1000, ratio=0.9, window=8) == 100
    assert resolve_budget(5, ratio=0.5, window=0) == 3  # 2.5 rounds up
    assert resolve_budget(15, ratio=0.7, window=0) == 5  # 4.5 in decimal, not 4.4999...
    assert resolve_budget(100, ratio=0.99, window=8) == 9  # 1 would not cover the window
    assert layer_budgets("snapkv", 2, 1000, ratio=0.75) == [250, 250]
    assert layer_budgets("pyramidkv", 2, 5, ratio=0.5) == [5, 5]  # C = 9 >= q


def test_beta_one_is_flat():
    assert layer_budgets("pyramidkv", 8, 4000, budget=100, beta=1) == [100] * 8


def test_distribute_exactly_largest_remainder():
    values = [Fraction(7, 2), Fraction(5, 2), Fraction(3, 2), Fraction(1, 2)]
    assert distribute_exactly(values, 8) == [4, 3, 1, 0]  # ties: lower index first
    assert distribute_exactly([Fraction(1, 3)] * 3, 1) == [1, 0, 0]


@FAST
@given(
    num_layers=st.integers(1, 80),
    window=st.integers(0, 64),
    extra=st.integers(0, 600),
    prompt_len=st.integers(1, 6000),
    beta=st.one_of(st.integers(1, 40), st.floats(1.0, 40.0)),
    method=st.sampled_from(["pyramidkv", "snapkv", "adakv", "streamingllm"]),
)
def test_budget_properties(num_layers, window, extra, prompt_len, beta, method):
    budget = max(1, window + extra)
    budgets = layer_budgets(method, num_layers, prompt_len, budget=budget, window=window, beta=beta)
    assert len(budgets) == num_layers
    if prompt_len <= budget:
        assert budgets == [prompt_len] * num_layers
        return
    assert sum(budgets) == num_layers * budget
    assert all(window <= b <= prompt_len for b in budgets)
    assert all(a >= b for a, b in itertools.pairwise(budgets))
    pyramid = method in ("pyramidkv", "adakv") and uses_pyramid(
        num_layers, prompt_len, budget, window
    )
    if not pyramid:
        assert budgets == [budget] * num_layers
        return
    exact = pyramid_selected_schedule(
        num_layers, prompt_len, budget, window, Fraction(repr(float(beta)))
    )
    assert all(abs(b - window - x) < 1 for b, x in zip(budgets, exact))


@FAST
@given(
    prompt_len=st.integers(1, 20000),
    ratio=st.floats(0.01, 0.99),
    window=st.integers(0, 32),
    num_layers=st.integers(1, 40),
)
def test_ratio_budget_properties(prompt_len, ratio, window, num_layers):
    budget = resolve_budget(prompt_len, ratio=ratio, window=window)
    assert budget >= window + 1
    assert abs(budget - max(window + 1, (1 - ratio) * prompt_len)) <= 0.5 + 1e-9
    budgets = layer_budgets("pyramidkv", num_layers, prompt_len, ratio=ratio, window=window)
    assert sum(budgets) == num_layers * min(budget, prompt_len)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"method": "h2o"}, "method"),
        ({"num_layers": 0}, "num_layers"),
        ({"prompt_len": 0}, "prompt_len"),
        ({"budget": 4}, "budget"),
        ({"budget": 0, "window": 0}, "budget"),
        ({"budget": None, "ratio": 1.0}, "ratio"),
        ({"budget": None, "ratio": 0.0}, "ratio"),
        ({"budget": None, "ratio": math.nan}, "ratio"),
        ({"budget": 64, "ratio": 0.5}, "budget or ratio"),
        ({"budget": None}, "budget or ratio"),
        ({"window": -1}, "window"),
        ({"beta": 0.5}, "beta"),
        ({"budget": 64.0}, "budget"),
        ({"num_layers": True}, "num_layers"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    args = {"method": "pyramidkv", "num_layers": 32, "prompt_len": 4000, "budget": 128}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        layer_budgets(**args)
