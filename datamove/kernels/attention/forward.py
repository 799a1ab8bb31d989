"""The fused attention's forward kernel (``kernels.attention``'s module doc): an online softmax
over blocks of keys, the logsumexp saved, the probabilities never stored."""
import triton
import triton.language as tl

from datamove.kernels.attention.tiles import (_biased, _dropout_rows, _head_bias, _head_rows, _keep_block, _keys_end,
                                              _store_rows, _visible)


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
    k_end = _keys_end(pid_j, b, kpm_ptr, stride_mb, stride_mk, Lk, BLOCK_J, CAUSAL, HAS_KPM)
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
