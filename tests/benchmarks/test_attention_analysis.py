"""Attention statistics and recall from plan_keep selections (pure torch, tiny random model)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.attention_analysis import (
    entropy_stats,
    kept_mask,
    method_recalls,
    oracle_mask,
    recall,
    slope,
    window_scores,
)
from kvcompress.policies import PAD_INDEX, PolicySettings, observation_window_scores, plan_keep


def test_recall_bounds_and_partial_mask():
    later = torch.zeros(1, 2, 1, 4)  # 1 layer, 2 query heads (1 KV head), 1 query, 4 keys
    later[0, 0, 0] = torch.tensor([0.5, 0.25, 0.25, 0.0])
    later[0, 1, 0] = torch.tensor([0.0, 0.0, 0.5, 0.5])
    mask = torch.tensor([[[True, False, True, False]]])
    # head 0 keeps 0.75 of its mass, head 1 keeps 0.5
    assert recall(later, mask).tolist() == pytest.approx([0.625])
    assert recall(later, torch.ones_like(mask)).tolist() == pytest.approx([1.0])
    assert recall(later, torch.zeros_like(mask)).tolist() == pytest.approx([0.0])


def test_kept_mask_padding_never_erases_token_zero():
    indices = torch.tensor([[[0, 3, PAD_INDEX], [1, 2, 4]]])  # [L=1, H=2, K=3]
    counts = torch.tensor([[2, 3]])
    mask = kept_mask(indices, counts, 5)
    assert mask.tolist() == [[[True, False, False, True, False],
                              [False, True, True, False, True]]]


def test_window_scores_match_the_policy_definition():
    torch.manual_seed(0)
    queries = torch.randn(6, 20, 8)  # [H_q, S, D]: GQA 3 query heads per KV head
    keys = torch.randn(2, 20, 8)
    logits = torch.einsum("hqd,hsd->hqs", queries, keys.repeat_interleave(3, 0)) / math.sqrt(8)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    ours = window_scores(probs[:, -5:, :], num_kv_heads=2)
    reference = observation_window_scores(queries[:, -5:], keys)  # sum over window, GQA mean
    assert torch.allclose(ours, reference, atol=1e-5)


def test_entropy_stats_uniform_and_peaked():
    positions = torch.tensor([9, 19])
    uniform = torch.zeros(1, 2, 20)
    uniform[0, 0, :10] = 0.1
    uniform[0, 1, :] = 0.05
    stats = entropy_stats(uniform, positions)
    assert stats["normalized_entropy"].tolist() == pytest.approx([1.0])
    assert stats["entropy"].tolist() == pytest.approx([(math.log(10) + math.log(20)) / 2])
    peaked = torch.zeros(1, 2, 20)
    peaked[0, :, 0] = 1.0
    stats = entropy_stats(peaked, positions)
    assert stats["normalized_entropy"].tolist() == pytest.approx([0.0])
    assert stats["sink_mass"].tolist() == pytest.approx([1.0])
    assert stats["top_mass"].tolist() == pytest.approx([1.0])


def test_method_recalls_full_budget_and_oracle():
    torch.manual_seed(1)
    layers, kv_heads, group, length = 3, 2, 2, 64
    scores = torch.rand(layers, kv_heads, length)
    later = torch.rand(layers, kv_heads * group, 5, length).softmax(-1)
    out = method_recalls(scores, later, methods=["pyramidkv", "snapkv", "streamingllm"],
                         budgets=[16, 64], window=4, num_kv_heads=kv_heads)
    assert set(out) == {"pyramidkv", "snapkv", "streamingllm", "oracle"}
    for method in out:
        assert out[method][64] == pytest.approx([1.0] * layers)  # budget >= prompt: all kept
        assert all(0.0 < r < 1.0 for r in out[method][16])
    # snapkv keeps each head's top window scores: recall equals the masks from plan_keep
    plan = plan_keep(PolicySettings("snapkv", budget=16, window=4), [length], [scores],
                     num_layers=layers, num_kv_heads=kv_heads)
    mask = kept_mask(plan.indices[0], plan.counts[0], length)
    assert out["snapkv"][16] == pytest.approx(recall(later, mask).tolist())
    oracle = oracle_mask(later, kv_heads, 16, 4)
    assert oracle.sum(-1).eq(16).all() and oracle[..., -4:].all()


def test_slope():
    assert slope([3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert slope([1.0]) == 0.0


def test_recorder_on_a_tiny_random_llama():
    """The registered attention function sees every layer: prefill stats, window rows and one
    later row per generated token, with the model's outputs unchanged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.attention_analysis import analyze_input, install_attention, stack_layers

    install_attention()
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 64, (1, 40))
    with torch.no_grad():
        expected = model(ids).logits[0, -1].argmax().item()
    model.set_attn_implementation("kvcompress_analysis")
    recorder, generated = analyze_input(model, ids, new_tokens=3, window=4, num_kv_heads=2)
    assert generated[0] == expected
    scores, later, stats = stack_layers(recorder)
    assert scores.shape == (2, 2, 40) and later.shape == (2, 4, 3, 40)
    # window rows are softmax rows over the prompt: 4 window queries x 2 query heads per KV
    # head (mean over the group, summed over the window) -> each KV head's scores sum to 4
    assert torch.allclose(scores.sum(-1), torch.full((2, 2), 4.0), atol=1e-4)
    assert stats["entropy"].shape == (2, 4)
    assert (later.sum(-1) <= 1 + 1e-5).all() and (later.sum(-1) > 0.5).all()
