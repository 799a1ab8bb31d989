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
SELECTION_ROUNDS = 4  # measure what the plan chose untuned (knobs of its layouts, its layout changes), select again: at most this often


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
    gpus: int | None = None  # measuring processes, one per GPU (None: all)
    retry_failed: bool = False


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


def fused_training(analysis):
    """The analysis's fused training graph as ``dataflow.snapshot.FusedTraining`` (what the
    kernels, the selection and the artifact read; the same form the GPU machines load)."""
    from datamove.dataflow.snapshot import load_fused, snapshot, snapshot_fused

    return load_fused(snapshot(analysis.fused.graph, analysis.fused.operators), snapshot_fused(analysis))


def boundary_layouts(torch_order: dict) -> dict:
    """The layouts fixed from outside: activations and outputs in PyTorch's order, their gradients too."""
    return {**torch_order, **{f"d_{t}": layout for t, layout in torch_order.items()}}


def attention_setups(fused, dtype_name: str) -> list[dict]:
    """``kernels.attention_variants.AttentionCase`` arguments of the graph's fused attention in the
    spec's layout of its inputs (what the tuning measures), and ``bias``: whether the bias add
    before it folds in (``datamove.candidates.attention_bias``; the tuning measures that too)."""
    from datamove.candidates import attention_bias, attention_roles

    roles, _ = attention_roles(fused)
    if roles is None:
        return []
    graph, letters = fused.graph, roles.letters
    kernel = {letters["batch"]: "b", letters["heads"]: "h", letters["rows"]: "j", letters["features"]: "p"}
    q = graph.tensors[roles.tensors["q"]].letters
    mask = roles.tensors["mask"]
    return [dict(B=graph.size(letters["batch"]), H=graph.size(letters["heads"]), L=graph.size(letters["rows"]),
                 P=graph.size(letters["features"]), dropout_p=graph.tensors[mask].p if mask else 0.0,
                 layout="".join(kernel[x] for x in q), bias=attention_bias(fused, roles) is not None)]


def run_job(o: JobOptions) -> int:
    from datamove.dataflow.pipeline import analyse_spec
    from datamove.candidates import NO_TIMINGS, Timings, plan_layer
    from datamove.export import spec_hash, write_artifact
    from datamove.report import write_report
    from datamove.report_data import report_data
    from datamove.dataflow.spec import SpecError
    from datamove.kernels.device import DeviceFacts, query_device, versions
    from datamove.kernels.interpreter import interpreted
    from datamove.layer import tensor_interface
    from datamove.layouts.cost_model import DEVICES, device_figures

    stages = Stages()
    stages("analysis and fusion")
    analysis = analyse_spec(o.spec, o.dims, o.options)
    fused = fused_training(analysis)
    spec_name = o.spec.stem
    module = analysis.spec.function.__globals__
    torch_order, weights = module.get("TORCH_ORDER", {}), module.get("WEIGHTS", {})
    try:  # before any tuning: the data inputs and TORCH_ORDER agree with the graph
        interface = tensor_interface(fused.graph, torch_order, analysis.spec.inputs)
    except ValueError as err:
        raise SpecError(f"{o.spec}: {err}") from None
    facts = query_device()
    measured = isinstance(facts, DeviceFacts) and not interpreted()
    figures = device_figures(facts.name) if measured and any(k.lower() in facts.name.lower() for k in DEVICES) \
        else device_figures(o.cost_model_device)
    device = facts.name if measured else f"cost model: {figures.name}"
    out = o.out or default_out(spec_name, dict(fused.graph.dim_values), o.dtype, device if measured else "costmodel")
    ceilings = None
    timings = NO_TIMINGS
    tuning = None
    if measured:
        from datamove.tuning import Tuner, fused_spaces, tune
        from datamove.kernels.bench import measure_ceilings
        from datamove.kernels.tuning_db import TuningDB

        stages(f"tuning on {facts.name} (budget {o.budget_s:g} s; database {o.db or DEFAULT_DB})")
        path = Path(o.db or DEFAULT_DB)
        path.parent.mkdir(parents=True, exist_ok=True)
        db = TuningDB(path)
        ceilings = measure_ceilings(db)
        tuner = Tuner(db, budget_s=o.budget_s, gpus=o.gpus, retry_failed=o.retry_failed)
        print(f"measuring on {tuner.gpus} GPU(s), one process each", flush=True)
        dtype = getattr(torch, o.dtype)
        spaces = fused_spaces(fused, spec_name, dtype)
        tuning = tune(tuner, fused, spaces, dtype=dtype, attention=attention_setups(fused, o.dtype))
        timings = Timings(db.query(device=facts.name, dtype=o.dtype, versions=versions()), facts.name, o.dtype)
    else:
        reason = facts.reason if not isinstance(facts, DeviceFacts) else "TRITON_INTERPRET=1"
        print(f"No GPU ({reason}): NOTHING IS MEASURED. The selection runs on the cost model with the figures of "
              f"{figures.name}, and every time in the plan and the report is a prediction.", flush=True)
    stages("selection")

    def choose():
        return plan_layer(fused, spec_name, dtype=o.dtype, figures=figures, timings=timings,
                          boundary=boundary_layouts(torch_order), device=device)

    plan = choose()
    if measured:
        from datamove.tuning import measure_layout_changes, tune_chosen

        def choose_again():
            nonlocal timings
            timings = Timings(db.query(device=facts.name, dtype=o.dtype, versions=versions()), facts.name, o.dtype)
            return choose()

        plan = refine_plan(plan, choose_again,
                           lambda chosen: tune_chosen(tuner, spaces, chosen),
                           lambda wanted: measure_layout_changes(tuner, fused.graph, wanted, dtype),
                           lambda: tuner.report.stopped)
    stages("export")
    write_artifact(out, plan, fused.graph, fused.operators, spec_name=spec_name, spec_digest=spec_hash(o.spec),
                   torch_order=torch_order, weights=weights, versions=versions(), inputs=interface.activations,
                   device={"name": device, "measured": measured,
                           "capability": list(facts.compute_capability) if measured else None})
    stages("report")
    paths = write_report(report_data(analysis, fused, plan, spec_name, o.dtype, figures, ceilings, timings, measured),
                         out)
    stages.done()
    print(summary(plan, out, paths, tuning, stages))
    return 0


def refine_plan(plan, choose, measure_chosen, measure_changes, stopped, rounds: int = SELECTION_ROUNDS):
    """Measure what ``plan`` chose without a measurement and choose again, at most ``rounds`` times:
    ``measure_chosen(plan)`` tunes the knobs of the layouts its generated operators run and returns
    how many variants were new, ``measure_changes(wanted)`` times the layout changes it inserts unmeasured
    ((tensor, from, to) set), ``choose()`` selects again from the database; ``stopped()``: the
    tuning budget is spent.  Ends when a round measured nothing new."""
    from datamove.layouts.plan import LAYOUT_CHANGE, MEASURED

    for _ in range(rounds):
        tuned = measure_chosen(plan)
        wanted = {(s.config["tensor"], s.config["from"], s.config["to"]) for s in plan.steps
                  if s.kind == LAYOUT_CHANGE and s.source != MEASURED}
        if wanted and not stopped():
            measure_changes(wanted)
        if not (tuned or wanted) or stopped():
            break
        print(f"{tuned} knob setting(s) of the chosen layouts and {len(wanted)} layout change(s) measured: "
              f"choosing again", flush=True)
        plan = choose()
    return plan


def summary(plan, out: Path, paths: dict, tuning, stages: Stages) -> str:
    lines = ["", f"Plan ({plan.timing} times, {plan.device}):"]
    for step in plan.steps:
        lines.append(f"  {step.phase[:3]}  {step.kind:18s} {step.name:48s} {step.time_ms:8.4f} ms  {step.source}")
    lines.append(f"  total {plan.total_ms:.4f} ms (sum of per-operator bests {plan.best_sum_ms:.4f} ms); "
                 f"search: {plan.search.get('states')} states, {plan.search.get('edges')} edges, "
                 f"{plan.search.get('seconds')} s")
    if tuning is not None:
        counts = ", ".join(f"{n} {s}" for s, n in tuning.counts.items() if n)
        lines.append(f"Tuning: {counts} in {tuning.wall_s:.0f} s" + (f"; stopped: {tuning.stopped} (rerun to go on)"
                                                                      if tuning.stopped else ""))
    lines += [f"Artifact: {out}/ (plan.json, graph.json, manifest.json, kernels/)",
              f"Report: {paths['html']} (also {paths['markdown'].name}, {paths['png'].name}, {paths['json'].name})",
              "Load it:  from datamove.export import load_layer; layer = load_layer(\"" + str(out) + "\")",
              f"Done in {sum(stages.times.values()):.1f} s (" + ", ".join(f"{k.split(' ')[0]} {v:.1f} s"
                                                                          for k, v in stages.times.items()) + ")."]
    return "\n".join(lines)
