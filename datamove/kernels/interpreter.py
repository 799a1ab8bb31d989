"""The Triton CPU interpreter (``TRITON_INTERPRET=1``): how to tell, its bfloat16 cast, and
log1p / expm1, which it lacks.

The interpreter runs kernels through NumPy; its cast from float32 to bfloat16 truncates where a
GPU rounds to nearest, which doubles the rounding error of every bf16 store. Kernels that store
bf16 round first under the interpreter (``round_bf16``), so a CPU check holds them to the same
tolerance as a GPU one.  It runs no libdevice function: ``log1p`` and ``expm1`` are libdevice's on a
GPU and, under the interpreter, formulas as exact near 0 from its (NumPy's) log and exp.
"""
import os

import triton
import triton.language as tl
from triton.language.extra import libdevice


def interpreted() -> bool:
    """Whether Triton kernels run through the CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def log1p(x):
    """log(1 + x) of an fp32 block, to an ulp or two near 0 too: libdevice's; under the interpreter,
    Goldberg's log(u) * x / (u - 1), u = 1 + x rounded (x itself where u rounds to 1)."""
    if INTERPRETED:
        u = 1.0 + x
        d = u - 1.0
        return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))
    else:
        return libdevice.log1p(x)


@triton.jit
def expm1(x):
    """exp(x) - 1 of an fp32 block, to an ulp or two near 0 too: libdevice's; under the interpreter,
    Kahan's (u - 1) * x / log(u), u = exp(x) rounded (x where u rounds to 1, -1 where u - 1 does,
    u itself above 88, where u - 1 rounds to u, infinite past 88.7, where the formula gives nan)."""
    if INTERPRETED:
        u = tl.exp(x)
        d = u - 1.0
        kahan = d * (x / tl.where(d == 0.0, 1.0, tl.log(u)))
        return tl.where(d == 0.0, x, tl.where(d == -1.0, -1.0, tl.where(x > 88.0, u, kahan)))
    else:
        return libdevice.expm1(x)


@triton.jit
def round_bf16(x):
    """fp32 block rounded to the nearest bf16 value (ties to even), still fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def store_cast(x, ptr):
    """``x`` (fp32) cast to the element type of ``ptr``, rounded to nearest for bf16 (for the interpreter)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        x = round_bf16(x)
    return x.to(ptr.dtype.element_ty)
