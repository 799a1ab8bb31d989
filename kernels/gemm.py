"""Triton batched-GEMM template: any strides, fp32 accumulation, fused element-wise epilogue.

Computes, for every (b0, b1, m, n),

    y = alpha * sum_k A[b0, b1, m, k] * B[b0, b1, k, n]        (fp32 accumulator)
    y = y + bias[b0, b1, m, n]                                  (optional; bias broadcast by stride 0)
    saved = y                                                   (optional, save="pre_activation")
    y = relu(y) | gelu_tanh(y)                                  (optional)
    saved = y                                                   (optional, save="pre_dropout")
    y = keep ? y / (1 - p) : 0                                  (optional dropout)
    C[b0, b1, m, n] = y

Every operand is addressed by one element stride per GEMM dim (two batch dims, then m/k, k/n or
m/n), so one kernel serves every storage layout that ``kernels.contraction`` maps to a GEMM.
Dropout keeps element e iff ``kernels.philox.dropout_keep(seed, offset, n(e), p)``, where n(e) is
its logical row-major index over the output's letters in spec order, assembled from per-dim digits
``(q1, q2, l0, l1, l2)``: a dim's flat index f adds ``(f % q1)*l0 + ((f // q1) % q2)*l1 +
(f // (q1*q2))*l2`` (``kernels.contraction.dropout_digits`` derives them).  The mask therefore equals
``dataflow.dropout_mask.keep_mask(seed, offset, out_logical_shape, p)`` in any layout.

Inputs bf16, fp16 or fp32 (A and B alike; fp32 uses IEEE dot products, as do bf16 inputs under the
CPU interpreter, whose tl.dot mishandles bf16 and whose bf16 cast truncates), outputs any of the three.
``saved`` has C's dtype.
Offsets inside a batch are int32: each operand must hold fewer than 2**31 elements.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.philox import dropout_keep

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SAVES = ("none", "pre_activation", "pre_dropout")


@dataclass(frozen=True)
class GemmConfig:
    """Knobs of one compiled variant: tile sizes, grouped (swizzled) launch order, pipelining, warps."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} s{self.num_stages} w{self.num_warps}"


# Curated for Hopper (228 KB shared memory per SM; bf16 tiles: stage bytes = 2*(BM*BK + BK*BN)).
HOPPER_CONFIGS = (
    GemmConfig(128, 256, 64, 8, 3, 8),
    GemmConfig(256, 128, 64, 8, 3, 8),
    GemmConfig(128, 128, 64, 8, 4, 8),
    GemmConfig(128, 128, 64, 8, 4, 4),
    GemmConfig(128, 64, 64, 8, 4, 4),
    GemmConfig(64, 128, 64, 8, 4, 4),
    GemmConfig(64, 64, 64, 8, 4, 4),
)
# Tiny tiles for the CPU interpreter (tl.dot needs every block dim >= 16).
INTERPRETER_CONFIGS = (
    GemmConfig(16, 32, 16, 2, 1, 4),
    GemmConfig(32, 16, 32, 1, 1, 4),
)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def valid_configs() -> tuple[GemmConfig, ...]:
    """The configs to try on this machine: the interpreter's tiny set, or the Hopper set."""
    return INTERPRETER_CONFIGS if interpreted() else HOPPER_CONFIGS


class GemmShape(NamedTuple):
    b0: int
    b1: int
    m: int
    n: int
    k: int


@triton.jit
def _digits(f, q1, q2, l0, l1, l2):
    """Logical-index term (int64) of a GEMM dim's flat index ``f`` (scalar or block)."""
    return (f % q1).to(tl.int64) * l0 + ((f // q1) % q2).to(tl.int64) * l1 + (f // (q1 * q2)).to(tl.int64) * l2


@triton.jit
def _round_bf16(x):
    """fp32 block rounded to the nearest bf16 value (ties to even), still fp32: the interpreter's cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _gemm_kernel(
    a_ptr,  # A[b0, b1, m, k]
    b_ptr,  # B[b0, b1, k, n]
    c_ptr,  # C[b0, b1, m, n]
    bias_ptr,  # bias[b0, b1, m, n], stride 0 on dims it lacks; read only if HAS_BIAS
    saved_ptr,  # saved[b0, b1, m, n]; written only if SAVE != "none"
    B1, M, N, K,
    stride_ab0, stride_ab1, stride_am, stride_ak,
    stride_bb0, stride_bb1, stride_bk, stride_bn,
    stride_cb0, stride_cb1, stride_cm, stride_cn,
    stride_biasb0, stride_biasb1, stride_biasm, stride_biasn,
    stride_sb0, stride_sb1, stride_sm, stride_sn,
    alpha, p, seed, offset,
    q1_b0, q2_b0, l0_b0, l1_b0, l2_b0,  # dropout index digits of b0 (see _digits)
    q1_b1, q2_b1, l0_b1, l1_b1, l2_b1,
    q1_m, q2_m, l0_m, l1_m, l2_m,
    q1_n, q2_n, l0_n, l1_n, l2_n,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "none" | "relu" | "gelu"
    HAS_DROPOUT: tl.constexpr,
    SAVE: tl.constexpr,  # "none" | "pre_activation" | "pre_dropout"
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along k
    FP32_DOT: tl.constexpr,  # dot in fp32 with exact (IEEE) products, not tf32 / bf16 tensor-core inputs
    ROUND_BF16: tl.constexpr,  # round to bf16 before the (truncating, in the interpreter) cast of C and saved
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order of output tiles: GROUP_M row-tiles share their B column-tiles in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    pid_b = tl.program_id(1)
    pid_b0 = (pid_b // B1).to(tl.int64)
    pid_b1 = (pid_b % B1).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + pid_b0 * stride_ab0 + pid_b1 * stride_ab1 + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + pid_b0 * stride_bb0 + pid_b1 * stride_bb1 + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # Epilogue on the fp32 tile.
    mask = mask_m[:, None] & mask_n[None, :]
    acc = acc * alpha
    if HAS_BIAS:
        bias_ptrs = (bias_ptr + pid_b0 * stride_biasb0 + pid_b1 * stride_biasb1
                     + offs_m[:, None] * stride_biasm + offs_n[None, :] * stride_biasn)
        acc += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
    saved_ptrs = saved_ptr + pid_b0 * stride_sb0 + pid_b1 * stride_sb1 + offs_m[:, None] * stride_sm + offs_n[None, :] * stride_sn
    if SAVE == "pre_activation":
        tl.store(saved_ptrs, (_round_bf16(acc) if ROUND_BF16 else acc).to(saved_ptr.dtype.element_ty), mask=mask)
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "gelu":
        # 0.5 x (1 + tanh(z)) == x sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3)
        acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
    if SAVE == "pre_dropout":
        tl.store(saved_ptrs, (_round_bf16(acc) if ROUND_BF16 else acc).to(saved_ptr.dtype.element_ty), mask=mask)
    if HAS_DROPOUT:
        index = (_digits(pid_b0, q1_b0, q2_b0, l0_b0, l1_b0, l2_b0) + _digits(pid_b1, q1_b1, q2_b1, l0_b1, l1_b1, l2_b1)
                 + _digits(offs_m, q1_m, q2_m, l0_m, l1_m, l2_m)[:, None]
                 + _digits(offs_n, q1_n, q2_n, l0_n, l1_n, l2_n)[None, :])
        keep = dropout_keep(seed, offset, index, p)
        acc = tl.where(keep, acc * (1.0 / (1.0 - p)), 0.0)
    c_ptrs = c_ptr + pid_b0 * stride_cb0 + pid_b1 * stride_cb1 + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, (_round_bf16(acc) if ROUND_BF16 else acc).to(c_ptr.dtype.element_ty), mask=mask)


def gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, shape: GemmShape,
         a_strides: tuple[int, int, int, int], b_strides: tuple[int, int, int, int], c_strides: tuple[int, int, int, int], *,
         alpha: float = 1.0, bias: torch.Tensor | None = None, bias_strides: tuple[int, int, int, int] = (0, 0, 0, 0),
         activation: str = "none", dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
         dropout_digits: tuple[tuple[int, int, int, int, int], ...] | None = None,
         saved: torch.Tensor | None = None, saved_strides: tuple[int, int, int, int] | None = None, save: str | None = None,
         config: GemmConfig | None = None) -> torch.Tensor:
    """Launch the template; ``c`` (and ``saved``) are written in place and ``c`` is returned.

    ``a``, ``b``, ``c``, ``bias``, ``saved`` are tensors whose first element is element 0 of the
    operand; everything else is addressed through the strides, in elements, ordered (b0, b1, m, k)
    for A, (b0, b1, k, n) for B and (b0, b1, m, n) for C, bias and saved.  ``dropout_digits``: four
    ``(q1, q2, l0, l1, l2)`` (b0, b1, m, n), required when ``dropout_p > 0``.
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
    for t in (a, b, c, bias, saved):
        if t is not None and t.numel() >= 2**31:
            raise ValueError("operands must hold fewer than 2**31 elements (int32 offsets)")
    config = config or valid_configs()[0]
    digits = dropout_digits or ((1, 1, 0, 0, 0),) * 4
    grid = (triton.cdiv(shape.m, config.block_m) * triton.cdiv(shape.n, config.block_n), shape.b0 * shape.b1)
    _gemm_kernel[grid](
        a, b, c, c if bias is None else bias, c if saved is None else saved,
        shape.b1, shape.m, shape.n, shape.k,
        *a_strides, *b_strides, *c_strides, *bias_strides, *(saved_strides or (0, 0, 0, 0)),
        alpha, dropout_p, seed, offset,
        *digits[0], *digits[1], *digits[2], *digits[3],
        HAS_BIAS=bias is not None, ACTIVATION=activation, HAS_DROPOUT=dropout_p > 0, SAVE=save,
        EVEN_K=shape.k % config.block_k == 0,
        # The interpreter's tl.dot multiplies bf16 storage bits (uint16) as integers, and its
        # fp32 -> bf16 cast truncates: there, upcast before the dot and round before the store.
        FP32_DOT=a.dtype == torch.float32 or (interpreted() and a.dtype == torch.bfloat16),
        ROUND_BF16=interpreted() and c.dtype == torch.bfloat16,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_stages=config.num_stages, num_warps=config.num_warps,
    )
    return c
