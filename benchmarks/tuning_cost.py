"""The main job's tuning cost and the quality of its plan against an exhaustive tuning (one GPU host).

    python benchmarks/tuning_cost.py --work out/tuning_cost --case bert configs/bert.py B=8,L=512 \
        --case llama configs/llama.py B=4,T=2048,D=2048,H=32,KV=8,E=64,F=8192

For each case (a name, a spec, its dims; bf16):
- ``cold``: ``optimize-layer`` with a new tuning database (``WORK/<name>/tuning.db``) and the default
  budget: wall time, whether the tuning finished (the stop message otherwise) and its cost per stage
  (``report.json``'s ``meta.tuning``);
- ``warm``: the same command again (everything read back from the database);
- ``exhaustive``: the job with what the tuning's rules prune measured too (``--exhaustive``:
  ``datamove.tuning.tune``), over a copy of the cold database, so that it measures only what the
  default left out, with ``--exhaustive-budget-s``;
- the default plan's layer and the exhaustive plan's timed here in alternating rounds: fwd+bwd
  GPU busy time per call (profiler sums, ``benchmarks/layer.py``'s ``kernel_profile``), medians,
  and the default's gap to the exhaustive one.
Each step's result is kept in ``WORK/<name>/<step>.json`` and a step already done is not run
again (``--steps`` picks some; the exhaustive run, when its budget stops it, goes on from its
database on the next call): the steps fit device calls of a few minutes each, WORK carried along.
The results (``OUT/tuning_cost.md`` and ``.json``) are rewritten after every case, with what is done.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.layer import _call, kernel_profile, llama_tables  # noqa: E402
from datamove.export import load_layer, read_manifest  # noqa: E402
from datamove.harness.bench import require_cuda, utc_stamp, write_results  # noqa: E402
from datamove.kernels.device import query_device, versions  # noqa: E402

ROUNDS = 5  # alternating rounds of the two plans' layers


def optimize(spec: str, dims: str, db: Path, out: Path, budget_s: float | None, exhaustive: bool = False,
             gpus: int | None = None) -> dict:
    """One ``optimize-layer`` run (``gpus``: measuring on the first that many, default all): its wall
    time (s), exit status, the tuning's summary line and its cost per stage from the report."""
    command = [sys.executable, "-m", "datamove.cli", spec, "--dims", dims, "--db", str(db), "--out", str(out)]
    command += (["--budget-s", f"{budget_s:g}"] if budget_s is not None else []) + (["--exhaustive"] if exhaustive else [])
    command += ["--gpus", str(gpus)] if gpus is not None else []
    # as on a user's installation, whose packages have their bytecode (a GPU host of ours sets
    # PYTHONDONTWRITEBYTECODE: every run compiled DaCe and datamove again, seconds of each warm run)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    # the job's output goes to its log as it comes: a run killed from outside leaves what it said
    log = out.parent / f"{out.name}{'-exhaustive' if exhaustive else ''}-{time.strftime('%H%M%S')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    wall = time.monotonic() - started
    said = log.read_text().splitlines()
    summary = next((line for line in said if line.startswith("Tuning: ")), None)
    tuning = json.loads((out / "report.json").read_text())["meta"].get("tuning") if done.returncode == 0 else None
    plan = json.loads((out / "plan.json").read_text()) if done.returncode == 0 else {}
    return {"wall_s": round(wall, 1), "rc": done.returncode, "summary": summary, "tuning": tuning,
            "plan_ms": plan.get("total_ms"), "log": str(log), "error": (said or [""])[-1] if done.returncode else None}


def layer_step(artifact: Path):
    """fwd+bwd of the artifact's layer on the GPU (Llama: HF's rotary tables set), as ``layer.py`` calls it."""
    manifest = read_manifest(artifact)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(artifact, device="cuda", allow_mismatch=True).train()
    if manifest["spec"] == "llama":
        cos, sin = llama_tables(manifest, layer.dtype, "cuda")
        with torch.no_grad():
            layer.spec_view("cos").copy_(cos[0])
            layer.spec_view("sin").copy_(sin[0])
    program = layer.program(True)
    x = torch.randn(program.torch_shapes[program.interface.activations[0]], device="cuda", dtype=layer.dtype,
                    requires_grad=True)
    return _call(layer, x, torch.randn_like(x), True)


def compare_plans(default: Path, exhaustive: Path) -> dict:
    """Both plans' layers, fwd+bwd kernel ms per call: medians of ``ROUNDS`` alternating rounds."""
    steps = {"default": layer_step(default), "exhaustive": layer_step(exhaustive)}
    for step in steps.values():
        for _ in range(3):
            step()
    times = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            times[name].append(kernel_profile(step)[0])
    result = {name: round(statistics.median(ms), 4) for name, ms in times.items()}
    result["gap_percent"] = round((result["default"] / result["exhaustive"] - 1) * 100, 2)
    return result


STEPS = ("cold", "warm", "exhaustive", "compare")


def run_case(work: Path, name: str, spec: str, dims: str, budget_s: float | None, exhaustive_budget_s: float | None,
             steps=STEPS) -> dict:
    """The case's ``steps`` not done yet in ``work`` (each kept as ``WORK/<name>/<step>.json``; the
    exhaustive run done only once its tuning finished: a run stopped by its budget is run again,
    going on from its database), then everything done so far.  A cold run starts from an empty
    database: only in a new ``work`` folder (or after deleting the case's)."""
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    db, exhaustive_db = folder / "tuning.db", folder / "exhaustive.db"
    case = {"name": name, "spec": spec, "dims": dims}
    for step in STEPS:
        record = folder / f"{step}.json"
        done = json.loads(record.read_text()) if record.exists() else None
        if step in steps and not _finished(step, done):
            if step == "cold" and db.exists():
                raise SystemExit(f"{db}: a cold run needs an empty database; use a new --work folder")
            if step in ("warm", "exhaustive", "compare") and not (folder / "cold.json").exists():
                raise SystemExit(f"{name}: {step} needs the cold run first (--steps cold)")
            if step == "exhaustive" and not exhaustive_db.exists():
                shutil.copy(db, exhaustive_db)
            if step == "compare":
                exhaustive_record = folder / "exhaustive.json"
                if not _finished("exhaustive", json.loads(exhaustive_record.read_text()) if exhaustive_record.exists() else None):
                    print(f"{name}: the exhaustive tuning has not finished: plans not compared yet", file=sys.stderr)
                    continue
                done = compare_plans(folder / "default", folder / "exhaustive")
            else:
                exhaustive = step == "exhaustive"
                done = optimize(spec, dims, exhaustive_db if exhaustive else db, folder / ("exhaustive" if exhaustive else "default"),
                                exhaustive_budget_s if exhaustive else budget_s, exhaustive=exhaustive)
                done["date"] = utc_stamp()
            record.write_text(json.dumps(done, indent=1))
        if done is not None:
            case["kernel_ms" if step == "compare" else step] = done
    return case


def _finished(step: str, done: dict | None) -> bool:
    """Whether a step's record says it needs no new run (an exhaustive run: its tuning finished)."""
    if done is None:
        return False
    return step != "exhaustive" or (done.get("rc") == 0 and not (done.get("tuning") or {}).get("stopped"))


def _stopped(run: dict) -> str:
    if run["rc"]:
        return f"failed (exit {run['rc']}: {run['error']})"
    tuning = run.get("tuning") or {}
    return tuning.get("stopped") or "finished"


def markdown(report: dict) -> str:
    lines = [f"# The main job's tuning cost ({report['device']}, {report['date']})", "",
             *[f"- {note}" for note in report.get("notes", [])], *([""] if report.get("notes") else []),
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".", "",
             "Cold: a new tuning database, the default budget; warm: the same command again; exhaustive: what the "
             "tuning's rules prune measured too, over a copy of the cold database. Cold plan: its time as the job "
             "measured it (the sum of its steps). Kernel: the plans' layers, fwd+bwd "
             "GPU busy time per call, medians of alternating rounds; gap: the default plan's over the exhaustive one's.",
             "", "| case | cold s | cold tuning | cold plan ms (job) | warm s | exhaustive s | default plan ms | "
             "exhaustive plan ms | gap |", "|---|---|---|---|---|---|---|---|---|"]
    for case in report["cases"]:
        kernel, missing = case.get("kernel_ms", {}), {"wall_s": "not run"}
        cold, warm, exhaustive = (case.get(step, missing) for step in ("cold", "warm", "exhaustive"))
        lines.append(f"| {case['name']} {case['dims']} | {cold['wall_s']} | {_stopped(cold) if 'rc' in cold else ''} | "
                     f"{format(cold['plan_ms'], '.4f') if cold.get('plan_ms') else ''} | {warm['wall_s']} | {exhaustive['wall_s']}"
                     + (f" ({_stopped(exhaustive)})" if "rc" in exhaustive and _stopped(exhaustive) != "finished" else "")
                     + f" | {kernel.get('default', '')} | {kernel.get('exhaustive', '')} | "
                     + (f"{kernel['gap_percent']:+.2f}%" if kernel else "") + " |")
    for case in report["cases"]:
        tuning = case.get("cold", {}).get("tuning")
        if not tuning:
            continue
        lines += ["", f"## {case['name']}: the cold tuning per stage", "",
                  "| stage | timed | failed | read back | pruned | left by the budget | s |", "|---|---|---|---|---|---|---|"]
        for stage in tuning["stages"]:
            counts = stage["counts"]
            failed = sum(counts.get(k, 0) for k in ("failed", "too slow", "wrong"))
            lines.append(f"| {stage['stage']} | {counts.get('ok', 0)} | {failed} | {counts.get('skipped', 0)} | "
                         f"{stage['pruned']} | {stage['left']} | {stage['wall_s']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=3, action="append", required=True, metavar=("NAME", "SPEC", "DIMS"),
                        help="a case: its name, spec file and dims (e.g. bert configs/bert.py B=8,L=512)")
    parser.add_argument("--work", type=Path, default=Path("out/tuning_cost"), help="the jobs' databases and artifacts")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--budget-s", type=float, default=None, help="the default runs' budget (default: the job's)")
    parser.add_argument("--exhaustive-budget-s", type=float, default=3600.0,
                        help="the exhaustive run's budget; a run it stops goes on when this is run again")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS),
                        help="the steps to run where not done yet in --work (one device call each, say)")
    args = parser.parse_args()
    require_cuda("benchmarks/tuning_cost.py")
    report = {"date": utc_stamp(), "device": torch.cuda.get_device_name(), "facts": query_device().to_dict(),
              "versions": versions(), "cases": []}
    for name, spec, dims in args.case:  # the results rewritten after each case: what was measured stays
        report["cases"].append(run_case(args.work, name, spec, dims, args.budget_s, args.exhaustive_budget_s, args.steps))
        write_results(args.out, "tuning_cost", report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
