"""Jit helpers shared by the kernel modules (loaded per Triton mode through the same loader).

Why not ``tl.sum`` / ``tl.max`` / ``tl.zeros`` / ``tl.cdiv``: those are ``@jit`` functions of
``triton.language`` itself, decorated once when triton is first imported. If that import happened
before ``TRITON_INTERPRET=1`` was set (another test module imported vLLM or triton first), they
are compiled-mode functions that the interpreter refuses to call. Reducing with
``tl.reduce(x, axis, <standard combine fn>)`` compiles to exactly what ``tl.sum`` / ``tl.max`` do
on a GPU, and the interpreter recognises these combine functions by identity and runs numpy on
them, whatever mode they were built in. Kernels use ``tl.full`` instead of ``tl.zeros`` and
integer arithmetic instead of ``tl.cdiv`` for the same reason.
"""

import triton
import triton.language as tl

SUM_COMBINE = tl.standard._sum_combine
MAX_COMBINE = tl.standard._elementwise_max


@triton.jit
def row_sum(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, SUM_COMBINE)


@triton.jit
def row_max(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, MAX_COMBINE)
