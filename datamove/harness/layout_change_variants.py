"""A layout change (``kernels.layout_change.permute_copy``) as a sweep variant, timed like every other
kernel so the selection prices changes by measurement.  Key: ``op = "layout:<letters>"`` (the
tensor's letters in spec order), ``dims`` {letter: size}, ``layout`` {"from", "to"} (storage
orders), ``knobs`` {"impl": "triton-tiles", "block_s", "block_a", "num_warps", "kernel": the kernel's
source version, ``kernels.layout_change.KERNEL_ID``}; ``bytes`` = read +
written.  Check: the copy equals its source exactly (random normal data, never zeros).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from datamove.dtypes import Precision, parse
from datamove.harness.accuracy import Closeness
from datamove.kernels.contraction import empty_in_layout
from datamove.kernels.layout_change import KERNEL_ID, TILE, permute_copy


@dataclass(frozen=True)
class CopyVerdict:
    """Exact equality of the copy (``passed``), as a ``harness.accuracy.Closeness``-like verdict."""

    closeness: Closeness

    passed = property(lambda self: self.closeness.passed)
    error = property(lambda self: self.closeness.error)
    baseline_error = property(lambda self: self.closeness.baseline_error)

    def __str__(self) -> str:
        return str(self.closeness)


class LayoutChangeVariant:
    """``permute_copy(src, dst)`` with ``src`` stored in ``source`` order and ``dst`` in ``target`` order."""

    def __init__(self, letters: str, sizes: dict, source: str, target: str, dtype: Precision | torch.dtype, device):
        precision = parse(dtype)
        self.letters, self.sizes, self.source, self.target = letters, dict(sizes), source, target
        self.dtype_, self.device = precision.torch, device
        self.op, self.dims = f"layout:{letters}", {x: sizes[x] for x in letters}
        self.dtype = precision.name  # the tuning database's key
        self.layout, self.knobs = {"from": source, "to": target}, {"impl": "triton-tiles", **TILE, "kernel": KERNEL_ID}
        self.flop, self.bytes = 0, 2 * math.prod(self.dims.values()) * precision.itemsize
        self.src = self.dst = None

    def build(self) -> None:
        self.src = empty_in_layout(self.letters, self.source, self.sizes, self.dtype_, self.device)
        self.src.copy_(torch.randn(self.src.shape, device=self.device, dtype=torch.float32))
        self.dst = empty_in_layout(self.letters, self.target, self.sizes, self.dtype_, self.device)
        self.run()

    def run(self) -> None:
        permute_copy(self.src, self.dst)

    def check(self) -> CopyVerdict:
        self.dst.fill_(float("nan"))
        self.run()
        equal = bool(torch.equal(self.dst, self.src))
        return CopyVerdict(Closeness(0.0 if equal else float("inf"), 0.0, equal))
