"""Dropout masks that every datamove kernel can regenerate.

Convention (shared by the reference executor and every Triton kernel, forward or backward, in
any layout).  The element of a dropout-masked tensor with *logical* row-major index ``n`` over the
tensor's named dims in spec order has the global counter ``g = offset + n``.  One Philox-4x32-10
call on the 64-bit counter ``g // 4`` (as Triton's ``tl.randint4x``: counter words (lo, hi, 0, 0),
the 64-bit seed as key) yields four 32-bit words; the element takes word ``g % 4``, maps it to
[0, 1) as ``tl.rand`` does, and is kept iff that value is ``> p``.  Kept elements are scaled by
``1 / (1 - p)``.  Four consecutive logical elements thus share one Philox call (what PyTorch's
and FlashAttention's dropout do too): a kernel whose tile runs along the tensor's last logical
dim draws a quarter of the calls (``kernels.philox.dropout_keep_quads``); any other kernel can
still decide element by element (``kernels.philox.dropout_keep``).  Word 0 of counter ``c`` is
``tl.rand(seed, c)``.  This module reproduces the convention bit for bit in NumPy so the float64
reference sees the same mask.
"""
from __future__ import annotations

import numpy as np

DECISIONS_PER_CALL = 4  # keep decisions drawn from one Philox-4x32-10 call (its four output words)
_KEY_A = np.uint32(0x9E3779B9)
_KEY_B = np.uint32(0xBB67AE85)
_ROUND_A = np.uint64(0xD2511F53)
_ROUND_B = np.uint64(0xCD9E8D57)
_TO_UNIFORM = np.float32(4.6566127342e-10)


def _mulhilo(a: np.uint64, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    prod = a * b.astype(np.uint64)
    return (prod >> np.uint64(32)).astype(np.uint32), (prod & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def philox_words(seed: int, counters: np.ndarray) -> np.ndarray:
    """``tl.randint4x(seed, counters)`` for int64 ``counters`` (any shape): uint32 array of shape
    ``counters.shape + (4,)``, the four output words of each call."""
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
    return np.stack([c0, c1, c2, c3], axis=-1)


def to_uniform(words: np.ndarray) -> np.ndarray:
    """uint32 Philox words -> float32 in [0, 1), as ``tl.rand`` maps them."""
    x = words.view(np.int32)
    x = np.where(x < 0, ~x, x)
    return x.astype(np.float32) * _TO_UNIFORM


def philox_uniform(seed: int, counters: np.ndarray) -> np.ndarray:
    """``tl.rand(seed, counters)`` for int64 ``counters`` (any shape), as float32 in [0, 1)."""
    return to_uniform(philox_words(seed, counters)[..., 0])


def dropout_uniform(seed: int, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    """The convention's uniform value of every element of a mask of ``shape`` (spec order) at ``offset``."""
    g = offset + np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    first = g[0] // DECISIONS_PER_CALL if g.size else 0
    calls = np.arange(first, (g[-1] // DECISIONS_PER_CALL + 1) if g.size else first, dtype=np.int64)
    words = philox_words(seed, calls)  # each call once, then each element picks its word
    picked = words[g // DECISIONS_PER_CALL - first, g % DECISIONS_PER_CALL]
    return to_uniform(picked).reshape(shape)


def keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """Boolean keep-mask of ``shape`` (logical dims in spec order): True where the element survives."""
    return dropout_uniform(seed, offset, shape) > np.float32(p)


def dropout_scale_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """float64 multiplier of ``shape``: ``1/(1-p)`` where kept, 0 where dropped (all ones when p == 0)."""
    if p == 0.0:
        return np.ones(shape)
    return keep_mask(seed, offset, shape, p) / (1.0 - p)
