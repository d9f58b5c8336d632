"""Both platform kernels implement the step contract's PlatformKernel, with its exact
signatures (the layer's softmax, ``soft_cap`` and ``sinks``, as keyword-only arguments)."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvcompress.attention.cpu_kernel import CpuPagedKernel
from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.paging import PageLayout
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from kvcompress.step import KVMover, PlatformKernel

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_size=32, page_size=16, dtype_bytes=4,
                    total_pages=64)
METHODS = ("prepare", "write", "attend", "accumulate_window_scores", "move")


def parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


@pytest.mark.parametrize(
    ("kernel", "page_format"),
    [(CpuPagedKernel(LAYOUT, torch.float32), CPU_PAGE_FORMAT),
     (TritonPagedKernel(LAYOUT, torch.float32), GPU_PAGE_FORMAT)],
    ids=["cpu", "triton"],
)
def test_kernel_implements_the_protocol(kernel, page_format):
    assert isinstance(kernel, PlatformKernel)
    assert kernel.page_format == page_format
    for name in METHODS:
        assert parameters(getattr(kernel, name)) == parameters(getattr(PlatformKernel, name)), name
    for name in ("attend", "accumulate_window_scores"):
        extra = inspect.signature(getattr(kernel, name)).parameters
        assert [extra[key].kind for key in ("soft_cap", "sinks")] == [
            inspect.Parameter.KEYWORD_ONLY] * 2, name


def test_a_bare_page_format_is_a_mover_but_not_a_kernel():
    assert isinstance(CPU_PAGE_FORMAT, KVMover)
    assert not isinstance(CPU_PAGE_FORMAT, PlatformKernel)
