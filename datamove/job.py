"""The main job of ``optimize-layer SPEC``: analysis -> fusion -> tuning -> selection -> export -> report.

Several shapes (``--dims 'B=8,L=128|512'``): the analysis runs at the first, each other shape is the
same fused graph at its sizes (``FusedTraining.with_dims``); each shape is tuned (one database, one
budget) and gets its own plan, the parameters stored as the first plan stores them (so one layer's
weights serve every plan); the artifact holds them all and the report lists them.

Into ``out`` (default ``out/<spec>-<options>-<dims>-<dtype>-<device>``, the ``--set`` options as
``activation_gelu``): ``plan.json`` and the rest of the artifact (``datamove.export``), and the
report (``report.html``, ``report.md``, PNG figures, ``report.json``), all written into a temporary
sibling folder that replaces ``out`` at the end (``datamove.output``: an interrupted run leaves the
previous output whole; nothing of an earlier run stays beside the new one).  The manifest and
``report.json`` carry the plan's identity (``plan_id``) and the ``--set`` options.  On a GPU every
candidate of the fused training graph goes through the tuning
database (``datamove.tuning``; resumable, within ``budget_s``; a second run reads it back and
takes seconds); without one, nothing is measured: the selection runs on the cost model with a
named device's figures and says so, and so does every figure of the report.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from datamove.dtypes import BF16, Precision, parse

DEFAULT_DB = Path.home() / ".cache" / "datamove" / "tuning.db"
SELECTION_ROUNDS = 4  # measure what the plan chose untuned (knobs of its layouts, its layout changes), select again: at most this often


@dataclass
class JobOptions:
    spec: Path
    dims: list = field(default_factory=lambda: [{}])  # every shape: {dim -> value} overrides, the first: plan.json's
    options: dict = field(default_factory=dict)
    dtype: Precision = BF16  # any spelling is taken (``dtypes.parse``)
    out: Path | None = None
    budget_s: float = 600.0
    db: Path | None = None
    cost_model_device: str = "H100"
    gpus: int | None = None  # measuring processes, one per GPU (None: all)
    retry_failed: bool = False
    exhaustive: bool = False  # measure what the tuning's rules prune too (``tuning.tune``; a benchmark's reference)

    def __post_init__(self):
        self.dtype = parse(self.dtype)


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


def default_out(spec: str, shapes: list[dict], dtype: Precision | str, device: str, options: dict | None = None) -> Path:
    """``out/<spec>-<options>-<dims>-<dtype>-<device>``, the dtype's short name (``bf16``), each
    ``--set`` option as ``activation_gelu`` (none: left out), a dim of several values as ``L128_512``."""
    short = parse(dtype).short
    text = "-".join(f"{k}" + "_".join(str(v) for v in dict.fromkeys(shape[k] for shape in shapes)) for k in shapes[0])
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    chosen = "".join(f"-{_slug(name)}_{_slug(value)}" for name, value in (options or {}).items())
    return Path("out") / f"{spec}{chosen}-{text}-{short}-{slug}"


def _slug(text) -> str:
    return "".join(c if c.isalnum() or c in "._" else "_" for c in str(text))


def fused_training(analysis):
    """The analysis's fused training graph as ``dataflow.snapshot.FusedTraining`` (what the
    kernels, the selection and the artifact read; the same form the GPU machines load)."""
    from datamove.dataflow.snapshot import load_fused, snapshot, snapshot_fused

    return load_fused(snapshot(analysis.fused.graph, analysis.fused.operators), snapshot_fused(analysis))


def boundary_layouts(torch_order: dict) -> dict:
    """The layouts fixed from outside: activations and outputs in PyTorch's order, their gradients too."""
    return {**torch_order, **{f"d_{t}": layout for t, layout in torch_order.items()}}


def attention_setups(fused, dtype: Precision | str) -> list[dict]:
    """What the tuning measures of the graph's fused attention (``families.attention``: the
    registered family's ``AttentionFamily.setups``), for ``datamove.tuning.tune``."""
    from datamove.families import ATTENTION

    return ATTENTION.setups(fused, parse(dtype).name)


def run_job(o: JobOptions) -> int:
    """The job (the module doc); on a GPU the tuning's measuring processes start first and get
    ready (imports, CUDA contexts: seconds) during the analysis and fusion; the tuning's processes
    end with it."""
    from datamove.kernels.device import DeviceFacts, query_device
    from datamove.kernels.interpreter import interpreted

    facts = query_device()
    pools = None
    if isinstance(facts, DeviceFacts) and not interpreted():
        from datamove.tuning import tuning_pools

        pools = tuning_pools(o.gpus).start()
    try:
        return _run(o, facts, pools)
    finally:
        if pools is not None:
            pools.close()


def _settings(spec: Path, module: dict, name: str, sizes: dict[str, int], keys: str) -> dict:
    """The spec's ``HF_CONFIG`` or ``MODULE_CONFIG`` (empty where it gives none): a dict keyed by
    ``keys``, or a function of the dims' ``sizes`` returning one (called after the ``--set`` options)."""
    from datamove.dataflow.spec import SpecError
    from datamove.export import AT_LEAST

    settings = module.get(name, {})
    if callable(settings):
        settings = settings(sizes)
    if not isinstance(settings, dict) or not all(isinstance(key, str) for key in settings):
        raise SpecError(f"{spec}: {name} is {type(settings).__name__}; expected a dict of {keys} to the values the "
                        "layer computes (a list: values computing the same), or a function of the dims' sizes "
                        "returning one")
    members = [member for value in settings.values() for member in (value if isinstance(value, list) else [value])]
    bounds = [member for member in members if isinstance(member, dict)] if name == "HF_CONFIG" else []
    wrong = next((bound for bound in bounds if list(bound) != [AT_LEAST] or isinstance(bound[AT_LEAST], bool)
                  or not isinstance(bound[AT_LEAST], (int, float))), None)
    if wrong is not None:
        raise SpecError(f"{spec}: HF_CONFIG has the value {wrong!r}; a dict there is a lower bound, "
                        f"{{{AT_LEAST!r}: number}} (any value that number or above), e.g. "
                        f"\"sliding_window\": [None, {{{AT_LEAST!r}: sizes[\"T\"]}}]")
    try:  # the manifest keeps them
        json.dumps(settings)
    except (TypeError, ValueError) as err:
        raise SpecError(f"{spec}: {name}: {err}; give numbers, strings, booleans, None, lists and dicts of them") from None
    return settings


def _run(o: JobOptions, facts, pools) -> int:
    from datamove.dataflow.analysis_cache import cached_analysis
    from datamove.candidates import NO_TIMINGS, Timings, plan_layer
    from datamove.export import read_manifest, spec_hash, write_artifact
    from datamove.output import OutputError, check_out, whole_folder
    from datamove.report import write_report
    from datamove.report_data import report_data
    from datamove.dataflow.spec import SpecError
    from datamove.kernels.device import DeviceFacts, versions
    from datamove.runtime.layer import tensor_interface
    from datamove.layouts.cost_model import DEVICES, device_figures

    stages = Stages()
    stages("analysis and fusion")
    analysis = cached_analysis(o.spec, o.dims[0], o.options)
    fused = fused_training(analysis)
    spec_name = o.spec.stem
    module = analysis.spec.function.__globals__
    torch_order, weights = module.get("TORCH_ORDER", {}), module.get("WEIGHTS", {})
    sizes = dict(analysis.spec.dim_values)
    hf_config = _settings(o.spec, module, "HF_CONFIG", sizes, "HF config names")
    module_config = _settings(o.spec, module, "MODULE_CONFIG", sizes, "WEIGHTS kinds")
    if not all(isinstance(settings, dict) and all(isinstance(path, str) for path in settings)
               and kind in weights for kind, settings in module_config.items()):
        raise SpecError(f"{o.spec}: MODULE_CONFIG maps {sorted(module_config)}; expected WEIGHTS kinds "
                        f"({sorted(weights) or 'none'}) to dicts of the module's attribute paths (e.g. "
                        "'self_attn.num_heads') to the values the layer computes")
    if not isinstance(torch_order, dict) or not all(isinstance(t, str) and isinstance(letters, str)
                                                    for t, letters in torch_order.items()):
        raise SpecError(f"{o.spec}: TORCH_ORDER = {torch_order!r}: expected a dict of data inputs and outputs to "
                        "their letters in PyTorch's dim order, e.g. TORCH_ORDER = {\"x\": \"bsd\"}")
    if not isinstance(weights, dict) or not all(
            isinstance(kind, str) and isinstance(table, dict) and all(
                isinstance(t, str) and isinstance(entry, (tuple, list)) and len(entry) == 3 for t, entry in table.items())
            for kind, table in weights.items()):
        raise SpecError(f"{o.spec}: WEIGHTS = {weights!r}: expected a dict of PyTorch module kinds to dicts of the "
                        "layer's parameters to (state-dict key, its letters, stack index or None), as in configs/gpt2.py")
    positions = module.get("POSITION_TABLES", ())
    try:  # before any tuning: the data inputs, TORCH_ORDER and POSITION_TABLES agree with the graph
        interface = tensor_interface(fused.graph, torch_order, analysis.spec.inputs, positions)
    except ValueError as err:
        raise SpecError(f"{o.spec}: {err}") from None
    shaped = shapes_of(fused, o.dims, interface)
    measured = pools is not None
    figures = device_figures(facts.name) if measured and any(k.lower() in facts.name.lower() for k in DEVICES) \
        else device_figures(o.cost_model_device)
    device = facts.name if measured else f"cost model: {figures.name}"
    out = o.out or default_out(spec_name, [dict(f.graph.dim_values) for f in shaped.values()], o.dtype,
                               device if measured else "costmodel", o.options)
    if o.out is None:
        check_out(out, "the output folder")
    ceilings = None
    timings = NO_TIMINGS
    tunings = []
    if measured:
        from datamove.tuning import (Tuner, fused_spaces, measure_layout_changes, tune, tune_chosen,
                                     tune_chosen_gemms)
        from datamove.harness.bench import measure_ceilings
        from datamove.harness.tuning_db import TuningDB

        stages(f"tuning on {facts.name} (budget {o.budget_s:g} s; database {o.db or DEFAULT_DB})")
        path = Path(o.db or DEFAULT_DB)
        path.parent.mkdir(parents=True, exist_ok=True)
        db = TuningDB(path)
        ceilings = measure_ceilings(db)
        tuner = Tuner(db, budget_s=o.budget_s, retry_failed=o.retry_failed, pools=pools)
        print(f"measuring on {tuner.gpus} GPU(s), one process each", flush=True)
        dtype = o.dtype.torch  # what the sweeps' tensors and kernels are made in
    else:
        found = ("No CUDA GPU found" if not isinstance(facts, DeviceFacts)
                 else f"{facts.name} found, but TRITON_INTERPRET=1 is set")
        why = f" (CUDA runtime: {facts.reason})" if not isinstance(facts, DeviceFacts) else ""
        print(f"{found}: NOTHING IS MEASURED. The selection runs on the cost model with the figures of "
              f"{figures.name}, and every time in the plan and the report is a prediction{why}.", flush=True)
        unused = [f"{flag} {value}" for flag, value in (("--db", o.db), ("--gpus", o.gpus)) if value is not None]
        unused += ["--retry-failed"] if o.retry_failed else []
        if unused:
            print(f"Not used without a GPU (nothing is measured): {', '.join(unused)}.", flush=True)
    boundary = boundary_layouts(torch_order)
    plans = []
    try:
        for label, each in shaped.items():
            if measured:
                stages(f"tuning {label}")
                spaces = fused_spaces(each, spec_name, dtype)
                tunings.append(tune(tuner, each, spaces, spec=spec_name, dtype=dtype, attention=attention_setups(each, o.dtype),
                                    exhaustive=o.exhaustive))
                timings = Timings(db.query(device=facts.name, dtype=o.dtype.name, versions=versions()), facts.name, o.dtype)
            stages(f"selection {label}")

            def choose(each=each, boundary=boundary):
                return plan_layer(each, spec_name, dtype=o.dtype, figures=figures, timings=timings, boundary=boundary,
                                  device=device)

            plan = choose()
            if measured:
                def choose_again(choose=choose):
                    nonlocal timings
                    timings = Timings(db.query(device=facts.name, dtype=o.dtype.name, versions=versions()), facts.name, o.dtype)
                    return choose()

                plan = refine_plan(plan, choose_again,
                                   lambda chosen, spaces=spaces, each=each: tune_chosen(tuner, spaces, chosen)
                                   + tune_chosen_gemms(tuner, each, chosen, dtype),
                                   lambda wanted, each=each: measure_layout_changes(tuner, each.graph, wanted, dtype))
            if not plans:  # every later plan stores the parameters and constants as the first one does
                boundary = {**boundary, **{t: plan.layouts[t] for t in interface.parameters + interface.constants}}
            plans.append(plan)
    finally:  # the sweeps' worker processes, kept from one sweep to the next
        if measured:
            tuner.close()
    try:  # everything into a temporary sibling folder, which replaces out at the end (datamove.output)
        with whole_folder(out) as folder:
            stages("export")
            manifest = write_artifact(
                folder, plans[0], fused.graph, fused.operators, spec_name=spec_name, spec_digest=spec_hash(o.spec),
                torch_order=torch_order, weights=weights, hf_config=hf_config, module_config=module_config,
                versions=versions(), other_plans=tuple(plans[1:]), inputs=interface.activations, options=o.options,
                positions=interface.positions,
                device={"name": device, "measured": measured,
                        "capability": list(facts.compute_capability) if measured else None})
            stages("report")
            data = report_data(analysis, fused, plans[0], spec_name, o.dtype, figures, ceilings, timings, measured)
            data.meta["shapes"] = [{"dims": label, "total_ms": plan.total_ms, "timing": plan.timing}
                                   for label, plan in zip(shaped, plans)]
            data.meta["options"] = dict(o.options)
            if tunings:
                data.meta["tuning"] = tunings[0].to_json()
            data.meta["plan_id"] = read_manifest(manifest)["plan_id"]
            paths = {kind: out / path.name for kind, path in write_report(data, folder).items()}
    except OSError as err:
        raise OutputError(f"{out}: writing the output failed ({err}); what was there before is left as it was") from None
    stages.done()
    print(summary(plans, list(shaped), out, paths, tunings, stages))
    return 0


def shapes_of(fused, shapes: list[dict], interface) -> dict:
    """{label of each shape (its call dims, ``B=8, L=512``) -> the fused graph at its dims}; the first
    is ``fused`` itself; ``interface``: the layer's (``layer.tensor_interface``).  Refuses
    alternatives of a dim that sizes the weights (``SpecError``)."""
    from datamove.dataflow.spec import SpecError
    from datamove.runtime.shapes import call_dims, describe, sized_by

    dims = call_dims(fused.graph, interface)
    fixed = sorted({d for shape in shapes for d, v in shape.items() if shapes[0].get(d) != v and d not in dims})
    if fixed:
        held = "; ".join(f"{d} sizes {sized_by(fused.graph, interface, d)}" for d in fixed)
        raise SpecError(f"--dims: {', '.join(fixed)} take(s) several values, but only {', '.join(dims)} may (the sizes "
                        f"a call chooses); {held}: run optimize-layer once per value (docs/runtime.md, Variable lengths)")
    result = {}
    for shape in shapes:
        each = fused if shape is shapes[0] else fused.with_dims({**fused.graph.dim_values, **shape})
        result[describe({d: each.graph.dim_values[d] for d in dims})] = each
    return result


def refine_plan(plan, choose, measure_chosen, measure_changes, rounds: int = SELECTION_ROUNDS):
    """Measure what ``plan`` chose without a measurement and choose again, at most ``rounds`` times:
    ``measure_chosen(plan)`` tunes the knobs of the layouts its generated operators run (nothing
    once the budget is spent) and its GEMMs where a measurement can change it
    (``tuning.tune_chosen_gemms``), and returns how many variants were new, ``measure_changes(wanted)`` times
    the layout changes it inserts unmeasured ((tensor, from, to) set), also past the budget: a few
    seconds each, and the cost model's price of one was 20x off where its tile fell on a dim of
    size 1 (Llama-8B at B=1: six changes, 5.35 ms of a 14 ms layer, priced 0.2); ``choose()`` selects again from
    the database.  Ends when a round measured nothing new."""
    from datamove.layouts.plan import LAYOUT_CHANGE, MEASURED

    for _ in range(rounds):
        tuned = measure_chosen(plan)
        wanted = {(s.config.tensor, s.config.source, s.config.target) for s in plan.steps
                  if s.kind == LAYOUT_CHANGE and s.source != MEASURED}
        if wanted:
            measure_changes(wanted)
        if not (tuned or wanted):
            break
        print(f"{tuned} variant(s) of the chosen layouts and {len(wanted)} layout change(s) measured: "
              f"choosing again", flush=True)
        plan = choose()
    return plan


def summary(plans, labels: list[str], out: Path, paths: dict, tunings: list, stages: Stages) -> str:
    plan = plans[0]
    lines = ["", f"Plan at {labels[0]} ({plan.timing} times, {plan.device}):"]
    for step in plan.steps:
        lines.append(f"  {step.phase[:3]}  {step.kind:18s} {step.name:48s} {step.time_ms:8.4f} ms  {step.source}")
    lines.append(f"  total {plan.total_ms:.4f} ms (sum of per-operator bests {plan.best_sum_ms:.4f} ms); "
                 f"search: {plan.search.get('states')} states, {plan.search.get('edges')} edges, "
                 f"{plan.search.get('seconds')} s")
    lines.append("Shapes tuned: " + "; ".join(f"{label} ({each.total_ms:.4f} ms {each.timing})"
                                              for label, each in zip(labels, plans)))
    for tuning in {id(t): t for t in tunings}.values():  # the shapes' sweeps share one tuner
        lines += tuning.lines()
    lines += [f"Artifact: {out}/ (plan.json, graph.json, manifest.json, kernels/)",
              f"Report: {paths['html']} (also {paths['markdown'].name}, {paths['png'].name}, {paths['json'].name})",
              "Load it:  from datamove.export import load_layer; layer = load_layer(\"" + str(out) + "\")",
              f"Done in {sum(stages.times.values()):.1f} s (" + ", ".join(f"{k.split(' ')[0]} {v:.1f} s"
                                                                          for k, v in stages.times.items()) + ")."]
    return "\n".join(lines)
