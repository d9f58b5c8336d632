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


# fp8 pages: the pool is uint8; KV_FP8 (constexpr) names the format of its bytes:
# 0 none, 1 e4m3fn ("fp8", "fp8_e4m3"), 2 e5m2. See _triton_support.fp8_kind.
@triton.jit
def fp8_decode(codes, KV_FP8: tl.constexpr):
    """uint8 fp8 codes -> fp16, exactly, by moving bits (no fp8 hardware conversion: runs on
    any GPU, sm_80 included, and the interpreter agrees bit for bit). e5m2 is the top byte of
    an fp16; e4m3 placed in an fp16's low exponent bits reads as its value times 2^-8, which
    the launchers fold into the scales (``_triton_support.FP8_DECODE_FACTOR``). e4m3's NaN
    code reads as a finite value: the writes never store it (they saturate) but for NaN
    inputs."""
    wide = codes.to(tl.uint16)
    bits = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7) if KV_FP8 == 1 else wide << 8
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _fp8_encode(x, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr,
                SUBNORMAL_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """fp32 -> fp8 code by integer arithmetic: round to nearest even, saturated to +-MAX (as
    the GPUs' cvt.rn.satfinite), NaN -> 0x7F. Not ``x.to(fp8)``: the Triton interpreter rounds
    that differently from the hardware, so the tests could not check the GPU's bytes."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = tl.where(x == x, tl.minimum(tl.abs(x), MAX), 0.0)  # NaN: coded below
    mbits = magnitude.to(tl.int32, bitcast=True)
    # Normal: drop 23 - MANTISSA bits, ties to even (the carry may bump the exponent).
    lsb = (mbits >> (23 - MANTISSA)) & 1
    half = (1 << (22 - MANTISSA)) - 1
    normal = ((mbits + half + lsb) >> (23 - MANTISSA)) - ((127 - BIAS) << MANTISSA)
    # Subnormal: the code is the magnitude in units of the smallest subnormal, rounded to
    # nearest even by the fp32 add (exact: the scaled value is below 2^MANTISSA).
    scaled = tl.minimum(magnitude, MIN_NORMAL) * SUBNORMAL_SCALE  # normals: unused, in range
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(magnitude < MIN_NORMAL, subnormal, normal)
    code = tl.where(x != x, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def fp8_encode(x, KV_FP8: tl.constexpr):
    """fp32 values (already divided by the scale) -> uint8 fp8 codes of format KV_FP8."""
    if KV_FP8 == 1:
        codes = _fp8_encode(x, 3, 7, 448.0, 512.0, 0.015625)
    else:
        codes = _fp8_encode(x, 2, 15, 57344.0, 65536.0, 6.103515625e-05)
    return codes
