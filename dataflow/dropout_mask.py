"""Dropout masks that every datamove kernel can regenerate.

Convention (shared by the reference executor and every Triton kernel, forward or backward, in
any layout).  The element of a dropout-masked tensor with *logical* row-major index ``n`` over the
tensor's named dims in spec order has the global counter ``g = offset + n``.  One Philox-4x32-10
call on the 64-bit counter ``g // 8`` (as Triton's ``tl.randint4x``: counter words (lo, hi, 0, 0),
the 64-bit seed as key) yields four 32-bit words, i.e. eight 16-bit halves (word ``w``'s low half
is half ``2 w``, its high half ``2 w + 1``); the element takes half ``g % 8`` and is kept iff that
16-bit value is ``>= keep_threshold(p) = round(p * 65536)``, so it is dropped with probability
``round(p * 65536) / 65536`` (p = 0.1: 0.1000061).  Kept elements are scaled by ``1 / (1 - p)``.
Eight consecutive logical elements thus share one Philox call: a kernel whose tile runs along the
tensor's last logical letter makes an eighth of the calls (``kernels.philox.dropout_keep_octets``);
any other kernel can still decide element by element (``kernels.philox.dropout_keep``).  This
module reproduces the convention bit for bit in NumPy so the float64 reference sees the same mask.
"""
from __future__ import annotations

import numpy as np

DECISIONS_PER_CALL = 8  # keep decisions drawn from one Philox-4x32-10 call (its eight 16-bit halves)
DECISION_LEVELS = 1 << 16  # each decision compares a 16-bit value
_KEY_A = np.uint32(0x9E3779B9)
_KEY_B = np.uint32(0xBB67AE85)
_ROUND_A = np.uint64(0xD2511F53)
_ROUND_B = np.uint64(0xCD9E8D57)
_TO_UNIFORM = np.float32(4.6566127342e-10)


def keep_threshold(p: float) -> int:
    """The 16-bit level at or above which an element is kept: ``round(p * 65536)``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability {p} is not in [0, 1)")
    return int(round(p * DECISION_LEVELS))


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


def philox_uniform(seed: int, counters: np.ndarray) -> np.ndarray:
    """``tl.rand(seed, counters)`` for int64 ``counters`` (any shape), as float32 in [0, 1)."""
    x = philox_words(seed, counters)[..., 0].view(np.int32)
    x = np.where(x < 0, ~x, x)
    return x.astype(np.float32) * _TO_UNIFORM


def decision_values(seed: int, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    """The convention's 16-bit value (uint16) of every element of a mask of ``shape`` (spec order) at ``offset``."""
    g = offset + np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    if not g.size:
        return np.zeros(shape, dtype=np.uint16)
    first = g[0] // DECISIONS_PER_CALL
    calls = np.arange(first, g[-1] // DECISIONS_PER_CALL + 1, dtype=np.int64)
    words = philox_words(seed, calls)
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(len(calls), DECISIONS_PER_CALL)
    return halves[g // DECISIONS_PER_CALL - first, g % DECISIONS_PER_CALL].astype(np.uint16).reshape(shape)


def keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """Boolean keep-mask of ``shape`` (logical dims in spec order): True where the element survives."""
    return decision_values(seed, offset, shape) >= keep_threshold(p)


def dropout_scale_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """float64 multiplier of ``shape``: ``1/(1-p)`` where kept, 0 where dropped (all ones when p == 0)."""
    if p == 0.0:
        return np.ones(shape)
    return keep_mask(seed, offset, shape, p) / (1.0 - p)
