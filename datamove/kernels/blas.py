"""cuBLAS GEMMs called on device pointers through cuBLASLt, without PyTorch's dispatcher.

``vc.addmm_(va, vb, beta=0)`` costs 30-50 us of host time on a slow GPU host (argument parsing,
dispatch, shape and layout checks, the views it is called on, then ``cublasGemmEx``'s own
algorithm lookup), for a GEMM the device runs in 15-140 us.  ``DirectGemm`` derives the GEMM's
cuBLAS arguments once from the three views; ``LtMatmul`` turns them into cuBLASLt descriptors and
asks cuBLASLt's heuristic for its first algorithm once, then each call is one ``cublasLtMatmul``
through ``ctypes`` on new pointers (H200 host: the layer's 12 GEMMs launched plainly took 2.52 ms
of wall per fwd+bwd through ``addmm_``, 2.17 through ``cublasGemmEx`` on pointers, 2.03 this way).
The heuristic's first algorithm was the kernel PyTorch's ``cublasGemmEx`` runs wherever checked:
the same kernel names in the BERT-large layer's profile (H200), results bitwise equal on every
layout ``tests/test_blas.py`` tries on the GPU.  The tuning also times the heuristic's next
algorithms (``ALGORITHMS``: other tiles, clusters, split-K) and a plan's cuBLAS step may name one
(its config's ``algorithm``), made through this call only.

Used only where PyTorch's settings are those under which it makes that call (``settings()``:
cuBLAS the preferred backend, reduced precision reductions with split-K allowed, no fp16
accumulation, no SM carveout) and for bf16 / fp16 operands with unambiguous strides;
``LtMatmul.of`` returns None otherwise, and without cuBLASLt in the process, and the caller goes
through PyTorch.

Layouts: row-major math, ``C[M, N] = A[M, K] @ B[K, N]`` (a leading batch dim on all three for the
batched call).  cuBLAS is column-major: a matrix with unit column stride is its transpose there, so
a row-major C is computed as ``C^T = B^T A^T`` (B first), a column-major C as ``C = A B``.

Memory: one handle per device; algorithms that need a workspace get one of ``WORKSPACE_BYTES``
per device and stream (as PyTorch keeps one per handle and stream), allocated on first use.
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch

OP_N, OP_T = 0, 1  # cublasOperation_t
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14  # cudaDataType_t
COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
DATA_TYPES = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}
TRANSA, TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
BATCH_COUNT, BATCH_STRIDE = 5, 6  # cublasLtMatrixLayoutAttribute_t
MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
WORKSPACE_BYTES = 32 * 1024 * 1024  # PyTorch's cuBLAS workspace on Hopper
# The heuristic's algorithms the tuning times per cuBLAS call (``harness.contraction_variants``): H100,
# BERT-large's GEMMs alone (L2 flushed), the fastest of the first eight against the first: 1.00-1.07x,
# the 1024-wide ones 1.04-1.07x; B=8 L=512 the ten distinct calls 360.8 -> 354.1 us, B=96 L=128 716.0 -> 698.6.
ALGORITHMS = 8

_WORKSPACES: dict[tuple[int, int], torch.Tensor] = {}  # (device index, stream) -> workspace


def _mapped_library(name: str):
    """The already loaded library whose file name starts with ``name``, found by its path in
    this process's memory map (never a second copy loaded), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if f"/{name}" in line})
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
    return None


@functools.cache
def _lt():
    """(cuBLASLt as PyTorch loaded it, its entry points typed; handles by device), or None; found once."""
    library = _mapped_library("libcublasLt.so")
    if library is None:
        return None
    p, i, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    library.cublasLtMatmul.argtypes = [p, p, p, p, p, p, p, p, p, p, p, p, p, p, size, p]
    library.cublasLtMatrixLayoutCreate.argtypes = [p, i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    library.cublasLtMatmulDescCreate.argtypes = [p, i, i]
    for name in ("cublasLtMatmulDescSetAttribute", "cublasLtMatrixLayoutSetAttribute",
                 "cublasLtMatmulPreferenceSetAttribute"):
        getattr(library, name).argtypes = [p, i, p, size]
    library.cublasLtMatmulAlgoGetHeuristic.argtypes = [p, p, p, p, p, p, p, i, p, p]
    for name in ("cublasLtMatmulDescDestroy", "cublasLtMatrixLayoutDestroy", "cublasLtMatmulPreferenceDestroy"):
        getattr(library, name).argtypes = [p]
    return library, {}


def _reduction_allowed(value) -> bool:
    """PyTorch's reduced-precision reduction setting (a bool, or (allowed, split-K allowed) since 2.12)."""
    return all(value) if isinstance(value, tuple) else bool(value)


def settings() -> tuple:
    """What decides whether PyTorch's own GEMM is the one ``LtMatmul`` makes (read per call of a
    program: a user may change them between calls)."""
    carveout = getattr(torch._C, "_get_sm_carveout_experimental", lambda: None)()
    return (torch._C._get_blas_preferred_backend() == torch._C._BlasBackend.Cublas,
            _reduction_allowed(torch._C._get_cublas_allow_bf16_reduced_precision_reduction()),
            _reduction_allowed(torch._C._get_cublas_allow_fp16_reduced_precision_reduction()),
            not torch._C._get_cublas_allow_fp16_accumulation(), carveout is None)


DEFAULT_SETTINGS = (True, True, True, True, True)


def _operand(t: torch.Tensor, transpose: bool) -> tuple[int, int] | None:
    """(op, leading dim) under which cuBLAS reads matrix ``t`` (its last two dims), or its
    transpose where ``transpose``, from ``t``'s memory; None where neither stride is 1 or a dim
    is 1 (strides ambiguous)."""
    rows, cols = t.shape[-2:]
    row_stride, col_stride = t.stride()[-2:]
    if rows == 1 or cols == 1:
        return None
    if row_stride == 1 and col_stride >= rows:  # column-major: cuBLAS's own order, t as it is
        return (OP_T if transpose else OP_N), col_stride
    if col_stride == 1 and row_stride >= cols:  # row-major: cuBLAS reads t's transpose
        return (OP_N if transpose else OP_T), row_stride
    return None


@dataclass(frozen=True)
class DirectGemm:
    """The cuBLAS arguments of one ``vc = va @ vb`` (beta 0).  ``swapped``: B is cuBLAS's first
    operand (C row-major)."""

    args: tuple  # (op first, op second, m, n, k, ld first, ld second, ld C), column-major as cuBLAS takes them
    strides: tuple | None  # batch strides (first, second, C) in elements, None for one matrix
    batch: int
    data_type: int
    swapped: bool

    @classmethod
    def derive(cls, va: torch.Tensor, vb: torch.Tensor, vc: torch.Tensor) -> "DirectGemm | None":
        """The call computing ``vc = va @ vb`` (2-D, or 3-D batched over dim 0) from the views'
        shapes, strides and dtype (any device), or None where it cannot be made (module doc)."""
        if va.dtype not in DATA_TYPES or not va.dtype == vb.dtype == vc.dtype or not va.dim() == vb.dim() == vc.dim() \
                or va.dim() not in (2, 3):
            return None
        m, n = vc.shape[-2:]
        k = va.shape[-1]
        if vc.stride(-1) == 1 and vc.stride(-2) >= n:  # row-major C: C^T = B^T A^T
            first, second, ldc, swapped, rows, cols = _operand(vb, True), _operand(va, True), vc.stride(-2), True, n, m
        elif vc.stride(-2) == 1 and vc.stride(-1) >= m:  # column-major C: C = A B
            first, second, ldc, swapped, rows, cols = _operand(va, False), _operand(vb, False), vc.stride(-1), False, m, n
        else:
            return None
        if first is None or second is None:  # _operand refuses a dim of 1 in A (m, k) or B (k, n): none in C either
            return None
        strides = None
        if vc.dim() == 3:
            a_first, b_second = (vb, va) if swapped else (va, vb)
            strides = (a_first.stride(0), b_second.stride(0), vc.stride(0))
        return cls((first[0], second[0], rows, cols, k, first[1], second[1], ldc), strides,
                   vc.shape[0] if vc.dim() == 3 else 1, DATA_TYPES[vc.dtype], swapped)

    def operands(self, pa, pb, pc) -> tuple:
        """(first, second, C) as cuBLAS takes them, from A's, B's and C's pointers."""
        return (pb, pa, pc) if self.swapped else (pa, pb, pc)


def _checked(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"cuBLASLt {what}: status {status}")


class LtMatmul:
    """A ``DirectGemm`` as a cuBLASLt matmul on one device, its descriptors and algorithm found
    once (``algorithm``: the index in cuBLASLt's heuristic's list, 0 its first, PyTorch's);
    ``__call__(pa, pb, pc)``: the GEMM on A's, B's and C's data pointers (tensors laid out as the
    views it was made from), on the current stream."""

    def __init__(self, gemm: DirectGemm, device: int, algorithm: int = 0):
        library, handles = _lt()
        self.library, self.gemm, self.device = library, gemm, device
        with torch.cuda.device(device):
            if device not in handles:
                handle = ctypes.c_void_p()
                _checked(library.cublasLtCreate(ctypes.byref(handle)), "create")
                handles[device] = handle
            self.handle = handles[device]
            self.desc, self.layouts = ctypes.c_void_p(), []
            _checked(library.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, CUDA_R_32F), "matmul desc")
            op_a, op_b, m, n, k, lda, ldb, ldc = gemm.args
            for attribute, op in ((TRANSA, op_a), (TRANSB, op_b)):
                value = ctypes.c_int32(op)
                _checked(library.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value), 4), "op")
            stored = [((m, k) if op_a == OP_N else (k, m), lda), ((k, n) if op_b == OP_N else (n, k), ldb), ((m, n), ldc)]
            for index, ((rows, cols), ld) in enumerate(stored):
                layout = ctypes.c_void_p()
                _checked(library.cublasLtMatrixLayoutCreate(ctypes.byref(layout), gemm.data_type, rows, cols, ld), "layout")
                self.layouts.append(layout)
                if gemm.strides is not None:
                    count, stride = ctypes.c_int32(gemm.batch), ctypes.c_int64(gemm.strides[index])
                    _checked(library.cublasLtMatrixLayoutSetAttribute(layout, BATCH_COUNT, ctypes.byref(count), 4), "batch")
                    _checked(library.cublasLtMatrixLayoutSetAttribute(layout, BATCH_STRIDE, ctypes.byref(stride), 8),
                             "batch stride")
            self.results = self._heuristic(algorithm + 1)  # kept: the algorithm is a result's first field
        if len(self.results) <= algorithm:
            raise RuntimeError(f"cuBLASLt: {len(self.results)} algorithms for {gemm}, none #{algorithm}")
        self.algorithm = algorithm
        self.algo = ctypes.addressof(self.results[algorithm])
        self.workspace_bytes = self.results[algorithm].workspace_size

    def _heuristic(self, count: int) -> list:
        """cuBLASLt's heuristic's first ``count`` algorithms for this call (fewer where it has fewer),
        within ``WORKSPACE_BYTES``; the same list for the same call, device and library."""
        library, (a, b, c) = self.library, self.layouts
        preference, limit = ctypes.c_void_p(), ctypes.c_uint64(WORKSPACE_BYTES)
        _checked(library.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "preference")
        try:
            _checked(library.cublasLtMatmulPreferenceSetAttribute(preference, MAX_WORKSPACE, ctypes.byref(limit), 8),
                     "workspace limit")
            results, found = (_HeuristicResult * count)(), ctypes.c_int(0)
            _checked(library.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, c, c, preference, count,
                                                             results, ctypes.byref(found)), "heuristic")
        finally:
            library.cublasLtMatmulPreferenceDestroy(preference)
        return results[:found.value]

    def algorithms(self) -> int:
        """How many of the heuristic's first ``ALGORITHMS`` algorithms this call has."""
        with torch.cuda.device(self.device):
            return len(self._heuristic(ALGORITHMS))

    @classmethod
    def of(cls, va: torch.Tensor, vb: torch.Tensor, vc: torch.Tensor, algorithm: int = 0) -> "LtMatmul | None":
        """The matmul computing ``vc = va @ vb`` on the views' device with the heuristic's
        ``algorithm``-th algorithm (0: its first, PyTorch's), or None where PyTorch is to make it (not
        CUDA, no cuBLASLt loaded, a call ``DirectGemm`` cannot express, no such algorithm)."""
        if vc.device.type != "cuda" or _lt() is None:
            return None
        gemm = DirectGemm.derive(va, vb, vc)
        if gemm is None:
            return None
        try:
            return cls(gemm, vc.device.index if vc.device.index is not None else torch.cuda.current_device(), algorithm)
        except RuntimeError:
            return None

    def __call__(self, pa: int, pb: int, pc: int, residual: int = 0) -> None:
        """C = A B, or with ``residual`` (the data pointer of a tensor laid out as C) C = A B + residual."""
        first, second, out = self.gemm.operands(pa, pb, pc)
        stream = torch._C._cuda_getCurrentRawStream(self.device)
        workspace = 0
        if self.workspace_bytes:
            buffer = _WORKSPACES.get((self.device, stream))
            if buffer is None:
                buffer = _WORKSPACES[(self.device, stream)] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                          device=f"cuda:{self.device}")
            workspace = buffer.data_ptr()
        a, b, c = self.layouts
        status = self.library.cublasLtMatmul(self.handle, self.desc, _ONE, first, a, second, b, _ONE if residual else _ZERO,
                                             residual or out, c, out, c, self.algo, workspace, self.workspace_bytes, stream)
        if status:
            raise RuntimeError(f"cuBLASLt matmul {self.gemm}: status {status}")

    def __del__(self):
        library = getattr(self, "library", None)
        if library is None or not hasattr(self, "desc"):
            return
        try:
            library.cublasLtMatmulDescDestroy(self.desc)
            for layout in self.layouts:
                library.cublasLtMatrixLayoutDestroy(layout)
        except (AttributeError, TypeError):  # interpreter shutdown: ctypes torn down first
            pass


def algorithm_count(va: torch.Tensor, vb: torch.Tensor, vc: torch.Tensor, device) -> int:
    """How many algorithms (at most ``ALGORITHMS``) cuBLASLt's heuristic has for ``vc = va @ vb`` on
    CUDA ``device``, from the views' shapes, strides and dtype (any device, meta included); 0 where
    ``LtMatmul`` cannot make the call."""
    gemm = DirectGemm.derive(va, vb, vc)
    if gemm is None or _lt() is None:
        return 0
    index = torch.device(device).index
    try:
        return LtMatmul(gemm, torch.cuda.current_device() if index is None else index).algorithms()
    except RuntimeError:
        return 0


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (its first 64 bytes), then what it needs."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_ALPHA, _BETA = ctypes.c_float(1.0), ctypes.c_float(0.0)  # host scalars (cuBLASLt's default pointer mode)
_ONE, _ZERO = ctypes.addressof(_ALPHA), ctypes.addressof(_BETA)
