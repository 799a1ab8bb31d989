"""Dropout masks that every datamove kernel can regenerate.

Convention (shared by the reference executor and every Triton kernel, forward or backward, in
any layout).  The element of a dropout-masked tensor with *logical* row-major index ``n`` over the
tensor's named dims in spec order has the global counter ``g = offset + n``.  Counters come in
groups of 64 (``DECISION_GROUP``): counter ``g = 64 G + 8 h + c`` (``c = g % 8``, ``h = (g // 8) % 8``)
takes half ``h`` of Philox-4x32-10 call ``8 G + c`` on that 64-bit call counter (as Triton's
``tl.randint4x``: counter words (lo, hi, 0, 0), the 64-bit seed as key), whose four 32-bit words
are eight 16-bit halves (word ``w``'s low half is half ``2 w``, its high half ``2 w + 1``).  The
element is kept iff that 16-bit value is ``>= keep_threshold(p) = round(p * 65536)``, so it is
dropped with probability ``round(p * 65536) / 65536`` (p = 0.1: 0.1000061).  Kept elements are
scaled by ``1 / (1 - p)``.

So a group of 64 consecutive elements is eight calls, call ``c`` deciding the elements ``c, c + 8,
..., c + 56`` of the group.  That is the element order of a tensor-core (MMA) accumulator tile:
each thread holds, per row, column pairs ``2 q, 2 q + 1`` of every eight columns, i.e. every
decision of two whole calls, so a kernel whose tile runs along the tensor's last logical letter in
whole groups draws each call once, in the thread that uses it, without moving decisions between
threads (``kernels.philox.dropout_keep_octets``).  Any other kernel can decide element by element
(``kernels.philox.dropout_keep``).  This module reproduces the convention bit for bit in NumPy so
the float64 reference sees the same mask.
"""
from __future__ import annotations

import numpy as np

DECISIONS_PER_CALL = 8  # keep decisions drawn from one Philox-4x32-10 call (its eight 16-bit halves)
DECISION_GROUP = DECISIONS_PER_CALL * DECISIONS_PER_CALL  # counters 64 G .. 64 G + 63: calls 8 G .. 8 G + 7
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
    call, half = call_and_half(g)
    first = call.min()
    calls = np.arange(first, call.max() + 1, dtype=np.int64)
    words = philox_words(seed, calls)
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(len(calls), DECISIONS_PER_CALL)
    return halves[call - first, half].astype(np.uint16).reshape(shape)


def call_and_half(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Philox call counter, half 0..7) of each int64 counter ``g``: ``g = 64 G + 8 h + c`` -> (8 G + c, h)."""
    g = np.asarray(g, dtype=np.int64)
    return (g // DECISION_GROUP) * DECISIONS_PER_CALL + g % DECISIONS_PER_CALL, (g // DECISIONS_PER_CALL) % DECISIONS_PER_CALL


def keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """Boolean keep-mask of ``shape`` (logical dims in spec order): True where the element survives."""
    return decision_values(seed, offset, shape) >= keep_threshold(p)


def dropout_scale_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """float64 multiplier of ``shape``: ``1/(1-p)`` where kept, 0 where dropped (all ones when p == 0)."""
    if p == 0.0:
        return np.ones(shape)
    return keep_mask(seed, offset, shape, p) / (1.0 - p)
