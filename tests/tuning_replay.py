"""A recorded GPU tuning replayed on CPU: ``datamove.tuning``'s rules run as the job runs them
(``tune``, then the selection rounds of ``job.refine_plan``), each sweep answered from the
recorded database instead of a GPU, so a test can say which variants a rule measures, which it
leaves, and the plan it ends with.

``tests/golden/bert_h200_tuning.json.gz``: every record of a cold ``optimize-layer configs/bert.py``
(BERT-large B=8 L=512 bf16) on an H200 whose knob stage measured every knob setting of each
operator's fastest access pattern (before ``knob_climb``): op, dims, dtype, layout, knobs, status
and median ms of each.
"""
from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

from unittest import mock

from datamove.dtypes import parse as parse_dtype
from datamove.harness import contraction_variants
from datamove.harness.tuning_db import Key, Record, canonical_json
from datamove.kernels.blas import ALGORITHMS

RECORDED = Path(__file__).parent / "golden" / "bert_h200_tuning.json.gz"


def key_of(variant) -> tuple:
    """A variant's identity in the recorded database (its key less the device and versions)."""
    return (variant.op, canonical_json(variant.dims), canonical_json(variant.layout), canonical_json(variant.knobs))


class ReplayTuner:
    """What ``tune``, ``tune_chosen`` and the others call on a ``datamove.tuning.Tuner``, answered
    from ``recorded`` ({``key_of``: (status, median ms)}): a variant swept is 'measured' where it
    was recorded (``measured``), else kept in ``unrecorded`` (the recording never timed it)."""

    def __init__(self, recorded: dict, device: str):
        from datamove.tuning import TuningReport

        self.recorded, self.device = recorded, device
        self.measured: set = set()
        self.unrecorded: list = []
        self.report = TuningReport()
        self.ranker = self

    def ranked(self, variants) -> list:
        timed = [(self.recorded[key_of(v)][1], n, v) for n, v in enumerate(variants)
                 if key_of(v) in self.measured and self.recorded.get(key_of(v), ("",))[0] == "ok"]
        return [v for *_, v in sorted(timed, key=lambda t: t[:2])]

    def time_ms(self, variant) -> float | None:
        found = self.recorded.get(key_of(variant)) if key_of(variant) in self.measured else None
        return found[1] if found and found[0] == "ok" else None

    def unmeasured(self, variants) -> set:
        return {key_of(v) for v in variants if key_of(v) not in self.measured}

    def left(self, reserve: bool = False) -> None:
        return None

    def measure(self, variants, *, stage: str, pruned: int = 0, pruned_why: str = "", **_) -> None:
        cost = self.report.stage(stage)
        cost.pruned += pruned
        cost.pruned_why = pruned_why or cost.pruned_why
        for v in variants:
            key = key_of(v)
            status = "skipped" if key in self.measured else "ok" if key in self.recorded else "unrecorded"
            if status == "unrecorded":
                self.unrecorded.append(v)
            self.measured.add(key)
            for counts in (cost.counts, self.report.counts):
                counts[status] = counts.get(status, 0) + 1

    def records(self, dtype: str) -> list[Record]:
        """The records measured so far, as the job's ``Timings`` reads them."""
        return [Record(Key(self.device, {}, op, json.loads(dims), dtype, json.loads(layout), json.loads(knobs)),
                       status, ms, ms, ms)
                for (op, dims, layout, knobs), (status, ms) in self.recorded.items() if (op, dims, layout, knobs) in self.measured]


def recorded(path: Path = RECORDED) -> tuple[dict, str, str]:
    """({key_of: (status, median ms)}, device, dtype) of a recording (status 'ok', 'failed', 'wrong').
    Its Triton GEMMs' ``template`` knob (the source hash their timings hold for,
    ``kernels.gemm.TEMPLATE_ID``) is read as the installed template's: the replay checks the
    tuning's rules, which an edit of the template's file (a message, say) does not change."""
    from datamove.kernels.gemm import TEMPLATE_ID

    data = json.loads(gzip.decompress(path.read_bytes()))
    times, dtypes = {}, set()
    for op, dims, dtype, layout, knobs, status, ms in data["rows"]:
        knobs = re.sub(r'"template":"[0-9a-f]{12}"', f'"template":"{TEMPLATE_ID}"', knobs)
        times[(op, dims, layout, knobs)] = (status, ms)
        dtypes.add(dtype)
    (dtype,) = dtypes
    return times, data["device"], dtype


def replay(spec: str, fused, *, exhaustive: bool = False, path: Path = RECORDED):
    """(tuner, plan): the job's tuning of ``fused`` (``spec``'s training graph at the recording's
    dims) and its selection rounds, replayed on the recording; the plan from what was measured.
    The fused attention's stage is not replayed (its configurations depend on the GPU's shared
    memory): its recorded times count as measured."""
    from datamove.candidates import Timings, plan_layer
    from datamove.job import refine_plan
    from datamove.layouts.cost_model import device_figures
    from datamove.tuning import fused_spaces, measure_layout_changes, tune, tune_chosen, tune_chosen_gemms
    from plans import spec_module

    times, device, dtype = recorded(path)
    torch_dtype = parse_dtype(dtype).torch
    tuner = ReplayTuner(times, device)
    with _without_gpu():
        spaces = fused_spaces(fused, spec, dtype)
    # the attention's configurations depend on the GPU's shared memory: its records are taken as swept
    tuner.measured |= {key for key in times if key[0].startswith("attention:")}
    with _without_gpu():
        tune(tuner, fused, spaces, spec=spec, dtype=dtype, attention=[], exhaustive=exhaustive)
    order = getattr(spec_module(spec), "TORCH_ORDER", {})
    boundary = {**order, **{f"d_{t}": layout for t, layout in order.items()}}

    def choose():
        return plan_layer(fused, spec, dtype=dtype, figures=device_figures("H200"), boundary=boundary, device=device,
                          timings=Timings(tuner.records(dtype), device, dtype))

    with _without_gpu():
        plan = refine_plan(choose(), choose,
                           lambda chosen: tune_chosen(tuner, spaces, chosen) + tune_chosen_gemms(tuner, fused, chosen, torch_dtype),
                           lambda wanted: measure_layout_changes(tuner, fused.graph, wanted, torch_dtype))
    return tuner, plan


def _without_gpu():
    """The variants made as on the GPU that recorded them (kernel sources and Triton GEMM
    configurations not the interpreter's), ``cublas_algorithms`` replaced by ``_recorded_algorithms``."""
    from contextlib import ExitStack

    from datamove.families import residual_add

    stack = ExitStack()
    stack.enter_context(mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}))
    for module in (contraction_variants, residual_add):
        stack.enter_context(mock.patch.object(module, "cublas_algorithms", _recorded_algorithms))
    return stack


def _recorded_algorithms(plan, sizes, dtype, device, direct_only: bool = False) -> int:
    """``contraction_variants.cublas_algorithms`` without a GPU: as many as cuBLASLt's heuristic
    gives at most where cuBLASLt takes the call (those it did not give are not in the recording)."""
    return ALGORITHMS if plan.blas else 0 if direct_only else 1
