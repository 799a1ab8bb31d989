"""Layout conversions in the fused attention kernels, read from their TTGIR: no GPU needed.

    PYTHONPATH=$PWD python3 benchmarks/attention_layouts.py

Compiles ``_attn_fwd_kernel`` (64x128 tiles) and ``_attn_bwd_dkdv_kernel`` (64x64, dQ atomic) for
sm_90 (``triton.compile`` with ``GPUTarget("cuda", 90, 32)``, 4 warps, 3 stages; bf16 Q/K/V, P = 64,
keys in whole groups of 64), without dropout, drawing the mask, and writing / reading a saved
mask, and prints each variant's ``ttg.convert_layout`` operations (a conversion of a large block
goes through shared memory) and the layouts the Philox counters are computed in (a layout that
replicates them across threads computes each call more than once).  A reading of the compiler's
output, not a measurement: the installed Triton may differ from the GPU machine's.
"""
from __future__ import annotations

import inspect
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import datamove.kernels.attention as attention

POINTER_TYPES = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "dq_acc_ptr": "*fp32", "arrivals_ptr": "*i32", "kpm_ptr": "*u8",
                 "mask_ptr": "*i16"}
FLOAT_ARGS = ("qk_scale", "scale", "dropout_scale")


def ttgir(kernel, constants: dict) -> str:
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i64" if name == "seed" else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=3))
    return compiled.asm["ttgir"]


def main() -> None:
    common = dict(P=64, CAUSAL=False, HAS_KPM=False, INDEX_64=False, GROUPED=True)
    kernels = {"forward": (attention._attn_fwd_kernel, dict(BLOCK_J=64, BLOCK_K=128, EVEN_K=True), (0, 1)),
               "dK/dV": (attention._attn_bwd_dkdv_kernel, dict(BLOCK_J=64, BLOCK_K=64, EVEN=True, DQ_ATOMIC=True), (0, 2))}
    for name, (kernel, tiles, mask_io) in kernels.items():
        cases = [("no dropout", False, 0), ("mask drawn", True, 0), ("saved mask" + (" written" if mask_io[1] == 1 else " read"),
                                                                       True, mask_io[1])]
        for label, dropout, io in cases:
            text = ttgir(kernel, dict(common, **tiles, HAS_DROPOUT=dropout, MASK_IO=io))
            conversions = re.findall(r"ttg\.convert_layout %\S+ : (tensor<[^>]*>)", text)
            counters = sorted(set(re.findall(r"arith\.muli %\S+, %\S+ : (tensor<\d+x\d+xi64, [^\n]*?)(?: loc|$)", text)))
            print(f"{name}, {label}: {len(conversions)} layout conversions")
            for c in conversions:
                print(f"    {c}")
            for c in (c for c in counters if "x1xi64" not in c):  # [R, 1]: row counters, not Philox
                print(f"    Philox products in {c[:120]}")
    print("\nLayouts:", *sorted(set(re.findall(r"^#(?:linear|mma)\d* = .*", text, re.M))), sep="\n  ")


if __name__ == "__main__":
    main()
