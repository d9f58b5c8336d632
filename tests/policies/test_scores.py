"""Observation-window scores, GQA aggregation, pooling and H2O attention mass vs loop references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.policies import (
    accumulate_attention_mass,
    aggregate_window_probs,
    finalize_window_scores,
    observation_window_scores,
    pool_scores,
    window_attention_probs,
)

from .reference import ref_aggregate, ref_pool, ref_window_probs

FAST = settings(max_examples=40, deadline=None)


def random_qk(num_kv_heads: int, group: int, window: int, seq_len: int, dim: int = 8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(num_kv_heads * group, window, dim, generator=gen)
    keys = torch.randn(num_kv_heads, seq_len, dim, generator=gen)
    return queries, keys


@pytest.mark.parametrize("group", [1, 3, 8])
def test_window_probs_match_loops_and_are_causal(group):
    queries, keys = random_qk(num_kv_heads=2, group=group, window=4, seq_len=11)
    probs = window_attention_probs(queries, keys)
    assert probs.shape == (2, group, 4, 11) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.double(), ref_window_probs(queries, keys), atol=1e-6, rtol=0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, group, 4))
    for i in range(4):  # window query i sits at position 11 - 4 + i
        assert torch.all(probs[..., i, 11 - 4 + i + 1 :] == 0)


@pytest.mark.parametrize("group_reduce", ["mean", "max", "sum"])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_aggregate_matches_loops(group_reduce, group):
    probs = window_attention_probs(*random_qk(3, group, 5, 13, seed=group))
    got = aggregate_window_probs(probs, group_reduce)
    assert got.shape == (3, 13) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref_aggregate(probs, group_reduce), atol=1e-6, rtol=0)


@pytest.mark.parametrize("group_reduce", ["mean", "max", "sum"])
def test_aggregate_is_separable_over_query_and_key_chunks(group_reduce):
    probs = window_attention_probs(*random_qk(2, 4, 6, 20, seed=1))
    whole = aggregate_window_probs(probs, group_reduce)
    by_queries = sum(aggregate_window_probs(chunk, group_reduce) for chunk in probs.split(2, -2))
    by_keys = torch.cat([aggregate_window_probs(c, group_reduce) for c in probs.split(7, -1)], -1)
    torch.testing.assert_close(by_queries, whole)
    torch.testing.assert_close(by_keys, whole)


def test_batched_leading_dims():
    queries = torch.randn(3, 2, 4 * 2, 5, 8)  # [layers, batch, H_q, W, D]
    keys = torch.randn(3, 2, 2, 9, 8)
    scores = observation_window_scores(queries, keys, group_reduce="max")
    assert scores.shape == (3, 2, 2, 9)
    single = observation_window_scores(queries[1, 0], keys[1, 0], group_reduce="max")
    torch.testing.assert_close(scores[1, 0], single)


def test_mean_over_window_is_sum_over_w():
    queries, keys = random_qk(2, 2, 4, 10)
    summed = observation_window_scores(queries, keys)
    mean = observation_window_scores(queries, keys, window_reduce="mean")
    torch.testing.assert_close(mean, summed / 4)
    torch.testing.assert_close(finalize_window_scores(summed, "mean", 4), summed / 4)
    # the total mass per query head is one per window query
    torch.testing.assert_close(summed.sum(-1), torch.full((2,), 4.0))


def test_mismatched_heads_and_window_are_rejected():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        window_attention_probs(torch.randn(3, 2, 4), torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="window queries"):
        window_attention_probs(torch.randn(2, 6, 4), torch.randn(2, 5, 4))


@FAST
@given(
    pooling=st.sampled_from(["max", "avg", "none"]),
    kernel=st.sampled_from([1, 3, 5, 7, 9]),
    length=st.integers(1, 30),
    seed=st.integers(0, 2**16),
)
def test_pool_matches_loops(pooling, kernel, length, seed):
    row = torch.rand(length, generator=torch.Generator().manual_seed(seed))
    got = pool_scores(row[None, None], pooling, kernel)[0, 0]
    torch.testing.assert_close(got, torch.tensor(ref_pool(row.tolist(), pooling, kernel)))


@pytest.mark.parametrize("pooling", ["max", "avg", "none"])
def test_pool_lengths_treat_the_tail_as_padding(pooling):
    rows = torch.rand(3, 2, 12) + 5.0  # large values in the tail must not leak into the prefix
    lengths = torch.tensor([12, 7, 0])[:, None]
    got = pool_scores(rows, pooling, 5, lengths=lengths)
    for r, length in enumerate([12, 7, 0]):
        for h in range(2):
            expected = ref_pool(rows[r, h, :length].tolist(), pooling, 5)
            torch.testing.assert_close(got[r, h, :length], torch.tensor(expected))
            assert torch.all(got[r, h, length:] == float("-inf"))


def test_pool_rejects_even_kernels_and_unknown_methods():
    with pytest.raises(ValueError, match="pooling_kernel"):
        pool_scores(torch.rand(4), "max", 4)
    with pytest.raises(ValueError, match="pooling"):
        pool_scores(torch.rand(4), "median", 3)


def test_attention_mass_accumulates_and_grows():
    first = torch.rand(2, 3, 1, 5).softmax(-1)  # [H_kv, G, T, S]
    second = torch.rand(2, 3, 2, 7).softmax(-1)
    running = accumulate_attention_mass(None, first)
    running = accumulate_attention_mass(running, second)
    expected = torch.zeros(2, 7)
    expected[:, :5] += first.mean(1).sum(1)
    expected += second.mean(1).sum(1)
    torch.testing.assert_close(running, expected)
    with pytest.raises(ValueError, match="running score"):
        accumulate_attention_mass(running, first)


def test_rank_union_keeps_the_top_of_every_source_whatever_its_scale():
    from kvcompress.policies import rank_union

    generator = torch.Generator().manual_seed(0)
    window = torch.rand(3, 2, 40, generator=generator) * 8.0  # sums over 8 queries
    reconstruction = torch.rand(3, 2, 40, generator=generator) * 1e-3  # tiny maxima
    union = rank_union([window, reconstruction])
    assert union.shape == window.shape and union.dtype == torch.float32
    top = union.topk(10, dim=-1).indices
    for scores in (window, reconstruction):  # each source's best 5 are in the top 10
        best = scores.topk(5, dim=-1).indices
        assert all(set(best[i, j].tolist()) <= set(top[i, j].tolist())
                   for i in range(3) for j in range(2))
    assert torch.equal(rank_union([window]).argsort(-1), window.argsort(-1))
    with pytest.raises(ValueError, match="one shape"):
        rank_union([window, reconstruction[..., :5]])


def test_rank_union_over_a_whole_request_keeps_each_sources_best_rows_whole():
    """Ranked over [L, H, S] together (model-wide budgets), a source whose mass sits in one
    row keeps that row on top: the ranks stay comparable across rows."""
    from kvcompress.policies import rank_union

    generator = torch.Generator().manual_seed(1)
    window = torch.rand(3, 2, 40, generator=generator)
    reconstruction = torch.rand(3, 2, 40, generator=generator) * 1e-3
    reconstruction[1, 0] += 1.0  # one head the reconstruction needs entirely
    union = rank_union([window, reconstruction], ranked_dims=3)
    assert union.shape == window.shape
    top = set(union.flatten().topk(80).indices.tolist())
    needed = {(1 * 2 + 0) * 40 + position for position in range(40)}
    assert needed <= top  # the needed head's 40 tokens are among the top 80
    best_window = set(window.flatten().topk(40).indices.tolist())
    assert best_window <= top
    with pytest.raises(ValueError, match="ranked_dims"):
        rank_union([window], ranked_dims=4)
