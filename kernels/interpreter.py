"""The Triton CPU interpreter (``TRITON_INTERPRET=1``): how to tell, its bfloat16 cast, and the one
compiler hint it cannot run (``opaque``).

The interpreter runs kernels through NumPy; its cast from float32 to bfloat16 truncates where a
GPU rounds to nearest, which doubles the rounding error of every bf16 store. Kernels that store
bf16 round first under the interpreter (``round_bf16``), so a CPU check holds them to the same
tolerance as a GPU one.
"""
import os

import triton
import triton.language as tl


def interpreted() -> bool:
    """Whether Triton kernels run through the CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


COMPILED = tl.constexpr(not interpreted())  # decided when triton is first imported, as the interpreter is


@triton.jit
def opaque(x):
    """``x`` (an integer block of at most 32 bits) unchanged, through an impure copy the compiler may
    neither duplicate nor recompute: a value used in two layouts is then computed once and converted,
    instead of recomputed in the second layout. The interpreter (no inline assembly) returns ``x``."""
    if COMPILED:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x.to(tl.int32)], dtype=tl.int32, is_pure=False,
                                      pack=1).to(x.dtype)
    return x


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
