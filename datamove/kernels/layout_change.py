"""Layout changes: a tensor copied from one storage order of its letters to another.

``permute_copy`` is what the plan's ``LAYOUT_CHANGE`` steps run (``datamove.runtime.steps.LayoutChangeLauncher``):
one Triton kernel over tiles [BLOCK_S, BLOCK_A] of two letters, ``a`` innermost in the destination
and ``s`` innermost in the source (or the destination's next letter when both share their innermost
letter), the other letters one index per program; each tile is read along ``s`` and written along
``a``, both coalesced (the compiler converts the tile between the two through shared memory).
PyTorch's strided ``copy_`` reads or writes one side with a stride: 0.5-1.1 TB/s on an H200 for
BERT-large's 8 MiB activations (benchmarks/results).  ``harness.layout_change_variants`` times it
like every other kernel.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from datamove.kernels.device import source_id
from datamove.kernels.launch import ceil_div, launch


GRID_DIMS = 4  # letters besides the two tile letters a tensor may have
TILE = {"block_s": 64, "block_a": 64, "num_warps": 4}
KERNEL_ID = source_id(__file__)  # the kernel's source version: a timing holds for it


@triton.jit
def _permute_kernel(
    src_ptr, dst_ptr,  # the same tensor in two storage orders
    G1, G2, G3, S, A,  # extents of the grid letters g1..g3 (g0 is what is left of the grid), s and a
    src_g0, src_g1, src_g2, src_g3, src_s, src_a,  # strides of the source, in elements
    dst_g0, dst_g1, dst_g2, dst_g3, dst_s, dst_a,  # strides of the destination
    BLOCK_S: tl.constexpr, BLOCK_A: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    blocks_a = tl.cdiv(A, BLOCK_A)
    blocks_s = tl.cdiv(S, BLOCK_S)
    offs_a = (pid % blocks_a) * BLOCK_A + tl.arange(0, BLOCK_A)
    rest = pid // blocks_a
    offs_s = (rest % blocks_s) * BLOCK_S + tl.arange(0, BLOCK_S)
    rest = rest // blocks_s
    g3 = rest % G3
    rest = rest // G3
    g2 = rest % G2
    rest = rest // G2
    g1 = rest % G1
    g0 = rest // G1
    ok = (offs_s < S)[:, None] & (offs_a < A)[None, :]
    src = src_ptr + g0 * src_g0 + g1 * src_g1 + g2 * src_g2 + g3 * src_g3
    dst = dst_ptr + g0 * dst_g0 + g1 * dst_g1 + g2 * dst_g2 + g3 * dst_g3
    tile = tl.load(src + offs_s[:, None] * src_s + offs_a[None, :] * src_a, mask=ok)
    tl.store(dst + offs_s[:, None] * dst_s + offs_a[None, :] * dst_a, tile, mask=ok)


def tile_dims(src: torch.Tensor, dst: torch.Tensor) -> tuple[int | None, int, list[int]]:
    """(s, a, grid) of ``permute_copy``: the dims of its tile, ``a`` innermost in ``dst`` and ``s``
    innermost in ``src`` (``dst``'s next where they are the same dim; None for a tensor of one
    dim), and the others, outermost first as ``dst`` stores them.  A dim of size 1 is innermost in
    no storage order (its stride says nothing; ranked so, Llama-8B's K/V at B=1 took 1-wide tiles
    along the batch: 0.165 ms for 8 MiB on an H200, 20x a copy)."""
    dims = list(range(src.dim()))
    inner_first = lambda x: sorted(dims, key=lambda d: (src.shape[d] == 1, x.stride(d), d))  # noqa: E731
    by_dst = inner_first(dst)
    a, s = by_dst[0], inner_first(src)[0]
    if s == a:
        s = by_dst[1] if len(dims) > 1 else None
    tile = [a] if s is None else [s, a]
    return s, a, [d for d in reversed(by_dst) if d not in tile]


def permute_copy(src: torch.Tensor, dst: torch.Tensor, block_s: int = TILE["block_s"], block_a: int = TILE["block_a"],
                 num_warps: int = TILE["num_warps"]) -> None:
    """``dst[...] = src[...]``: two dense tensors of one shape, dtype and device, stored in any two
    orders of their dims (at most ``GRID_DIMS`` + 2 dims), in one tiled Triton kernel."""
    if src.shape != dst.shape or src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(f"permute_copy: source {tuple(src.shape)} {src.dtype} {src.device} and destination "
                         f"{tuple(dst.shape)} {dst.dtype} {dst.device} differ")
    if src.dim() > GRID_DIMS + 2:
        raise ValueError(f"permute_copy: {src.dim()} dims, at most {GRID_DIMS + 2}")
    s, a, grid = tile_dims(src, dst)
    pad = GRID_DIMS - len(grid)
    extent = lambda d: 1 if d is None else src.shape[d]  # noqa: E731
    stride = lambda x, d: 0 if d is None else x.stride(d)  # noqa: E731
    g = [None] * pad + grid
    programs = math.prod(extent(d) for d in g) * ceil_div(extent(s), block_s) * ceil_div(extent(a), block_a)
    if programs:
        launch(_permute_kernel, (programs,), [
            src, dst, extent(g[1]), extent(g[2]), extent(g[3]), extent(s), extent(a),
            *(stride(src, d) for d in g), stride(src, s), stride(src, a),
            *(stride(dst, d) for d in g), stride(dst, s), stride(dst, a)],
            dict(BLOCK_S=block_s, BLOCK_A=block_a, num_warps=num_warps))
