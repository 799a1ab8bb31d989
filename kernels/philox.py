"""Triton side of the dropout convention in ``dataflow.dropout_mask``.

A kernel passes the global counter of each element (the mask's ``offset`` plus the element's
logical row-major index over the tensor's named dims in spec order, independent of the storage
layout) and gets the keep decision that ``dataflow.dropout_mask.keep_mask`` computes in NumPy.
Counter ``g = 64 G + 8 h + c`` is half ``h`` of Philox call ``8 G + c``.

- ``dropout_keep(seed, offset, logical_index, threshold)``: any block of elements, one Philox call
  per element.
- ``dropout_keep_octets(seed, call_counter, threshold)``: a [R, C] block of Philox calls (C a
  multiple of 8; row r's calls ``call_counter[r, 0] + c`` with ``call_counter[r, 0] % 8 == 0``:
  whole groups); returns the [R, 8 C] keep block, column ``64 (c // 8) + 8 h + c % 8`` from half
  ``h`` of call (r, c).  The caller passes ``(offset + n) // 8`` for the element n at column 8 c
  (n at column 0 must have ``(offset + n) % 64 == 0``): an eighth of the calls, and in a
  tensor-core accumulator's layout every thread draws just the calls of its own columns.
- ``keep_bytes(seed, calls, threshold)``: one uint8 per call, bit ``h`` the decision of half ``h``;
  ``keep_bytes_once`` the same, each call drawn by one thread whatever layouts consume the bytes.
- ``keep_halves(word, threshold)``: the (low, high) decisions of one word.

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
    c0, c1, c2, c3 = philox4(seed, ((g >> 6) << 3) | (g & 7))
    half = (g >> 3) & 7
    word = half >> 1
    picked = tl.where(word == 0, c0, tl.where(word == 1, c1, tl.where(word == 2, c2, c3)))
    return ((picked >> ((half & 1) * 16).to(tl.uint32)) & 0xFFFF) >= threshold


@triton.jit
def _keep_bit_pair(word, threshold, SHIFT: tl.constexpr):
    """uint8 block: the decisions of ``word``'s low / high half at bits SHIFT / SHIFT + 1."""
    low, high = keep_halves(word, threshold)
    return (low.to(tl.uint8) << SHIFT) | (high.to(tl.uint8) << (SHIFT + 1))


@triton.jit
def keep_bytes(seed, calls, threshold):
    """uint8 block: bit h of element (..) = the keep decision from half h of Philox call calls[..]."""
    w0, w1, w2, w3 = philox4(seed, calls)
    return (_keep_bit_pair(w0, threshold, 0) | _keep_bit_pair(w1, threshold, 2)
            | _keep_bit_pair(w2, threshold, 4) | _keep_bit_pair(w3, threshold, 6))


@triton.jit
def unpack_groups(decision_bytes):
    """[R, C] uint8 (C % 8 == 0, whole groups of calls) -> [R, 8 C] bool: column 64 (c // 8) + 8 h + c % 8
    is bit h of decision_bytes[r, c]."""
    R: tl.constexpr = decision_bytes.shape[0]
    C: tl.constexpr = decision_bytes.shape[1]
    grouped = tl.reshape(decision_bytes, (R, C // 8, 8))
    bits = (grouped[:, :, None, :] >> tl.arange(0, 8).to(tl.uint8)[None, None, :, None]) & 1  # [R, G, h, c]
    return tl.reshape(bits, (R, 8 * C)) != 0


@triton.jit
def unpack_rows(decision_bytes):
    """[1, C] uint8 -> [8, C] bool: row h is bit h (the decision of half h of each column's call)."""
    return ((decision_bytes >> tl.arange(0, 8).to(tl.uint8)[:, None]) & 1) != 0


@triton.jit
def keep_bytes_once(seed, calls, threshold):
    """``keep_bytes``, each call drawn by one thread whatever layouts the bytes are then used in.

    Where a consumer's layout holds a call's decisions in several threads (a blocked tile whose
    threads hold runs of consecutive columns: eight calls per run of eight), the compiler would
    recompute Philox in that layout rather than convert the bytes to it; drawn inside a branch
    (both arms alike, the condition not known at compile time) they are computed once, in a layout
    of their own, and converted (a byte per call through shared memory)."""
    if seed >= 0:
        decision_bytes = keep_bytes(seed, calls, threshold)
    else:
        decision_bytes = keep_bytes(seed, calls, threshold)
    return decision_bytes


@triton.jit
def dropout_keep_octets(seed, call_counter, threshold, ONCE: tl.constexpr = True):
    """Boolean [R, 8 C] block from the [R, C] block of Philox counters ``call_counter`` (whole
    groups, see the module doc): column ``64 (c // 8) + 8 h + c % 8`` is half ``h`` of call (r, c).
    ``ONCE``: each call drawn by one thread and its byte converted (``keep_bytes_once``), for blocked
    layouts; False: drawn in the consumer's layout, for a tensor-core accumulator whose threads hold
    exactly the columns of their own calls (no conversion needed)."""
    if ONCE:
        decision_bytes = keep_bytes_once(seed, call_counter, threshold)
    else:
        decision_bytes = keep_bytes(seed, call_counter, threshold)
    return unpack_groups(decision_bytes)
