"""Expected-attention scores (``--kv-scoring expected``) against dense references: the
averaged rotation against the rotary embedding applied position by position, the scores
against the formula computed query head by query head, and the Gaussian expectation
against sampling."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress.attention.expected_scores import expected_scores, mean_rotation

DIM = 16


def rotate(vector: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """The neox rotary embedding of ``vector [D]`` at ``position`` over the first
    ``2 * len(inv_freq)`` dimensions (rotate_half form, as Hugging Face Llama applies it)."""
    half = inv_freq.shape[0]
    rotary, rest = vector[: 2 * half].double(), vector[2 * half:].double()
    angles = position * inv_freq.double()
    cos, sin = torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)
    rotated_half = torch.cat([-rotary[half:], rotary[:half]])
    return torch.cat([rotary * cos + rotated_half * sin, rest])


def inverse_frequencies(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


@pytest.mark.parametrize("rotary_dim", [DIM, DIM // 2], ids=["full", "partial"])
def test_mean_rotation_is_the_rotary_embedding_averaged(rotary_dim):
    """Horizon 1 is the embedding at that position; a horizon averages them (checked on
    random vectors, partial rotary dimensions pass through)."""
    inv_freq = inverse_frequencies(rotary_dim)
    vector = torch.randn(DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    one = mean_rotation(inv_freq, 37, DIM, horizon=1).double()
    torch.testing.assert_close(one @ vector, rotate(vector, 37, inv_freq), atol=1e-5, rtol=0)
    averaged = mean_rotation(inv_freq, 100, DIM, horizon=50).double()
    reference = torch.stack([rotate(vector, t, inv_freq) for t in range(100, 150)]).mean(0)
    torch.testing.assert_close(averaged @ vector, reference, atol=1e-5, rtol=0)


def reference_scores(keys, lengths, means, covariances, rotation, scale, reduce):
    """Query head by query head, key by key, in float64."""
    num_kv_heads, _, width = keys.shape
    group = means.shape[0] // num_kv_heads
    rotation = rotation.double()
    out = torch.zeros(num_kv_heads, width, dtype=torch.float64)
    for head in range(num_kv_heads):
        length = int(lengths[head])
        per_query = []
        for query_head in range(head * group, (head + 1) * group):
            mean = rotation @ means[query_head].double()
            cov = rotation @ covariances[query_head].double() @ rotation.T
            logits = torch.tensor([
                scale * mean @ keys[head, :, j].double()
                + 0.5 * scale**2 * keys[head, :, j].double() @ cov @ keys[head, :, j].double()
                for j in range(length)], dtype=torch.float64)
            per_query.append(torch.softmax(logits, 0))
        stacked = torch.stack(per_query)
        out[head, :length] = stacked.amax(0) if reduce == "max" else stacked.mean(0)
    return out


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_scores_match_the_formula_per_query_head(reduce):
    """GQA 3:1 over two KV heads of different lengths: every score equals the per-head,
    per-key reference; slots past a row's length score 0 and each row sums to 1 (mean)."""
    generator = torch.Generator().manual_seed(3)
    heads, group, width = 2, 3, 11
    keys = torch.randn(heads, DIM, width, generator=generator)
    lengths = torch.tensor([11, 7])
    means = torch.randn(heads * group, DIM, generator=generator)
    factor = torch.randn(heads * group, DIM, DIM, generator=generator) * 0.3
    covariances = factor @ factor.transpose(1, 2)
    rotation = mean_rotation(inverse_frequencies(DIM), 20, DIM, horizon=64)
    scores = expected_scores(keys, lengths, means, covariances, rotation, DIM**-0.5, reduce)
    reference = reference_scores(keys, lengths, means, covariances, rotation, DIM**-0.5, reduce)
    torch.testing.assert_close(scores.double(), reference, atol=1e-5, rtol=1e-4)
    assert (scores[1, 7:] == 0).all()
    if reduce == "mean":
        torch.testing.assert_close(scores.sum(-1), torch.ones(heads), atol=1e-5, rtol=0)


def test_a_fixed_query_scores_like_its_attention():
    """No spread (covariance 0) and horizon 1: the score is the attention the rotated mean
    query pays each key."""
    generator = torch.Generator().manual_seed(5)
    inv_freq = inverse_frequencies(DIM)
    keys = torch.randn(1, DIM, 9, generator=generator)
    query = torch.randn(1, DIM, generator=generator)
    rotation = mean_rotation(inv_freq, 12, DIM, horizon=1)
    scores = expected_scores(keys, torch.tensor([9]), query, torch.zeros(1, DIM, DIM), rotation,
                             0.25)
    rotated = rotate(query[0], 12, inv_freq)
    attention = torch.softmax(0.25 * rotated @ keys[0].double(), 0)
    torch.testing.assert_close(scores[0].double(), attention, atol=1e-6, rtol=1e-5)


def test_the_gaussian_expectation_matches_sampling():
    """exp(scale mu.k + scale^2/2 k^T S k) is E[exp(scale q.k)] for q ~ N(mu, S): the
    unnormalized score of each key against a Monte-Carlo estimate (horizon 1, rotation at
    position 0 is the identity)."""
    generator = torch.Generator().manual_seed(7)
    keys = torch.randn(DIM, 5, generator=generator, dtype=torch.float64) * 0.5
    mean = torch.randn(DIM, generator=generator, dtype=torch.float64) * 0.5
    factor = torch.randn(DIM, DIM, generator=generator, dtype=torch.float64) * 0.2
    cov = factor @ factor.T
    samples = mean + torch.randn(400_000, DIM, generator=generator, dtype=torch.float64) @ factor.T
    sampled = torch.exp(0.5 * samples @ keys).mean(0)
    sampled = sampled / sampled.sum()
    identity = mean_rotation(inverse_frequencies(DIM), 0, DIM, horizon=1)
    scores = expected_scores(keys[None].float(), torch.tensor([5]), mean[None].float(),
                             cov[None].float(), identity, 0.5)[0].double()
    torch.testing.assert_close(scores, sampled, atol=2e-3, rtol=0.02)
    assert math.isclose(float(scores.sum()), 1.0, abs_tol=1e-5)
