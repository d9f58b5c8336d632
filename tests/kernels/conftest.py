"""Kernel tests run the Triton kernels on a GPU when there is one, else in Triton's CPU interpreter.

``TRITON_INTERPRET`` is set per test (monkeypatch), not for the whole process: other test folders
(vLLM, engine) must not get interpreted kernels. This works whatever was imported before, because
``kvcompress.kernels`` builds its Triton kernels lazily, per interpreter mode, on first call.
"""

from __future__ import annotations

import pytest
import torch

from kvcompress.kernels import has_triton, has_triton_gpu
from tests.triton_interpreter import use_interpreter

ON_GPU = has_triton_gpu()


@pytest.fixture(autouse=True)
def _triton_interpreter_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """Where Triton kernels run: the GPU, or CPU tensors for the interpreter."""
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def needs_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    if not has_triton():
        pytest.skip("triton is not installed")
    if not ON_GPU:
        use_interpreter(monkeypatch)  # skips, with the reason, where it cannot run ours
