"""The method registry: lookup, and a method added by one record is planned like the built-ins.

The toy methods below are what a file in kvcompress/policies/methods/ would hold; registering
them for the test stands in for adding them to registry.COMPRESSION_METHODS.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress.policies import (
    COMPRESSION_METHODS,
    METHODS,
    CompressionMethod,
    PolicySettings,
    SelectionBlock,
    SelectionSettings,
    get_method,
    layer_budgets,
    plan_keep,
    temporarily_registered,
)
from kvcompress.policies.selection import PAD_INDEX, top_quota_positions

from .reference import _pooled_prefix


def select_lowest_per_head(block: SelectionBlock, settings: SelectionSettings) -> torch.Tensor:
    """Each head's ``quota`` lowest pooled scores (ties: lower position)."""
    # Negating ranks the lowest first; positions past the prefix (-inf) must stay unselectable.
    negated = torch.where(torch.isfinite(block.scores), -block.scores, -math.inf)
    return top_quota_positions(negated, block.quota[:, :, None])


def select_first_tokens(block: SelectionBlock, settings: SelectionSettings) -> torch.Tensor:
    """The first ``quota`` prompt positions, in every head; no scores needed."""
    slot = torch.arange(int(block.quota.max()), device=block.quota.device)
    first = torch.where(slot < block.quota[:, :, None], slot, PAD_INDEX)
    return first[:, :, None, :].expand(-1, -1, block.num_kv_heads, -1)


LOWEST = CompressionMethod(
    name="lowest",
    summary="keeps the lowest-scored tokens (a test toy)",
    budget_shape="pyramid",
    needs_scores=True,
    select=select_lowest_per_head,
)
FIRST = CompressionMethod(
    name="first",
    summary="keeps the first tokens (a test toy)",
    budget_shape="uniform",
    needs_scores=False,
    select=select_first_tokens,
)


def toy_reference(policy, lens, scores, num_layers, num_kv_heads):
    """kept[r][l][h]: the window plus the toy's choice from the pooled prefix, head by head."""
    result = []
    for r, q in enumerate(lens):
        budgets = layer_budgets(policy.method, num_layers, q, policy.budget, window=policy.window)
        prefix = q - min(policy.window, q)
        per_layer = []
        for layer, keep in enumerate(budgets):
            quota = keep - policy.window
            heads = []
            for h in range(num_kv_heads):
                if keep == q:
                    heads.append(list(range(q)))
                    continue
                if policy.method == "first":
                    chosen = range(quota)
                else:
                    row = _pooled_prefix(
                        scores[r][layer, h], prefix, policy.pooling, policy.pooling_kernel
                    )
                    chosen = sorted(range(prefix), key=lambda j: (row[j], j))[:quota]
                heads.append(sorted(set(chosen) | set(range(prefix, q))))
            per_layer.append(heads)
        result.append(per_layer)
    return result


@pytest.mark.parametrize("method", [LOWEST, FIRST])
@pytest.mark.parametrize("pooling", ["max", "none"])
def test_a_registered_method_is_planned_with_its_budgets_and_selection(method, pooling):
    lens, num_layers, num_kv_heads = [300, 41, 129, 20], 4, 3
    gen = torch.Generator().manual_seed(7)
    shape = (num_layers, num_kv_heads)
    scores = [torch.randint(0, 5, (*shape, q), generator=gen).float() for q in lens]  # many ties
    with temporarily_registered(method):
        policy = PolicySettings(method.name, budget=32, window=4, pooling=pooling)
        given = scores if method.needs_scores else None
        plan = plan_keep(policy, lens, given, num_layers=num_layers, num_kv_heads=num_kv_heads)
        budgets = [layer_budgets(method.name, num_layers, q, budget=32, window=4) for q in lens]
        expected = toy_reference(policy, lens, scores, num_layers, num_kv_heads)
    assert budgets[0] == (sorted(budgets[0], reverse=True) if method is LOWEST else [32] * 4)
    assert (budgets[0][0] > 32) == (method.budget_shape == "pyramid")
    for r, per_layer in enumerate(budgets):
        assert plan.counts[r].tolist() == [[keep] * num_kv_heads for keep in per_layer]
    counts, indices = plan.counts.tolist(), plan.indices.tolist()
    kept = [
        [[row[: counts[r][li][h]] for h, row in enumerate(layer)] for li, layer in enumerate(req)]
        for r, req in enumerate(indices)
    ]
    assert kept == expected


def test_registration_lasts_for_the_block_only_and_leaves_the_user_choices_alone():
    with temporarily_registered(LOWEST):
        assert get_method("lowest") is LOWEST
        assert "lowest" not in METHODS  # users choose from COMPRESSION_METHODS only
    with pytest.raises(ValueError, match="method must be one of"):
        get_method("lowest")
    with pytest.raises(ValueError, match="lowest"):
        PolicySettings("lowest", budget=32)


@pytest.mark.parametrize("name", ["snapkv", "lowest"])
def test_a_name_cannot_be_registered_twice(name):
    clash = CompressionMethod(name, "a clash", "uniform", False, select_first_tokens)
    with temporarily_registered(LOWEST):
        with pytest.raises(ValueError, match="already registered"), temporarily_registered(clash):
            pass
        assert get_method("lowest") is LOWEST  # the failed attempt removed nothing


def test_the_registry_lists_each_built_in_once_in_user_order():
    assert METHODS == ("pyramidkv", "snapkv", "streamingllm", "adakv")
    assert [get_method(name) for name in METHODS] == list(COMPRESSION_METHODS)
    shapes = {method.name: method.budget_shape for method in COMPRESSION_METHODS}
    assert shapes == {
        "pyramidkv": "pyramid", "snapkv": "uniform", "streamingllm": "uniform", "adakv": "pyramid"
    }
    assert [m.name for m in COMPRESSION_METHODS if not m.needs_scores] == ["streamingllm"]
    # what the selections are typed to read exists on the settings plan_keep passes them
    assert isinstance(PolicySettings("snapkv", budget=16), SelectionSettings)
    with pytest.raises(ValueError, match="budget_shape"):
        CompressionMethod("odd", "a bad shape", "triangle", True, select_first_tokens)
