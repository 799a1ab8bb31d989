"""Triton side of the dropout convention in ``dataflow.dropout_mask``.

A kernel passes the global counter of each element (the mask's ``offset`` plus the element's
logical row-major index over the tensor's named dims in spec order, independent of the storage
layout) and gets the keep decision that ``dataflow.dropout_mask.keep_mask`` computes in NumPy.

- ``dropout_keep(seed, offset, logical_index, threshold)``: any block of elements, one Philox call
  per element (the 16-bit half picked by the counter's low three bits).
- ``dropout_keep_octets(seed, call_counter, threshold)``: a [R, C] block of Philox calls whose
  eight halves cover eight consecutive elements each; returns the [R, 8 C] keep block, column
  ``8 c + h`` from half ``h`` of call (r, c).  The caller passes ``(offset + n) // 8`` for the
  element n at column 8 c (which must have ``(offset + n) % 8 == 0``): an eighth of the calls.
- ``keep_halves(word, threshold)``: the (low, high) decisions of one word, for kernels that pack
  decisions themselves.

``threshold`` is ``keep_threshold(p)`` (host side): an element is kept iff its 16-bit value is ``>= threshold``.
"""
import triton
import triton.language as tl

from dataflow.dropout_mask import keep_threshold  # noqa: F401 - the host-side half of the convention, for kernels


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
def keep_halves(word, threshold):
    """(low, high): True where the uint32 ``word``'s low / high 16-bit half keeps its element."""
    return (word & 0xFFFF) >= threshold, (word >> 16) >= threshold


@triton.jit
def dropout_keep(seed, offset, logical_index, threshold):
    """Boolean block: True where the element at ``logical_index`` (int32/int64 block) of the mask
    at counter ``offset`` survives; one Philox call per element."""
    g = offset + logical_index
    c0, c1, c2, c3 = philox4(seed, g >> 3)
    word = (g >> 1) & 3
    picked = tl.where(word == 0, c0, tl.where(word == 1, c1, tl.where(word == 2, c2, c3)))
    return ((picked >> ((g & 1) * 16).to(tl.uint32)) & 0xFFFF) >= threshold


@triton.jit
def dropout_keep_octets(seed, call_counter, threshold):
    """Boolean [R, 8 C] block from the [R, C] block of Philox counters ``call_counter``: column
    ``8 c + h`` is half ``h`` of call (r, c) (see the module doc)."""
    c0, c1, c2, c3 = philox4(seed, call_counter)
    # [R, C, 2, 2, 2]: [.., i, j, k] = half 4 i + 2 j + k, the low (k = 0) or high (k = 1) half of word 2 i + j
    halves = tl.join(tl.join(tl.join(c0 & 0xFFFF, c2 & 0xFFFF), tl.join(c1 & 0xFFFF, c3 & 0xFFFF)),
                     tl.join(tl.join(c0 >> 16, c2 >> 16), tl.join(c1 >> 16, c3 >> 16)))
    return tl.reshape(halves, (halves.shape[0], 8 * halves.shape[1])) >= threshold
