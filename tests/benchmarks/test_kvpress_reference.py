"""The kvpress reference tool's pure parts (kvpress itself lives in .venv-kvpress, not here)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from benchmarks import kvpress_reference as ref
from kvcompress.policies import layer_budgets


def test_prompts_are_deterministic_and_seeded():
    first = ref.passkey_prompts(5, seed=3)
    assert first == ref.passkey_prompts(5, seed=3)
    assert first != ref.passkey_prompts(5, seed=4)
    assert len({p.passkey for p in first}) == 5


def test_prompt_holds_its_needle_once_and_ends_with_the_question():
    for prompt in ref.passkey_prompts(20, seed=0):
        assert prompt.text.count(ref.needle(prompt.passkey)) == 1
        assert prompt.text.count(prompt.passkey) == 1
        assert prompt.text.endswith("\n" + ref.QUESTION)
        assert len(prompt.passkey) == 6 and prompt.passkey.isdigit()
        assert 0.0 <= prompt.depth <= 1.0
    depths = [p.depth for p in ref.passkey_prompts(40, seed=0)]
    assert min(depths) < 0.3 and max(depths) > 0.7  # the needle moves through the prompt


def test_is_correct_looks_for_the_passkey():
    assert ref.is_correct(" 123456. Remember", "123456")
    assert not ref.is_correct(" 12345", "123456")


def test_kept_mask_ignores_entries_past_the_count():
    indices = torch.tensor([[0, 2, 7], [1, 3, 3]])
    mask = ref.kept_mask(indices, torch.tensor([2, 1]), 5)
    assert mask.tolist() == [[True, False, True, False, False], [False, True, False, False, False]]


def test_overlap_stats():
    theirs = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    ours = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1]], dtype=torch.bool)
    stats = ref.overlap_stats(ours, theirs)
    assert stats == {"overlap": 0.75, "identical": 0.5, "kept_ours": 4, "kept_theirs": 4}


@pytest.mark.parametrize("prompt_len", [97, 290, 301, 1000, 4099])
@pytest.mark.parametrize("budget", [8, 33, 64, 96])
def test_kvpress_ratio_keeps_the_budget(prompt_len, budget):
    ratio = ref.kvpress_ratio(prompt_len, budget)
    assert 0 < ratio < 1
    assert int(prompt_len * (1 - ratio)) == budget  # kvpress.utils.compute_n_kept
    assert round(prompt_len * (1 - ratio)) == budget  # PyramidKVPress's fallback


def test_original_pyramid_overshoots_where_ours_is_exact():
    for prompt_len, budget in [(290, 64), (290, 128), (1000, 100), (4000, 512)]:
        original = ref.kvcache_factory_pyramid(30, prompt_len, budget, 8, 20)
        ours = layer_budgets("pyramidkv", 30, prompt_len, budget, None, 8, 20.0)
        assert sum(ours) == 30 * budget
        assert sum(original) >= 30 * budget
        assert original == sorted(original, reverse=True)
    assert sum(ref.kvcache_factory_pyramid(30, 290, 64, 8, 20)) == 2235
    # Below 2 * (budget - window) the original keeps the budget everywhere, as ours does.
    assert ref.kvcache_factory_pyramid(30, 290, 192, 8, 20) == [192] * 30
    assert layer_budgets("pyramidkv", 30, 290, 192, None, 8, 20.0) == [192] * 30


@pytest.mark.parametrize("budget", [16, 64, 100, 128, 512])
def test_adakv_floor_reproduces_kvpress_safeguard(budget):
    """Ours: ceil(floor * quota) prefix tokens per head; kvpress: int(alpha * budget) tokens per
    head, the window's 8 first (they score highest)."""
    floor = ref.kvpress_adakv_floor(budget, 8, 0.2)
    ours = math.ceil(Fraction(repr(floor)) * (budget - 8))
    assert ours == max(int(budget * 0.2) - 8, 0)


def test_configs():
    assert [c.name for c in ref.ours_configs("streamingllm", 64)] == ["-"]
    matched, defaults = ref.ours_configs("adakv", 64)
    assert (matched.name, matched.settings.pooling, matched.settings.pooling_kernel) == (
        "kvpress", "avg", 5)
    assert (defaults.name, defaults.settings.pooling) == ("defaults", "max")
    assert matched.settings.window == defaults.settings.window == ref.WINDOW


def test_ours_kept_keeps_window_and_budget_per_head():
    torch.manual_seed(0)
    layers, heads, prompt_len, budget = 4, 3, 50, 16
    scores = torch.rand(layers, heads, prompt_len)
    for config in ref.ours_configs("snapkv", budget):
        kept = ref.ours_kept(config, scores, prompt_len)
        assert kept.shape == (layers, heads, prompt_len)
        assert (kept.sum(dim=-1) == budget).all()
        assert kept[..., -ref.WINDOW:].all()


def test_module_does_not_import_kvpress_or_vllm_at_import_time():
    import subprocess
    import sys

    code = ("import sys, benchmarks.kvpress_reference; "
            "assert 'kvpress' not in sys.modules and 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
