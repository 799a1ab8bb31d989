"""Dropout masks that every datamove kernel can regenerate.

Convention (shared by the reference executor and every Triton kernel, forward or backward, in
any layout).  The element of a dropout-masked tensor with *logical* row-major index ``n`` over the
tensor's named dims in spec order has the global counter ``g = offset + n``.  Counters come in
groups of 64 (``DECISION_GROUP``), each decided by four Philox-4x32-10 calls (as Triton's
``tl.randint4x``: counter words (lo, hi, 0, 0), the 64-bit seed as key) whose four 32-bit words are
sixteen bytes (word ``w``'s bits ``8 k .. 8 k + 7`` are byte ``4 w + k``).  Counter
``g = 64 G + 8 i + 2 t + e`` (``i = (g // 8) % 8``, ``t = (g % 8) // 2``, ``e = g % 2``) takes byte
``2 i + e`` of call ``4 G + t``.  The element is kept iff that byte is ``>= keep_threshold(p) =
round(p * 256)``, so it is dropped with probability ``round(p * 256) / 256`` (p = 0.1: 0.1015625),
and kept elements are scaled by ``dropout_scale(p) = 1 / (1 - round(p * 256) / 256)``, so the
expectation is exact.  Eight-bit decisions, as FlashAttention's dropout makes them, take one Philox
call per sixteen elements.

So a call decides, in each of the eight runs of eight elements of its group, the pair ``2 t, 2 t + 1``.
That is the element order of a tensor-core (MMA) accumulator tile: each thread holds, per row,
column pairs ``2 t, 2 t + 1`` of every eight columns, i.e. every decision of one whole call per
64 columns, so a kernel whose tile runs along the tensor's last logical letter in whole groups
draws each call once, in the thread that uses it, without moving decisions between threads
(``kernels.philox.dropout_keep_grouped``).  Any other kernel can decide element by element
(``kernels.philox.dropout_keep``).  This module reproduces the convention bit for bit in NumPy so
the float64 reference sees the same mask.
"""
from __future__ import annotations

import numpy as np

DECISIONS_PER_CALL = 16  # keep decisions drawn from one Philox-4x32-10 call (its sixteen bytes)
DECISION_GROUP = 64  # counters 64 G .. 64 G + 63: calls 4 G .. 4 G + 3
CALLS_PER_GROUP = DECISION_GROUP // DECISIONS_PER_CALL
DECISION_LEVELS = 1 << 8  # each decision compares an 8-bit value
CHUNK_GROUPS = 4096  # groups drawn at a time: BERT-large's attention mask (33.5M) 0.15 s against 0.42 at once (2 cores)
_KEY_A = np.uint32(0x9E3779B9)
_KEY_B = np.uint32(0xBB67AE85)
_ROUND_A = np.uint64(0xD2511F53)
_ROUND_B = np.uint64(0xCD9E8D57)
_TO_UNIFORM = np.float32(4.6566127342e-10)


def keep_threshold(p: float) -> int:
    """The 8-bit level at or above which an element is kept: ``round(p * 256)``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability {p} is not in [0, 1)")
    threshold = int(round(p * DECISION_LEVELS))
    if threshold == DECISION_LEVELS:
        raise ValueError(f"dropout probability {p} rounds to 1 in steps of 1/{DECISION_LEVELS}: every element "
                         "would be dropped")
    return threshold


def dropout_scale(p: float) -> float:
    """The factor of a kept element: ``1 / (1 - q)`` for the probability ``q = round(p * 256) / 256``
    with which elements are dropped (p = 0.1: 1.1130435)."""
    return DECISION_LEVELS / (DECISION_LEVELS - keep_threshold(p))


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
    """The convention's 8-bit value (uint8) of every element of a mask of ``shape`` (spec order) at ``offset``."""
    n = int(np.prod(shape, dtype=np.int64))
    if not n:
        return np.zeros(shape, dtype=np.uint8)
    if offset % DECISION_GROUP == 0:  # whole groups: the bytes are a fixed permutation of each group's calls
        groups = -(-n // DECISION_GROUP)
        first = offset // DECISION_GROUP * CALLS_PER_GROUP
        values = np.empty(groups * DECISION_GROUP, dtype=np.uint8)
        for start in range(0, groups, CHUNK_GROUPS):  # a working set in cache, not arrays of every call
            stop = min(groups, start + CHUNK_GROUPS)
            calls = first + np.arange(start * CALLS_PER_GROUP, stop * CALLS_PER_GROUP, dtype=np.int64)
            # call 4 G + t, byte 2 i + e -> element 8 i + 2 t + e of group G
            call_bytes = philox_words(seed, calls).astype("<u4").view(np.uint8).reshape(-1, CALLS_PER_GROUP, 8, 2)
            values[start * DECISION_GROUP:stop * DECISION_GROUP].reshape(-1, 8, CALLS_PER_GROUP, 2)[...] = \
                call_bytes.transpose(0, 2, 1, 3)
        return values[:n].reshape(shape)
    g = offset + np.arange(n, dtype=np.int64)
    call, byte = call_and_byte(g)
    first = call.min()
    calls = np.arange(first, call.max() + 1, dtype=np.int64)
    call_bytes = philox_words(seed, calls).astype("<u4").view(np.uint8).reshape(len(calls), DECISIONS_PER_CALL)
    return call_bytes[call - first, byte].reshape(shape)


def call_and_byte(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Philox call counter, byte 0..15) of each int64 counter ``g``: ``g = 64 G + 8 i + 2 t + e`` -> (4 G + t, 2 i + e)."""
    g = np.asarray(g, dtype=np.int64)
    return (g // DECISION_GROUP) * CALLS_PER_GROUP + (g % 8) // 2, 2 * ((g // 8) % 8) + g % 2


def keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """Boolean keep-mask of ``shape`` (logical dims in spec order): True where the element survives."""
    return decision_values(seed, offset, shape) >= keep_threshold(p)


def dropout_scale_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """float64 multiplier of ``shape``: ``dropout_scale(p)`` where kept, 0 where dropped (all ones when p == 0)."""
    if p == 0.0:
        return np.ones(shape)
    return keep_mask(seed, offset, shape, p) * dropout_scale(p)
