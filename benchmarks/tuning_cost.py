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
The results (``OUT/tuning_cost.md`` and ``.json``) are rewritten after every case.
"""
from __future__ import annotations

import argparse
import json
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
from datamove.harness.bench import utc_stamp, write_results  # noqa: E402
from datamove.kernels.device import query_device, versions  # noqa: E402

ROUNDS = 5  # alternating rounds of the two plans' layers


def optimize(spec: str, dims: str, db: Path, out: Path, budget_s: float | None, exhaustive: bool = False) -> dict:
    """One ``optimize-layer`` run: its wall time (s), exit status, the tuning's summary line and its
    cost per stage from the report."""
    command = [sys.executable, "-m", "datamove.cli", spec, "--dims", dims, "--db", str(db), "--out", str(out)]
    command += (["--budget-s", f"{budget_s:g}"] if budget_s is not None else []) + (["--exhaustive"] if exhaustive else [])
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - started
    log = out.parent / f"{out.name}{'-exhaustive' if exhaustive else ''}-{time.strftime('%H%M%S')}.log"
    log.write_text(done.stdout + done.stderr)
    summary = next((line for line in done.stdout.splitlines() if line.startswith("Tuning: ")), None)
    tuning = json.loads((out / "report.json").read_text())["meta"].get("tuning") if done.returncode == 0 else None
    plan = json.loads((out / "plan.json").read_text()) if done.returncode == 0 else {}
    return {"wall_s": round(wall, 1), "rc": done.returncode, "summary": summary, "tuning": tuning,
            "plan_ms": plan.get("total_ms"), "log": str(log), "error": (done.stderr.strip().splitlines() or [""])[-1]
            if done.returncode else None}


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


def run_case(work: Path, name: str, spec: str, dims: str, budget_s: float | None, exhaustive_budget_s: float | None) -> dict:
    folder = work / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    db = folder / "tuning.db"
    case = {"name": name, "spec": spec, "dims": dims, "date": utc_stamp()}
    case["cold"] = optimize(spec, dims, db, folder / "default", budget_s)
    case["warm"] = optimize(spec, dims, db, folder / "default", budget_s)
    exhaustive_db = folder / "exhaustive.db"
    shutil.copy(db, exhaustive_db)
    case["exhaustive"] = optimize(spec, dims, exhaustive_db, folder / "exhaustive", exhaustive_budget_s, exhaustive=True)
    if case["cold"]["rc"] == 0 and case["exhaustive"]["rc"] == 0:
        case["kernel_ms"] = compare_plans(folder / "default", folder / "exhaustive")
    return case


def _stopped(run: dict) -> str:
    if run["rc"]:
        return f"failed (exit {run['rc']}: {run['error']})"
    tuning = run.get("tuning") or {}
    return tuning.get("stopped") or "finished"


def markdown(report: dict) -> str:
    lines = [f"# The main job's tuning cost ({report['device']}, {report['date']})", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".", "",
             "Cold: a new tuning database, the default budget; warm: the same command again; exhaustive: what the "
             "tuning's rules prune measured too, over a copy of the cold database. Kernel: the plans' layers, fwd+bwd "
             "GPU busy time per call, medians of alternating rounds; gap: the default plan's over the exhaustive one's.",
             "", "| case | cold s | cold tuning | warm s | exhaustive s | default plan ms | exhaustive plan ms | gap |",
             "|---|---|---|---|---|---|---|---|"]
    for case in report["cases"]:
        kernel = case.get("kernel_ms", {})
        lines.append(f"| {case['name']} {case['dims']} | {case['cold']['wall_s']} | {_stopped(case['cold'])} | "
                     f"{case['warm']['wall_s']} | {case['exhaustive']['wall_s']} | {kernel.get('default', '')} | "
                     f"{kernel.get('exhaustive', '')} | "
                     + (f"{kernel['gap_percent']:+.2f}%" if kernel else "") + " |")
    for case in report["cases"]:
        tuning = case["cold"].get("tuning")
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
    parser.add_argument("--exhaustive-budget-s", type=float, default=3600.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/tuning_cost.py needs a CUDA GPU: nothing measured", file=sys.stderr)
        return 2
    report = {"date": utc_stamp(), "device": torch.cuda.get_device_name(), "facts": query_device().to_dict(),
              "versions": versions(), "cases": []}
    for name, spec, dims in args.case:  # the results rewritten after each case: what was measured stays
        report["cases"].append(run_case(args.work, name, spec, dims, args.budget_s, args.exhaustive_budget_s))
        write_results(args.out, "tuning_cost", report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
