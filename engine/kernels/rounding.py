"""Rounding helpers shared by the kernels, so that a kernel rounds exactly where, and as,
the torch code it replaces rounds.

Triton's interpreter (TRITON_INTERPRET=1, how the tests run the kernels without a GPU)
truncates fp32 -> bf16 casts and drops the carry in fp32 -> fp8 casts, where the GPU rounds
to nearest even. `cast` rounds explicitly under the interpreter, so the interpreted kernels
compute what the compiled ones do; compiled for a GPU, it is a plain cast.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .checks import interpreting

INTERPRETED: tl.constexpr = tl.constexpr(interpreting())


@triton.jit
def cast(x, dt: tl.constexpr):
    """x -> dt, rounding to nearest even (fp32 -> bf16 by integer arithmetic when interpreted)."""
    if INTERPRETED and dt == tl.bfloat16 and x.dtype == tl.float32:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536                          # keep 8 significant bits
        x = b.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def round_to_e4m3(y):
    """Round fp32 y in [-448, 448] to the nearest float8_e4m3fn value (ties to even), still
    as fp32, so that the cast to fp8 afterwards is exact whatever rounding the cast does.

    Adding c = 1.5 * 2**23 * spacing rounds to a multiple of spacing in IEEE fp32 addition;
    the spacing is 2**(e - 3) for |y| in [2**e, 2**(e+1)), and 2**-9 below e4m3's smallest
    normal 2**-6."""
    a = tl.abs(y)
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF                       # biased exponent of |y|
    c = ((tl.maximum(e, 127 - 6) + 20) << 23) | 0x400000                    # bits of 1.5 * 2**(e+20)
    c = c.to(tl.float32, bitcast=True)
    r = (a + c) - c                                                        # >= +0
    # y's sign put back by its bit, not by negating r: triton 3.6 compiles -r as 0 - r, which
    # makes -(+0) +0 where torch keeps -0 (seen on the H200: 2 of 307,200 bytes differed)
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_fp8(x):
    """Per-row absmax fp8 of x: (R, D) -> (q (R, D) fp32 holding e4m3 values, scale (R,) fp32),
    as engine.attention.quantize_fp8 (round-to-nearest divisions, so the stored bytes match)."""
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)                    # (R,)
    scale = tl.math.div_rn(amax, 448.0)
    q = tl.math.div_rn(x, scale[:, None])
    return round_to_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0)), scale


@triton.jit
def quantize_fp8_row(x):
    """quantize_fp8 of one row x: (D,) -> (q (D,), scale)."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    return round_to_e4m3(q), scale
