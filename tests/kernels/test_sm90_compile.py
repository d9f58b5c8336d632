"""Every Triton kernel configuration the launchers pick compiles for an H100/H200 (sm_90).

Runs without a GPU: Triton's frontend, LLVM and the bundled ptxas only. Catches what the CPU
interpreter lets through (non-constexpr globals, dot shape/type rules, shared-memory overflow).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcompress.kernels import (
    DecodeScoreTarget,
    move_kv_triton,
    paged_attention_triton,
    window_scores_triton,
    write_kv_triton,
)
from tests.kernels.aot_compile import capture_launches
from tests.kernels.kernel_cases import make_case

H100_MAX_SHARED_BYTES = 232448


def _has_ptxas() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin"))


pytestmark = pytest.mark.skipif(not _has_ptxas(), reason="triton NVIDIA backend not available")


def compile_all(launches) -> None:
    assert launches, "the launcher launched nothing"
    for launch in launches:
        compiled = launch.compile(arch=90)
        assert compiled.metadata.shared <= H100_MAX_SHARED_BYTES, launch.kernel.__name__


@pytest.mark.parametrize(
    "query_lens, group, head_size, page_size, dtype, num_splits",
    [
        ([1, 1], 4, 128, 16, torch.bfloat16, 1),  # Llama-3-8B decode
        ([1, 1], 4, 128, 16, torch.bfloat16, 8),  # split-K decode + combine
        ([1], 4, 128, 16, torch.bfloat16, 4),  # one request: ints equal to 1 become constexpr
        ([9, 1], 4, 128, 16, torch.bfloat16, 1),  # prefill chunk tile
        ([9, 1], 8, 64, 32, torch.float16, 1),
        ([1, 1], 1, 128, 8, torch.float32, 2),  # ieee fp32 dot (decode tile: compiles faster)
        ([3, 1], 3, 96, 16, torch.bfloat16, 1),  # padded head dim, odd group
    ],
)
def test_paged_attention_compiles(
    monkeypatch, query_lens, group, head_size, page_size, dtype, num_splits
):
    case = make_case(query_lens, [[30, 20]] * len(query_lens), group=group, head_size=head_size,
                     page_size=page_size, dtype=dtype, poison=False)
    with capture_launches(monkeypatch) as launches:
        paged_attention_triton(
            case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc,
            case.scale, torch.empty_like(case.query),
            lse_out=torch.empty(case.query.shape[:2]), num_splits=num_splits,
        )
    compile_all(launches)


@pytest.mark.parametrize(
    "query_lens, num_splits, window",
    [([1, 1], 4, None), ([9, 1], 1, None),  # split-K decode + combine; prefill tile
     # with a sliding window (types of the scan start, constexpr branches): split-K decode,
     # prefill, and W - 1 == 0
     ([1, 1], 4, 512), ([9, 1], 1, 1), ([1], 2, 1)],
)
def test_paged_attention_with_soft_cap_and_sinks_compiles(monkeypatch, query_lens, num_splits,
                                                          window):
    case = make_case(query_lens, [[30, 20]] * len(query_lens), group=4, head_size=128,
                     page_size=16, dtype=torch.bfloat16, poison=False)
    with capture_launches(monkeypatch) as launches:
        paged_attention_triton(
            case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc,
            case.scale, torch.empty_like(case.query), lse_out=torch.empty(case.query.shape[:2]),
            soft_cap=50.0, sinks=torch.zeros(8, dtype=torch.bfloat16), num_splits=num_splits,
            sliding_window=window,
        )
    compile_all(launches)


def test_window_scores_with_soft_cap_and_sinks_compile(monkeypatch):
    case = make_case([9, 5], [[30, 20]] * 2, group=4, head_size=128, page_size=16,
                     dtype=torch.bfloat16, poison=False)
    with capture_launches(monkeypatch) as launches:
        window_scores_triton(
            case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc,
            torch.zeros(2, dtype=torch.int32), case.scale, torch.zeros(2, 2, 64),
            soft_cap=50.0, sinks=torch.zeros(8),
        )
    compile_all(launches)


@pytest.mark.parametrize(
    "query_lens, group, head_size, dtype",
    [([9, 5], 4, 128, torch.bfloat16), ([1, 1], 8, 64, torch.float16)],
)
def test_window_scores_compiles(monkeypatch, query_lens, group, head_size, dtype):
    case = make_case(query_lens, [[30, 20]] * 2, group=group, head_size=head_size, page_size=16,
                     dtype=dtype, poison=False)
    with capture_launches(monkeypatch) as launches:
        window_scores_triton(
            case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc,
            torch.zeros(2, dtype=torch.int32), case.scale, torch.zeros(2, 2, 64),
        )
    compile_all(launches)


def test_cache_kernels_compile(monkeypatch):
    pool = torch.zeros(8, 2, 16, 128, dtype=torch.bfloat16)
    with capture_launches(monkeypatch) as launches:
        key = torch.zeros(5, 8, 128, dtype=torch.bfloat16)
        write_kv_triton(key, key, pool, torch.zeros(5, 8, dtype=torch.int64))
        slots = torch.arange(10, dtype=torch.int64)
        move_kv_triton(pool, slots, slots + 10)
    compile_all(launches)


@pytest.mark.parametrize(
    "kv_fp8, query_lens, num_splits, dtype",
    [(torch.float8_e4m3fn, [1, 1], 4, torch.bfloat16),  # split-K decode + combine
     (torch.float8_e5m2, [9, 1], 1, torch.float16)],  # prefill tile
)
def test_fp8_pages_compile(monkeypatch, kv_fp8, query_lens, num_splits, dtype):
    """fp8 pages: the attention and window-score kernels decode uint8 codes (hardware fp8
    conversions: sm_89 and later), the write encodes them."""
    case = make_case(query_lens, [[30, 20]] * len(query_lens), group=4, head_size=128,
                     page_size=16, dtype=dtype, poison=False)
    pool = torch.zeros(case.pool.shape, dtype=torch.uint8)
    fp8 = dict(kv_fp8=kv_fp8, k_scale=0.5)
    with capture_launches(monkeypatch) as launches:
        paged_attention_triton(
            case.query, pool, case.page_tables, case.kv_lens, case.query_start_loc,
            case.scale, torch.empty_like(case.query), lse_out=torch.empty(case.query.shape[:2]),
            soft_cap=50.0, sinks=torch.zeros(8), num_splits=num_splits, v_scale=2.0, **fp8,
        )
        window_scores_triton(
            case.query, pool, case.page_tables, case.kv_lens, case.query_start_loc,
            torch.zeros(len(query_lens), dtype=torch.int32), case.scale,
            torch.zeros(len(query_lens), 2, 64), **fp8,
        )
        key = torch.zeros(5, 8, 128, dtype=dtype)
        write_kv_triton(key, key, pool, torch.zeros(5, 8, dtype=torch.int64), v_scale=2.0, **fp8)
    compile_all(launches)


@pytest.mark.parametrize(
    "query_lens, group, num_splits, softmax, width",
    [([1, 1], 4, 1, False, 40), ([1, 1], 4, 8, True, 40),  # decode, split-K + combine
     ([9, 1], 3, 1, True, 40), ([1], 8, 2, False, 40),  # prefill tile, odd group; one request
     ([1, 1], 4, 1, False, 1)],  # a first generated token: W == 1 becomes a constexpr
)
def test_paged_attention_with_decode_scores_compiles(monkeypatch, query_lens, group, num_splits,
                                                     softmax, width):
    case = make_case(query_lens, [[30, 20]] * len(query_lens), group=group, head_size=128,
                     page_size=16, dtype=torch.bfloat16, poison=False)
    count = len(query_lens)
    target = DecodeScoreTarget(
        slots=torch.arange(count, dtype=torch.int32),
        begin=torch.zeros(count, 2, dtype=torch.int64),
        reduce_codes=torch.zeros(count, dtype=torch.int64),
        mass=torch.zeros(count, 3, 2, width)[:, 1],  # a strided layer view, as the engine passes
    )
    extra = dict(soft_cap=50.0, sinks=torch.zeros(2 * group)) if softmax else {}
    with capture_launches(monkeypatch) as launches:
        paged_attention_triton(
            case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc,
            case.scale, torch.empty_like(case.query), num_splits=num_splits,
            decode_scores=target, **extra,
        )
    assert any(launch.kernel.__name__ == "decode_mass_kernel" for launch in launches)
    compile_all(launches)
