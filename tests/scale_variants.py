"""Tiny Triton variants for the harness tests: y = 1.75 * x over one dim i, with a BLOCK knob.

``grid="floor"`` launches n // BLOCK programs (a planted bug: the tail is never written), and a
BLOCK that is not a power of two fails to compile; both must be recorded, never timed.
"""
import time

import torch
import triton
import triton.language as tl

from datamove.harness.accuracy import closeness

SCALE = 1.75


@triton.jit
def scale_kernel(
    x_ptr,  # (i,) input, contiguous
    y_ptr,  # (i,) output, contiguous
    n_i,
    scale,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_i
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, x * scale, mask=mask)


class ScaleVariant:
    """``Variant`` for ``scale_kernel`` at size ``n`` (elements), on ``device``.

    ``log``: a file that gets one line (the knobs) per ``build()``, so tests can count builds;
    ``build_pause_s``: a sleep inside ``build()``, so a sweep can be killed midway.
    """

    op = "scale[i->i]"

    def __init__(self, n, block, grid="cdiv", dtype=torch.float32, device="cpu", log=None, build_pause_s=0.0):
        self.n, self.block, self.grid, self.torch_dtype, self.device = n, block, grid, dtype, device
        self.dims = {"i": n}
        self.dtype = str(dtype).removeprefix("torch.")
        self.layout = {"x": "i", "y": "i"}
        self.knobs = {"BLOCK": block, "grid": grid}
        self.bytes = 2 * n * dtype.itemsize
        self.flop = n
        self.log, self.build_pause_s = log, build_pause_s

    def build(self):
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{self.block} {self.grid}\n")
        time.sleep(self.build_pause_s)
        self.x = torch.randn(self.n, dtype=self.torch_dtype, device=self.device)
        self.y = torch.empty_like(self.x)
        self.run()  # compiles (Triton compiles at the first launch)

    def run(self):
        programs = triton.cdiv(self.n, self.block) if self.grid == "cdiv" else self.n // self.block
        scale_kernel[(programs,)](self.x, self.y, self.n, SCALE, BLOCK=self.block)

    def check(self):
        self.x.copy_(torch.randn(self.n, dtype=self.torch_dtype, device=self.device))  # fresh inputs
        self.y.fill_(float("nan"))  # poison: an unwritten element fails the check
        self.run()
        return closeness(self.y, self.x * SCALE, self.x.double() * SCALE)


def variants(n, device="cpu", **kwargs):
    """Three good variants, one that fails to compile (BLOCK=100) and one that is wrong (floor grid)."""
    return [ScaleVariant(n, 64, device=device, **kwargs), ScaleVariant(n, 128, device=device, **kwargs),
            ScaleVariant(n, 100, device=device, **kwargs), ScaleVariant(n, 256, "floor", device=device, **kwargs),
            ScaleVariant(n, 512, device=device, **kwargs)]
