"""fp8 pages (uint8 pool of e4m3 / e5m2 codes with separate K and V scales) in the attention
and window-score kernels: the torch references against themselves over the decoded pages,
the Triton kernels (GPU, or the interpreter on CPU) against the references. The write of the
codes is in test_write_kv.py; moves in test_move_kv.py."""

from __future__ import annotations

import pytest
import torch

from kvcompress.kernels import (
    paged_attention_ref,
    paged_attention_triton,
    window_scores_ref,
    window_scores_triton,
)
from tests.kernels.kernel_cases import (
    FP8_FORMATS,
    FP8_SCALES,
    TOLERANCES,
    fp8_case,
    make_case,
    model_softmax,
    run_attention,
)

_fp8_decode = None  # the kernels' decode, set by the decode test for its kernel to call
MIXED = ([1, 6, 1, 0, 11], [[25, 9], [0, 3], [40, 17], [5, 2], [13, 13]])
DECODE = ([1, 1, 1], [[70, 5], [0, 33], [18, 64]])


@pytest.mark.parametrize("kv_fp8", FP8_FORMATS)
@pytest.mark.parametrize("window", [None, 8])
def test_reference_on_fp8_pages_is_attention_over_the_decoded_values(kv_fp8, window):
    """Codes times their scale, K's and V's apart: the reference over fp32 pages holding them."""
    case = make_case(*MIXED, group=3, head_size=64, page_size=8)
    quantized, decoded = fp8_case(case, kv_fp8, **FP8_SCALES)
    softmax = model_softmax("both", case.query.shape[1], device=case.query.device)
    expected, expected_lse = run_attention(decoded, paged_attention_ref, sliding_window=window,
                                           **softmax)
    out, lse = run_attention(quantized, paged_attention_ref, kv_fp8=kv_fp8,
                             sliding_window=window, **softmax, **FP8_SCALES)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)
    unscaled, _ = run_attention(quantized, paged_attention_ref, kv_fp8=kv_fp8, **softmax)
    assert (unscaled - out).abs().max() > 0.1, "the scales should matter"


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    "kv_fp8, scenario, group, dtype, options",
    [
        # prefill chunks + decode rows, GQA, bf16 queries
        (torch.float8_e4m3fn, MIXED, 3, torch.bfloat16, {}),
        (torch.float8_e5m2, MIXED, 3, torch.bfloat16, {}),
        # split-K decode (V's scale applied before the splits merge), fp16 queries
        (torch.float8_e4m3fn, DECODE, 4, torch.float16, dict(num_splits=4)),
        (torch.float8_e5m2, DECODE, 2, torch.float32, dict(num_splits=2)),
        # the model softmax (soft-cap and sinks) and a sliding window, on fp32 queries
        (torch.float8_e4m3fn, MIXED, 2, torch.float32, dict(softmax="both", sliding_window=5)),
        (torch.float8_e5m2, DECODE, 1, torch.float32, dict(softmax="sinks", num_splits=4)),
    ],
)
def test_triton_attention_on_fp8_pages_matches_reference(device, kv_fp8, scenario, group, dtype,
                                                         options):
    options = dict(options)
    case = make_case(*scenario, group=group, head_size=64, page_size=16, dtype=dtype)
    quantized, _ = fp8_case(case, kv_fp8, **FP8_SCALES)
    quantized = quantized.to(device)
    if "softmax" in options:
        options.update(model_softmax(options.pop("softmax"), case.query.shape[1], device))
    splits = {"num_splits": options.pop("num_splits")} if "num_splits" in options else {}
    expected, expected_lse = run_attention(quantized, paged_attention_ref, kv_fp8=kv_fp8,
                                           **options, **FP8_SCALES)
    out, lse = run_attention(quantized, paged_attention_triton, kv_fp8=kv_fp8, **options,
                             **splits, **FP8_SCALES)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


def run_window_scores(case, kernel, window_start, **kwargs) -> torch.Tensor:
    scores = torch.zeros(len(case.query_lens), case.page_tables.shape[1], 96,
                         device=case.query.device)
    kernel(case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc,
           torch.tensor(window_start, dtype=torch.int32, device=case.query.device), case.scale,
           scores, **kwargs)
    return scores


@pytest.mark.parametrize("kv_fp8", FP8_FORMATS)
def test_window_scores_reference_on_fp8_pages_reads_decoded_keys(kv_fp8):
    case = make_case(*MIXED, group=3, head_size=64, page_size=8)
    quantized, decoded = fp8_case(case, kv_fp8, **FP8_SCALES)
    window_start = [0, 2, 0, 0, 6]
    expected = run_window_scores(decoded, window_scores_ref, window_start)
    scores = run_window_scores(quantized, window_scores_ref, window_start, kv_fp8=kv_fp8,
                               k_scale=FP8_SCALES["k_scale"])
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    "kv_fp8, dtype, softmax, with_lse",
    [(torch.float8_e4m3fn, torch.bfloat16, None, False),
     (torch.float8_e5m2, torch.float32, "both", False),
     (torch.float8_e4m3fn, torch.float32, "soft_cap", True)],
)
def test_triton_window_scores_on_fp8_pages_match_reference(device, kv_fp8, dtype, softmax,
                                                           with_lse):
    """Both passes (the LSE pass, and the scores with the attention kernel's LSE)."""
    case = make_case(*MIXED, group=3, head_size=64, page_size=8, dtype=dtype)
    quantized, _ = fp8_case(case, kv_fp8, **FP8_SCALES)
    quantized = quantized.to(device)
    model = model_softmax(softmax, case.query.shape[1], device) if softmax else {}
    window_start = [0, 2, 0, 0, 6]
    expected = run_window_scores(quantized, window_scores_ref, window_start, kv_fp8=kv_fp8,
                                 k_scale=FP8_SCALES["k_scale"], **model)
    extra = {}
    if with_lse:
        _, lse = run_attention(quantized, paged_attention_triton, kv_fp8=kv_fp8, **model,
                               **FP8_SCALES)
        extra["softmax_lse"] = lse
    scores = run_window_scores(quantized, window_scores_triton, window_start, kv_fp8=kv_fp8,
                               k_scale=FP8_SCALES["k_scale"], **model, **extra)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(scores, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("kv_fp8", FP8_FORMATS)
def test_kernel_decode_of_every_code_times_its_factor_is_the_fp8_value(device, kv_fp8):
    """The kernels' decode (bit moves, any GPU) against torch, all 256 codes; e4m3's NaN
    codes excepted (never written: the writes saturate)."""
    import triton
    import triton.language as tl

    from kvcompress.kernels._triton_support import (
        FP8_DECODE_FACTOR,
        fp8_kind,
        load_kernel_module,
    )

    global _fp8_decode  # kernels see globals, not closures
    _fp8_decode = load_kernel_module("_triton_helpers").fp8_decode

    @triton.jit  # decorated here, in the test's Triton mode
    def decode_kernel(codes_ptr, out_ptr, KV_FP8: tl.constexpr):
        index = tl.arange(0, 256)
        codes = tl.load(codes_ptr + index)
        tl.store(out_ptr + index, _fp8_decode(codes, KV_FP8).to(tl.float32))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    out = torch.empty(256, device=device)
    kind = fp8_kind(kv_fp8, codes)
    decode_kernel[(1,)](codes, out, KV_FP8=kind)
    expected = codes.view(kv_fp8).float()
    finite = ~expected.isnan()
    assert torch.equal(out[finite] * FP8_DECODE_FACTOR[kind], expected[finite])
    if kv_fp8 == torch.float8_e5m2:
        assert out[~finite].isnan().all()
