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


MINUS_TWO_LOG2E = tl.constexpr(-2.8853900817779268)  # exp(-2|z|) == exp2(|z| * MINUS_TWO_LOG2E)
TANH_SERIES_BELOW = tl.constexpr(0.2)


@triton.jit
def soft_cap(scores, cap):
    """``cap * tanh(scores / cap)`` (logit soft-capping), scores and cap in the same units.

    Triton has no portable tanh. Away from 0 it comes from one exp2 of a non-positive
    argument (no overflow at any score); near 0, where ``1 - exp(-2|z|)`` would cancel, from
    its Taylor series (error below 1e-7 relative for |z| < 0.2).
    """
    z = scores / cap
    # tensor * constexpr, never constexpr * tensor (that would wrap the tensor in a constexpr).
    decay = tl.exp2(tl.abs(z) * MINUS_TWO_LOG2E)
    magnitude = (1.0 - decay) / (1.0 + decay)
    z2 = z * z
    series = z * (1.0 + z2 * (-0.3333333333333333 + z2 * (0.13333333333333333
                                                          + z2 * -0.05396825396825397)))
    tanh = tl.where(tl.abs(z) < TANH_SERIES_BELOW, series, tl.where(z < 0, -magnitude, magnitude))
    return tanh * cap
