"""The Triton functions the fused attention's kernels share (``kernels.attention``'s module doc):
a program's head and block of rows, their stores, the biases, the dropout counters and keep
decisions of a block of scores, the masks of what a query row may see."""
import triton
import triton.language as tl

from datamove.kernels.philox import dropout_keep, dropout_keep_grouped, keep_bits, unpack_grouped

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
def _keys_end(pid_j, b, kpm_ptr, stride_mb, stride_mk, Lk, BLOCK_J: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_KPM: tl.constexpr):
    """The end of the keys that query block ``pid_j`` of batch b sees: Lk, before the block's end if
    CAUSAL, before the padding mask's last kept key if HAS_KPM (``_keys_kept``)."""
    k_end = Lk
    if CAUSAL:
        k_end = tl.minimum(Lk, (pid_j + 1) * BLOCK_J)
    if HAS_KPM:
        k_end = tl.minimum(k_end, _keys_kept(kpm_ptr, b, stride_mb, stride_mk, Lk))
    return k_end


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
