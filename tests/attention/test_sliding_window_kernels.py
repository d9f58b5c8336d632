"""Sliding-window attention through the platform kernels (vLLM's C++ CPU kernel; the Triton
adapter, interpreted on CPU tensors) vs a dense band-masked reference.

The convention (vLLM's ``sliding_window=W``): the query at row position q sees the row positions
``q - W + 1 <= k <= q``, per (request, KV head) row with that row's own length. These cases pin
it exactly: every window is also checked to differ from the W - 1 and W + 1 bands, so an
off-by-one in either direction fails.
"""

from types import SimpleNamespace

import pytest
import torch

from kvcompress.attention import cpu_kernel as cpu_kernel_module
from kvcompress.attention.cpu_kernel import CpuPagedKernel
from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from tests.paged_cases import (
    MODEL_SOFTMAXES,
    PagedCase,
    build_case,
    dense_attention,
    model_softmax,
    run_kernel,
)

# (row lengths before the step [R][layers * heads], new tokens per request), 2 layers x 2 heads.
SLIDING_LAYOUTS = {
    # unequal row lengths in one request (compressed rows), decode, a chunk on context
    "mixed": ([[5, 9, 33, 1], [40, 40, 40, 40], [3, 17, 2, 60], [0, 0, 0, 0]], [1, 7, 1, 20]),
    "decode": ([[70, 12, 5, 44], [1, 2, 3, 4], [300, 517, 90, 260]], [1, 1, 1]),
    # prefill chunks much longer than the windows, fresh and on (unequal) context
    "long_prefill": ([[0, 0, 0, 0], [30, 3, 64, 17]], [90, 75]),
}
# Smaller than a page, a page, larger than a page, larger than every row.
WINDOWS = [1, 3, 16, 37, 1000]


def dense_band_attention(case: PagedCase, layer: int, scale: float, window: int | None,
                         **softmax) -> torch.Tensor:
    """The loop reference (``paged_cases.dense_attention``) over keys ``max(0, q - W + 1) ..
    q`` (all with ``window`` None), with the model's softmax."""
    return dense_attention(case, layer, scale, window=window, **softmax)


def run_cpu_kernel(case: PagedCase, dtype: torch.dtype, window: int | None,
                   **softmax) -> list[torch.Tensor]:
    return run_kernel(CpuPagedKernel(case.layout, dtype), case, window, **softmax)


def sliding_case(layout_name: str, group: int, head_size: int, page_size: int,
                 dtype: torch.dtype, page_format=CPU_PAGE_FORMAT) -> PagedCase:
    lengths, num_new = SLIDING_LAYOUTS[layout_name]
    return build_case(page_format, lengths, num_new, num_layers=2, num_kv_heads=2,
                      group=group, head_size=head_size, page_size=page_size, dtype=dtype)


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("split_kv", [True, False])
@pytest.mark.parametrize("page_size, head_size", [(16, 64), (32, 128)])  # vec16, vec ISAs
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("layout_name", sorted(SLIDING_LAYOUTS))
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_kernel_window_is_q_minus_w_plus_1_to_q(window, layout_name, group, page_size,
                                                      head_size, split_kv, monkeypatch):
    monkeypatch.setattr(cpu_kernel_module, "envs",
                        SimpleNamespace(VLLM_CPU_ATTN_SPLIT_KV=split_kv))
    case = sliding_case(layout_name, group, head_size, page_size, torch.float32)
    outputs = run_cpu_kernel(case, torch.float32, window)
    scale = head_size**-0.5
    for layer, output in enumerate(outputs):
        expected = dense_band_attention(case, layer, scale, window)
        torch.testing.assert_close(output.double(), expected, **tolerance(torch.float32))
        if window < 1000:  # the neighbouring bands differ: an off-by-one would fail above
            for other in (window - 1, window + 1):
                if other >= 1:
                    wrong = dense_band_attention(case, layer, scale, other)
                    assert (wrong - expected).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 0])
def test_cpu_kernel_without_a_window_is_full_attention(window):
    case = sliding_case("mixed", 3, 64, 16, torch.float32)
    outputs = run_cpu_kernel(case, torch.float32, window)
    for layer, output in enumerate(outputs):
        expected = dense_band_attention(case, layer, 64**-0.5, None)
        torch.testing.assert_close(output.double(), expected, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
@pytest.mark.parametrize("layout_name", sorted(SLIDING_LAYOUTS))
@pytest.mark.parametrize("window", [3, 37])
def test_cpu_kernel_window_with_the_model_softmax(window, layout_name, kind, dtype):
    """Soft-cap and sinks (one kernel call per KV head) combine with the window."""
    case = sliding_case(layout_name, 3, 64, 16, dtype)
    softmax = model_softmax(kind, case.query.shape[1], dtype, device=case.query.device)
    outputs = run_cpu_kernel(case, dtype, window, **softmax)
    for layer, output in enumerate(outputs):
        expected = dense_band_attention(case, layer, 64**-0.5, window, **softmax)
        plain = dense_band_attention(case, layer, 64**-0.5, window)
        assert (expected - plain).abs().max() > 0.05
        torch.testing.assert_close(output.double(), expected, **tolerance(dtype))


def test_cpu_kernel_window_is_shift_invariant():
    """A row whose leading tokens were dropped (shorter, the same last tokens) attends the
    same as the full row when the window excludes what was dropped."""
    window, page_size = 9, 16
    full = build_case(CPU_PAGE_FORMAT, [[40, 40]], [5], num_layers=1, num_kv_heads=2,
                      group=2, head_size=64, page_size=page_size, dtype=torch.float32)
    # Row 0 drops its first page (16 tokens), row 1 two: both keep >= W - 1 context tokens
    # (what the pager may drop: floor((40 - W + 1) / 16) = 2 pages at most).
    dropped = build_case(CPU_PAGE_FORMAT, [[24, 8]], [5], num_layers=1, num_kv_heads=2,
                         group=2, head_size=64, page_size=page_size, dtype=torch.float32)
    for row, drop in enumerate([16, 32]):
        dropped.old_keys[0, row] = full.old_keys[0, row][drop:]
        dropped.old_values[0, row] = full.old_values[0, row][drop:]
        request = dropped.state.requests["req0"]
        positions = torch.arange(40 - drop)
        slots = (torch.as_tensor(request.table.pages[row])[positions // page_size].long()
                 * page_size + positions % page_size)
        CPU_PAGE_FORMAT.write_tokens(dropped.pool, dropped.old_keys[0, row],
                                     dropped.old_values[0, row], slots)
    dropped.query.copy_(full.query)
    dropped.new_keys.copy_(full.new_keys)
    dropped.new_values.copy_(full.new_values)
    expected = run_cpu_kernel(full, torch.float32, window)[0]
    shifted = run_cpu_kernel(dropped, torch.float32, window)[0]
    torch.testing.assert_close(shifted, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(
        expected.double(), dense_band_attention(full, 0, 64**-0.5, window), atol=2e-5,
        rtol=2e-5)


def test_cpu_kernel_rejects_a_negative_window():
    case = sliding_case("mixed", 1, 64, 16, torch.float32)
    kernel = CpuPagedKernel(case.layout, torch.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        kernel.attend(kernel.prepare(case.step), 0, case.query, case.pool,
                      torch.empty_like(case.query), 0.1, sliding_window=-1)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("kind", [None, "both"])
@pytest.mark.parametrize("layout_name", sorted(SLIDING_LAYOUTS))
@pytest.mark.parametrize("window", [3, 37])
def test_triton_adapter_passes_the_window(window, layout_name, kind):
    """The GPU adapter (Triton, interpreted) hands the window to its kernel: same band."""
    case = sliding_case(layout_name, 2, 32, 16, torch.float32, page_format=GPU_PAGE_FORMAT)
    softmax = ({} if kind is None
               else model_softmax(kind, case.query.shape[1], device=case.query.device))
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True)
    for layer, output in enumerate(run_kernel(kernel, case, window, **softmax)):
        expected = dense_band_attention(case, layer, 32**-0.5, window, **softmax)
        torch.testing.assert_close(output.double(), expected, **tolerance(torch.float32))
