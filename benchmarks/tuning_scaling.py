"""The main job's tuning over a host's GPUs: the same cold job measuring on 1, 2, 4 ... of them.

    python benchmarks/tuning_scaling.py --work out/tuning_scaling --spec configs/bert.py --dims B=8,L=512 \
        --gpus 1 2 4 [--budget-s 90]

Per GPU count N (``optimize-layer --gpus N``, bf16): a new tuning database (``WORK/gpus<N>/tuning.db``)
and new kernel caches (Triton's and datamove's, in that folder), the job run once, cold
(``benchmarks/tuning_cost.py``'s ``optimize``).  From its report's tuning cost
(``meta.tuning``): the variants measured (timed, failed, too slow, wrong: everything not read back),
the seconds of the stages that measured, and their ratio, variants per second; the same per stage,
which shows where it stops scaling (a stage of few variants keeps most GPUs idle; each sweep starts
its measuring processes anew).  Speed-up: variants per second over the one-GPU run's.  With a budget
the runs stop at different points of the same ordered sweeps, so their plans are compared only where
every run finished (``plan ms``: the plan's measured total).  A count already done in WORK is not run
again.  Results: ``OUT/tuning_scaling.md`` / ``.json``, rewritten after each count.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.tuning_cost import _stopped, optimize  # noqa: E402
from datamove.harness.bench import utc_stamp, write_results  # noqa: E402
from datamove.kernels.device import query_device, versions  # noqa: E402

READ_BACK = "skipped"  # a sweep's count of variants read back from the database
COLD_CACHES = {"TRITON_CACHE_DIR": "triton-cache", "DATAMOVE_KERNEL_CACHE": "kernel-cache"}  # per run: each compiles all
PHASES = ("build", "check", "time")  # a measured variant's, as the tuning cost keeps them (harness.bench.PhaseClock)


def measured(counts: dict) -> int:
    """Variants a stage measured (every outcome but read back)."""
    return sum(n for status, n in counts.items() if status != READ_BACK)


def busy_share(stage: dict, kind: str) -> float | None:
    """The share of a stage's wall time its ``kind`` ('compile', 'measure') workers were busy, all together."""
    workers = stage.get(f"{kind}_workers")
    return round(stage[f"{kind}_busy_s"] / (workers * stage["wall_s"]), 2) if workers and stage["wall_s"] else None


def throughput(tuning: dict) -> dict:
    """Variants measured, seconds of the stages that measured, variants per second; per stage too,
    with its seconds to a first result and how busy it kept its measuring and compile workers."""
    stages = [{"stage": s["stage"], "measured": measured(s["counts"]), "wall_s": s["wall_s"],
               "startup_s": s.get("startup_s"), "measure_busy": busy_share(s, "measure"), "compile_busy": busy_share(s, "compile"),
               "phase_ms": {phase: round(1e3 * seconds / measured(s["counts"]), 1)
                            for phase, seconds in s.get("measure_phases_s", {}).items() if measured(s["counts"])}}
              for s in tuning["stages"]]
    busy = [s for s in stages if s["measured"]]
    variants, seconds = sum(s["measured"] for s in busy), sum(s["wall_s"] for s in busy)
    for s in stages:
        s["per_s"] = round(s["measured"] / s["wall_s"], 2) if s["measured"] and s["wall_s"] else None
    return {"measured": variants, "measuring_s": round(seconds, 1),
            "per_s": round(variants / seconds, 2) if seconds else None, "stages": stages}


def run_count(work: Path, spec: str, dims: str, gpus: int, budget_s: float | None) -> dict:
    """The cold job measuring on ``gpus`` GPUs, kept as ``WORK/gpus<N>.json`` where it ran to the end
    (not run again then)."""
    record = work / f"gpus{gpus}.json"
    if record.exists():
        return json.loads(record.read_text())
    folder = work / f"gpus{gpus}"
    if (folder / "tuning.db").exists():
        raise SystemExit(f"{folder / 'tuning.db'}: a cold run needs an empty database; use a new --work folder")
    folder.mkdir(parents=True, exist_ok=True)
    for variable, cache in COLD_CACHES.items():  # nothing compiled by an earlier count's run
        os.environ[variable] = str(folder / cache)
    run = optimize(spec, dims, folder / "tuning.db", folder / "artifact", budget_s, gpus=gpus)
    run.update(gpus=gpus, date=utc_stamp())
    if run["rc"]:  # not kept: the next call runs it again, cold
        (folder / "tuning.db").unlink(missing_ok=True)
        return run
    run["throughput"] = throughput(run["tuning"])
    record.write_text(json.dumps(run, indent=1))
    return run


def markdown(report: dict) -> str:
    runs = report["runs"]
    base = next((r["throughput"]["per_s"] for r in runs if r["gpus"] == 1 and r.get("throughput")), None)
    plans_comparable = runs and all(r["rc"] == 0 and _stopped(r) == "finished" for r in runs)
    lines = [f"# The main job's tuning over several GPUs ({report['device']}, {report['date']})", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + "."
             + (f" Host: {report['host']['gpus']} GPUs, {report['host']['cpu_cores']} CPU cores." if "host" in report else ""),
             "",
             f"`{report['spec']}` at {report['dims']}, bf16, each GPU count from a new tuning database"
             + (f", budget {report['budget_s']:g} s" if report["budget_s"] is not None else "")
             + ". Measured: variants timed, failed or too slow; variants/s: measured over the seconds of the stages "
             "that measured; speed-up: over one GPU's variants/s."
             + ("" if plans_comparable else " Plans not compared: not every run finished its tuning."), "",
             "| GPUs | job wall s | tuning | measured | measuring s | variants/s | speed-up | plan ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        t = r.get("throughput") or {}
        speedup = f"{t['per_s'] / base:.2f}x" if base and t.get("per_s") else ""
        lines.append(f"| {r['gpus']} | {r['wall_s']} | {_stopped(r)} | {t.get('measured', '')} | {t.get('measuring_s', '')} | "
                     f"{t.get('per_s', '')} | {speedup} | {r.get('plan_ms') if plans_comparable else ''} |")
    names = [s["stage"] for s in next((r["throughput"]["stages"] for r in runs if r.get("throughput")), [])]
    if names:
        lines += _stage_table(runs, names, "Per stage: variants measured / seconds (variants per second).",
                              lambda s: f"{s['measured']} / {s['wall_s']}" + (f" ({s['per_s']})" if s["per_s"] else ""))
        lines += _stage_table(runs, names, "Per stage: seconds before a first result (workers starting, first compiles) / "
                              "measuring processes busy / compile workers busy (shares of the stage's wall time).",
                              lambda s: "" if not s["measured"] else
                              f"{s['startup_s']} s / {_share(s['measure_busy'])} / {_share(s['compile_busy'])}")
        lines += _stage_table(runs, names, "Per stage: a measured variant's milliseconds in its measuring process, by "
                              "phase: build (kernel loaded, inputs made) / check (against float64) / time (warm-up "
                              "and timed repetitions).",
                              lambda s: " / ".join(str(s["phase_ms"].get(p, "-")) for p in PHASES) if s.get("phase_ms") else "")
    return "\n".join(lines) + "\n"


def _stage_table(runs: list, names: list, title: str, cell) -> list[str]:
    """A table of one row per stage (``names``) and one column per run: ``cell(stage)`` of the run's
    stage of that name (empty where the run has none)."""
    lines = ["", title, "", "| stage | " + " | ".join(f"{r['gpus']} GPU(s)" for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for name in names:
        stages = [next((s for s in (r.get("throughput") or {}).get("stages", []) if s["stage"] == name), None) for r in runs]
        lines.append(f"| {name} | " + " | ".join("" if s is None else cell(s) for s in stages) + " |")
    return lines


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="configs/bert.py")
    parser.add_argument("--dims", default="B=8,L=512")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4], help="the GPU counts, one cold job each")
    parser.add_argument("--work", type=Path, default=Path("out/tuning_scaling"), help="the jobs' databases and artifacts")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--budget-s", type=float, default=None, help="each job's budget (default: the job's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/tuning_scaling.py needs a CUDA GPU: nothing measured", file=sys.stderr)
        return 2
    if max(args.gpus) > torch.cuda.device_count():
        print(f"--gpus {max(args.gpus)}: this host has {torch.cuda.device_count()} GPU(s)", file=sys.stderr)
        return 2
    report = {"date": utc_stamp(), "device": torch.cuda.get_device_name(), "facts": query_device().to_dict(),
              "versions": versions(), "host": {"gpus": torch.cuda.device_count(), "cpu_cores": os.cpu_count()},
              "spec": args.spec, "dims": args.dims, "budget_s": args.budget_s, "runs": []}
    args.work.mkdir(parents=True, exist_ok=True)
    for gpus in args.gpus:
        report["runs"].append(run_count(args.work, args.spec, args.dims, gpus, args.budget_s))
        write_results(args.out, "tuning_scaling", report, markdown(report))
        print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
