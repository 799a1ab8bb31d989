"""The fused attention's backward kernels (``kernels.attention``'s module doc): the preprocess
(delta = rowsum(dO * O)), dK and dV over blocks of keys (dQ added atomically, "atomic"), and dQ
over blocks of queries ("split")."""
import triton
import triton.language as tl

from datamove.kernels.attention.tiles import (_biased, _dq_acc_rows, _dropout_rows, _head_bias, _head_rows, _keep_block,
                                              _keys_end, _keys_kept, _store_rows, _visible)


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
    k_end = _keys_end(pid_j, b, kpm_ptr, stride_mb, stride_mk, Lk, BLOCK_J, CAUSAL, HAS_KPM)
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
