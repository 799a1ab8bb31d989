"""Fused multi-head attention (flash-attention manner) with Philox dropout, for any tensor layout.

The operator found by the fusion pass, over named dims b (batch), h (head), j (query position),
k (key position), p (head dim):

    S[b,h,j,k] = scale * sum_p Q[b,h,j,p] K[b,h,k,p]
    S          = -inf where masked (causal: k > j; key padding: key_padding_mask[b,k] is True)
    P          = softmax_k(S)
    P~         = P * keep[b,h,j,k] * dropout_scale(dropout_p)   (1 / (1 - dropout_p), p rounded to 1/256)
    O[b,h,j,p] = sum_k P~[b,h,j,k] V[b,h,k,p]

The forward pass streams K/V blocks through an online softmax; P never reaches memory. It saves
the logsumexp ``lse[b,h,j] = log sum_k exp(S)`` (float32, natural log) for the backward pass,
which recomputes P from Q, K and lse. Backward: a preprocess kernel (delta = rowsum(dO * O)), a
kernel over key blocks for dK and dV that also adds dQ with fp32 atomics into a zeroed buffer, the
last of a head's key blocks to finish writing the head's dQ in dQ's dtype and layout (an arrival
counter per (b, h): no separate cast kernel; "atomic"), or a second kernel over query blocks for
dQ ("split"). Every kernel computes score tiles (j, k), rows j: the
dropout decisions of a Philox call then lie in the accumulator columns of the thread that draws
it (module doc below); the dK/dV kernel feeds P~ and dS to its MMAs transposed.

Grouped-query attention (GQA, Llama's K/V heads shared by G query heads each): K and V (and dK,
dV) are over H / G heads, query head h reading K/V head h // G (the kernels' ``GROUPS``; the
launchers take it from the shapes, k and v (b, h / G, k, p), and check ``groups`` where given);
the K/V tensors are read in place, never repeated over the query heads.  O, lse, dO, dQ, delta and
the dropout mask stay over the query heads (b, h, j, k), indexed as without groups.  Backward:
one dK/dV program per block of one K/V head's keys (grid: key blocks x b * H / G) runs its
group's G query heads in turn, in head order, through its loop over query blocks, summing into
one fp32 dK and dV accumulator (deterministic, no atomics, no per-query-head dK/dV buffer to sum
afterwards: FlashAttention-2 writes dK/dV per query head and sums them in a second pass; here
the group's sum never leaves the registers, and K and V are loaded once per group); with dQ
"atomic" each query head's dQ is written by the last key block to finish that head (its arrival
counter), as without groups; the dQ kernel ("split") runs per query head, reading K/V head h // G.
The forward and the dQ kernel are unchanged but for the K/V head's index; with G = 1 every kernel
compiles to the code it compiled to before groups existed.  Biases (below) are refused with G > 1.

Layouts: every tensor is addressed through one stride per named dim, so any permuted storage
(``(b,h,j,p)``, BERT's ``(b,j,h,p)`` = ``[B, L, H*P]`` view, the paper's ``(p,h,b,j)``) works
without copies. The launchers take torch tensors whose ``.shape`` is the logical order
(b, h, j, p) / (b, h, k, p) (pass permuted views) and read ``.stride()``.

Dropout convention (``kernels.philox`` / ``dataflow.dropout_mask``): the probability at logical
position (b, h, j, k) has logical index ``n = b*sb + h*sh + j*sj + k*sk``, where (sb, sh, sj, sk)
are the row-major strides of the probabilities' dims in their spec order (``dropout_strides_for``);
it is kept iff the convention's 8-bit value of counter ``g = offset + n`` (``g = 64 G + 8 i + 2 t + e``:
byte ``2 i + e`` of Philox call ``4 G + t``) is ``>= keep_threshold(dropout_p)``, and kept ones are
scaled by ``dropout_scale(dropout_p)``.  Where k is the mask's last logical letter and every row
starts a group of 64 counters (``dropout_grouped``: the offset and the strides of b, h, j multiples
of 64, e.g. BERT's (h, b, j, k) and (b, h, j, k) masks with L % 64 == 0) and the key blocks are
whole groups (block_k % 64 == 0), the kernels draw one Philox call per sixteen keys, each in the
thread whose accumulator columns it decides (``kernels.philox.dropout_keep_grouped``); elsewhere
one call per element (``kernels.philox.dropout_keep``).

How the backward gets the mask is the knob ``dropout_mask`` of its configuration
(``attention_configs``, ``attention_backward``, ``fused_attention``'s ``backward_config``):

- "regenerate" (the default): the backward saves nothing and reads nothing; every kernel that
  needs the mask draws it again from (seed, offset): the dK/dV kernel, and with dQ "split" the
  dQ kernel too.
- "saved": the forward writes the decisions, 16 bits per Philox call: int16 (b, h, j, k // 16)
  contiguous, bit ``2 i + e`` of [b, h, j, c] = the decision of key ``64 (c // 4) + 8 i + 2 (c % 4) + e``
  (``new_saved_mask``; 1/8 byte per probability; blocks a causal forward skips stay unwritten and
  are never read unmasked), and the backward kernels read it instead of drawing.  Only where the
  layout lets the kernels draw one call per sixteen keys (elsewhere nothing is saved and the backward draws the mask,
  as "regenerate"), and only with key blocks of whole groups (block_k % 64 == 0) on both sides.

Fully masked rows (every key padded) give O = 0, zero gradients and lse = +inf.

Biases (``bias=(bq, bv)``, each (h, p)): the attention over q + bq, k + bk and v + bv, the bias
add before it (BERT's Q/K/V) folded in.  The forward forms q + bq as it loads q, rounded to q's
dtype as a bias-add kernel would store it, and writes it out (``q_biased``) for the backward, which
reads it as its q: the dK/dV kernel's q tiles then go from their pipelined loads straight into its
MMAs (adding bq to each tile there made the backward 18% slower at BERT-large B=8 L=512 on the
H200).  k's bias needs no argument: it adds (q_j + bq) . bk to every score of row j, which the
softmax cancels, and dQ = dS (k + bk) = dS k since each row of dS sums to 0 (leaving it out also
keeps dQ clear of that sum's rounding times bk); lse is then the one of the scores without it,
which only the backward reads.  v's bias (``v_bias`` in the backward): the forward adds
(sum_k P~) bv to O once after its loop (fp32); dP~ = dO (v + bv)^T takes v + bv formed once per
key block in the dK/dV kernel (rounded to v's dtype) and the row term dO_j . bv (fp32) in the dQ
kernel.

Arithmetic: fp16/bf16 (or fp32, TF32 dots on GPU) operands, fp32 accumulation and statistics;
the softmax runs in base 2 with log2(e) folded into the scale.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from datamove.dataflow.dropout_mask import DECISION_GROUP
from datamove.kernels.interpreter import interpreted
from datamove.kernels import philox
from datamove.kernels.device import source_id
from datamove.kernels.launch import ceil_div, launch
from datamove.kernels.philox import dropout_keep, dropout_keep_grouped, dropout_scale, keep_bits, keep_threshold, unpack_grouped

LOG2E = 1.4426950408889634
KERNEL_ID = source_id(__file__, philox.__file__)  # the kernels' source version: a timing holds for it
DROPOUT_MASK_OPTIONS = ("regenerate", "saved")  # how the backward gets the dropout mask (module doc)
KEYS_SCANNED = tl.constexpr(1024)  # padding-mask entries ``_keys_kept`` reads per load


@triton.jit
def _row_counters(b, h, rows, offset, drop_sb, drop_sh, drop_srow, INDEX_64: tl.constexpr, GROUPED: tl.constexpr):
    """Dropout counter (offset + logical index) of each row's element at column 0; with GROUPED the
    first Philox call counter of that element's group (counter // 16 = 4 G: the counter starts group G of 64)."""
    if INDEX_64:
        g = offset + b * drop_sb + h * drop_sh + rows.to(tl.int64) * drop_srow
    else:
        g = offset + b.to(tl.int32) * drop_sb + h.to(tl.int32) * drop_sh + rows * drop_srow
    if GROUPED:
        g = g >> 4
    return g


@triton.jit
def _keep_block(seed, threshold, row_counter, col_start, drop_scol, mask_ptr, mask_rows, Lk,
                BLOCK_C: tl.constexpr, GROUPED: tl.constexpr, MASK_IO: tl.constexpr):
    """Boolean [R, BLOCK_C] keep block of the rows with dropout counters ``row_counter`` ([R],
    ``_row_counters``) and the keys col_start .. col_start + BLOCK_C - 1 (logical stride
    ``drop_scol``). GROUPED (``dropout_grouped``; drop_scol == 1, col_start and BLOCK_C multiples of 64):
    one Philox call per sixteen keys; ``MASK_IO`` 1 also writes their bits to the saved mask, 2 reads
    the bits from it instead of drawing (``mask_rows``: [R] int64 row indices into it, -1 for rows
    outside the mask). Else one call per element."""
    if GROUPED:
        calls = col_start // 16 + tl.arange(0, BLOCK_C // 16)
        io_ptrs = mask_ptr + mask_rows[:, None] * (Lk // 16) + calls[None, :]
        io_ok = (mask_rows >= 0)[:, None] & (calls < Lk // 16)[None, :]
        if MASK_IO == 2:
            keep = unpack_grouped(tl.load(io_ptrs, mask=io_ok, other=0).to(tl.uint16, bitcast=True))
        elif MASK_IO == 1:  # the bits stored, and unpacked in the accumulator's layout
            bits = keep_bits(seed, row_counter[:, None] + calls[None, :], threshold)
            tl.store(io_ptrs, bits.to(tl.int16, bitcast=True), mask=io_ok)
            keep = unpack_grouped(bits)
        else:  # in the accumulator's layout each thread draws the calls of its own columns
            keep = dropout_keep_grouped(seed, row_counter[:, None] + calls[None, :], threshold)
    else:
        cols = (col_start + tl.arange(0, BLOCK_C)).to(row_counter.dtype) * drop_scol
        keep = dropout_keep(seed, 0, row_counter[:, None] + cols[None, :], threshold)
    return keep


@triton.jit
def _head_rows(x_ptr, stride_xb, stride_xh, stride_xr, stride_xp, H, L, BLOCK: tl.constexpr, P: tl.constexpr,
               LONGEST_FIRST: tl.constexpr):
    """The program's (b, h) and block of rows (grid: row blocks x b*h) of a (b, h, row, p) tensor
    with L rows (query rows j, or key rows k): ``(pid, pid_bh, b, h, offs, offs_p, row_ok, x)``, x
    the [BLOCK, P] tile at ``x_ptr`` (zeros beyond L).

    ``LONGEST_FIRST``: 0, blocks in grid order; else the causal mask's work per row block grows
    with the block (1: query rows, which see more keys the later they are) or shrinks (-1: key
    rows): the programs, started in launch order (grid dim 0 fastest), take the row blocks longest
    first, every head's alike, so the short ones fill the last wave instead of a long one
    running alone at the end."""
    if LONGEST_FIRST == 0:
        pid = tl.program_id(0)
        pid_bh = tl.program_id(1)
    else:
        heads = tl.num_programs(1)
        rank = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)  # launch order
        pid_bh = rank % heads
        pid = rank // heads
        if LONGEST_FIRST > 0:
            pid = tl.num_programs(0) - 1 - pid
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    offs_p = tl.arange(0, P)
    row_ok = offs < L
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + offs[:, None] * stride_xr + offs_p[None, :] * stride_xp,
                mask=row_ok[:, None], other=0.0)
    return pid, pid_bh, b, h, offs, offs_p, row_ok, x


@triton.jit
def _store_rows(x_ptr, stride_xb, stride_xh, stride_xr, stride_xp, b, h, offs, offs_p, row_ok, x):
    """Store the fp32 [BLOCK, P] tile ``x`` of rows ``offs`` of head (b, h) into a (b, h, row, p)
    tensor of any strides, in its dtype; rows beyond the end (``row_ok`` False) untouched. The
    counterpart of ``_head_rows``'s load."""
    tl.store(x_ptr + b * stride_xb + h * stride_xh + offs[:, None] * stride_xr + offs_p[None, :] * stride_xp,
             x.to(x_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _head_bias(b_ptr, h, stride_bh, stride_bp, offs_p):
    """Head h's bias [P] (an (h, p) tensor of any strides), fp32."""
    return tl.load(b_ptr + h * stride_bh + offs_p * stride_bp).to(tl.float32)


@triton.jit
def _biased(x, bias):
    """``x`` (a [rows, P] tile) plus ``bias`` [P] (fp32), rounded to x's dtype (as a separate
    bias-add kernel stores it)."""
    return (x.to(tl.float32) + bias[None, :]).to(x.dtype)


@triton.jit
def _dq_acc_rows(dq_acc_ptr, stat_base, offs_j, offs_p, P: tl.constexpr):
    """[J, P] pointers to rows ``offs_j`` of one head in the fp32 dQ accumulator, (b, h, j, p)
    contiguous; ``stat_base`` = (b * H + h) * Lq, the head's first row."""
    return dq_acc_ptr + (stat_base + offs_j[:, None]) * P + offs_p[None, :]


@triton.jit
def _dropout_rows(b, h, offs_j, row_ok, stat_base, offset, drop_sb, drop_sh, drop_sj,
                  INDEX_64: tl.constexpr, GROUPED: tl.constexpr):
    """(``_row_counters`` of the rows ``offs_j``, their row indices into a saved mask: ``stat_base``
    (= (b * H + h) * Lq) + j, -1 beyond Lq), what ``_keep_block`` takes."""
    drop_row = _row_counters(b, h, offs_j, offset, drop_sb, drop_sh, drop_sj, INDEX_64, GROUPED)
    return drop_row, tl.where(row_ok, stat_base + offs_j, -1)


@triton.jit
def _keys_kept(kpm_ptr, b, stride_mb, stride_mk, Lk):
    """1 + the last key of batch b that the padding mask keeps (0 where it keeps none): the keys
    after it are masked for every query, so their blocks are skipped (their probabilities, and
    every gradient through them, are exactly 0).  Read ``KEYS_SCANNED`` keys at a time (one load
    up to that length: a loop of short loads at every program's start took what the skipped
    blocks saved)."""
    last = tl.zeros([], tl.int32) - 1
    for start in range(0, Lk, KEYS_SCANNED):
        offs = start + tl.arange(0, KEYS_SCANNED)
        pad = tl.load(kpm_ptr + b * stride_mb + offs * stride_mk, mask=offs < Lk, other=1)
        last = tl.maximum(last, tl.max(tl.where(pad == 0, offs, -1), 0))
    return last + 1


@triton.jit
def _visible(valid, b, offs_j, offs_k, kpm_ptr, stride_mb, stride_mk, Lk, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr):
    """``valid`` ([J, K] bool) narrowed to the scores a query row j may see of key k: k <= j if
    CAUSAL, keys the padding mask keeps if HAS_KPM."""
    if CAUSAL:
        valid = valid & (offs_k[None, :] <= offs_j[:, None])
    if HAS_KPM:
        pad = tl.load(kpm_ptr + b * stride_mb + offs_k * stride_mk, mask=offs_k < Lk, other=1)
        valid = valid & (pad == 0)[None, :]
    return valid


@triton.jit
def _attn_fwd_kernel(
    q_ptr,  # (b, h, j, p) any strides
    k_ptr,  # (b, h // GROUPS, k, p) any strides: K/V head h // GROUPS serves query head h
    v_ptr,  # (b, h // GROUPS, k, p) any strides
    o_ptr,  # (b, h, j, p) any strides
    lse_ptr,  # (b, h, j) float32, contiguous
    kpm_ptr,  # (b, k) uint8, nonzero = padded key (unused unless HAS_KPM)
    mask_ptr,  # (b, h, j, k // 16) int16 contiguous: the saved mask, written if MASK_IO == 1
    bq_ptr, bv_ptr,  # (h, p) any strides: the biases of q and v (unused unless HAS_BIAS; module doc: k's needs none)
    qb_ptr,  # (b, h, j, p) any strides: q + bq written for the backward (unused unless HAS_BIAS)
    stride_qb, stride_qh, stride_qj, stride_qp,
    stride_kb, stride_kh, stride_kk, stride_kp,
    stride_vb, stride_vh, stride_vk, stride_vp,
    stride_ob, stride_oh, stride_oj, stride_op,
    stride_mb, stride_mk,
    stride_bqh, stride_bqp, stride_bvh, stride_bvp,
    stride_qbb, stride_qbh, stride_qbj, stride_qbp,
    drop_sb, drop_sh, drop_sj, drop_sk,  # logical strides of (b, h, j, k) for the dropout index
    H, Lq, Lk,
    qk_scale,  # scale * log2(e)
    drop_threshold, dropout_scale, seed, offset,  # keep_threshold(dropout_p), dropout_scale(dropout_p)
    P: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, INDEX_64: tl.constexpr,
    GROUPED: tl.constexpr, MASK_IO: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUPS: tl.constexpr,  # query heads per K/V head (grouped-query attention; 1: one K/V head each)
):
    pid_j, pid_bh, b, h, offs_j, offs_p, row_ok, q = _head_rows(q_ptr, stride_qb, stride_qh, stride_qj, stride_qp,
                                                                 H, Lq, BLOCK_J, P, 1 if CAUSAL else 0)
    if HAS_BIAS:
        q = _biased(q, _head_bias(bq_ptr, h, stride_bqh, stride_bqp, offs_p))
        _store_rows(qb_ptr, stride_qbb, stride_qbh, stride_qbj, stride_qbp, b, h, offs_j, offs_p, row_ok, q)
    k_base = k_ptr + b * stride_kb + (h // GROUPS) * stride_kh
    v_base = v_ptr + b * stride_vb + (h // GROUPS) * stride_vh
    if HAS_DROPOUT:
        drop_row, mask_rows = _dropout_rows(b, h, offs_j, row_ok, pid_bh.to(tl.int64) * Lq, offset, drop_sb, drop_sh,
                                            drop_sj, INDEX_64, GROUPED)

    m_i = tl.full([BLOCK_J], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_J], tl.float32)
    kept_i = tl.zeros([BLOCK_J], tl.float32)  # with HAS_BIAS and HAS_DROPOUT: the kept probabilities' sum, as l_i
    acc = tl.zeros([BLOCK_J, P], tl.float32)
    k_end = Lk
    if CAUSAL:
        k_end = tl.minimum(Lk, (pid_j + 1) * BLOCK_J)
    if HAS_KPM:
        k_end = tl.minimum(k_end, _keys_kept(kpm_ptr, b, stride_mb, stride_mk, Lk))
    for start_k in range(0, k_end, BLOCK_K):
        offs_k = start_k + tl.arange(0, BLOCK_K)
        col_ok = offs_k < Lk
        kt = tl.load(k_base + offs_k[None, :] * stride_kk + offs_p[:, None] * stride_kp, mask=col_ok[None, :], other=0.0)
        s = tl.dot(q, kt) * qk_scale  # (j, k), log2 units
        if CAUSAL or HAS_KPM or not EVEN_K:
            valid = _visible(col_ok[None, :], b, offs_j, offs_k, kpm_ptr, stride_mb, stride_mk, Lk, CAUSAL, HAS_KPM)
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
        if HAS_KPM:  # a row whose keys so far are all padded keeps m = -inf; shift it by 0 instead
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            keep = _keep_block(seed, drop_threshold, drop_row, start_k, drop_sk, mask_ptr, mask_rows, Lk,
                               BLOCK_K, GROUPED, MASK_IO)
            p = tl.where(keep, p, 0.0)
            if HAS_BIAS:
                kept_i = kept_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_k[:, None] * stride_vk + offs_p[None, :] * stride_vp, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    if HAS_BIAS:  # sum_k p_jk (v_k + bv) = sum_k p_jk v_k + (sum_k p_jk) bv: v's bias once, after the loop
        if not HAS_DROPOUT:
            kept_i = l_i
        acc += kept_i[:, None] * _head_bias(bv_ptr, h, stride_bvh, stride_bvp, offs_p)[None, :]
    empty = l_i == 0.0  # only for fully padded rows
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc * (dropout_scale / l_safe)[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    _store_rows(o_ptr, stride_ob, stride_oh, stride_oj, stride_op, b, h, offs_j, offs_p, row_ok, o)
    tl.store(lse_ptr + pid_bh.to(tl.int64) * Lq + offs_j, lse, mask=row_ok)


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr,  # (b, h, j, p) any strides
    do_ptr,  # (b, h, j, p) any strides
    delta_ptr,  # (b, h, j) float32, contiguous: rowsum(dO * O)
    dq_acc_ptr,  # (b, h, j, p) float32, contiguous: zeroed here (unused unless ZERO_DQ)
    arrivals_ptr,  # (b, h) int32, contiguous: zeroed here (unused unless ZERO_DQ)
    stride_ob, stride_oh, stride_oj, stride_op,
    stride_dob, stride_doh, stride_doj, stride_dop,
    H, Lq,
    P: tl.constexpr, BLOCK_J: tl.constexpr, ZERO_DQ: tl.constexpr,
):
    pid_j, pid_bh, b, h, offs_j, offs_p, row_ok, o = _head_rows(o_ptr, stride_ob, stride_oh, stride_oj, stride_op,
                                                                 H, Lq, BLOCK_J, P, 0)
    do = tl.load(do_ptr + b * stride_dob + h * stride_doh + offs_j[:, None] * stride_doj + offs_p[None, :] * stride_dop,
                 mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + pid_bh.to(tl.int64) * Lq + offs_j, delta, mask=row_ok)
    if ZERO_DQ:
        tl.store(_dq_acc_rows(dq_acc_ptr, pid_bh.to(tl.int64) * Lq, offs_j, offs_p, P), tl.zeros([BLOCK_J, P], tl.float32),
                 mask=row_ok[:, None])
        if pid_j == 0:
            tl.store(arrivals_ptr + pid_bh, 0)


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr,  # (b, h, j, p) any strides
    k_ptr,  # (b, h // GROUPS, k, p) any strides
    v_ptr,  # (b, h // GROUPS, k, p) any strides
    do_ptr,  # (b, h, j, p) any strides
    lse_ptr,  # (b, h, j) float32, contiguous
    delta_ptr,  # (b, h, j) float32, contiguous
    dq_acc_ptr,  # (b, h, j, p) float32, contiguous, zeroed: dQ accumulated atomically (unused unless DQ_ATOMIC)
    arrivals_ptr,  # (b, h) int32, contiguous, zeroed: key blocks done with the head (unused unless DQ_ATOMIC)
    dq_ptr,  # (b, h, j, p) any strides: dQ, written by the head's last key block (unused unless DQ_ATOMIC)
    dk_ptr,  # (b, h // GROUPS, k, p) any strides
    dv_ptr,  # (b, h // GROUPS, k, p) any strides
    kpm_ptr,  # (b, k) uint8, nonzero = padded key (unused unless HAS_KPM)
    mask_ptr,  # (b, h, j, k // 16) int16 contiguous: the saved mask, read if MASK_IO == 2
    bv_ptr,  # (h, p) any strides: v's bias (unused unless HAS_BIAS; q is the forward's q + bq: module doc)
    stride_qb, stride_qh, stride_qj, stride_qp,
    stride_kb, stride_kh, stride_kk, stride_kp,
    stride_vb, stride_vh, stride_vk, stride_vp,
    stride_dob, stride_doh, stride_doj, stride_dop,
    stride_dkb, stride_dkh, stride_dkk, stride_dkp,
    stride_dvb, stride_dvh, stride_dvk, stride_dvp,
    stride_dqb, stride_dqh, stride_dqj, stride_dqp,
    stride_mb, stride_mk,
    stride_bvh, stride_bvp,
    drop_sb, drop_sh, drop_sj, drop_sk,
    H, Lq, Lk,
    scale, qk_scale,  # scale, scale * log2(e)
    drop_threshold, dropout_scale, seed, offset,  # keep_threshold(dropout_p), dropout_scale(dropout_p)
    P: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, INDEX_64: tl.constexpr,
    GROUPED: tl.constexpr, MASK_IO: tl.constexpr, EVEN: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPS: tl.constexpr,  # query heads per K/V head: a program runs the GROUPS query heads of its K/V head in turn
):
    # grid: key blocks x b * (H // GROUPS): one program per block of one K/V head's keys
    pid_k, pid_bkv, b, kv, offs_k, offs_p, col_ok, k = _head_rows(k_ptr, stride_kb, stride_kh, stride_kk, stride_kp,
                                                                  H // GROUPS, Lk, BLOCK_K, P, -1 if CAUSAL else 0)
    key_ok = col_ok
    if HAS_KPM:
        pad = tl.load(kpm_ptr + b * stride_mb + offs_k * stride_mk, mask=col_ok, other=1)
        key_ok = key_ok & (pad == 0)
    v = tl.load(v_ptr + b * stride_vb + kv * stride_vh + offs_k[:, None] * stride_vk + offs_p[None, :] * stride_vp,
                mask=col_ok[:, None], other=0.0)
    if HAS_BIAS:  # GROUPS == 1 (the launcher refuses biases with grouped heads)
        v = _biased(v, _head_bias(bv_ptr, kv, stride_bvh, stride_bvp, offs_p))
    dk = tl.zeros([BLOCK_K, P], tl.float32)
    dv = tl.zeros([BLOCK_K, P], tl.float32)
    j_start = 0
    if CAUSAL:  # rows j < k see none of this block's keys
        j_start = (pid_k * BLOCK_K) // BLOCK_J * BLOCK_J
    j_end = Lq
    if HAS_KPM:  # a block of keys the padding mask drops for every query: dK = dV = 0
        j_end = tl.where(pid_k * BLOCK_K < _keys_kept(kpm_ptr, b, stride_mb, stride_mk, Lk), Lq, j_start)
    # dK, dV sum over the group's query heads in a fixed order (deterministic, no atomics): each
    # query head's rows in turn, into the same fp32 accumulators
    for g in range(GROUPS):
        h = kv * GROUPS + g
        q_base = q_ptr + b * stride_qb + h * stride_qh
        do_base = do_ptr + b * stride_dob + h * stride_doh
        stat_base = (b * H + h) * Lq
        for start_j in range(j_start, j_end, BLOCK_J):
            offs_j = start_j + tl.arange(0, BLOCK_J)
            row_ok = offs_j < Lq
            q = tl.load(q_base + offs_j[:, None] * stride_qj + offs_p[None, :] * stride_qp, mask=row_ok[:, None],
                        other=0.0)
            do = tl.load(do_base + offs_j[:, None] * stride_doj + offs_p[None, :] * stride_dop, mask=row_ok[:, None],
                         other=0.0)
            lse2 = tl.load(lse_ptr + stat_base + offs_j, mask=row_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_ptr + stat_base + offs_j, mask=row_ok, other=0.0)
            # (j, k) tiles, as the forward's: the dropout groups lie along the accumulator's columns
            s_jk = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(v))  # dL/dP~ (j, k)
            if HAS_DROPOUT:
                drop_row, mask_rows = _dropout_rows(b, h, offs_j, row_ok, stat_base, offset, drop_sb, drop_sh, drop_sj,
                                                    INDEX_64, GROUPED)
                keep = _keep_block(seed, drop_threshold, drop_row, pid_k * BLOCK_K, drop_sk, mask_ptr, mask_rows, Lk,
                                   BLOCK_K, GROUPED, MASK_IO)
            p = tl.math.exp2(s_jk * qk_scale - lse2[:, None])
            if CAUSAL or HAS_KPM or not EVEN:
                valid = key_ok[None, :] & row_ok[:, None]
                if CAUSAL:
                    valid = valid & (offs_k[None, :] <= offs_j[:, None])
                p = tl.where(valid, p, 0.0)
            if HAS_DROPOUT:
                dv += tl.dot(tl.trans(tl.where(keep, p, 0.0).to(do.dtype)), do)
                dp = tl.where(keep, dp * dropout_scale, 0.0)
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            ds = (p * (dp - delta[:, None])).to(q.dtype)  # dL/dS (j, k), without the scale
            dk += tl.dot(tl.trans(ds), q)
            if DQ_ATOMIC:
                dq = tl.dot(ds, k) * scale
                tl.atomic_add(_dq_acc_rows(dq_acc_ptr, stat_base, offs_j, offs_p, P), dq, mask=row_ok[:, None],
                              sem="relaxed")
        if DQ_ATOMIC and GROUPS > 1:  # done with query head h (GROUPS == 1: after dK and dV are stored, below)
            _dq_arrive(dq_acc_ptr, arrivals_ptr, dq_ptr, stride_dqb, stride_dqh, stride_dqj, stride_dqp, b, h, stat_base,
                       offs_p, H, Lq, P, BLOCK_J)

    _store_rows(dk_ptr, stride_dkb, stride_dkh, stride_dkk, stride_dkp, b, kv, offs_k, offs_p, col_ok, dk * scale)
    _store_rows(dv_ptr, stride_dvb, stride_dvh, stride_dvk, stride_dvp, b, kv, offs_k, offs_p, col_ok, dv * dropout_scale)
    if DQ_ATOMIC and GROUPS == 1:
        _dq_arrive(dq_acc_ptr, arrivals_ptr, dq_ptr, stride_dqb, stride_dqh, stride_dqj, stride_dqp, b, kv,
                   (b * H + kv) * Lq, offs_p, H, Lq, P, BLOCK_J)


@triton.jit
def _dq_arrive(dq_acc_ptr, arrivals_ptr, dq_ptr, stride_dqb, stride_dqh, stride_dqj, stride_dqp, b, h, stat_base, offs_p,
               H, Lq, P: tl.constexpr, BLOCK_J: tl.constexpr):
    """A dK/dV program is done adding to query head h's dQ accumulator (rows from ``stat_base`` =
    (b * H + h) * Lq): the head's last key block to arrive writes the head's dQ."""
    tl.debug_barrier()  # every thread's adds precede the release below
    arrived = tl.atomic_add(arrivals_ptr + b * H + h, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        for start_j in range(0, Lq, BLOCK_J):
            offs_j = start_j + tl.arange(0, BLOCK_J)
            row_ok = offs_j < Lq
            dq = tl.load(_dq_acc_rows(dq_acc_ptr, stat_base, offs_j, offs_p, P), mask=row_ok[:, None], other=0.0,
                         cache_modifier=".cg")
            _store_rows(dq_ptr, stride_dqb, stride_dqh, stride_dqj, stride_dqp, b, h, offs_j, offs_p, row_ok, dq)


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr,  # (b, h, j, p) any strides
    k_ptr,  # (b, h, k, p) any strides
    v_ptr,  # (b, h, k, p) any strides
    do_ptr,  # (b, h, j, p) any strides
    lse_ptr,  # (b, h, j) float32, contiguous
    delta_ptr,  # (b, h, j) float32, contiguous
    dq_ptr,  # (b, h, j, p) any strides
    kpm_ptr,  # (b, k) uint8, nonzero = padded key (unused unless HAS_KPM)
    mask_ptr,  # (b, h, j, k // 16) int16 contiguous: the saved mask, read if MASK_IO == 2
    bv_ptr,  # (h, p) any strides: v's bias (unused unless HAS_BIAS; q is the forward's q + bq: module doc)
    stride_qb, stride_qh, stride_qj, stride_qp,
    stride_kb, stride_kh, stride_kk, stride_kp,
    stride_vb, stride_vh, stride_vk, stride_vp,
    stride_dob, stride_doh, stride_doj, stride_dop,
    stride_dqb, stride_dqh, stride_dqj, stride_dqp,
    stride_mb, stride_mk,
    stride_bvh, stride_bvp,
    drop_sb, drop_sh, drop_sj, drop_sk,
    H, Lq, Lk,
    scale, qk_scale,
    drop_threshold, dropout_scale, seed, offset,  # keep_threshold(dropout_p), dropout_scale(dropout_p)
    P: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, INDEX_64: tl.constexpr,
    GROUPED: tl.constexpr, MASK_IO: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUPS: tl.constexpr,  # query heads per K/V head
):
    pid_j, pid_bh, b, h, offs_j, offs_p, row_ok, q = _head_rows(q_ptr, stride_qb, stride_qh, stride_qj, stride_qp,
                                                                 H, Lq, BLOCK_J, P, 1 if CAUSAL else 0)
    do = tl.load(do_ptr + b * stride_dob + h * stride_doh + offs_j[:, None] * stride_doj + offs_p[None, :] * stride_dop,
                 mask=row_ok[:, None], other=0.0)
    if HAS_BIAS:  # do_j . (v_k + bv) = do_j . v_k + do_j . bv: v's bias as one term per row
        do_bv = tl.sum(do.to(tl.float32) * _head_bias(bv_ptr, h, stride_bvh, stride_bvp, offs_p)[None, :], 1)
    lse2 = tl.load(lse_ptr + pid_bh.to(tl.int64) * Lq + offs_j, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + pid_bh.to(tl.int64) * Lq + offs_j, mask=row_ok, other=0.0)
    k_base = k_ptr + b * stride_kb + (h // GROUPS) * stride_kh
    v_base = v_ptr + b * stride_vb + (h // GROUPS) * stride_vh
    if HAS_DROPOUT:
        drop_row, mask_rows = _dropout_rows(b, h, offs_j, row_ok, pid_bh.to(tl.int64) * Lq, offset, drop_sb, drop_sh,
                                            drop_sj, INDEX_64, GROUPED)

    dq = tl.zeros([BLOCK_J, P], tl.float32)
    k_end = Lk
    if CAUSAL:
        k_end = tl.minimum(Lk, (pid_j + 1) * BLOCK_J)
    if HAS_KPM:
        k_end = tl.minimum(k_end, _keys_kept(kpm_ptr, b, stride_mb, stride_mk, Lk))
    for start_k in range(0, k_end, BLOCK_K):
        offs_k = start_k + tl.arange(0, BLOCK_K)
        col_ok = offs_k < Lk
        k = tl.load(k_base + offs_k[:, None] * stride_kk + offs_p[None, :] * stride_kp, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + offs_k[:, None] * stride_vk + offs_p[None, :] * stride_vp, mask=col_ok[:, None], other=0.0)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if CAUSAL or HAS_KPM or not EVEN:
            valid = _visible(col_ok[None, :] & row_ok[:, None], b, offs_j, offs_k, kpm_ptr, stride_mb, stride_mk, Lk,
                             CAUSAL, HAS_KPM)
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v))  # dL/dP~ (j, k)
        if HAS_BIAS:
            dp += do_bv[:, None]
        if HAS_DROPOUT:
            keep = _keep_block(seed, drop_threshold, drop_row, start_k, drop_sk, mask_ptr, mask_rows, Lk,
                               BLOCK_K, GROUPED, MASK_IO)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq += tl.dot(ds, k)

    _store_rows(dq_ptr, stride_dqb, stride_dqh, stride_dqj, stride_dqp, b, h, offs_j, offs_p, row_ok, dq * scale)


# ----------------------------------------------------------------------------------------------
# knobs

def _max_shared_memory() -> int:
    device = torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def attention_configs(head_dim: int, direction: str, *, interpret: bool | None = None) -> list[dict]:
    """Valid knob configurations of the ``direction`` ("forward" or "backward") kernels.

    Each is a dict of ``block_j``, ``block_k`` (rows of the j / k tiles), ``num_warps``,
    ``num_stages`` and, for "backward", ``dq_mode`` ("atomic": one kernel over k-blocks that also
    adds dQ with fp32 atomics; "split": a second kernel over j-blocks computes dQ) and
    ``dropout_mask`` (``DROPOUT_MASK_OPTIONS``: "regenerate" or "saved", see the module doc). On a GPU the
    list keeps tiles whose pipelined operand buffers fit the device's shared memory and whose fp32
    tiles fit the registers (per thread: at most 64 score-tile elements, at most 64 forward / 128
    backward accumulator elements; beyond them ptxas spills), with 4 or 8 warps for 64-row tiles
    (8: each thread holds half as much of the tiles, e.g. the Philox state) and 8 for 128-row ones; in the Triton interpreter (no GPU) warps and stages
    mean nothing and the list holds small tiles.
    """
    _check_head_dim(head_dim)
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', not {direction!r}")
    interpret = interpreted() if interpret is None else interpret
    dq_modes = ("atomic", "split") if direction == "backward" else (None,)
    if interpret:
        tiles = [(bj, bk, 4, 1, mode) for bj in (16, 32, 64) for bk in (16, 32, 64) for mode in dq_modes]
    else:
        smem = _max_shared_memory()
        tiles = []
        for bj, bk in ((64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128)) if direction == "forward" else \
                ((32, 32), (32, 64), (64, 64), (32, 128), (64, 128)):
            rows = bj if direction == "forward" else bk
            for warps, stages, mode in [(w, s, m) for w in ((4, 8) if rows <= 64 else (8,)) for s in (2, 3)
                                        for m in dq_modes]:
                threads = 32 * warps
                if direction == "forward":
                    buffers = 2 * (bj * head_dim + stages * 2 * bk * head_dim + bj * bk)  # Q, staged K, V, P~
                    fits = bj * bk // threads <= 64 and bj * head_dim // threads <= 64  # S tile, O accumulator
                else:
                    buffers = 2 * (2 * bk * head_dim + stages * 2 * bj * head_dim + bj * bk)  # K, V, staged Q, dO, dS
                    if mode == "split":  # the dQ kernel: Q, dO, staged K, V, dS
                        buffers = max(buffers, 2 * (2 * bj * head_dim + stages * 2 * bk * head_dim + bj * bk))
                    fits = bj * bk // threads <= 32 and 2 * bk * head_dim // threads <= 128  # S, dP; dK, dV
                if fits and buffers <= smem and not _miscompiled(head_dim, bj, mode):
                    tiles.append((bj, bk, warps, stages, mode))
    configs = []
    for bj, bk, warps, stages, mode in tiles:
        config = dict(block_j=bj, block_k=bk, num_warps=warps, num_stages=stages)
        if mode is None:
            configs.append(config)
        else:
            configs += [dict(config, dq_mode=mode, dropout_mask=option) for option in mask_options(bk)]
    return configs


def mask_options(block_k: int) -> tuple:
    """The ``DROPOUT_MASK_OPTIONS`` a kernel with key blocks of ``block_k`` can take: saving (or
    reading) the mask needs whole groups of Philox calls (``block_k % 64 == 0``)."""
    return tuple(o for o in DROPOUT_MASK_OPTIONS if o != "saved" or block_k % DECISION_GROUP == 0)


def _miscompiled(head_dim: int, block_j: int, dq_mode) -> bool:
    """Backward configurations whose compiled dK/dV kernel gives wrong dK on an H200 (triton 3.6,
    session 5 sweep, results/attention.md): head dim 128, 32-row j tiles, dQ "split", the mask
    regenerated. dK's error varied with stages and warps, from 2x the other variants' to 85x; the
    same kernel with the dQ atomics, or reading a saved mask, was right (a compiler fault, not
    isolated yet). Left out of the knob space (with either mask option) rather than offered."""
    return head_dim == 128 and block_j == 32 and dq_mode == "split"


# Defaults: the fastest configurations of benchmarks/attention.py's sweep on an H200
# (results/attention.md, session 5: dropout counters in groups of 64, (j, k) tiles in every kernel,
# the backward regenerating the mask, dQ "atomic" written by each head's last key block).
_GPU_DEFAULTS = {
    "forward": {64: dict(block_j=128, block_k=64, num_warps=8, num_stages=3),
                128: dict(block_j=64, block_k=64, num_warps=4, num_stages=3)},
    "backward": {64: dict(block_j=64, block_k=64, num_warps=4, num_stages=3, dq_mode="atomic",
                          dropout_mask="regenerate"),
                 128: dict(block_j=64, block_k=64, num_warps=4, num_stages=2, dq_mode="split",
                           dropout_mask="regenerate")},
}


def default_config(head_dim: int, direction: str, *, interpret: bool | None = None, groups: int = 1) -> dict:
    """The knob configuration the launchers use when none is given; ``groups``: query heads per K/V
    head (grouped-query attention), where the GPU backward's dQ runs "split" (H200, Llama-3.2-1B's
    attention, B=4 T=2048 H=32 KV=8 E=64 causal: 0.631 ms against 0.728 with the atomic dQ at the
    same tiles, ``benchmarks/results/attention_gqa.md``)."""
    _check_head_dim(head_dim)
    interpret = interpreted() if interpret is None else interpret
    if interpret:
        config = dict(block_j=16, block_k=DECISION_GROUP, num_warps=4, num_stages=1)  # whole groups: saved masks work
        return dict(config, dq_mode="atomic", dropout_mask="regenerate") if direction == "backward" else config
    table = _GPU_DEFAULTS[direction]
    if head_dim in table:
        config = dict(table[head_dim])
    else:
        config = dict(table[64]) if head_dim < 64 else attention_configs(head_dim, direction)[0]
    if direction == "backward" and groups > 1:
        config["dq_mode"] = "split"
    return config


# ----------------------------------------------------------------------------------------------
# launchers

def supported_head_dim(head_dim: int) -> bool:
    """Whether the kernels take heads of ``head_dim`` features: a power of two in [16, 256]."""
    return 16 <= head_dim <= 256 and not head_dim & (head_dim - 1)


def _check_head_dim(head_dim: int) -> None:
    if not supported_head_dim(head_dim):
        raise ValueError(f"head dim {head_dim} unsupported: must be a power of two in [16, 256]")


def dropout_strides_for(order: str, B: int, H: int, Lq: int, Lk: int) -> tuple[int, int, int, int]:
    """Logical strides (sb, sh, sj, sk) of probabilities whose spec order is ``order`` (e.g. "hbjk")."""
    sizes = dict(b=B, h=H, j=Lq, k=Lk)
    if sorted(order) != sorted("bhjk"):
        raise ValueError(f"order {order!r} is not a permutation of 'bhjk'")
    strides, running = {}, 1
    for dim in reversed(order):
        strides[dim] = running
        running *= sizes[dim]
    return strides["b"], strides["h"], strides["j"], strides["k"]


def dropout_grouped(dropout_strides, offset: int) -> bool:
    """Whether the layout lets the kernels draw the mask one Philox call per sixteen keys: k is the
    mask's last logical letter (stride 1) and every row (b, h, j) starts a group of 64 counters (the
    offset and the other logical strides are multiples of 64; then L_k % 64 == 0 too). The kernels
    then do so with key blocks of whole groups (``_block_grouped``). Else one call per element."""
    sb, sh, sj, sk = dropout_strides
    return sk == 1 and all(x % DECISION_GROUP == 0 for x in (offset, sb, sh, sj))


def _block_grouped(grouped: bool, block_k: int, saved_mask) -> bool:
    """Whether a launch with key blocks of ``block_k`` draws one call per sixteen keys (``grouped``:
    the layout allows it); a saved mask needs it."""
    whole = grouped and block_k % DECISION_GROUP == 0
    if saved_mask is not None and not whole:
        raise ValueError(f"a saved dropout mask needs block_k a multiple of {DECISION_GROUP} (whole groups of "
                         f"Philox calls), not {block_k}")
    return whole


def new_saved_mask(q, k, *, dropout_p: float, offset: int = 0, dropout_strides=None):
    """A buffer for ``attention_forward(saved_mask=...)`` and ``attention_backward(dropout_mask=
    "saved", saved_mask=...)``: int16 (b, h, j, k // 16) on q's device, 16 bits per Philox call
    (see the module doc), or None where nothing is saved (dropout_p == 0, or a layout where the
    kernels draw one Philox call per element)."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    drop = tuple(dropout_strides or dropout_strides_for("bhjk", B, H, Lq, Lk))
    if dropout_p == 0.0 or not dropout_grouped(drop, offset):
        return None
    return torch.empty((B, H, Lq, Lk // 16), device=q.device, dtype=torch.int16)


def _bias_args(biases: tuple, q, what: str, groups: int = 1) -> tuple:
    """Kernel arguments of ``biases``: logical (h, p) views of any strides in q's dtype and device
    (module doc: biases), or (None, ...) for none (placeholders, never read).  Not with grouped
    K/V heads (``groups`` > 1)."""
    if biases[0] is None:
        return (q,) * len(biases), (0,) * (2 * len(biases))
    if groups != 1:
        raise ValueError(f"{what}: biases are not taken with grouped K/V heads ({groups} query heads per K/V head)")
    H, P = q.shape[1], q.shape[3]
    if any(b is None or b.shape != (H, P) or b.dtype != q.dtype or b.device != q.device for b in biases):
        raise ValueError(f"{what} must be {'(h, p)' if len(biases) == 1 else 'each (h, p)'}: ({H}, {P}) in {q.dtype} "
                         f"on {q.device}")
    return tuple(biases), tuple(x for b in biases for x in b.stride())


def _prepare(q, k, v, dropout_p, offset, key_padding_mask, dropout_strides, saved_mask, groups):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D logical (b, h, j|k, p) views")
    B, H, Lq, P = q.shape
    KV, Lk = k.shape[1], k.shape[2]
    if k.shape != (B, KV, Lk, P) or v.shape != (B, KV, Lk, P) or Lq == 0 or Lk == 0 or KV == 0 or H % KV:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match (k and v: "
                         f"(b, h / groups, k, p) for a whole number of groups)")
    if groups is not None and groups != H // KV:
        raise ValueError(f"groups={groups}: q has {H} heads and k, v {KV}, so {H // KV} query heads share each K/V head")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError("q, k, v must share one dtype out of float16, bfloat16, float32")
    _check_head_dim(P)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p {dropout_p} outside [0, 1)")
    if key_padding_mask is None:
        kpm, kpm_strides = q, (0, 0)  # placeholder pointer, never read
    else:
        if key_padding_mask.shape != (B, Lk) or key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be bool of shape ({B}, {Lk})")
        kpm = key_padding_mask.view(torch.uint8)
        kpm_strides = kpm.stride()
    drop = tuple(dropout_strides or dropout_strides_for("bhjk", B, H, Lq, Lk))
    grouped = dropout_p > 0.0 and dropout_grouped(drop, offset)
    if saved_mask is not None and (not grouped or saved_mask.shape != (B, H, Lq, Lk // 16)
                                   or saved_mask.dtype != torch.int16 or not saved_mask.is_contiguous()):
        raise ValueError("saved_mask must come from new_saved_mask with the same arguments")
    last = offset + sum((n - 1) * s for n, s in zip((B, H, Lq, Lk), drop))
    return B, H, Lq, Lk, P, H // KV, kpm, kpm_strides, drop, grouped, last >= 2**31


def attention_forward(q, k, v, *, scale: float, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                      causal: bool = False, key_padding_mask=None, dropout_strides=None, o=None, saved_mask=None,
                      bias=None, q_biased=None, groups=None, block_j=None, block_k=None, num_warps=None,
                      num_stages=None):
    """Forward pass. ``q``: (b, h, j, p), ``k``, ``v``: (b, h / G, k, p) logical views of any strides:
    with G > 1 (grouped-query attention), query head h attends over K/V head h // G; ``groups``
    (optional) states G, checked against the shapes.

    ``key_padding_mask``: bool (b, k), True = key excluded. ``dropout_strides``: logical strides
    (sb, sh, sj, sk) of the probabilities' dropout index (default: (b, h, j, k) row-major).
    ``o``: optional output (b, h, j, p) of any strides, else allocated like ``q``.
    ``saved_mask``: optional ``new_saved_mask`` buffer the kernel writes the keep decisions to
    (for a backward with ``dropout_mask="saved"``).  ``bias``: optional (bq, bv), each (h, p): the
    kernel attends over q + bq (rounded to q's dtype), k + bk for any bk, and v + bv, so a bias add
    before the attention needs no kernel of its own (module doc: biases); it writes q + bq into
    ``q_biased`` ((b, h, j, p) of any strides, required with ``bias``), the backward's q.
    Returns ``(o, lse)``, lse float32 (b, h, j) contiguous, natural log.
    """
    B, H, Lq, Lk, P, G, kpm, kpm_strides, drop, grouped, index_64 = _prepare(q, k, v, dropout_p, offset,
                                                                           key_padding_mask, dropout_strides,
                                                                           saved_mask, groups)
    config = default_config(P, "forward")
    block_j, block_k = block_j or config["block_j"], block_k or config["block_k"]
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty((B, H, Lq), device=q.device, dtype=torch.float32)
    grid = (ceil_div(Lq, block_j), B * H)
    if bias is not None and (len(bias) != 2 or q_biased is None or q_biased.shape != q.shape):
        raise ValueError(f"bias must be (bq, bv) with q_biased, the {tuple(q.shape)} output q + bq is written to")
    biases, bias_strides = _bias_args(tuple(bias or (None, None)), q, "bias (bq, bv)", G)
    q_biased = q if q_biased is None else q_biased  # a placeholder without bias, never written
    launch(_attn_fwd_kernel, grid, [
        q, k, v, o, lse, kpm, lse if saved_mask is None else saved_mask, *biases, q_biased,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *kpm_strides, *bias_strides, *q_biased.stride(), *drop,
        H, Lq, Lk, scale * LOG2E,
        keep_threshold(dropout_p), dropout_scale(dropout_p), seed, offset,
    ], dict(P=P, BLOCK_J=block_j, BLOCK_K=block_k,
            CAUSAL=causal, HAS_KPM=key_padding_mask is not None, HAS_DROPOUT=dropout_p > 0.0, INDEX_64=index_64,
            GROUPED=_block_grouped(grouped, block_k, saved_mask), MASK_IO=0 if saved_mask is None else 1,
            EVEN_K=Lk % block_k == 0, HAS_BIAS=bias is not None, GROUPS=G,
            num_warps=num_warps or config["num_warps"], num_stages=num_stages or config["num_stages"]))
    return o, lse


def attention_backward(do, q, k, v, o, lse, *, scale: float, dropout_p: float = 0.0, seed: int = 0,
                       offset: int = 0, causal: bool = False, key_padding_mask=None, dropout_strides=None,
                       saved_mask=None, dq=None, dk=None, dv=None, v_bias=None, groups=None, block_j=None,
                       block_k=None, num_warps=None, num_stages=None, dq_mode=None, dropout_mask=None):
    """Backward pass: ``(dq, dk, dv)`` for upstream ``do`` (b, h, j, p) of any strides; with
    grouped K/V heads (k, v: (b, h / G, k, p), ``attention_forward``) dk and dv are over the K/V
    heads, each the sum over its G query heads (one program per block of a K/V head's keys runs
    the group's query heads in turn into one accumulator: a fixed order, no atomics).

    ``o``, ``lse`` (and ``saved_mask``) come from ``attention_forward`` with the same arguments.
    ``dq``/``dk``/``dv``: optional outputs of any strides, else allocated like ``q``/``k``/``v``.
    ``dq_mode``: "atomic" (dQ added with fp32 atomics inside the dK/dV kernel, whose last key
    block per head writes it) or
    "split" (own kernel). ``dropout_mask`` (module doc): "regenerate" (``saved_mask`` None: the
    dK/dV kernel, and with "split" the dQ kernel, draw the mask from (seed, offset)) or "saved"
    (the kernels read ``saved_mask``, the forward's ``new_saved_mask`` buffer; None only where
    ``new_saved_mask`` gives None, and then the mask is drawn as with "regenerate").  After a
    forward with ``bias=(bq, bv)``: ``q`` is its ``q_biased``, ``k`` and ``v`` as given to it, and
    ``v_bias`` its bv (the gradients are those of the biased q, k, v, which are those of q, k, v).
    """
    B, H, Lq, Lk, P, G, kpm, kpm_strides, drop, grouped, index_64 = _prepare(q, k, v, dropout_p, offset,
                                                                           key_padding_mask, dropout_strides,
                                                                           saved_mask, groups)
    config = default_config(P, "backward", groups=G)
    block_j, block_k = block_j or config["block_j"], block_k or config["block_k"]
    num_warps, num_stages = num_warps or config["num_warps"], num_stages or config["num_stages"]
    dq_mode, dropout_mask = dq_mode or config["dq_mode"], dropout_mask or config["dropout_mask"]
    if dq_mode not in ("atomic", "split"):
        raise ValueError(f"dq_mode must be 'atomic' or 'split', not {dq_mode!r}")
    if dropout_mask not in DROPOUT_MASK_OPTIONS:
        raise ValueError(f"dropout_mask must be one of {DROPOUT_MASK_OPTIONS}, not {dropout_mask!r}")
    if (saved_mask is not None) != (dropout_mask == "saved" and grouped):
        given = "given" if saved_mask is not None else "None"
        raise ValueError(f"dropout_mask={dropout_mask!r} with saved_mask {given}: "
                         "'saved' reads the forward's new_saved_mask buffer (None where that is None), "
                         "'regenerate' takes none")
    atomic = dq_mode == "atomic"
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    delta = torch.empty((B, H, Lq), device=q.device, dtype=torch.float32)
    dq_acc = torch.empty((B, H, Lq, P), device=q.device, dtype=torch.float32) if atomic else delta
    arrivals = torch.empty((B, H), device=q.device, dtype=torch.int32) if atomic else delta
    mask, mask_io = (delta, 0) if saved_mask is None else (saved_mask, 2)  # delta: a placeholder pointer, never read
    launch(_attn_bwd_preprocess_kernel, (ceil_div(Lq, block_j), B * H),
           [o, do, delta, dq_acc, arrivals, *o.stride(), *do.stride(), H, Lq],
           dict(P=P, BLOCK_J=block_j, ZERO_DQ=atomic, num_warps=4))
    flags = dict(P=P, BLOCK_J=block_j, BLOCK_K=block_k, CAUSAL=causal, HAS_KPM=key_padding_mask is not None,
                 HAS_DROPOUT=dropout_p > 0.0, INDEX_64=index_64, GROUPED=_block_grouped(grouped, block_k, saved_mask),
                 MASK_IO=mask_io, HAS_BIAS=v_bias is not None, GROUPS=G,
                 EVEN=Lq % block_j == 0 and Lk % block_k == 0, num_warps=num_warps, num_stages=num_stages)
    biases, bias_strides = _bias_args((v_bias,), q, "v_bias", G)
    scalars = (H, Lq, Lk, scale, scale * LOG2E, keep_threshold(dropout_p), dropout_scale(dropout_p), seed, offset)
    launch(_attn_bwd_dkdv_kernel, (ceil_div(Lk, block_k), B * (H // G)), [
        q, k, v, do, lse, delta, dq_acc, arrivals, dq, dk, dv, kpm, mask, *biases,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *dq.stride(), *kpm_strides,
        *bias_strides, *drop, *scalars], dict(DQ_ATOMIC=atomic, **flags))
    if not atomic:
        launch(_attn_bwd_dq_kernel, (ceil_div(Lq, block_j), B * H), [
            q, k, v, do, lse, delta, dq, kpm, mask, *biases,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *kpm_strides, *bias_strides, *drop,
            *scalars], flags)
    return dq, dk, dv


class FusedAttention(torch.autograd.Function):
    """Autograd wrapper: ``FusedAttention.apply(q, k, v, scale, dropout_p, seed, offset, causal,
    key_padding_mask, dropout_strides, forward_config, backward_config)`` -> o (b, h, j, p). With
    the backward configuration's ``dropout_mask`` "saved" the forward writes the mask
    (``new_saved_mask``, where the layout allows) and the backward reads it; with "regenerate"
    the backward draws it again."""

    @staticmethod
    def forward(ctx, q, k, v, scale, dropout_p, seed, offset, causal, key_padding_mask, dropout_strides,
                forward_config, backward_config):
        backward_config = dict(default_config(q.shape[-1], "backward", groups=q.shape[1] // max(k.shape[1], 1)),
                               **(backward_config or {}))
        saved_mask = None
        if backward_config["dropout_mask"] == "saved":
            saved_mask = new_saved_mask(q, k, dropout_p=dropout_p, offset=offset, dropout_strides=dropout_strides)
        o, lse = attention_forward(q, k, v, scale=scale, dropout_p=dropout_p, seed=seed, offset=offset,
                                   causal=causal, key_padding_mask=key_padding_mask, dropout_strides=dropout_strides,
                                   saved_mask=saved_mask, **(forward_config or {}))
        ctx.save_for_backward(q, k, v, o, lse, key_padding_mask, saved_mask)
        ctx.args = dict(scale=scale, dropout_p=dropout_p, seed=seed, offset=offset, causal=causal,
                        dropout_strides=dropout_strides, **backward_config)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, key_padding_mask, saved_mask = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, key_padding_mask=key_padding_mask,
                                        saved_mask=saved_mask, **ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def fused_attention(q, k, v, *, scale: float | None = None, dropout_p: float = 0.0, seed: int | None = None,
                    offset: int = 0, causal: bool = False, key_padding_mask=None, dropout_strides=None,
                    forward_config: dict | None = None, backward_config: dict | None = None):
    """Differentiable fused attention over logical (b, h, j, p) views; returns O (b, h, j, p).

    ``scale`` defaults to 1/sqrt(p); ``seed`` defaults to a draw from torch's default generator.
    ``forward_config``/``backward_config``: knob dicts as listed by ``attention_configs`` (a partial
    dict takes the rest from ``default_config``); ``backward_config["dropout_mask"]`` chooses
    whether the forward saves the dropout mask for the backward or the backward regenerates it.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return FusedAttention.apply(q, k, v, scale, dropout_p, seed, offset, causal, key_padding_mask,
                                dropout_strides, forward_config, backward_config)
