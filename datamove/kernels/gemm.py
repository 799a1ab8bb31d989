"""Triton batched-GEMM template: any strides, fp32 accumulation, fused element-wise epilogue.

Computes, for every (b0, b1, m, n),

    y = alpha * sum_k A[b0, b1, m, k] * B[b0, b1, k, n]        (fp32 accumulator)
    y = y + bias[b0, b1, m, n]                                  (optional; bias broadcast by stride 0)
    saved = y                                                   (optional, save="pre_activation")
    y = relu(y) | gelu_tanh(y)                                  (optional)
    saved = y                                                   (optional, save="pre_dropout")
    y = keep ? y * dropout_scale(p) : 0                         (optional dropout)
    C[b0, b1, m, n] = y

or, as the backward of such an epilogue (``gradient``; none of the above then),

    y = alpha * sum_k A[b0, b1, m, k] * B[b0, b1, k, n]        (fp32 accumulator)
    y = y * relu'(F) * factor_scale | y * gelu_tanh'(F)         F = factor[b0, b1, m, n]
    C[b0, b1, m, n] = y
    sums[m] = sum over b0, b1, n of y   (or sums[n], over b0, b1, m; optional, fp32 sums)

or, with a join epilogue (launched by ``kernels.gemm_join.gemm_join``: a Llama SwiGLU MLP's element-wise work), a
caller's ``@triton.jit`` function of the product (and of A times a second B) and other tensors' tiles.

The sums (a bias gradient) come in two kernels: each tile's epilogue stores its fp32 row (column)
sums into a partial buffer, one row per (batch, tile along the summed dim, epilogue slice), and
``_sum_partials_kernel`` adds those rows in order, so the result does not depend on scheduling.

Every operand is addressed by one element stride per GEMM dim (two batch dims, then m/k, k/n or
m/n), so one kernel serves every storage layout that ``kernels.contraction`` maps to a GEMM.
Configs with ``tma=True`` read A and B through 4-d host tensor descriptors instead (TMA on Hopper:
no address tiles in registers, no masks), which needs a unit-stride matrix dim and 16-byte
aligned strides in both (``tma_compatible``); C, bias and saved always go through pointers (a
gradient epilogue's factor, with TMA reads, through a descriptor where its layout allows).
Configs with ``store_tma=True`` write C through a descriptor too (an asynchronous TMA store from shared
memory; C needs the same alignment, ``tma_compatible``).  Configs with ``persistent=True`` launch about
one program per multiprocessor, each looping over output tiles (batch-major, grouped within a batch)
instead of one program per tile, in one loop over (tile, k) that Triton flattens: the next tile's
first loads are in flight while this tile's epilogue runs.
Dropout keeps element e by the convention of ``dataflow.dropout_mask`` at counter offset + n(e), where
n(e) is its logical row-major index over the output's letters in spec order, assembled from per-dim
digits ``(q1, q2, l0, l1, l2)``: a dim's flat index f adds ``(f % q1)*l0 + ((f // q1) % q2)*l1 +
(f // (q1*q2))*l2`` (``kernels.contraction.dropout_digits`` derives them).  When C's n (or m) dim
runs along the output's last logical letter with unit logical stride (l0 == 1, q1 % 64 == 0),
every other logical stride and the offset are multiples of 64 and the epilogue's slices hold whole
groups of 64 columns (rows), each group is four Philox calls, drawn once each in the threads whose
accumulator columns they decide
(``kernels.philox.dropout_keep_grouped``, see ``_grouped``); otherwise each element makes its own
call (``kernels.philox.dropout_keep``).  The mask equals
``dataflow.dropout_mask.keep_mask(seed, offset, out_logical_shape, p)`` in any layout.

Inputs bf16, fp16 or fp32 (A and B alike; fp32 uses IEEE dot products, as do bf16 inputs under the
CPU interpreter, whose tl.dot mishandles bf16 and whose bf16 cast truncates), outputs any of the three.
``saved`` has C's dtype.
Offsets inside a batch are int32: each operand must hold fewer than 2**31 elements.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from datamove.dataflow.dropout_mask import DECISION_GROUP
from datamove.kernels.interpreter import interpreted, round_bf16
from datamove.kernels import philox
from datamove.kernels.device import source_id
from datamove.kernels.launch import ceil_div, through_jit
from datamove.kernels.philox import dropout_keep, dropout_keep_grouped, dropout_scale, keep_threshold

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the template's source version (with the Philox draws its epilogue calls): a timing of a Triton
# configuration holds for the template that was timed (``harness.contraction_variants.config_knobs``)
TEMPLATE_ID = source_id(__file__, philox.__file__)
SAVES = ("none", "pre_activation", "pre_dropout")
GRADIENTS = ("none", "relu", "gelu")  # the factor's derivative the backward epilogue multiplies by
SUM_PARTIAL_COLUMNS = 128  # sums a program of ``_sum_partials_kernel`` adds up
SUM_PARTIAL_ROWS = 32  # partial rows it loads at a time


@dataclass(frozen=True)
class GemmConfig:
    """Knobs of one compiled variant: tile sizes, grouped (swizzled) launch order, pipelining, warps."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int
    tma: bool = False  # A and B tiles through host tensor descriptors (TMA on Hopper); see tma_compatible
    epilogue_split: int = 0  # 1, 2, 4: epilogue on that many column slices in turn; 0: chosen by _epilogue_split
    persistent: bool = False  # one program per multiprocessor, each looping over output tiles
    store_tma: bool = False  # C written through a tensor descriptor (TMA store); needs tma

    def __str__(self) -> str:
        text = f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} s{self.num_stages} w{self.num_warps}"
        text += (" tma" if self.tma else "") + (" store-tma" if self.store_tma else "")
        text += f" e{self.epilogue_split}" if self.epilogue_split else ""
        return text + (" persistent" if self.persistent else "")


HOPPER_SHARED_MEMORY = 232448  # bytes one block may use on Hopper (227 KiB, opt-in)
# Curated for Hopper and 16-bit inputs (stage bytes = 2 * (BM*BK + BK*BN)).
HOPPER_CONFIGS = (
    GemmConfig(128, 256, 64, 8, 3, 8),
    GemmConfig(256, 128, 64, 8, 3, 8),
    GemmConfig(128, 128, 64, 8, 4, 8),
    GemmConfig(128, 128, 64, 8, 4, 4),
    GemmConfig(128, 64, 64, 8, 4, 4),
    GemmConfig(64, 128, 64, 8, 4, 4),
    GemmConfig(64, 64, 64, 8, 4, 4),
    GemmConfig(128, 256, 64, 8, 3, 8, tma=True),
    GemmConfig(128, 256, 64, 8, 4, 8, tma=True),
    GemmConfig(256, 128, 64, 8, 3, 8, tma=True),
    GemmConfig(128, 128, 64, 8, 4, 8, tma=True),
    GemmConfig(128, 128, 64, 8, 4, 4, tma=True),
    GemmConfig(128, 64, 64, 8, 4, 4, tma=True),
    GemmConfig(64, 128, 64, 8, 4, 4, tma=True),
    # two stages: less shared memory, so 2-3 blocks per SM overlap loads and stores when K is short
    GemmConfig(128, 256, 64, 8, 2, 8, tma=True),
    GemmConfig(128, 128, 64, 8, 2, 4, tma=True),
    # persistent: no tail wave of tiles, the next tile's first loads issued while this one's epilogue runs
    GemmConfig(128, 256, 64, 8, 3, 8, tma=True, persistent=True),
    GemmConfig(256, 128, 64, 8, 3, 8, tma=True, persistent=True),
    GemmConfig(128, 128, 64, 8, 4, 8, tma=True, persistent=True),
    # ... and C stored by TMA: within 1-3% of cuBLAS at BERT-large's FFN GEMMs on an H100 (the
    # template's other configs: 2-11% slower), 11 us less than a pointer-stored epilogue with dropout
    GemmConfig(128, 256, 64, 8, 3, 8, tma=True, persistent=True, store_tma=True),
    GemmConfig(128, 256, 64, 8, 4, 8, tma=True, epilogue_split=2, persistent=True, store_tma=True),
    GemmConfig(128, 256, 64, 8, 3, 8, tma=True, store_tma=True),
)
# Tiny tiles for the CPU interpreter (tl.dot needs every block dim >= 16).
INTERPRETER_CONFIGS = (
    GemmConfig(16, 32, 16, 2, 1, 4),
    GemmConfig(32, 16, 32, 1, 1, 4),
    GemmConfig(16, 32, 16, 2, 1, 4, tma=True),
    GemmConfig(16, 64, 16, 2, 1, 4, epilogue_split=4),
    GemmConfig(16, 32, 16, 2, 1, 4, persistent=True),
    GemmConfig(16, 32, 16, 2, 1, 4, tma=True, persistent=True),
    GemmConfig(16, 32, 16, 2, 1, 4, tma=True, store_tma=True),
    GemmConfig(16, 64, 16, 2, 1, 4, tma=True, epilogue_split=2, persistent=True, store_tma=True),
)
INTERPRETER_PROGRAMS = 3  # a persistent grid under the interpreter: programs loop over several tiles


def valid_configs(dtype: torch.dtype = torch.bfloat16) -> tuple[GemmConfig, ...]:
    """The configs to try on this machine for inputs of ``dtype``: the interpreter's tiny set, or
    the Hopper configs whose pipeline buffers and staging fit in shared memory (``shared_bytes``)."""
    if interpreted():
        return INTERPRETER_CONFIGS
    return tuple(c for c in HOPPER_CONFIGS if shared_bytes(c, dtype) <= HOPPER_SHARED_MEMORY)


def shared_bytes(c: GemmConfig, dtype: torch.dtype, saves: bool = False, pair: bool = False) -> int:
    """Shared memory of ``c`` for inputs of ``dtype``: its pipeline buffers (stages x (BM + BN) x BK
    elements; a join epilogue's pair mode, ``pair``, stages two B tiles: (BM + 2 BN)), a TMA store's
    staging buffer (a slice of the tile) and, with an epilogue that also writes the value before its
    activation or dropout, or a join epilogue's other outputs through pointers (``saves``), a second
    slice, which that store's layout change takes (sm_90, Triton 3.6: GPT-2's FFN GEMM with bias +
    GELU saving the pre-activation asked 262176 bytes at 128 x 256 x 64, four stages, halves)."""
    staged = c.block_m * c.block_n // max(c.epilogue_split, 1) if c.store_tma else 0
    columns = c.block_n * (2 if pair else 1)
    return (c.num_stages * (c.block_m + columns) * c.block_k + staged * (2 if saves else 1)) * dtype.itemsize


def pair_fits(c: GemmConfig) -> bool:
    """Whether a join epilogue's pair mode (two fp32 [BM, BN] accumulators, ``kernels.gemm_join``) keeps
    both in at most 128 registers a thread, as the largest single-accumulator config does (128 x 256 at
    8 warps): BM x BN <= 128 x 128 at 8 warps, 128 x 64 at 4."""
    return 2 * c.block_m * c.block_n <= 128 * 32 * c.num_warps


def fitted(c: GemmConfig, dtype: torch.dtype, saves: bool, pair: bool = False) -> GemmConfig | None:
    """``c`` with as many pipeline stages as fit beside its epilogue's shared memory (``shared_bytes``;
    at least 2), None where none does or, for a join epilogue's ``pair`` mode, where its two
    accumulators do not fit (``pair_fits``); ``c`` itself under the interpreter."""
    if interpreted():
        return c
    if pair and not pair_fits(c):
        return None
    while shared_bytes(c, dtype, saves, pair) > HOPPER_SHARED_MEMORY:
        if c.num_stages <= 2:
            return None
        c = replace(c, num_stages=c.num_stages - 1)
    return c


def _tma_view(t: torch.Tensor, sizes: tuple[int, int, int, int], strides: tuple[int, int, int, int]):
    """(descriptor shape, strides, unit dim swapped last?) of a (b0, b1, x, y) operand, or None.

    TMA needs a 16-byte aligned base, one unit-stride dim (it becomes the descriptor's last; if
    that is x, x and y swap) and every other stride a multiple of 16 bytes (size-1 dims get 16 bytes).
    """
    item = t.element_size()
    if t.data_ptr() % 16:
        return None
    if strides[3] == 1:
        swapped = False
    elif strides[2] == 1:
        swapped = True
        sizes, strides = (*sizes[:2], sizes[3], sizes[2]), (*strides[:2], strides[3], strides[2])
    else:
        return None
    strides = tuple(st if n > 1 else 16 // item for n, st in zip(sizes[:3], strides[:3])) + (1,)
    if any(st * item % 16 for st in strides[:3]):
        return None
    return sizes, strides, swapped


def tma_compatible(a: torch.Tensor, b: torch.Tensor, shape: GemmShape, a_strides, b_strides,
                   c: torch.Tensor | None = None, c_strides=None) -> bool:
    """True when A and B can be read through tensor descriptors (configs with ``tma=True``) and,
    given ``c``, C written through one (``store_tma=True``)."""
    return (_tma_view(a, (shape.b0, shape.b1, shape.m, shape.k), a_strides) is not None
            and _tma_view(b, (shape.b0, shape.b1, shape.k, shape.n), b_strides) is not None
            and (c is None or _tma_view(c, (shape.b0, shape.b1, shape.m, shape.n), c_strides) is not None))


class GemmShape(NamedTuple):
    b0: int
    b1: int
    m: int
    n: int
    k: int


@triton.jit
def _digits(f, q1, q2, l0, l1, l2):
    """Logical-index term (int32) of a GEMM dim's flat index ``f`` (scalar or block)."""
    return (f % q1) * l0 + ((f // q1) % q2) * l1 + (f // (q1 * q2)) * l2


@triton.jit
def _gemm_kernel(
    a_src,  # A[b0, b1, m, k]: pointer, or with TMA a descriptor over [b0, b1, m, k] ([b0, b1, k, m] if A_M_MAJOR)
    b_src,  # B[b0, b1, k, n]: pointer, or with TMA a descriptor over [b0, b1, k, n] ([b0, b1, n, k] if B_K_MAJOR)
    c_ptr,  # C[b0, b1, m, n]
    c_desc,  # with STORE_TMA a descriptor over C as [b0, b1, m, n] ([b0, b1, n, m] if C_M_MAJOR); else c_ptr
    bias_ptr,  # bias[b0, b1, m, n], stride 0 on dims it lacks; read unless BIAS == "none"
    saved_ptr,  # saved[b0, b1, m, n]; written only if SAVE != "none"
    factor_ptr,  # factor[b0, b1, m, n]; read only if GRADIENT != "none"
    factor_desc,  # with FACTOR_TMA a descriptor over the factor as [b0, b1, m, n] ([b0, b1, n, m] if FACTOR_M_MAJOR)
    sums_ptr,  # fp32 partial sums [rows, M] (SUMS == "m") or [rows, N] (SUMS == "n"); rows: see _tile_epilogue
    B1, BATCHES, M, N, K,  # BATCHES = b0 * b1
    stride_ab0, stride_ab1, stride_am, stride_ak,  # unused with TMA
    stride_bb0, stride_bb1, stride_bk, stride_bn,  # unused with TMA
    stride_cb0, stride_cb1, stride_cm, stride_cn,
    stride_biasb0, stride_biasb1, stride_biasm, stride_biasn,
    stride_sb0, stride_sb1, stride_sm, stride_sn,
    stride_fb0, stride_fb1, stride_fm, stride_fn,
    factor_scale,  # GRADIENT == "relu": the factor's positive entries pass y times this
    alpha, drop_scale, threshold, seed, offset,  # kernels.philox.dropout_scale(p), keep_threshold(p)
    q1_b0, q2_b0, l0_b0, l1_b0, l2_b0,  # dropout index digits of b0 (see _digits)
    q1_b1, q2_b1, l0_b1, l1_b1, l2_b1,
    q1_m, q2_m, l0_m, l1_m, l2_m,
    q1_n, q2_n, l0_n, l1_n, l2_n,
    BIAS: tl.constexpr,  # "none"; "m" / "n": a vector along that dim (stride 0 on the other); "mn": a tile
    ACTIVATION: tl.constexpr,  # "none" | "relu" | "gelu"
    HAS_DROPOUT: tl.constexpr,
    GROUPED: tl.constexpr,  # dropout: "n" / "m": one Philox call per sixteen columns / rows (see _grouped); "none": per element
    INDEX_64: tl.constexpr,  # offset + logical index may pass 2**31: add them in int64
    SAVE: tl.constexpr,  # "none" | "pre_activation" | "pre_dropout"
    GRADIENT: tl.constexpr,  # "none" | "relu" | "gelu": y times that derivative of the factor (no bias, activation, dropout)
    SUMS: tl.constexpr,  # "none" | "m" | "n": partial sums of y along that dim (over the other and the batches)
    FACTOR_TMA: tl.constexpr,  # the factor's tiles through factor_desc (TMA) instead of a tile of pointers
    FACTOR_M_MAJOR: tl.constexpr,  # FACTOR_TMA: the factor's unit stride is along m
    TMA: tl.constexpr,  # A and B tiles through tensor descriptors (TMA on Hopper) instead of pointers
    A_M_MAJOR: tl.constexpr,  # TMA: A's unit stride is along m
    B_K_MAJOR: tl.constexpr,  # TMA: B's unit stride is along k
    STORE_TMA: tl.constexpr,  # C written through c_desc
    C_M_MAJOR: tl.constexpr,  # STORE_TMA: C's unit stride is along m
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along k
    FP32_DOT: tl.constexpr,  # dot in fp32 with exact (IEEE) products, not tf32 / bf16 tensor-core inputs
    ROUND_BF16: tl.constexpr,  # round to bf16 before the (truncating, in the interpreter) cast of C and saved
    EPILOGUE_SPLIT: tl.constexpr,  # 1, 2 or 4: the epilogue runs on column slices of the tile, one after another
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,  # each program loops over output tiles (grid: one program per SM)
):
    # Output tiles in batch-major order (consecutive tiles share a batch's A and B in L2): one per
    # program on a (tiles, batches) grid, or with PERSISTENT every num_programs-th on a grid of
    # about one program per multiprocessor.
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        first, step = tl.program_id(0), tl.num_programs(0)
    else:
        first, step = tl.program_id(1) * tiles + tl.program_id(0), tiles * BATCHES
    # With PERSISTENT, one loop over (tile, k) once Triton flattens it, so that the pipeline runs on
    # into the next tile's loads during this tile's epilogue; the epilogue takes its coordinates from
    # a counter of its own, so that nothing computed before the main loop stays live across it.
    tile_c = first - step
    for tile in tl.range(first, tiles * BATCHES, step, flatten=PERSISTENT):
        pid_m, pid_n, pid_b0, pid_b1 = _tile_coords(tile, tiles, M, N, B1, BLOCK_M, BLOCK_N, GROUP_M)
        acc, _ = _main_loop(a_src, b_src, b_src, pid_m, pid_n, pid_b0, pid_b1, M, N, K,
                            stride_ab0, stride_ab1, stride_am, stride_ak, stride_bb0, stride_bb1, stride_bk, stride_bn,
                            TMA, A_M_MAJOR, B_K_MAJOR, EVEN_K, FP32_DOT, False, BLOCK_M, BLOCK_N, BLOCK_K)
        tile_c += step
        pid_m, pid_n, pid_b0, pid_b1 = _tile_coords(tile_c, tiles, M, N, B1, BLOCK_M, BLOCK_N, GROUP_M)
        _tile_epilogue(acc, pid_m, pid_n, pid_b0, pid_b1, c_ptr, c_desc, bias_ptr, saved_ptr, factor_ptr, factor_desc, sums_ptr,
                       B1, M, N, stride_cb0, stride_cb1, stride_cm, stride_cn, stride_biasb0, stride_biasb1, stride_biasm,
                       stride_biasn, stride_sb0, stride_sb1, stride_sm, stride_sn, stride_fb0, stride_fb1, stride_fm,
                       stride_fn, factor_scale, alpha, drop_scale, threshold, seed,
                       offset, q1_b0, q2_b0, l0_b0, l1_b0, l2_b0, q1_b1, q2_b1, l0_b1, l1_b1, l2_b1,
                       q1_m, q2_m, l0_m, l1_m, l2_m, q1_n, q2_n, l0_n, l1_n, l2_n, BIAS, ACTIVATION, HAS_DROPOUT,
                       GROUPED, INDEX_64, SAVE, GRADIENT, SUMS, FACTOR_TMA, FACTOR_M_MAJOR, STORE_TMA, C_M_MAJOR,
                       ROUND_BF16, EPILOGUE_SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def _tile_coords(tile, tiles, M, N, B1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n, pid_b0, pid_b1) of output tile ``tile`` (batch-major; within a batch, grouped:
    GROUP_M row-tiles share their B column-tiles in L2)."""
    pid = tile % tiles
    pid_b = tile // tiles
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n, pid_b // B1, pid_b % B1


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a @ b in fp32 (``FP32_DOT``: the operands converted to fp32 first, IEEE products)."""
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _main_loop(a_src, b_src, b1_src, pid_m, pid_n, pid_b0, pid_b1, M, N, K,
               stride_ab0, stride_ab1, stride_am, stride_ak, stride_bb0, stride_bb1, stride_bk, stride_bn,
               TMA: tl.constexpr, A_M_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr, EVEN_K: tl.constexpr,
               FP32_DOT: tl.constexpr, PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] accumulator A @ B of one output tile (``_gemm_kernel``'s
    arguments), and with ``PAIR`` also A @ B1 (``b1_src``: laid out as ``b_src``; each A tile read
    once for both, ``kernels.gemm_join``'s pair mode); without, the second is zeros and ``b1_src``
    is not read."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:  # out-of-range rows / columns / k come in as zeros
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if A_M_MAJOR:
                a = a_src.load([pid_b0, pid_b1, kk * BLOCK_K, pid_m * BLOCK_M]).reshape(BLOCK_K, BLOCK_M).T
            else:
                a = a_src.load([pid_b0, pid_b1, pid_m * BLOCK_M, kk * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
            if B_K_MAJOR:
                b = b_src.load([pid_b0, pid_b1, pid_n * BLOCK_N, kk * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
                if PAIR:
                    b1 = b1_src.load([pid_b0, pid_b1, pid_n * BLOCK_N, kk * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b = b_src.load([pid_b0, pid_b1, kk * BLOCK_K, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
                if PAIR:
                    b1 = b1_src.load([pid_b0, pid_b1, kk * BLOCK_K, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
            acc = _dot(a, b, acc, FP32_DOT)
            if PAIR:
                acc1 = _dot(a, b1, acc1, FP32_DOT)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = (a_src + pid_b0.to(tl.int64) * stride_ab0 + pid_b1.to(tl.int64) * stride_ab1
                  + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak)
        b_offs = (pid_b0.to(tl.int64) * stride_bb0 + pid_b1.to(tl.int64) * stride_bb1
                  + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn)
        b_ptrs = b_src + b_offs
        b1_ptrs = b1_src + b_offs
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                b_mask = mask_n[None, :]
            else:
                k_left = K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b_mask = (offs_k[:, None] < k_left) & mask_n[None, :]
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            if PAIR:
                b1 = tl.load(b1_ptrs, mask=b_mask, other=0.0)
            acc = _dot(a, b, acc, FP32_DOT)
            if PAIR:
                acc1 = _dot(a, b1, acc1, FP32_DOT)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            if PAIR:
                b1_ptrs += BLOCK_K * stride_bk
    return acc, acc1


@triton.jit
def _tile_epilogue(acc, pid_m, pid_n, pid_b0, pid_b1, c_ptr, c_desc, bias_ptr, saved_ptr, factor_ptr, factor_desc, sums_ptr,
                   B1, M, N,
                   stride_cb0, stride_cb1, stride_cm, stride_cn, stride_biasb0, stride_biasb1, stride_biasm,
                   stride_biasn, stride_sb0, stride_sb1, stride_sm, stride_sn, stride_fb0, stride_fb1, stride_fm,
                   stride_fn, factor_scale, alpha, drop_scale, threshold, seed,
                   offset, q1_b0, q2_b0, l0_b0, l1_b0, l2_b0, q1_b1, q2_b1, l0_b1, l1_b1, l2_b1,
                   q1_m, q2_m, l0_m, l1_m, l2_m, q1_n, q2_n, l0_n, l1_n, l2_n,
                   BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_DROPOUT: tl.constexpr, GROUPED: tl.constexpr,
                   INDEX_64: tl.constexpr, SAVE: tl.constexpr, GRADIENT: tl.constexpr, SUMS: tl.constexpr,
                   FACTOR_TMA: tl.constexpr, FACTOR_M_MAJOR: tl.constexpr, STORE_TMA: tl.constexpr,
                   C_M_MAJOR: tl.constexpr, ROUND_BF16: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The epilogue of output tile (pid_m, pid_n) of batch (pid_b0, pid_b1) on the fp32 tile ``acc``,
    in EPILOGUE_SPLIT column slices (fewer live registers for Philox) (``_gemm_kernel``'s arguments)."""
    acc = acc * alpha
    base_c = c_ptr + pid_b0.to(tl.int64) * stride_cb0 + pid_b1.to(tl.int64) * stride_cb1
    base_bias = bias_ptr + pid_b0.to(tl.int64) * stride_biasb0 + pid_b1.to(tl.int64) * stride_biasb1
    base_saved = saved_ptr + pid_b0.to(tl.int64) * stride_sb0 + pid_b1.to(tl.int64) * stride_sb1
    base_factor = factor_ptr + pid_b0.to(tl.int64) * stride_fb0 + pid_b1.to(tl.int64) * stride_fb1
    # partial sums: this tile's first row of the partial buffer (one per batch, tile along the summed
    # dim and, for row sums, epilogue slice) and the row length
    if SUMS == "m":
        sums_row = ((pid_b0 * B1 + pid_b1) * tl.cdiv(N, BLOCK_N) + pid_n) * EPILOGUE_SPLIT
        base_sums = sums_ptr + sums_row.to(tl.int64) * M
    else:
        sums_row = (pid_b0 * B1 + pid_b1) * tl.cdiv(M, BLOCK_M) + pid_m
        base_sums = sums_ptr + sums_row.to(tl.int64) * N
    index_b = 0
    if HAS_DROPOUT:
        index_b = _digits(pid_b0, q1_b0, q2_b0, l0_b0, l1_b0, l2_b0) + _digits(pid_b1, q1_b1, q2_b1, l0_b1, l1_b1, l2_b1)
    if EPILOGUE_SPLIT == 1:
        _epilogue(acc, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, base_c, stride_cm, stride_cn, c_desc, pid_b0, pid_b1,
                  base_bias, stride_biasm, stride_biasn, base_saved, stride_sm, stride_sn, base_factor, stride_fm,
                  stride_fn, factor_desc, factor_scale, base_sums, drop_scale, threshold, seed,
                  offset, index_b, q1_m, q2_m, l0_m, l1_m, l2_m, q1_n, q2_n, l0_n, l1_n, l2_n, BIAS, ACTIVATION,
                  HAS_DROPOUT, GROUPED, INDEX_64, SAVE, GRADIENT, SUMS, FACTOR_TMA, FACTOR_M_MAJOR, STORE_TMA,
                  C_M_MAJOR, ROUND_BF16)
    else:  # column halves (then quarters): [0, BLOCK_N/2) and [BLOCK_N/2, BLOCK_N)
        left, right = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
        if EPILOGUE_SPLIT == 2:
            parts = (left, right)
        else:
            left_left, left_right = left.reshape(BLOCK_M, 2, BLOCK_N // 4).permute(0, 2, 1).split()
            right_left, right_right = right.reshape(BLOCK_M, 2, BLOCK_N // 4).permute(0, 2, 1).split()
            parts = (left_left, left_right, right_left, right_right)
        for h in tl.static_range(EPILOGUE_SPLIT):
            # row sums (SUMS == "m"): one partial row per slice; column sums: the slices' columns differ
            slice_sums = base_sums + h * M if SUMS == "m" else base_sums
            _epilogue(parts[h], pid_m * BLOCK_M, pid_n * BLOCK_N + h * (BLOCK_N // EPILOGUE_SPLIT), M, N,
                      base_c, stride_cm, stride_cn, c_desc, pid_b0, pid_b1, base_bias, stride_biasm, stride_biasn,
                      base_saved, stride_sm, stride_sn, base_factor, stride_fm, stride_fn, factor_desc, factor_scale,
                      slice_sums, drop_scale, threshold, seed, offset, index_b,
                      q1_m, q2_m, l0_m, l1_m, l2_m, q1_n, q2_n, l0_n, l1_n, l2_n,
                      BIAS, ACTIVATION, HAS_DROPOUT, GROUPED, INDEX_64, SAVE, GRADIENT, SUMS, FACTOR_TMA, FACTOR_M_MAJOR,
                      STORE_TMA, C_M_MAJOR, ROUND_BF16)


@triton.jit
def _epilogue(acc, m_start, n_start, M, N,
              c_ptr, stride_cm, stride_cn,  # C tile base (batch offsets applied)
              c_desc, pid_b0, pid_b1,  # with STORE_TMA: C's descriptor and the tile's batch coordinates
              bias_ptr, stride_biasm, stride_biasn,
              saved_ptr, stride_sm, stride_sn,
              factor_ptr, stride_fm, stride_fn,  # factor tile base (batch offsets applied)
              factor_desc, factor_scale,  # with FACTOR_TMA: the factor's descriptor (the tile's batch: pid_b0, pid_b1)
              sums_ptr,  # this slice's partial row (SUMS == "m": indexed by m) or its tile's (SUMS == "n": by n)
              drop_scale, threshold, seed, offset, index_b,  # index_b: the batch dims' share of the dropout index
              q1_m, q2_m, l0_m, l1_m, l2_m, q1_n, q2_n, l0_n, l1_n, l2_n,
              BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_DROPOUT: tl.constexpr, GROUPED: tl.constexpr,
              INDEX_64: tl.constexpr, SAVE: tl.constexpr, GRADIENT: tl.constexpr, SUMS: tl.constexpr,
              FACTOR_TMA: tl.constexpr, FACTOR_M_MAJOR: tl.constexpr, STORE_TMA: tl.constexpr,
              C_M_MAJOR: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Bias, activation, saves, dropout (or the factor's derivative and the partial sums) and the
    store of the slice of C whose rows start at m_start and columns at n_start (its extents: acc's
    shape; both starts multiples of the extents).  Grouped dropout draws in acc's layout: in the
    accumulator's each thread draws the Philox calls of its own columns."""
    offs_m = m_start + tl.arange(0, acc.shape[0])
    offs_n = n_start + tl.arange(0, acc.shape[1])
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if GRADIENT != "none":
        if FACTOR_TMA:  # rows / columns past M / N come in as zeros
            if FACTOR_M_MAJOR:
                factor = factor_desc.load([pid_b0, pid_b1, n_start, m_start]).reshape(acc.shape[1], acc.shape[0]).T
            else:
                factor = factor_desc.load([pid_b0, pid_b1, m_start, n_start]).reshape(acc.shape[0], acc.shape[1])
            factor = factor.to(tl.float32)
        else:
            factor = tl.load(factor_ptr + offs_m[:, None] * stride_fm + offs_n[None, :] * stride_fn, mask=mask,
                             other=0.0).to(tl.float32)
        if GRADIENT == "relu":
            acc = tl.where(factor > 0.0, acc * factor_scale, 0.0)
        else:  # d/dx of x sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3): s + 2 x s (1 - s) z'
            s = tl.sigmoid(1.5957691216057308 * (factor + 0.044715 * factor * factor * factor))
            acc = acc * (s + factor * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 3 * 0.044715 * factor * factor))
        if SUMS == "m":
            tl.store(sums_ptr + offs_m, tl.sum(tl.where(mask, acc, 0.0), axis=1), mask=offs_m < M)
        elif SUMS == "n":
            tl.store(sums_ptr + offs_n, tl.sum(tl.where(mask, acc, 0.0), axis=0), mask=offs_n < N)
    if BIAS == "m":
        acc += tl.load(bias_ptr + offs_m * stride_biasm, mask=offs_m < M, other=0.0).to(tl.float32)[:, None]
    elif BIAS == "n":
        acc += tl.load(bias_ptr + offs_n * stride_biasn, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    elif BIAS == "mn":
        bias_ptrs = bias_ptr + offs_m[:, None] * stride_biasm + offs_n[None, :] * stride_biasn
        acc += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
    saved_ptrs = saved_ptr + offs_m[:, None] * stride_sm + offs_n[None, :] * stride_sn
    if SAVE == "pre_activation":
        tl.store(saved_ptrs, (round_bf16(acc) if ROUND_BF16 else acc).to(saved_ptr.dtype.element_ty), mask=mask)
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "gelu":
        # 0.5 x (1 + tanh(z)) == x sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3)
        acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
    if SAVE == "pre_dropout":
        tl.store(saved_ptrs, (round_bf16(acc) if ROUND_BF16 else acc).to(saved_ptr.dtype.element_ty), mask=mask)
    if HAS_DROPOUT:
        if GROUPED == "n":  # column c of the call block: the logical index of column n_start + 16c, (counter // 16) its call
            call_n = n_start + 16 * tl.arange(0, acc.shape[1] // 16)
            first = (index_b + _digits(offs_m, q1_m, q2_m, l0_m, l1_m, l2_m)[:, None]
                     + _digits(call_n, q1_n, q2_n, l0_n, l1_n, l2_n)[None, :])
        elif GROUPED == "m":  # the same along rows, on the transposed tile
            call_m = m_start + 16 * tl.arange(0, acc.shape[0] // 16)
            first = (index_b + _digits(offs_n, q1_n, q2_n, l0_n, l1_n, l2_n)[:, None]
                     + _digits(call_m, q1_m, q2_m, l0_m, l1_m, l2_m)[None, :])
        else:
            first = (index_b + _digits(offs_m, q1_m, q2_m, l0_m, l1_m, l2_m)[:, None]
                     + _digits(offs_n, q1_n, q2_n, l0_n, l1_n, l2_n)[None, :])
        if INDEX_64:
            first = first.to(tl.int64)
        if GROUPED == "n":
            keep = dropout_keep_grouped(seed, (offset + first) >> 4, threshold)
        elif GROUPED == "m":
            keep = tl.trans(dropout_keep_grouped(seed, (offset + first) >> 4, threshold))
        else:
            keep = dropout_keep(seed, offset, first, threshold)
        acc = tl.where(keep, acc * drop_scale, 0.0)
    out = (round_bf16(acc) if ROUND_BF16 else acc).to(c_ptr.dtype.element_ty)
    if STORE_TMA:  # rows / columns past M / N are not written
        if C_M_MAJOR:
            c_desc.store([pid_b0, pid_b1, n_start, m_start], out.T.reshape(1, 1, acc.shape[1], acc.shape[0]))
        else:
            c_desc.store([pid_b0, pid_b1, m_start, n_start], out.reshape(1, 1, acc.shape[0], acc.shape[1]))
    else:
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, out, mask=mask)


def _grouped(digits: tuple, offset: int, tile: tuple[int, int]) -> str:
    """Along which dim of C dropout decisions come sixteen per Philox call: "n" (or "m") when that
    dim's inner digit is the output's last logical letter (l0 == 1) over a multiple of 64 (q1),
    every other logical stride and ``offset`` are multiples of 64 and so is the epilogue's extent
    along that dim (``tile``: its rows and columns, ``BLOCK_M`` and ``BLOCK_N // EPILOGUE_SPLIT``),
    so that each aligned group of 64 consecutive columns (rows) is four calls (``dataflow.dropout_mask``);
    "none" otherwise.  ``digits``: the four ``(q1, q2, l0, l1, l2)`` of (b0, b1, m, n)."""
    for dim, name, extent in ((3, "n", tile[1]), (2, "m", tile[0])):
        q1, _, l0, l1, l2 = digits[dim]
        others = [l1, l2] + [l for other, d in enumerate(digits) if other != dim for l in d[2:]]
        if (l0 == 1 and all(x % DECISION_GROUP == 0 for x in (q1, offset, extent))
                and all(l % DECISION_GROUP == 0 for l in others)):
            return name
    return "none"


def _epilogue_split(config: GemmConfig, dropout: bool) -> int:
    """Column slices for the epilogue: dropout on more than ~32 elements per thread at once spills
    registers (measured with four decisions per Philox call, an earlier convention:
    benchmarks/results/dropout_quads.md); slices keep whole groups of 64 columns where the tile has them."""
    if config.epilogue_split:
        return config.epilogue_split
    if not dropout:
        return 1
    per_thread = config.block_m * config.block_n // (32 * config.num_warps)
    narrowest = DECISION_GROUP if config.block_n >= DECISION_GROUP else 16
    split = 1
    while split < 4 and per_thread // split > 32 and config.block_n // (2 * split) >= narrowest:
        split *= 2
    return split


def _bias_along(bias: torch.Tensor | None, strides: tuple[int, int, int, int]) -> str:
    """The epilogue's BIAS: "none", "m" / "n" for a bias that varies along that dim only (of the
    tile's; it may vary by batch), "mn" otherwise."""
    if bias is None:
        return "none"
    return {(True, False): "m", (False, True): "n"}.get((strides[2] != 0, strides[3] != 0), "mn")


def _slice_descriptor(t: torch.Tensor, shape: GemmShape, strides: tuple[int, int, int, int], config: GemmConfig,
                      split: int) -> tuple[TensorDescriptor, bool] | None:
    """(descriptor over ``t``, an operand shaped as C, in blocks of one epilogue slice; whether its
    unit stride is along m), or None where TMA cannot address it (``_tma_view``)."""
    view = _tma_view(t, (shape.b0, shape.b1, shape.m, shape.n), strides)
    if view is None:
        return None
    columns = config.block_n // split
    block = [1, 1, columns, config.block_m] if view[2] else [1, 1, config.block_m, columns]
    return TensorDescriptor(t, list(view[0]), list(view[1]), block), view[2]


def _operand_sources(a: torch.Tensor, b: torch.Tensor, shape: GemmShape, a_strides: tuple[int, int, int, int],
                     b_strides: tuple[int, int, int, int], config: GemmConfig):
    """(A's source, B's source, A's unit stride along m?, B's along k?) for ``_main_loop``: the tensors
    themselves, or with ``config.tma`` descriptors over them in blocks of the tile (``_tma_view``)."""
    if not config.tma:
        return a, b, False, False
    a_view = _tma_view(a, (shape.b0, shape.b1, shape.m, shape.k), a_strides)
    b_view = _tma_view(b, (shape.b0, shape.b1, shape.k, shape.n), b_strides)
    if a_view is None or b_view is None:
        raise ValueError(f"config {config} needs TMA-compatible A and B (see tma_compatible)")
    a_m_major, b_k_major = a_view[2], b_view[2]
    a_block = [1, 1, config.block_k, config.block_m] if a_m_major else [1, 1, config.block_m, config.block_k]
    b_block = [1, 1, config.block_n, config.block_k] if b_k_major else [1, 1, config.block_k, config.block_n]
    return (TensorDescriptor(a, list(a_view[0]), list(a_view[1]), a_block),
            TensorDescriptor(b, list(b_view[0]), list(b_view[1]), b_block), a_m_major, b_k_major)


@functools.cache
def _programs(device: torch.device) -> int:
    """Programs of a persistent grid on ``device``: its multiprocessors (the interpreter: a few)."""
    if interpreted() or device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, shape: GemmShape,
         a_strides: tuple[int, int, int, int], b_strides: tuple[int, int, int, int], c_strides: tuple[int, int, int, int], *,
         alpha: float = 1.0, bias: torch.Tensor | None = None, bias_strides: tuple[int, int, int, int] = (0, 0, 0, 0),
         activation: str = "none", dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
         dropout_digits: tuple[tuple[int, int, int, int, int], ...] | None = None,
         saved: torch.Tensor | None = None, saved_strides: tuple[int, int, int, int] | None = None, save: str | None = None,
         gradient: str = "none", factor: torch.Tensor | None = None,
         factor_strides: tuple[int, int, int, int] = (0, 0, 0, 0), factor_scale: float = 1.0,
         sums: torch.Tensor | None = None, sums_along: str = "none", sums_stride: int = 1,
         config: GemmConfig | None = None) -> torch.Tensor:
    """Launch the template; ``c`` (and ``saved``, ``sums``) are written in place and ``c`` is returned.

    ``a``, ``b``, ``c``, ``bias``, ``saved``, ``factor`` are tensors whose first element is element 0 of the
    operand; everything else is addressed through the strides, in elements, ordered (b0, b1, m, k)
    for A, (b0, b1, k, n) for B and (b0, b1, m, n) for C, bias, saved and factor.  ``dropout_digits``: four
    ``(q1, q2, l0, l1, l2)`` (b0, b1, m, n), required when ``dropout_p > 0``.  With ``gradient``
    ("relu" / "gelu"), C is the product times that derivative of ``factor`` (relu: times
    ``factor_scale`` where the factor is positive) and, given ``sums_along`` ("m" / "n"), ``sums``
    (M or N elements ``sums_stride`` apart, any dtype) gets C's fp32 sums along that dim, over the
    other and the batches, by a second kernel.  A join epilogue's launch is ``kernels.gemm_join.gemm_join``.
    """
    if a.dtype != b.dtype or a.dtype not in DTYPES or c.dtype not in DTYPES:
        raise TypeError(f"A {a.dtype}, B {b.dtype}, C {c.dtype}: A and B alike, each of {DTYPES}")
    if activation not in ("none", "relu", "gelu"):
        raise ValueError(f"activation {activation!r}")
    save = save or "none"
    if save not in SAVES or (save != "none") != (saved is not None):
        raise ValueError(f"save {save!r} needs a saved tensor, and only then")
    if not 0.0 <= dropout_p < 1.0 or (dropout_p > 0 and dropout_digits is None):
        raise ValueError(f"dropout_p {dropout_p} must be in [0, 1), and > 0 needs dropout_digits")
    if gradient not in GRADIENTS or (gradient != "none") != (factor is not None):
        raise ValueError(f"gradient {gradient!r} needs a factor, and only then")
    if gradient != "none" and (bias is not None or activation != "none" or dropout_p > 0 or save != "none"):
        raise ValueError("a gradient epilogue takes no bias, activation, dropout or save")
    if sums_along not in ("none", "m", "n") or (sums_along != "none") != (sums is not None) \
            or (sums is not None and gradient == "none"):
        raise ValueError(f"sums along {sums_along!r} need a sums tensor and a gradient, and only then")
    for t in (a, b, c, bias, saved, factor):
        if t is not None and t.numel() >= 2**31:
            raise ValueError("operands must hold fewer than 2**31 elements (int32 offsets)")
    config = config or valid_configs(a.dtype)[0]
    digits = dropout_digits or ((1, 1, 0, 0, 0),) * 4
    split = _epilogue_split(config, dropout_p > 0)
    grouped = _grouped(digits, offset, (config.block_m, config.block_n // split)) if dropout_p > 0 else "none"
    a_src, b_src, a_m_major, b_k_major = _operand_sources(a, b, shape, a_strides, b_strides, config)
    c_desc, c_m_major = c, False
    if config.store_tma:
        c_tiles = _slice_descriptor(c, shape, c_strides, config, split)
        if not config.tma or c_tiles is None:
            raise ValueError(f"config {config} needs tma and a TMA-compatible C (see tma_compatible)")
        c_desc, c_m_major = c_tiles
    factor_desc, factor_m_major = c, False  # the factor's tiles through a descriptor where it allows, with TMA reads
    if factor is not None and config.tma:
        factor_desc, factor_m_major = _slice_descriptor(factor, shape, factor_strides, config, split) or (c, False)
    tiles, batches = ceil_div(shape.m, config.block_m) * ceil_div(shape.n, config.block_n), shape.b0 * shape.b1
    grid = (min(tiles * batches, _programs(a.device)), 1) if config.persistent else (tiles, batches)
    partial = c
    if sums is not None:  # one row per (batch, tile along the summed dim[, epilogue slice]): _tile_epilogue
        rows = batches * (ceil_div(shape.n, config.block_n) * split if sums_along == "m" else ceil_div(shape.m, config.block_m))
        partial = torch.empty((rows, shape.m if sums_along == "m" else shape.n), dtype=torch.float32, device=c.device)
    through_jit(_gemm_kernel, grid)(
        a_src, b_src, c, c_desc, c if bias is None else bias, c if saved is None else saved,
        c if factor is None else factor, factor_desc, partial,
        shape.b1, batches, shape.m, shape.n, shape.k,
        *a_strides, *b_strides, *c_strides, *bias_strides, *(saved_strides or (0, 0, 0, 0)), *factor_strides,
        factor_scale, alpha, dropout_scale(dropout_p), keep_threshold(dropout_p), seed, offset,
        *digits[0], *digits[1], *digits[2], *digits[3],
        BIAS=_bias_along(bias, bias_strides), ACTIVATION=activation, HAS_DROPOUT=dropout_p > 0, GROUPED=grouped,
        INDEX_64=dropout_p > 0 and offset + c.numel() >= 2**31, SAVE=save, GRADIENT=gradient, SUMS=sums_along,
        FACTOR_TMA=factor_desc is not c, FACTOR_M_MAJOR=factor_m_major,
        TMA=config.tma, A_M_MAJOR=a_m_major, B_K_MAJOR=b_k_major, STORE_TMA=config.store_tma, C_M_MAJOR=c_m_major,
        EVEN_K=shape.k % config.block_k == 0,
        EPILOGUE_SPLIT=split,
        # The interpreter's tl.dot multiplies bf16 storage bits (uint16) as integers, and its
        # fp32 -> bf16 cast truncates: there, upcast before the dot and round before the store.
        FP32_DOT=a.dtype == torch.float32 or (interpreted() and a.dtype == torch.bfloat16),
        ROUND_BF16=interpreted() and c.dtype == torch.bfloat16,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        PERSISTENT=config.persistent, num_stages=config.num_stages, num_warps=config.num_warps,
    )
    if sums is not None:
        columns = partial.shape[1]
        through_jit(_sum_partials_kernel, (ceil_div(columns, SUM_PARTIAL_COLUMNS),))(
            partial, sums, partial.shape[0], columns, sums_stride, ROUND_BF16=interpreted() and sums.dtype == torch.bfloat16,
            BLOCK_COLUMNS=SUM_PARTIAL_COLUMNS, BLOCK_ROWS=SUM_PARTIAL_ROWS)
    return c


@triton.jit
def _sum_partials_kernel(partial_ptr, sums_ptr, ROWS, COLUMNS, stride_sums, ROUND_BF16: tl.constexpr,
                         BLOCK_COLUMNS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """sums[c * stride_sums] = sum over r of partial[r, c] (fp32 [ROWS, COLUMNS], row-major), in row
    order: the same result on every run."""
    columns = tl.program_id(0) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLUMNS), dtype=tl.float32)
    for first in range(0, ROWS, BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS)
        acc += tl.load(partial_ptr + rows.to(tl.int64)[:, None] * COLUMNS + columns[None, :],
                       mask=(rows < ROWS)[:, None] & (columns < COLUMNS)[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(sums_ptr + columns * stride_sums, (round_bf16(total) if ROUND_BF16 else total).to(sums_ptr.dtype.element_ty),
             mask=columns < COLUMNS)
