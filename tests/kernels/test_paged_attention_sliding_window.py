"""Sliding-window paged attention: the torch reference vs a dense band-masked softmax, the
Triton kernel vs the reference (a GPU, or Triton's interpreter on CPU tensors).

Convention (vLLM's ``sliding_window=W``): the query at row position q sees ``q - W + 1 <= k <=
q``, per (request, KV head) row with that row's own length.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress.kernels import paged_attention, paged_attention_ref, paged_attention_triton
from tests.kernels.kernel_cases import (
    MODEL_SOFTMAXES,
    TOLERANCES,
    PagedCase,
    head_keys_values,
    make_case,
    model_logits,
    model_softmax,
    run_attention,
)

# (query_lens, per-head context lengths before the new tokens), 2 KV heads.
SCENARIOS = {
    # decode rows, chunks on context, a fresh prefill, unequal head lengths, query_len 0
    "mixed": ([1, 6, 1, 0, 11], [[25, 9], [0, 3], [40, 17], [5, 2], [13, 13]]),
    "decode": ([1, 1, 1], [[70, 5], [0, 33], [18, 64]]),
    # chunks much longer than the windows (several 64-row query blocks), fresh and on context
    "long_prefill": ([90, 70], [[0, 0], [30, 3]]),
}
# Smaller than a page, one page (8), a few pages, larger than every row.
WINDOWS = [1, 3, 8, 20, 1000]


def dense_band_attention(case: PagedCase, window: int | None, soft_cap: float | None = None,
                         sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention in float64 with an explicit band mask, one (request, KV head)
    at a time: row position of query i is ``q = kv_len - query_len + i``; the mask keeps
    ``q - W + 1 <= k <= q`` (``k <= q`` with ``window`` None). Returns (out, lse)."""
    num_tokens, num_query_heads, head_size = case.query.shape
    num_kv_heads = case.page_tables.shape[1]
    group = num_query_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_query_heads, head_size, dtype=torch.float64)
    lse = torch.zeros(num_tokens, num_query_heads, dtype=torch.float64)
    starts = case.query_start_loc.tolist()
    query = case.query.cpu().double()
    for r, query_len in enumerate(case.query_lens):
        if query_len == 0:
            continue
        for h in range(num_kv_heads):
            keys, values = head_keys_values(case, r, h)
            kv_len = keys.shape[0]
            q_pos = torch.arange(kv_len - query_len, kv_len)[:, None]
            k_pos = torch.arange(kv_len)[None, :]
            band = k_pos <= q_pos
            if window:
                band &= k_pos >= q_pos - window + 1
            rows = slice(starts[r], starts[r] + query_len)
            for hq in range(h * group, (h + 1) * group):
                scores = query[rows, hq] @ keys.T * case.scale  # [query_len, kv_len]
                logits = torch.stack([model_logits(row, hq, soft_cap, sinks) for row in scores])
                logits[:, :-1] = logits[:, :-1].masked_fill(~band, float("-inf"))  # after the cap
                probs = torch.softmax(logits, dim=-1)[:, :-1]
                out[rows, hq] = probs @ values
                lse[rows, hq] = torch.logsumexp(logits, dim=-1)
    return out, lse


def _case(name: str, group: int = 2, dtype: torch.dtype = torch.float32,
          page_size: int = 8) -> PagedCase:
    return make_case(*SCENARIOS[name], group=group, head_size=64, page_size=page_size,
                     dtype=dtype)


# ---------------------------------------------------------------- the dense reference, pinned


def test_dense_band_reference_is_plain_causal_attention_without_a_window():
    """The band reference itself: W >= every row is full causal attention, W = 1 returns each
    query's own value, and the neighbouring bands W - 1, W + 1 give different results."""
    case = _case("mixed")
    full, full_lse = dense_band_attention(case, None)
    wide, wide_lse = dense_band_attention(case, 1000)
    torch.testing.assert_close(wide, full)
    torch.testing.assert_close(wide_lse, full_lse)
    own, _ = dense_band_attention(case, 1)
    starts = case.query_start_loc.tolist()
    for r, query_len in enumerate(case.query_lens):
        for h in range(2):
            _, values = head_keys_values(case, r, h)
            for i in range(query_len):
                for hq in (2 * h, 2 * h + 1):
                    torch.testing.assert_close(own[starts[r] + i, hq],
                                               values[values.shape[0] - query_len + i])
    narrow, _ = dense_band_attention(case, 4)
    for other in (3, 5):
        assert (dense_band_attention(case, other)[0] - narrow).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("window", WINDOWS)
def test_reference_matches_dense_band(window, name, group, dtype):
    case = _case(name, group=group, dtype=dtype)
    expected, expected_lse = dense_band_attention(case, window)
    out, lse = run_attention(case, paged_attention_ref, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
@pytest.mark.parametrize("window", [3, 20])
def test_reference_matches_dense_band_with_model_softmax(window, kind):
    case = _case("mixed", group=3)
    softmax = model_softmax(kind, case.query.shape[1], device=case.query.device)
    expected, expected_lse = dense_band_attention(case, window, **softmax)
    plain, _ = dense_band_attention(case, window)
    assert (expected - plain).abs().max() > 0.05
    out, lse = run_attention(case, paged_attention_ref, sliding_window=window, **softmax)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 0])
def test_no_window_is_full_attention(window):
    case = _case("mixed")
    expected, _ = run_attention(case, paged_attention_ref)
    out, _ = run_attention(case, paged_attention_ref, sliding_window=window)
    torch.testing.assert_close(out, expected)


def test_rejects_a_negative_window():
    case = _case("decode")
    with pytest.raises(ValueError, match="sliding_window"):
        run_attention(case, paged_attention_ref, sliding_window=-1)


# ---------------------------------------------------------------- Triton vs the reference


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_matches_reference(device, window, name, group):
    case = _case(name, group=group).to(device)
    expected, expected_lse = run_attention(case, paged_attention_ref, sliding_window=window)
    out, lse = run_attention(case, paged_attention_triton, sliding_window=window)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["mixed", "long_prefill"])
def test_triton_matches_reference_half_precision(device, name, dtype):
    case = _case(name, group=3, dtype=dtype, page_size=16).to(device)
    expected, _ = run_attention(case, paged_attention_ref, sliding_window=5)
    out, _ = run_attention(case, paged_attention_triton, sliding_window=5)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
@pytest.mark.parametrize("name", ["mixed", "long_prefill"])
def test_triton_window_with_model_softmax(device, name, kind, num_splits):
    """Split-K too: the sink joins the denominator once, whichever split holds which keys."""
    case = _case(name, group=3).to(device)
    softmax = model_softmax(kind, case.query.shape[1], device=case.query.device)
    expected, expected_lse = run_attention(case, paged_attention_ref, sliding_window=6,
                                           **softmax)
    out, lse = run_attention(case, paged_attention_triton, sliding_window=6,
                             num_splits=num_splits, **softmax)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


LONG_DECODE = ([1, 1, 4], [[300, 150], [517, 90], [260, 141]])


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    "split_args",
    [
        dict(num_splits=1),
        dict(num_splits=2),
        dict(num_splits=8),  # more splits than the window has tiles: some scan nothing
        dict(num_splits=4, block_n=16),
        # The heuristic with a long max_kv_len hint: the window bounds what it splits.
        dict(max_query_len=4, max_kv_len=4096),
        dict(max_query_len=4),  # no hint: sized from the window, no kv_lens sync
    ],
)
@pytest.mark.parametrize("window", [1, 7, 100])
def test_triton_split_k_with_a_window(device, window, split_args):
    case = make_case(*LONG_DECODE, group=3, head_size=64, page_size=16).to(device)
    expected, expected_lse = run_attention(case, paged_attention_ref, sliding_window=window)
    out, lse = run_attention(case, paged_attention_triton, sliding_window=window, **split_args)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


def _poison_before(case: PagedCase, bounds: torch.Tensor) -> None:
    """NaN into K and V of positions ``< bounds[r, h]`` of every head: a kernel that loads them
    (even masked: 0 * NaN in the PV product) returns NaN."""
    page_size = case.pool.shape[2]
    for r in range(bounds.shape[0]):
        for h in range(bounds.shape[1]):
            for j in range(int(bounds[r, h])):
                page = int(case.page_tables[r, h, j // page_size])
                case.pool[page, :, j % page_size] = float("nan")


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("window", [1, 9, 40])
def test_triton_skips_tiles_before_the_window(device, window, block_n, num_splits):
    """O(W) work: the tiles wholly before a program's first window are never read. Every
    position before ``floor((first query's position - W + 1) / block_n) * block_n`` of each
    head is poisoned; the output stays the reference's (computed before the poison)."""
    case = make_case(*LONG_DECODE, group=2, head_size=64, page_size=16)
    expected, expected_lse = run_attention(case, paged_attention_ref, sliding_window=window)
    query_lens = torch.tensor(case.query_lens)[:, None]
    first_visible = (case.kv_lens - query_lens - (window - 1)).clamp_min(0)
    bounds = first_visible // block_n * block_n
    assert int(bounds.min()) > 0
    _poison_before(case, bounds)
    case = case.to(device)
    out, lse = run_attention(case, paged_attention_triton, sliding_window=window,
                             block_n=block_n, num_splits=num_splits)
    torch.testing.assert_close(out, expected.to(device), **TOLERANCES[torch.float32])
    torch.testing.assert_close(lse, expected_lse.to(device), atol=1e-4, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
def test_dispatch_passes_the_window(device):
    case = _case("mixed").to(device)
    expected, _ = run_attention(case, paged_attention_ref, sliding_window=4)
    out, _ = run_attention(case, paged_attention, sliding_window=4)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    assert not math.isclose(
        float((out - run_attention(case, paged_attention_ref)[0]).abs().max()), 0.0)
