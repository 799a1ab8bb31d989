"""Compile every attention kernel to sm_90 PTX with Triton's compiler (no GPU needed), for
``test_attention.test_kernels_compile_for_hopper``:

    python3 tests/compile_attention.py '{"BLOCK_K": 64, "GROUPED": true, "MASK_IO": 1, "HAS_BIAS": true}'
    python3 tests/compile_attention.py '{"BLOCK_K": 64, "GROUPED": true, "MASK_IO": 1, "GROUPS": 4, "CAUSAL": true}'

prints each kernel's name once its PTX is built; a kernel that does not compile raises."""
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import datamove.kernels.attention as attention

POINTER_TYPES = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "dq_acc_ptr": "*fp32", "arrivals_ptr": "*i32",
                 "kpm_ptr": "*u8", "mask_ptr": "*i16"}  # other pointers: the layer's bf16 tensors
FLOAT_SCALARS = {"scale", "qk_scale", "dropout_scale"}
KERNELS = (attention._attn_fwd_kernel, attention._attn_bwd_preprocess_kernel, attention._attn_bwd_dkdv_kernel,
           attention._attn_bwd_dq_kernel)


def compile_all(chosen: dict) -> None:
    flags = dict(P=64, BLOCK_J=64, CAUSAL=False, HAS_KPM=True, HAS_DROPOUT=True, INDEX_64=False, EVEN_K=True,
                 EVEN=True, DQ_ATOMIC=True, ZERO_DQ=True, GROUPS=1)
    flags.update(chosen)
    for kernel in KERNELS:
        names = kernel.arg_names
        constants = {name: flags[name] for name in names if name in flags}
        signature = {name: "constexpr" if name in constants else POINTER_TYPES.get(name, "*bf16") if name.endswith("_ptr")
                     else "fp32" if name in FLOAT_SCALARS else "i32" for name in names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(name),): value for name, value in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert ".entry" in compiled.asm["ptx"], kernel.fn.__name__
        print(kernel.fn.__name__, flush=True)


if __name__ == "__main__":
    compile_all(json.loads(sys.argv[1]))
