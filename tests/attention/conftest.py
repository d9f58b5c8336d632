"""The GPU kernel adapter's tests run its Triton kernels on CPU tensors under Triton's
interpreter, set per test (never for the whole process: the engine tests must not get
interpreted kernels); the on-CUDA tests skip, with the reason, without a CUDA device."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import use_interpreter


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels on CPU tensors: the interpreter, for this test only."""
    use_interpreter(monkeypatch)
