"""Triton availability checks and lazy loading of the kernel modules.

Why lazy: ``@triton.jit`` decides at *decoration* time whether a kernel is compiled for the GPU or
run by the CPU interpreter (``TRITON_INTERPRET=1``). Importing ``kvcompress.kernels`` therefore
must not decorate anything; the kernel modules (``_*_triton.py``) are executed on first use and
cached per mode, so flipping ``TRITON_INTERPRET`` (as the kernel tests do) always yields kernels
built for the current mode, whatever was imported before.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from types import ModuleType

import torch

_TRUE_STRINGS = ("1", "true", "on", "yes")
LOG2E = math.log2(math.e)
_kernel_modules: dict[tuple[str, bool], ModuleType] = {}


@functools.lru_cache(maxsize=1)
def has_triton() -> bool:
    """True when the ``triton`` package imports."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_interpret_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE_STRINGS


@functools.lru_cache(maxsize=1)
def has_triton_gpu() -> bool:
    """True when Triton kernels can be compiled for a visible GPU (CUDA or ROCm).

    The engine uses this to pick the Triton path; otherwise it uses the torch references.
    """
    if not has_triton() or not torch.cuda.is_available():
        return False
    try:
        from triton.runtime import driver

        driver.active.get_current_target()
    except Exception:
        return False
    return True


def can_run_triton(*tensors: torch.Tensor) -> bool:
    """True when a Triton kernel can run on these tensors (GPU tensors, or interpreter on CPU)."""
    if not has_triton():
        return False
    if triton_interpret_enabled():
        return True
    return all(t.is_cuda for t in tensors) and has_triton_gpu()


def load_kernel_module(name: str) -> ModuleType:
    """Execute ``kvcompress.kernels.<name>`` for the current Triton mode and cache it."""
    interpret = triton_interpret_enabled()
    key = (name, interpret)
    module = _kernel_modules.get(key)
    if module is None:
        if not has_triton():
            raise RuntimeError("Triton is not installed; use the torch reference kernels")
        spec = importlib.util.find_spec(f"{__package__}.{name}")
        if spec is None or spec.loader is None:
            raise ImportError(f"kernel module {name!r} not found")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _kernel_modules[key] = module
    return module


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Fail with a clear message instead of a cryptic Triton error for CPU tensors."""
    if not can_run_triton(*tensors):
        raise RuntimeError(
            "Triton kernels need CUDA tensors and a GPU-enabled Triton, or TRITON_INTERPRET=1 for "
            "CPU tensors; use the *_ref torch implementation instead"
        )


def next_power_of_2(value: int) -> int:
    return 1 << max(0, (int(value) - 1).bit_length())


@functools.lru_cache(maxsize=8)
def num_compute_units(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (drives the split-K decision)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_compute_units(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: any small number, only shapes the grid
    index = device.index if device.index is not None else torch.cuda.current_device()
    return num_compute_units(index)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """The Triton interpreter multiplies bf16 tensors as raw uint16 in ``tl.dot``: upcast there.

    On a GPU the bf16 dot runs natively on tensor cores; this only affects the interpreter.
    """
    return triton_interpret_enabled() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot`` input precision: exact fp32 for fp32 models (tf32 would cost ~1e-3 relative
    error), the backend default (None) for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else None


# fp8 page formats -> the kernels' KV_FP8 constexpr (0: pages in the model's dtype).
_FP8_KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# What the kernels' fp8_decode value is multiplied by to give the code's value, by KV_FP8:
# launchers fold it into the K and V scales (once per launch, not per element).
FP8_DECODE_FACTOR = {0: 1.0, 1: 256.0, 2: 1.0}


def fp8_kind(kv_fp8: torch.dtype | None, pool: torch.Tensor) -> int:
    """The ``KV_FP8`` constexpr of the kernels for pages of ``kv_fp8`` (None: the model's
    dtype); fp8 pages must be a uint8 pool (their bytes, as vLLM allocates them)."""
    if kv_fp8 is None:
        return 0
    if kv_fp8 not in _FP8_KINDS:
        raise ValueError(f"kv_fp8 must be torch.float8_e4m3fn or torch.float8_e5m2, got {kv_fp8}")
    if pool.dtype != torch.uint8:
        raise TypeError(f"fp8 pages need a uint8 pool (their bytes), got {pool.dtype}")
    return _FP8_KINDS[kv_fp8]


def triton_softmax_args(soft_cap: float | None, sinks: torch.Tensor | None,
                        like: torch.Tensor) -> tuple[tuple[torch.Tensor, float], dict[str, bool]]:
    """The model-softmax launch arguments shared by the attention and window-score kernels:
    ``(sinks pointer, soft cap in base-2 logit units)`` and their constexpr switches. The
    kernels work in base-2 logits (``score * log2(e)``); ``cap * tanh(x / cap)`` scales the
    same way, so the cap is converted once here. Without sinks ``like`` is a dummy pointer."""
    sinks_arg = like if sinks is None else sinks.to(like.device, torch.float32).contiguous()
    soft_cap_log2 = float(soft_cap) * LOG2E if soft_cap else 0.0
    flags = {"HAS_SOFT_CAP": bool(soft_cap), "HAS_SINKS": sinks is not None}
    return (sinks_arg, soft_cap_log2), flags
