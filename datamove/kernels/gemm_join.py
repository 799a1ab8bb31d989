"""The GEMM template's join epilogue: element-wise work on one or two products and other tensors' tiles.

For every (b0, b1, m, n) of a batched GEMM (``kernels.gemm``'s dims and addressing),

    acc0 = alpha * sum_k A[b0, b1, m, k] * B[b0, b1, k, n]        (fp32)
    acc1 = alpha * sum_k A[b0, b1, m, k] * B1[b0, b1, k, n]       (fp32; pair mode only)
    C[b0, b1, m, n] = acc0                                        (optional: ``c`` given)
    ACC1[b0, b1, m, n] = acc1                                     (optional, pair mode)
    out_0, ..., out_s = fn(acc0[, acc1], in_0[b0, b1, m, n], ..., in_l[b0, b1, m, n])
    OUT_i[b0, b1, m, n] = out_i

``fn`` is a ``@triton.jit`` function of fp32 tiles (each [rows, columns] of one epilogue slice; the
loaded tiles cast to fp32) returning a tuple of fp32 tiles of that shape, one per store, in order.
A Llama SwiGLU MLP's forward is the pair mode on the stacked gate / up weights (acc0 = gate, acc1 =
up, ``fn`` returns (silu(gate), silu(gate) * up), gate and up stored too); its backward the single
mode on dh = dy @ W_down^T (``fn(dh, up, silu(gate), gate)`` returns (d_up, d_gate)).

Both modes run the template's main loop (``kernels.gemm._main_loop``), pair mode with its second B:
each A tile read once for two dot products.  Both run every config of
``kernels.gemm`` (TMA reads, persistent, epilogue slices, TMA store of C); pair mode only those whose
two accumulators fit (``kernels.gemm.pair_fits``: BM x BN <= 128 x 128 at 8 warps, 128 x 64 at 4;
on Hopper ``kernels.gemm.fitted(config, dtype, saves, pair=True)`` also fits the stages of two B
tiles into shared memory).  Loaded and stored tensors other than C go through pointers, with any
four element strides (a stride 0 broadcasts); with ``store_tma`` C goes through a descriptor.  The
epilogue runs on column slices of the tile (``join_split``) so that the loaded tiles and fn's values
fit in registers beside the accumulators.
Offsets inside a batch are int32: each tensor must hold fewer than 2**31 elements.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from datamove.kernels import gemm as template
from datamove.kernels.device import source_id
from datamove.kernels.gemm import (DTYPES, GemmConfig, GemmShape, _main_loop, _operand_sources, _programs,
                                   _slice_descriptor, _tile_coords, fitted, pair_fits, valid_configs)
from datamove.kernels.interpreter import interpreted, round_bf16
from datamove.kernels.launch import ceil_div, through_jit

# the source a timing of a join epilogue's GEMM holds for (``kernels.gemm.TEMPLATE_ID``, with this module)
JOIN_TEMPLATE_ID = source_id(template.__file__, template.philox.__file__, __file__)
MAX_LOADS = 4  # tiles fn reads besides the products (each held in fp32 registers beside the accumulators)
MAX_STORES = 4  # tiles fn returns

Strides = tuple[int, int, int, int]


@dataclass(frozen=True, eq=False)  # eq=False: tensors do not compare to one bool
class JoinEpilogue:
    """A GEMM's join epilogue (``gemm_join(..., join)``).

    ``fn``: a ``@triton.jit`` function, called as ``fn(acc0, acc1, *loaded)`` in pair mode (``b1``
    given) or ``fn(acc0, *loaded)``, on fp32 tiles, returning a tuple of ``len(stores)`` fp32 tiles.
    ``b1``: pair mode's second B, shaped and addressed as B (``gemm``'s ``b_strides``), same dtype.
    ``loads`` / ``stores``: tensors of any float dtype (stores: bf16, fp16 or fp32) whose first element
    is element (0, 0, 0, 0), with their element strides (b0, b1, m, n) in ``load_strides`` /
    ``store_strides``; at most ``MAX_LOADS`` / ``MAX_STORES``.  ``acc1`` / ``acc1_strides``: where pair
    mode also stores acc1 (None: not stored; acc0 is stored in ``gemm``'s ``c`` unless that is None).
    """

    fn: triton.JITFunction
    b1: torch.Tensor | None = None
    loads: tuple[torch.Tensor, ...] = ()
    load_strides: tuple[Strides, ...] = ()
    stores: tuple[torch.Tensor, ...] = ()
    store_strides: tuple[Strides, ...] = ()
    acc1: torch.Tensor | None = None
    acc1_strides: Strides | None = None

    @property
    def pair(self) -> bool:
        return self.b1 is not None


def _check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, join: JoinEpilogue) -> None:
    """ValueError / TypeError, one line, for a join the kernel cannot run."""
    if not isinstance(join.fn, (triton.JITFunction, InterpretedFunction)):  # @triton.jit's, interpreted or not
        raise TypeError(f"join fn must be a @triton.jit function, not {type(join.fn).__name__}")
    if a.dtype != b.dtype or a.dtype not in DTYPES or (join.pair and join.b1.dtype != a.dtype):
        raise TypeError(f"A {a.dtype}, B {b.dtype}, B1 {join.b1.dtype if join.pair else None}: alike, each of {DTYPES}")
    if len(join.loads) != len(join.load_strides) or len(join.stores) != len(join.store_strides):
        raise ValueError("a join needs one stride tuple per loaded and per stored tensor")
    if len(join.loads) > MAX_LOADS or len(join.stores) > MAX_STORES:
        raise ValueError(f"a join loads at most {MAX_LOADS} and stores at most {MAX_STORES} tensors")
    if any(len(s) != 4 for s in (*join.load_strides, *join.store_strides, join.acc1_strides or (0,) * 4)):
        raise ValueError("join strides are four element strides (b0, b1, m, n)")
    if (join.acc1 is not None) != (join.acc1_strides is not None) or (join.acc1 is not None and not join.pair):
        raise ValueError("acc1 is stored only in pair mode (b1 given), with acc1_strides")
    outputs = [t for t in (c, join.acc1, *join.stores) if t is not None]
    if not outputs:
        raise ValueError("a join stores something: c, acc1 or fn's results")
    if any(t.dtype not in DTYPES for t in outputs) or any(not t.dtype.is_floating_point for t in join.loads):
        raise TypeError(f"join outputs must be of {DTYPES}, loads floating point")
    if any(t.numel() >= 2**31 for t in (a, b, *outputs, *join.loads, *([join.b1] if join.pair else []))):
        raise ValueError("operands must hold fewer than 2**31 elements (int32 offsets)")


def join_split(config: GemmConfig) -> int:
    """Column slices of a join's epilogue: ``config.epilogue_split`` where set, else as many (1, 2, 4) as
    bring a slice to at most 16 elements a thread (the accumulators stay live while each slice's loads,
    fn's temporaries and results are: compiled for sm_90 at 8192 x 8192 x 2048 bf16, Triton 3.9, SwiGLU's
    pair forward at 128 x 128, 8 warps, spilled with 1 or 2 slices, not with 4 (194 registers); its
    backward (3 loads) at 128 x 256, 8 warps, spilled with 1 or 2, not with 4)."""
    if config.epilogue_split:
        return config.epilogue_split
    per_thread = config.block_m * config.block_n // (32 * config.num_warps)
    split = 1
    while split < 4 and per_thread // split > 16:
        split *= 2
    return split


def gemm_join(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, shape: GemmShape, a_strides: Strides,
              b_strides: Strides, c_strides: Strides, join: JoinEpilogue, *, alpha: float = 1.0,
              config: GemmConfig | None = None) -> torch.Tensor | None:
    """Launch the template with ``join`` as its epilogue (``kernels.gemm.gemm``'s arguments; ``c`` None:
    acc0 not stored).  Outputs are written in place; returns ``c``.  Without ``config``, the first of
    ``valid_configs`` that fits (``kernels.gemm.fitted``)."""
    _check(a, b, c, join)
    if config is None:
        saves = bool(join.stores) or join.acc1 is not None
        config = next(f for f in (fitted(x, a.dtype, saves, join.pair) for x in valid_configs(a.dtype)) if f)
    if join.pair and not pair_fits(config):
        raise ValueError(f"config {config}: two accumulators of {config.block_m} x {config.block_n} do not fit "
                         f"{config.num_warps} warps' registers (see kernels.gemm.pair_fits)")
    a_src, b_src, a_m_major, b_k_major = _operand_sources(a, b, shape, a_strides, b_strides, config)
    b1_src = _operand_sources(a, join.b1, shape, a_strides, b_strides, config)[1] if join.pair else b_src
    split = join_split(config)
    c_desc, c_m_major = c, False
    if config.store_tma and c is not None:
        c_tiles = _slice_descriptor(c, shape, c_strides, config, split)
        if not config.tma or c_tiles is None:
            raise ValueError(f"config {config} needs tma and a TMA-compatible C (see tma_compatible)")
        c_desc, c_m_major = c_tiles
    tiles, batches = ceil_div(shape.m, config.block_m) * ceil_div(shape.n, config.block_n), shape.b0 * shape.b1
    grid = (min(tiles * batches, _programs(a.device)), 1) if config.persistent else (tiles, batches)
    placeholder = a  # for a pointer that is never read or written
    through_jit(_join_kernel, grid)(
        a_src, b_src, b1_src, placeholder if c is None else c, placeholder if c_desc is None else c_desc,
        placeholder if join.acc1 is None else join.acc1, tuple(join.loads), tuple(join.stores),
        shape.b1, batches, shape.m, shape.n, shape.k, *a_strides, *b_strides,
        tuple(c_strides) if c is not None else (0,) * 4, tuple(join.acc1_strides or (0,) * 4),
        tuple(map(tuple, join.load_strides)), tuple(map(tuple, join.store_strides)), alpha,
        FN=join.fn, PAIR=join.pair, STORE_C=c is not None, STORE_ACC1=join.acc1 is not None,
        TMA=config.tma, A_M_MAJOR=a_m_major, B_K_MAJOR=b_k_major,
        STORE_TMA=config.store_tma and c is not None, C_M_MAJOR=c_m_major,
        EVEN_K=shape.k % config.block_k == 0,
        FP32_DOT=a.dtype == torch.float32 or (interpreted() and a.dtype == torch.bfloat16),  # as kernels.gemm
        ROUND_BF16=interpreted(), EPILOGUE_SPLIT=split,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        PERSISTENT=config.persistent, num_stages=config.num_stages, num_warps=config.num_warps,
    )
    return c


@triton.jit
def _join_kernel(
    a_src, b_src, b1_src,  # as kernels.gemm._gemm_kernel's a_src / b_src; b1_src: pair mode's second B, like b_src
    c_ptr,  # C[b0, b1, m, n] (acc0), written if STORE_C
    c_desc,  # with STORE_TMA a descriptor over C in slices ([b0, b1, n, m] if C_M_MAJOR); else c_ptr
    acc1_ptr,  # ACC1[b0, b1, m, n], written if STORE_ACC1
    loads, stores,  # tuples of pointers to [b0, b1, m, n] tensors: fn's extra inputs, its results' destinations
    B1, BATCHES, M, N, K,  # BATCHES = b0 * b1
    stride_ab0, stride_ab1, stride_am, stride_ak,  # unused with TMA
    stride_bb0, stride_bb1, stride_bk, stride_bn,  # B's and B1's; unused with TMA
    c_strides, acc1_strides,  # (b0, b1, m, n) element strides
    load_strides, store_strides,  # a (b0, b1, m, n) tuple per load / store
    alpha,
    FN: tl.constexpr,  # the join function (a JITFunction): FN(acc0[, acc1], *loaded) -> tuple, one per store
    PAIR: tl.constexpr,  # two products, by B and B1
    STORE_C: tl.constexpr, STORE_ACC1: tl.constexpr,
    TMA: tl.constexpr, A_M_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr,  # as kernels.gemm._gemm_kernel
    STORE_TMA: tl.constexpr, C_M_MAJOR: tl.constexpr, EVEN_K: tl.constexpr, FP32_DOT: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # round to bf16 before every (truncating, in the interpreter) cast to bf16
    EPILOGUE_SPLIT: tl.constexpr,  # 1, 2 or 4 column slices, one after another
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # tile order, persistence and the epilogue's own tile counter as in kernels.gemm._gemm_kernel
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        first, step = tl.program_id(0), tl.num_programs(0)
    else:
        first, step = tl.program_id(1) * tiles + tl.program_id(0), tiles * BATCHES
    tile_c = first - step
    for tile in tl.range(first, tiles * BATCHES, step, flatten=PERSISTENT):
        pid_m, pid_n, pid_b0, pid_b1 = _tile_coords(tile, tiles, M, N, B1, BLOCK_M, BLOCK_N, GROUP_M)
        acc0, acc1 = _main_loop(a_src, b_src, b1_src, pid_m, pid_n, pid_b0, pid_b1, M, N, K,
                                stride_ab0, stride_ab1, stride_am, stride_ak, stride_bb0, stride_bb1, stride_bk, stride_bn,
                                TMA, A_M_MAJOR, B_K_MAJOR, EVEN_K, FP32_DOT, PAIR, BLOCK_M, BLOCK_N, BLOCK_K)
        tile_c += step
        pid_m, pid_n, pid_b0, pid_b1 = _tile_coords(tile_c, tiles, M, N, B1, BLOCK_M, BLOCK_N, GROUP_M)
        slices0 = _column_slices(acc0 * alpha, EPILOGUE_SPLIT)
        slices1 = slices0
        if PAIR:
            slices1 = _column_slices(acc1 * alpha, EPILOGUE_SPLIT)
        for h in tl.static_range(EPILOGUE_SPLIT):
            _join_slice(slices0[h], slices1[h], pid_m * BLOCK_M, pid_n * BLOCK_N + h * (BLOCK_N // EPILOGUE_SPLIT),
                        M, N, pid_b0, pid_b1, c_ptr, c_desc, c_strides, acc1_ptr, acc1_strides,
                        loads, load_strides, stores, store_strides, FN, PAIR, STORE_C, STORE_ACC1, STORE_TMA,
                        C_M_MAJOR, ROUND_BF16)


@triton.jit
def _column_slices(acc, SPLIT: tl.constexpr):
    """``acc`` [rows, columns] as a tuple of SPLIT (1, 2, 4) tiles of its consecutive column ranges."""
    if SPLIT == 1:
        parts = (acc,)
    else:
        left, right = acc.reshape(acc.shape[0], 2, acc.shape[1] // 2).permute(0, 2, 1).split()
        if SPLIT == 2:
            parts = (left, right)
        else:
            left_left, left_right = left.reshape(acc.shape[0], 2, acc.shape[1] // 4).permute(0, 2, 1).split()
            right_left, right_right = right.reshape(acc.shape[0], 2, acc.shape[1] // 4).permute(0, 2, 1).split()
            parts = (left_left, left_right, right_left, right_right)
    return parts


@triton.jit
def _stored(x, ptr, ROUND_BF16: tl.constexpr):
    """fp32 ``x`` cast to ``ptr``'s element type (rounded to nearest bf16 first with ROUND_BF16)."""
    if ROUND_BF16 and ptr.dtype.element_ty == tl.bfloat16:
        x = round_bf16(x)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def _tile_ptrs(ptr, strides, pid_b0, pid_b1, offs_m, offs_n):
    """Pointers of the [offs_m, offs_n] tile of batch (pid_b0, pid_b1) of a tensor with (b0, b1, m, n) ``strides``."""
    base = ptr + pid_b0.to(tl.int64) * strides[0] + pid_b1.to(tl.int64) * strides[1]
    return base + offs_m[:, None] * strides[2] + offs_n[None, :] * strides[3]


@triton.jit
def _join_slice(acc0, acc1, m_start, n_start, M, N, pid_b0, pid_b1, c_ptr, c_desc, c_strides, acc1_ptr, acc1_strides,
                loads, load_strides, stores, store_strides, FN: tl.constexpr, PAIR: tl.constexpr,
                STORE_C: tl.constexpr, STORE_ACC1: tl.constexpr, STORE_TMA: tl.constexpr, C_M_MAJOR: tl.constexpr,
                ROUND_BF16: tl.constexpr):
    """Stores of acc0 / acc1 and of FN's results on the slice whose rows start at m_start and columns
    at n_start (its extents: acc0's shape) of batch (pid_b0, pid_b1) (``_join_kernel``'s arguments)."""
    offs_m = m_start + tl.arange(0, acc0.shape[0])
    offs_n = n_start + tl.arange(0, acc0.shape[1])
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if STORE_C:
        out = _stored(acc0, c_ptr, ROUND_BF16)
        if STORE_TMA:  # rows / columns past M / N are not written
            if C_M_MAJOR:
                c_desc.store([pid_b0, pid_b1, n_start, m_start], out.T.reshape(1, 1, acc0.shape[1], acc0.shape[0]))
            else:
                c_desc.store([pid_b0, pid_b1, m_start, n_start], out.reshape(1, 1, acc0.shape[0], acc0.shape[1]))
        else:
            tl.store(_tile_ptrs(c_ptr, c_strides, pid_b0, pid_b1, offs_m, offs_n), out, mask=mask)
    if STORE_ACC1:
        tl.store(_tile_ptrs(acc1_ptr, acc1_strides, pid_b0, pid_b1, offs_m, offs_n), _stored(acc1, acc1_ptr, ROUND_BF16),
                 mask=mask)
    loaded = ()
    for i in tl.static_range(len(loads)):
        tile = tl.load(_tile_ptrs(loads[i], load_strides[i], pid_b0, pid_b1, offs_m, offs_n), mask=mask, other=0.0)
        loaded = loaded + (tile.to(tl.float32),)
    if PAIR:
        results = FN(acc0, acc1, *loaded)
    else:
        results = FN(acc0, *loaded)
    tl.static_assert(len(results) == len(stores), "the join function returns a tuple of one tile per store")
    for i in tl.static_range(len(stores)):
        tl.store(_tile_ptrs(stores[i], store_strides[i], pid_b0, pid_b1, offs_m, offs_n),
                 _stored(results[i], stores[i], ROUND_BF16), mask=mask)
