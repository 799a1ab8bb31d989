"""The NumPy Philox reproduces Triton's tl.rand bit for bit (through the interpreter on CPU)."""
import numpy as np
import torch
import triton
import triton.language as tl

from dataflow.dropout_mask import keep_mask, philox_uniform
from kernels.philox import dropout_keep


@triton.jit
def _rand_kernel(out_ptr, keep_ptr, n, seed, offset, p, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n
    tl.store(out_ptr + idx, tl.rand(seed, offset + idx), mask=inside)
    tl.store(keep_ptr + idx, dropout_keep(seed, offset, idx, p).to(tl.int8), mask=inside)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_philox_matches_triton_rand():
    n, seed, offset, p = 1237, 0x1234_5678_9ABC, 977, 0.1
    out = torch.empty(n, dtype=torch.float32, device=_device())
    keep = torch.empty(n, dtype=torch.int8, device=_device())
    _rand_kernel[(triton.cdiv(n, 256),)](out, keep, n, seed, offset, p, BLOCK=256)
    expected = philox_uniform(seed, offset + np.arange(n))
    np.testing.assert_array_equal(out.cpu().numpy(), expected)
    np.testing.assert_array_equal(keep.cpu().numpy().astype(bool), keep_mask(seed, offset, (n,), p))
    assert 0.85 < keep_mask(seed, offset, (n,), p).mean() < 0.95
