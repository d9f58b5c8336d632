"""The CUDA path's tests, and what each needs:

- ``test_cuda_compile.py``: nvcc (kernel) and g++ with torch headers (binding); skipped,
  with the reason, where they are missing;
- ``test_cuda_gpu.py``: a CUDA device; skipped, with the reason, without one;
- the rest runs on any machine: TritonPagedKernel on CPU tensors under ``TRITON_INTERPRET=1``
  (set per test, as in tests/kernels) and the engine wiring with a faked platform.

No ``__init__.py`` here on purpose: a test package named ``cuda`` would shadow NVIDIA's
``cuda`` Python package on GPU machines.
"""

from __future__ import annotations

import os
import sys

import pytest

# tests/ on the path: the shared random paged cases of tests/unit (unit.paged_cases).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcompress.kernels import has_triton  # noqa: E402


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels on CPU tensors: the interpreter, for this test only."""
    if not has_triton():
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
