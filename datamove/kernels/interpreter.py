"""The Triton CPU interpreter (``TRITON_INTERPRET=1``): how to tell, and its bfloat16 cast.

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
