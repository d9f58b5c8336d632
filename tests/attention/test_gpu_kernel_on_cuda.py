"""On a CUDA device: the native cache move against the torch reference, and TritonPagedKernel
against the dense reference and the CPU path's numbers. Skipped (with the reason) elsewhere.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.attention.window_scores import accumulate_window_scores
from kvcompress.kernels import has_triton_gpu, move_kv_ref
from kvcompress.kernels.cuda_ext import jit_unavailable_reason, native_move_kv
from kvcompress.paging.page_format import FP8_KV_CACHE_DTYPES, GPU_PAGE_FORMAT, PageFormat
from kvcompress.step import KVScales, StepBatch
from tests.paged_cases import build_case, dense_attention

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and has_triton_gpu()),
    reason="no CUDA device with a GPU-enabled Triton: GPU correctness tests skipped",
)

MIXED = ([[5, 9, 33, 1], [40, 40, 40, 40], [3, 17, 2, 60], [0, 0, 0, 0]], [1, 7, 1, 20])


@pytest.fixture(scope="module")
def native_move():
    move = native_move_kv()
    if move is None:
        pytest.skip("native CUDA move unavailable (not prebuilt; JIT: "
                    f"{jit_unavailable_reason() or 'build failed, see the log'})")
    return move


def _moves(num_slots: int, count: int, skips: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=generator)
    src, dst = slots[:count].clone(), slots[count : 2 * count].clone()
    src[:skips] = -1  # negative entries on either side are skipped
    dst[skips : 2 * skips] = -1
    return src.to(dtype), dst.to(dtype)


# uint8: fp8 pages' bytes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("head_size", [128, 80, 20, 3])  # 16/8/4/2-byte word paths
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_native_move_matches_the_reference(native_move, dtype, head_size, slot_dtype):
    pool = torch.randn(64, 2, 16, head_size, device="cuda").to(dtype)
    src, dst = _moves(64 * 16, 300, 7, slot_dtype, seed=head_size)
    expected = pool.clone()
    move_kv_ref(expected, src.cuda(), dst.cuda())
    native_move(pool, src.cuda(), dst.cuda())
    assert torch.equal(pool, expected)


def test_native_move_handles_empty_and_strided_pools(native_move):
    base = torch.randn(32, 2, 16, 130, device="cuda")
    pool = base[..., :128]  # rows padded to 130: the kernel must honour the strides
    expected, padding = pool.clone(), base[..., 128:].clone()
    empty = torch.empty(0, dtype=torch.long, device="cuda")
    native_move(pool, empty, empty)
    src, dst = _moves(32 * 16, 100, 0, torch.int64, seed=1)
    move_kv_ref(expected, src.cuda(), dst.cuda())
    native_move(pool, src.cuda(), dst.cuda())
    assert torch.equal(pool, expected)
    assert torch.equal(base[..., 128:], padding)


def test_native_move_rejects_cpu_pools_and_mismatched_slots(native_move):
    with pytest.raises(RuntimeError):
        native_move(torch.zeros(2, 2, 16, 8), torch.zeros(1, dtype=torch.long),
                    torch.zeros(1, dtype=torch.long))
    pool = torch.zeros(2, 2, 16, 8, device="cuda")
    with pytest.raises(RuntimeError):
        native_move(pool, torch.zeros(2, dtype=torch.long, device="cuda"),
                    torch.zeros(3, dtype=torch.long, device="cuda"))


def test_kernel_move_prefers_the_native_move(native_move):
    layout = build_case(GPU_PAGE_FORMAT, [[4] * 4], [1], 2, 2, 2, 32, 16, torch.float32).layout
    kernel = TritonPagedKernel(layout, torch.bfloat16, torch.device("cuda"))
    assert kernel.native_move is native_move


def _to_cuda(step: StepBatch) -> StepBatch:
    tensors = ("num_new_tokens", "lengths_before", "slot_mapping")
    return StepBatch(**{**vars(step), **{name: getattr(step, name).cuda() for name in tensors},
                        "tables": step.tables.to(torch.device("cuda"))})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernel_on_gpu_matches_dense_and_cpu_numbers(dtype):
    cpu = build_case(GPU_PAGE_FORMAT, *MIXED, num_layers=2, num_kv_heads=2, group=4,
                     head_size=128, page_size=16, dtype=dtype)
    gpu_kernel = TritonPagedKernel(cpu.layout, dtype)  # Triton for CUDA tensors
    reference = TritonPagedKernel(cpu.layout, dtype, use_triton=False)  # torch, on CPU
    step, gpu_step = cpu.step, _to_cuda(cpu.step)
    gpu_pool = cpu.pool.cuda()
    gpu_args, cpu_args = gpu_kernel.prepare(gpu_step), reference.prepare(step)
    scale = 128**-0.5
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    for layer in range(2):
        rows = step.layer_rows(layer)
        keys, values = cpu.new_keys[:, rows], cpu.new_values[:, rows]
        gpu_kernel.write(gpu_pool, keys.cuda(), values.cuda(), gpu_step.slot_mapping[:, rows])
        reference.write(cpu.pool, keys, values, step.slot_mapping[:, rows])
        gpu_out = torch.empty_like(cpu.query, device="cuda")
        cpu_out = torch.empty_like(cpu.query)
        gpu_kernel.attend(gpu_args, layer, cpu.query.cuda(), gpu_pool, gpu_out, scale)
        reference.attend(cpu_args, layer, cpu.query, cpu.pool, cpu_out, scale)
        torch.testing.assert_close(gpu_out.cpu().double(), dense_attention(cpu, layer, scale),
                                   atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(gpu_out.cpu(), cpu_out, atol=tolerance, rtol=tolerance)
    assert torch.equal(gpu_pool.cpu(), cpu.pool)


def test_window_scores_on_gpu_match_the_torch_path_on_cpu():
    case = build_case(GPU_PAGE_FORMAT, [[10] * 4, [30] * 4, [0] * 4], [6, 1, 27], 2, 2, 4, 64,
                      16, torch.float32, prompt_lens=[16, 20, 30], window=4,
                      wants_compression=[True, False, True])
    kernel = TritonPagedKernel(case.layout, torch.float32)
    gpu_step, gpu_pool = _to_cuda(case.step), case.pool.cuda()
    gpu_step.window_queries = [replace(window, scores=window.scores.cuda())
                               for window in case.step.window_queries]
    args = kernel.prepare(gpu_step)
    for layer in range(2):
        rows = case.step.layer_rows(layer)
        kernel.write(gpu_pool, case.new_keys[:, rows].cuda(), case.new_values[:, rows].cuda(),
                     gpu_step.slot_mapping[:, rows])
    case.pool.copy_(gpu_pool.cpu())
    for layer in range(2):
        accumulate_window_scores(case.query, case.pool, GPU_PAGE_FORMAT, case.step, layer,
                                 0.125)
        keys = case.new_keys[:, case.step.layer_rows(layer)].cuda()
        kernel.accumulate_window_scores(args, layer, case.query.cuda(), keys, gpu_pool,
                                        gpu_step, 0.125)
    for window, expected in zip(gpu_step.window_queries, case.step.window_queries):
        assert expected.scores.abs().sum() > 0
        torch.testing.assert_close(window.scores.cpu(), expected.scores, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_triton_kernel_on_fp8_pages_matches_dense_and_cpu_numbers(cache_dtype):
    """fp8 pages on the GPU: the write stores the same bytes as the torch path (values
    representable at power-of-two scales), attention matches the dense reference."""
    scales = KVScales(0.5, 0.25)
    page_format = PageFormat(GPU_PAGE_FORMAT.key_layout, FP8_KV_CACHE_DTYPES[cache_dtype])
    cpu = build_case(page_format, *MIXED, num_layers=2, num_kv_heads=2, group=4,
                     head_size=128, page_size=16, dtype=torch.bfloat16, kv_scales=scales)
    gpu_kernel = TritonPagedKernel(cpu.layout, torch.bfloat16, kv_cache_dtype=cache_dtype)
    reference = TritonPagedKernel(cpu.layout, torch.bfloat16, use_triton=False,
                                  kv_cache_dtype=cache_dtype)
    step, gpu_step = cpu.step, _to_cuda(cpu.step)
    gpu_pool = cpu.pool.cuda()
    gpu_args, cpu_args = gpu_kernel.prepare(gpu_step), reference.prepare(step)
    scale = 128**-0.5
    for layer in range(2):
        rows = step.layer_rows(layer)
        keys, values = cpu.new_keys[:, rows], cpu.new_values[:, rows]
        gpu_kernel.write(gpu_pool, keys.cuda(), values.cuda(), gpu_step.slot_mapping[:, rows],
                         kv_scales=scales)
        reference.write(cpu.pool, keys, values, step.slot_mapping[:, rows], kv_scales=scales)
        gpu_out = torch.empty_like(cpu.query, device="cuda")
        cpu_out = torch.empty_like(cpu.query)
        gpu_kernel.attend(gpu_args, layer, cpu.query.cuda(), gpu_pool, gpu_out, scale,
                          kv_scales=scales)
        reference.attend(cpu_args, layer, cpu.query, cpu.pool, cpu_out, scale, kv_scales=scales)
        torch.testing.assert_close(gpu_out.cpu().double(), dense_attention(cpu, layer, scale),
                                   atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(gpu_out.cpu(), cpu_out, atol=3e-2, rtol=3e-2)
    assert gpu_pool.dtype == torch.uint8
    assert torch.equal(gpu_pool.cpu(), cpu.pool)
