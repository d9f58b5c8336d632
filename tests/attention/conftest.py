"""The GPU kernel adapter's tests run its Triton kernels on CPU tensors under Triton's
interpreter, set per test (never for the whole process: the engine tests must not get
interpreted kernels); the on-CUDA tests skip, with the reason, without a CUDA device."""

from __future__ import annotations

import pytest

from kvcompress.kernels import has_triton


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels on CPU tensors: the interpreter, for this test only."""
    if not has_triton():
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
