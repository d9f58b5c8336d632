"""Triton's CPU interpreter for one test (``use_interpreter``), skipped with the reason where
the installed Triton cannot interpret our kernels: Triton 3.6's interpreter turns a loop bound
loaded from memory into a one-element array and converts it with ``int()``, which NumPy 2.4
and later refuse ("only 0-dimensional arrays can be converted to Python scalars"). Seen on
the first GPU machine (Triton 3.6, NumPy 2.5); Triton 3.9 (this project's CPU setup) is fine.
A probe kernel decides, once per process."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def interpreter_problem() -> str | None:
    """None where the interpreter runs a loop over a loaded bound, else why it does not."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    def probe(bound_ptr, out_ptr, BLOCK: tl.constexpr):  # noqa: N803 (Triton's constexpr style)
        total = 0
        for _ in range(0, tl.load(bound_ptr), BLOCK):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")  # read when the kernel is made
        try:
            triton.jit(probe)[(1,)](torch.tensor([10], dtype=torch.int32), out, BLOCK=4)
        except Exception as error:  # noqa: BLE001 (any failure means: not usable here)
            return (f"Triton {triton.__version__}'s interpreter fails with NumPy "
                    f"{np.__version__} on a loop over a loaded bound: {error!r}")
    return None if int(out[0]) == 3 else "Triton's interpreter miscounted a probe loop"


def use_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels on CPU tensors under the interpreter for this test, or skip why not."""
    from kvcompress.kernels import has_triton

    if not has_triton():
        pytest.skip("triton is not installed")
    problem = interpreter_problem()
    if problem:
        pytest.skip(problem)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
