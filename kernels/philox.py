"""Triton side of the dropout convention in ``dataflow.dropout_mask``.

A kernel passes the global counter of each element (the mask's ``offset`` plus the element's
logical row-major index over the tensor's named dims in spec order, independent of the storage
layout) and gets the keep decision that ``dataflow.dropout_mask.keep_mask`` computes in NumPy.

- ``dropout_keep(seed, offset, logical_index, threshold)``: any block of elements, one Philox call
  per element (the word picked by the counter's low two bits).
- ``dropout_keep_quads(seed, quad_counter, threshold)``: a [R, C] block of Philox calls whose four
  words cover four consecutive elements each; returns the [R, 4 C] keep block, column ``4 c + w``
  from word ``w`` of call (r, c).  The caller passes ``(offset + n) // 4`` for the element n at
  column 4 c (which must have ``(offset + n) % 4 == 0``): a quarter of the calls.

``threshold`` is ``keep_threshold(p)``: the comparison with ``p`` done on the integers
(``keep_word`` decides one word; kernels that pack or store decisions use it directly).
"""
import functools

import numpy as np
import triton
import triton.language as tl

_TO_UNIFORM = np.float32(4.6566127342e-10)  # tl.rand's int32 -> [0, 1) factor


@functools.lru_cache(maxsize=64)
def keep_threshold(p: float) -> int:
    """The int32 T with ``uniform(word) > p  <=>  |x| > T``, x = the Philox word as int32 and
    |x| = ``x ^ (x >> 31)`` (what tl.rand scales): the largest |x| that float32(|x|) * 2^-31 maps
    to at most float32(p); the map is monotone, so a bisection finds it."""
    p = np.float32(p)
    low, high = -1, 2**31 - 1
    while low < high:
        mid = (low + high + 1) // 2
        if np.float32(mid) * _TO_UNIFORM <= p:
            low = mid
        else:
            high = mid - 1
    return low


@triton.jit
def philox4(seed, counter):
    """The four uint32 words of ``tl.randint4x(seed, counter)`` (Philox-4x32-10, counter words
    (lo, hi, 0, 0), the 64-bit seed as key), with each 32x32-bit product taken as one 64-bit
    product (one IMAD.WIDE instead of separate high and low halves)."""
    c0 = counter.to(tl.uint32)
    c1 = c0 * 0
    if tl.constexpr(counter.dtype.primitive_bitwidth) > 32:
        c1 = (counter >> 32).to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    key = c0.to(tl.uint64) * 0 + seed  # a uint64 block whether seed arrives as a scalar or a constexpr (seed == 1)
    k0 = (key & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        product_b = c2.to(tl.uint64) * 0xCD9E8D57
        product_a = c0.to(tl.uint64) * 0xD2511F53
        c0 = (product_b >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (product_a >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = product_b.to(tl.uint32)
        c3 = product_a.to(tl.uint32)
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def keep_word(word, threshold):
    """True where the uint32 Philox ``word`` keeps its element (``tl.rand``'s |x| against ``threshold``)."""
    x = word.to(tl.int32, bitcast=True)
    return (x ^ (x >> 31)) > threshold


@triton.jit
def dropout_keep(seed, offset, logical_index, threshold):
    """Boolean block: True where the element at ``logical_index`` (int32/int64 block) of the mask
    at counter ``offset`` survives; one Philox call per element."""
    g = offset + logical_index
    c0, c1, c2, c3 = philox4(seed, g >> 2)
    word = g & 3
    picked = tl.where(word == 0, c0, tl.where(word == 1, c1, tl.where(word == 2, c2, c3)))
    return keep_word(picked, threshold)


@triton.jit
def dropout_keep_quads(seed, quad_counter, threshold):
    """Boolean [R, 4 C] block from the [R, C] block of Philox counters ``quad_counter``: column
    ``4 c + w`` is word ``w`` of call (r, c) (see the module doc)."""
    c0, c1, c2, c3 = philox4(seed, quad_counter)
    words = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [R, C, 2, 2]: [.., i, j] = word 2 i + j
    return keep_word(tl.reshape(words, (words.shape[0], 4 * words.shape[1])), threshold)
