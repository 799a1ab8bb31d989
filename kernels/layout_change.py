"""Layout changes as sweep variants: a tensor copied from one storage order of its letters to another.

What the plan's ``LAYOUT_CHANGE`` steps run (``datamove.steps.LayoutChangeLauncher``: one strided
``copy_``), timed like every other kernel so the selection prices them by measurement.  Key:
``op = "layout:<letters>"`` (the tensor's letters in spec order), ``dims`` {letter: size},
``layout`` {"from", "to"} (storage orders), ``knobs`` {"impl": "torch-copy"}; ``bytes`` = read +
written.  Check: the copy equals its source exactly (random normal data, never zeros).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.accuracy import Closeness
from kernels.contraction import empty_in_layout


@dataclass(frozen=True)
class CopyVerdict:
    """Exact equality of the copy (``passed``), as a ``kernels.accuracy.Closeness``-like verdict."""

    closeness: Closeness

    passed = property(lambda self: self.closeness.passed)
    error = property(lambda self: self.closeness.error)
    baseline_error = property(lambda self: self.closeness.baseline_error)

    def __str__(self) -> str:
        return str(self.closeness)


class LayoutChangeVariant:
    """``dst.copy_(src)`` with ``src`` stored in ``source`` order and ``dst`` in ``target`` order."""

    def __init__(self, letters: str, sizes: dict, source: str, target: str, dtype: torch.dtype, device):
        self.letters, self.sizes, self.source, self.target = letters, dict(sizes), source, target
        self.dtype_, self.device = dtype, device
        self.op, self.dims = f"layout:{letters}", {x: sizes[x] for x in letters}
        self.dtype = str(dtype).removeprefix("torch.")
        self.layout, self.knobs = {"from": source, "to": target}, {"impl": "torch-copy"}
        self.flop, self.bytes = 0, 2 * math.prod(self.dims.values()) * dtype.itemsize
        self.src = self.dst = None

    def build(self) -> None:
        self.src = empty_in_layout(self.letters, self.source, self.sizes, self.dtype_, self.device)
        self.src.copy_(torch.randn(self.src.shape, device=self.device, dtype=torch.float32))
        self.dst = empty_in_layout(self.letters, self.target, self.sizes, self.dtype_, self.device)
        self.run()

    def run(self) -> None:
        self.dst.copy_(self.src)

    def check(self) -> CopyVerdict:
        self.dst.fill_(float("nan"))
        self.run()
        equal = bool(torch.equal(self.dst, self.src))
        return CopyVerdict(Closeness(0.0 if equal else float("inf"), 0.0, equal))
