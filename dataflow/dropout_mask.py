"""Dropout masks that every datamove kernel can regenerate.

Convention (shared by the reference executor and every Triton kernel, forward or backward, in
any layout): the element of a dropout-masked tensor with *logical* row-major index ``n`` over the
tensor's named dims in spec order is kept iff ``tl.rand(seed, offset + n) > p``.  Kept elements
are scaled by ``1 / (1 - p)``.  ``tl.rand`` is Philox-4x32-10 on the counter (lo, hi, 0, 0) with
the 64-bit seed as key, first output word, mapped to [0, 1) as Triton does; this module
reproduces it bit for bit in NumPy so the float64 reference sees the same mask.
"""
from __future__ import annotations

import numpy as np

_KEY_A = np.uint32(0x9E3779B9)
_KEY_B = np.uint32(0xBB67AE85)
_ROUND_A = np.uint64(0xD2511F53)
_ROUND_B = np.uint64(0xCD9E8D57)
_TO_UNIFORM = np.float32(4.6566127342e-10)


def _mulhilo(a: np.uint64, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    prod = a * b.astype(np.uint64)
    return (prod >> np.uint64(32)).astype(np.uint32), (prod & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def philox_uniform(seed: int, counters: np.ndarray) -> np.ndarray:
    """``tl.rand(seed, counters)`` for int64 ``counters`` (any shape), as float32 in [0, 1)."""
    counters = np.asarray(counters, dtype=np.int64)
    c0 = (counters & 0xFFFFFFFF).astype(np.uint32)
    c1 = ((counters >> 32) & 0xFFFFFFFF).astype(np.uint32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0 = np.uint32(seed & 0xFFFFFFFF)
    k1 = np.uint32((seed >> 32) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        for _ in range(10):
            hi_b, lo_b = _mulhilo(_ROUND_B, c2)
            hi_a, lo_a = _mulhilo(_ROUND_A, c0)
            c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
            k0 = np.uint32(k0 + _KEY_A)
            k1 = np.uint32(k1 + _KEY_B)
    x = c0.view(np.int32)
    x = np.where(x < 0, ~x, x)
    return x.astype(np.float32) * _TO_UNIFORM


def keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """Boolean keep-mask of ``shape`` (logical dims in spec order): True where the element survives."""
    counters = offset + np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).reshape(shape)
    return philox_uniform(seed, counters) > np.float32(p)


def dropout_scale_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """float64 multiplier of ``shape``: ``1/(1-p)`` where kept, 0 where dropped (all ones when p == 0)."""
    if p == 0.0:
        return np.ones(shape)
    return keep_mask(seed, offset, shape, p) / (1.0 - p)
