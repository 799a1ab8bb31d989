"""Triton side of the dropout convention in ``dataflow.dropout_mask``.

A kernel passes the Philox key ``seed`` (an integer, or a pointer to an int64 holding it:
``seed_value``) and the global counter of each element (the mask's ``offset`` plus the element's
logical row-major index over the tensor's named dims in spec order, independent of the storage
layout) and gets the keep decision that ``dataflow.dropout_mask.keep_mask`` computes in NumPy.
Counter ``g = 64 G + 8 i + 2 t + e`` is byte ``2 i + e`` of Philox call ``4 G + t``.

- ``dropout_keep(seed, offset, logical_index, threshold)``: any block of elements, one Philox call
  per element.
- ``dropout_keep_grouped(seed, call_counter, threshold)``: a [R, C] block of Philox calls (C a
  multiple of 4; row r's calls ``call_counter[r, 0] + c`` with ``call_counter[r, 0] % 4 == 0``:
  whole groups); returns the [R, 16 C] keep block, column ``64 (c // 4) + 8 i + 2 (c % 4) + e``
  from byte ``2 i + e`` of call (r, c).  The caller passes ``(offset + n) // 16`` for the element n
  at column 16 c (n at column 0 must have ``(offset + n) % 64 == 0``): a sixteenth of the calls,
  and in a tensor-core accumulator's layout every thread draws just the calls of its own columns.
- ``keep_bits(seed, calls, threshold)``: one uint16 per call, bit ``b`` the decision of byte ``b``;
  ``unpack_grouped`` (in place), ``unpack_gathered`` (exchanged between threads) and ``unpack_rows``
  (some or all sixteen) spread them over a tile's columns / rows.

``threshold`` is ``keep_threshold(p)`` (host side): an element is kept iff its byte is ``>= threshold``;
kept elements are scaled by ``dropout_scale(p)``.
"""
import triton
import triton.language as tl

from datamove.dataflow.dropout_mask import dropout_scale, keep_threshold  # noqa: F401 - the host-side half of the convention


@triton.jit
def seed_value(seed):
    """The Philox key: ``seed`` itself (a scalar, or a constexpr when it is 1), or the int64 it points
    to: a key kept in device memory lets a captured CUDA graph draw a fresh mask on every replay
    (the host writes a new key there, or a graph-safe ``torch.randint`` on the device does)."""
    if tl.constexpr(isinstance(seed, tl.tensor) and seed.dtype.is_ptr()):
        return tl.load(seed)
    else:
        return seed


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
    key = c0.to(tl.uint64) * 0 + seed_value(seed)  # a uint64 block whether seed is a scalar, a constexpr (1) or a pointer
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
def _byte_keeps(word, threshold):
    """The decisions of ``word``'s bytes 0..3 (bits 0-7, .., 24-31), as uint32 bits 0..3."""
    keeps = ((word & 0xFF) >= threshold).to(tl.uint32)
    keeps |= (((word >> 8) & 0xFF) >= threshold).to(tl.uint32) << 1
    keeps |= (((word >> 16) & 0xFF) >= threshold).to(tl.uint32) << 2
    return keeps | ((word >> 24) >= threshold).to(tl.uint32) << 3


@triton.jit
def _call_byte(w0, w1, w2, w3, byte):
    """Byte ``byte`` (a block of 0..15, broadcast against the words) of the call whose words are
    w0..w3: bits ``8 (byte % 4)`` .. of word ``byte // 4``."""
    word = byte >> 2
    picked = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
    return (picked >> ((byte & 3) * 8).to(tl.uint32)) & 0xFF


@triton.jit
def dropout_keep(seed, offset, logical_index, threshold):
    """Boolean block: True where the element at ``logical_index`` (int32/int64 block) of the mask
    at counter ``offset`` survives; one Philox call per element."""
    g = offset + logical_index
    c0, c1, c2, c3 = philox4(seed, ((g >> 6) << 2) | ((g >> 1) & 3))
    return _call_byte(c0, c1, c2, c3, ((g >> 2) & 14) | (g & 1)) >= threshold  # byte 2 i + e


@triton.jit
def keep_bits(seed, calls, threshold):
    """uint16 block: bit b of element (..) = the keep decision from byte b of Philox call calls[..]."""
    w0, w1, w2, w3 = philox4(seed, calls)
    bits = _byte_keeps(w0, threshold) | (_byte_keeps(w1, threshold) << 4)
    return (bits | (_byte_keeps(w2, threshold) << 8) | (_byte_keeps(w3, threshold) << 12)).to(tl.uint16)


@triton.jit
def _by_group(word):
    """[R, C] -> [R, C // 4, 1, 4, 1]: a call block's words as [R, G, i, t, e] with t the call within
    its group of 64 counters, broadcast over i and e."""
    R: tl.constexpr = word.shape[0]
    C: tl.constexpr = word.shape[1]
    return tl.reshape(word, (R, C // 4, 4))[:, :, None, :, None]


@triton.jit
def unpack_grouped(bits):
    """[R, C] uint16 (C % 4 == 0, whole groups of calls) -> [R, 16 C] bool: column
    64 (c // 4) + 8 i + 2 (c % 4) + e is bit 2 i + e of bits[r, c].  Each element shifts its call's
    bits in place: for a tensor-core accumulator, whose threads hold whole calls."""
    R: tl.constexpr = bits.shape[0]
    C: tl.constexpr = bits.shape[1]
    grouped = _by_group(bits)  # [R, G, i, t, e]
    shifts = (2 * tl.arange(0, 8)[:, None, None] + tl.arange(0, 2)[None, None, :]).to(tl.uint16)  # [i, t, e]
    return tl.reshape((grouped >> shifts[None, None, :, :, :]) & 1, (R, 16 * C)) != 0


@triton.jit
def unpack_gathered(bits):
    """[R, C] uint16 (C % 4 == 0, whole groups of calls) -> [R, 16 C] bool, as ``unpack_grouped``:
    column ``64 (c // 4) + 8 i + 2 (c % 4) + e`` is bit ``2 i + e`` of ``bits[r, c]``, each element
    fetching its call's bits with ``tl.gather``.  For a blocked tile, whose threads hold runs of eight
    consecutive columns (four calls each): drawn in such a tile, Triton 3.6 computes a call in every
    thread that uses one of its bytes (``dropout_keep_grouped``: 0.75-0.85 calls per element in
    sm_90 PTX, against 0.05 this way)."""
    R: tl.constexpr = bits.shape[0]
    C: tl.constexpr = bits.shape[1]
    column = tl.arange(0, 16 * C)
    call = 4 * (column // 64) + (column % 8) // 2
    bit = (2 * ((column % 64) // 8) + column % 2).to(tl.uint16)
    picked = tl.gather(bits, tl.broadcast_to(call[None, :], (R, 16 * C)), axis=1)
    return ((picked >> bit[None, :]) & 1) != 0


@triton.jit
def unpack_rows(bits, first, ROWS: tl.constexpr):
    """[1, C] uint16 -> [ROWS, C] bool: row r is bit ``first + r`` (the decision of byte first + r of
    each column's call; ``first + ROWS <= 16``)."""
    return ((bits.to(tl.uint32) >> (first + tl.arange(0, ROWS)).to(tl.uint32)[:, None]) & 1) != 0


@triton.jit
def dropout_keep_grouped(seed, call_counter, threshold):
    """Boolean [R, 16 C] block from the [R, C] block of Philox counters ``call_counter`` (whole
    groups, see the module doc): column ``64 (c // 4) + 8 i + 2 (c % 4) + e`` is byte ``2 i + e`` of
    call (r, c), each element comparing its own byte (``unpack_grouped(keep_bits(..))`` without the
    packing).  Drawn in the consumer's layout: in a tensor-core accumulator's, whose threads hold
    exactly the columns of their own calls, each call once; in a blocked tile whose threads hold runs
    of eight consecutive columns, each call in every thread that uses one of its bytes (exchanging
    the bits instead, ``tl.gather`` through shared memory, made Triton 3.6 abort compiling some tiles)."""
    R: tl.constexpr = call_counter.shape[0]
    C: tl.constexpr = call_counter.shape[1]
    w0, w1, w2, w3 = philox4(seed, call_counter)
    i = tl.arange(0, 8)[None, None, :, None, None]
    e = tl.arange(0, 2)[None, None, None, None, :]
    keep = _call_byte(_by_group(w0), _by_group(w1), _by_group(w2), _by_group(w3), 2 * i + e) >= threshold
    return tl.reshape(keep, (R, 16 * C))
