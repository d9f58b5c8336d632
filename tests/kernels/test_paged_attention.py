"""Paged attention: torch reference vs dense naive attention, Triton kernel vs reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcompress.kernels import paged_attention, paged_attention_ref, paged_attention_triton
from tests.kernels.kernel_cases import (
    MODEL_SOFTMAXES,
    TOLERANCES,
    dense_attention,
    make_case,
    model_softmax,
    run_attention,
)

# (query_lens, per-head context lengths before the new tokens) with 2 KV heads: decode rows,
# prefill chunks on prior context, a fresh prefill (context 0), unequal head lengths and a
# request with no query rows in this batch (query_len 0).
MIXED = ([1, 6, 1, 0, 11], [[25, 9], [0, 3], [40, 17], [5, 2], [13, 13]])
DECODE = ([1, 1, 1], [[70, 5], [0, 33], [18, 64]])


@pytest.mark.parametrize(
    "page_size, head_size, group, dtype",
    list(itertools.product([8, 16, 32], [64, 128], [1, 3, 8], [torch.float32, torch.bfloat16])),
)
def test_reference_matches_dense(page_size, head_size, group, dtype):
    case = make_case(*MIXED, group=group, head_size=head_size, page_size=page_size, dtype=dtype)
    expected, expected_lse = dense_attention(case)
    out, lse = run_attention(case, paged_attention_ref)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)


TRITON_CASES = list(
    itertools.product(
        [8, 16, 32], [64, 128], [1, 3, 8], [torch.float32, torch.bfloat16, torch.float16]
    )
)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("page_size, head_size, group, dtype", TRITON_CASES)
def test_triton_matches_reference_mixed_batch(device, page_size, head_size, group, dtype):
    case = make_case(*MIXED, group=group, head_size=head_size, page_size=page_size, dtype=dtype)
    case = case.to(device)
    expected, expected_lse = run_attention(case, paged_attention_ref)
    out, lse = run_attention(case, paged_attention_triton)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    "scenario, split_args, dtype",
    [
        (DECODE, dict(num_splits=1), torch.float32),
        (DECODE, dict(num_splits=4), torch.float32),
        (DECODE, dict(num_splits=8), torch.bfloat16),
        (([3, 1], [[30, 12], [5, 41]]), dict(num_splits=2), torch.float32),
        # The heuristic: few programs and a long (upper-bound) max_kv_len hint -> splits.
        (DECODE, dict(max_query_len=1, max_kv_len=4096), torch.float32),
    ],
)
def test_triton_split_k(device, scenario, split_args, dtype):
    case = make_case(*scenario, group=3, head_size=64, page_size=16, dtype=dtype).to(device)
    expected, expected_lse = run_attention(case, paged_attention_ref)
    out, lse = run_attention(case, paged_attention_triton, **split_args)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_reference_matches_dense_with_model_softmax(kind, group, dtype):
    case = make_case(*MIXED, group=group, head_size=64, page_size=8, dtype=dtype)
    softmax = model_softmax(kind, case.query.shape[1], device=case.query.device)
    expected, expected_lse = dense_attention(case, **softmax)
    plain, _ = dense_attention(case)
    assert (expected - plain).abs().max() > 0.05, "the model softmax should change the output"
    out, lse = run_attention(case, paged_attention_ref, **softmax)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_triton_matches_reference_with_model_softmax(device, kind, num_splits, dtype):
    """Split-K too: the sink joins the denominator once, whichever split holds which keys."""
    case = make_case(*MIXED, group=3, head_size=64, page_size=8, dtype=dtype).to(device)
    softmax = model_softmax(kind, case.query.shape[1], device=case.query.device)
    expected, expected_lse = run_attention(case, paged_attention_ref, **softmax)
    out, lse = run_attention(case, paged_attention_triton, num_splits=num_splits, **softmax)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
def test_a_large_soft_cap_changes_nothing_and_large_scores_stay_finite(device):
    """tanh in the kernel takes one exp2 of a non-positive argument: no overflow at any score."""
    case = make_case(*DECODE, group=2, head_size=64, page_size=16).to(device)
    expected, _ = run_attention(case, paged_attention_ref)
    out, _ = run_attention(case, paged_attention_triton, soft_cap=1e4)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    case.scale = 1e3  # scores of ~1e3: capped at 2, never inf or NaN
    expected, _ = run_attention(case, paged_attention_ref, soft_cap=2.0)
    out, _ = run_attention(case, paged_attention_triton, soft_cap=2.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("kernel", [paged_attention_ref, paged_attention_triton])
def test_strided_views_as_the_engine_passes_them(device, kernel):
    """Per-layer slices of [R, L, H, max_pages] tables, query/out as slices of wider buffers."""
    case = make_case(*MIXED, group=2, head_size=64, page_size=8, dtype=torch.float32)
    expected, _ = dense_attention(case)
    num_layers, layer = 3, 1
    num_requests = case.page_tables.shape[0]
    tables = torch.full((num_requests, num_layers, *case.page_tables.shape[1:]), 7,
                        dtype=torch.int32)
    tables[:, layer] = case.page_tables
    lens = torch.zeros(num_requests, num_layers, 2, dtype=torch.int32)
    lens[:, layer] = case.kv_lens
    num_tokens, num_query_heads, head_size = case.query.shape
    qkv = torch.randn(num_tokens, num_query_heads + 4, head_size)
    qkv[:, :num_query_heads] = case.query
    out_buffer = torch.zeros(num_tokens, num_query_heads + 1, head_size, device=device)
    out = out_buffer[:, 1:]
    kernel(
        qkv.to(device)[:, :num_query_heads], case.pool.to(device), tables.to(device)[:, layer],
        lens.to(device)[:, layer], case.query_start_loc.to(device), case.scale, out,
    )
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCES[torch.float32])
    assert torch.all(out_buffer[:, 0] == 0)


@pytest.mark.usefixtures("needs_triton")
def test_dispatch_and_empty_batch(device):
    case = make_case(*DECODE, group=1, head_size=64, page_size=16).to(device)
    expected, _ = run_attention(case, paged_attention_ref)
    out, _ = run_attention(case, paged_attention)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    empty = case.query[:0]
    no_requests = torch.zeros(1, dtype=torch.int32, device=device)
    paged_attention_triton(
        empty, case.pool, case.page_tables[:0], case.kv_lens[:0], no_requests, case.scale,
        torch.empty_like(empty),
    )


def test_rejects_bad_shapes():
    case = make_case(*DECODE, group=1, head_size=64, page_size=16)
    out = torch.empty_like(case.query)
    with pytest.raises(TypeError, match="int32"):
        paged_attention_ref(
            case.query, case.pool, case.page_tables.long(), case.kv_lens, case.query_start_loc,
            case.scale, out,
        )
    with pytest.raises(ValueError, match="kv_lens"):
        paged_attention_ref(
            case.query, case.pool, case.page_tables, case.kv_lens[:, :1], case.query_start_loc,
            case.scale, out,
        )
    with pytest.raises(ValueError, match="sinks"):  # one per query head, not per KV head
        paged_attention_ref(
            case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc,
            case.scale, out, sinks=torch.zeros(case.page_tables.shape[1] + 1),
        )
