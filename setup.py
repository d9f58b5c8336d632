"""Thin setuptools shim: metadata lives in pyproject.toml.

Native kernels under csrc/ (the CUDA cache move) are added as the optional extension
``kvcompress._C`` only when the build can see a CUDA build of torch and a CUDA toolkit.
Anything else (CPU torch, no nvcc, or torch hidden by pip's build isolation) skips it
without running a compiler; kvcompress then uses its Triton / torch kernels, or builds the
extension just in time (kvcompress/kernels/cuda_ext.py).

GPU build: ``pip install -e . --no-build-isolation`` in an environment that already has
the CUDA vLLM/torch. ``KVCOMPRESS_BUILD_CUDA=1`` turns a skip into an error, ``=0`` never
builds; ``TORCH_CUDA_ARCH_LIST`` picks the GPU architectures as usual.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from setuptools import setup

CUDA_SOURCES = ["csrc/module.cpp", "csrc/move_kv_binding.cpp", "csrc/move_kv_kernel.cu"]


def why_no_cuda_extension() -> str | None:
    """None when the CUDA extension can be built, else the reason it is skipped."""
    try:
        import torch
    except ImportError:
        return (
            "torch is not importable at build time (pip's build isolation hides it: "
            "use --no-build-isolation)"
        )
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    return None


def cuda_extension_kwargs() -> dict[str, Any]:
    mode = os.environ.get("KVCOMPRESS_BUILD_CUDA", "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return {}
    reason = why_no_cuda_extension()
    if reason is not None:
        if mode in ("1", "on", "true", "yes"):
            raise RuntimeError(f"KVCOMPRESS_BUILD_CUDA=1 but {reason}")
        print(f"kvcompress: not building the CUDA extension: {reason}", file=sys.stderr)
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    extension = CUDAExtension(
        "kvcompress._C",
        sources=CUDA_SOURCES,
        include_dirs=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__ too
    setup(**cuda_extension_kwargs())
