"""The main job of ``optimize-layer SPEC``: analysis -> fusion -> tuning -> selection -> export -> report.

Into ``out`` (default ``out/<spec>-<dims>-<dtype>-<device>``): ``plan.json`` and the rest of the
artifact (``datamove.export``), and the report (``report.html``, ``report.md``, PNG figures,
``report.json``).  On a GPU every candidate of the fused training graph goes through the tuning
database (``datamove.tuning``; resumable, within ``budget_s``; a second run reads it back and
takes seconds); without one, nothing is measured: the selection runs on the cost model with a
named device's figures and says so, and so does every figure of the report.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: no GPU, kernels are only generated
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEFAULT_DB = Path.home() / ".cache" / "datamove" / "tuning.db"


@dataclass
class JobOptions:
    spec: Path
    dims: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    dtype: str = "bfloat16"
    out: Path | None = None
    budget_s: float = 600.0
    db: Path | None = None
    cost_model_device: str = "H100"


class Stages:
    """Prints each stage as it starts and how long it took."""

    def __init__(self):
        self.started = time.monotonic()
        self.times: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def __call__(self, name: str) -> None:
        self.done()
        print(f"[{time.monotonic() - self.started:6.1f} s] {name} ...", flush=True)
        self._current = (name, time.monotonic())

    def done(self) -> None:
        if self._current:
            name, began = self._current
            self.times[name] = time.monotonic() - began
            self._current = None


def default_out(spec: str, dims: dict, dtype: str, device: str) -> Path:
    short = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    text = "-".join(f"{k}{v}" for k, v in dims.items())
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    return Path("out") / f"{spec}-{text}-{short}-{slug}"
