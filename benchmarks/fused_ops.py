"""Sweep every fused element-wise / normalization operator of the training graphs over its layouts.

    PYTHONPATH=$PWD python3 benchmarks/fused_ops.py [--spec bert gpt2] [--budget-s 840] [--db tuning.db]
        [--dims B=8,L=512] [--exhaustive] [--search two-stage|all] [--top 3] [--compile-workers 15]
        [--limit-ops N] [--limit-configs N] [--gpus N] [--retry-failed] [--out benchmarks/results]

No DaCe needed: graphs come from the stored snapshots (``dataflow.snapshot``: fused training
graphs and closed forms).  For each fused operator of each spec: PyTorch
eager's sequence of the unfused operators it replaces (``harness.eager``) and the configurations
of its layout space (``layouts.space.configurations``, pruned unless ``--exhaustive``) go through
``harness.bench.Sweep`` (``harness.sweep_variants``): compiled ahead in ``--compile-workers``
processes, built, checked (one measuring process per GPU, ``--gpus``; a variant that crashes or
hangs is recorded failed with the reason and not tried again unless ``--retry-failed``) against a float64 evaluation on the device, timed (CUDA events, L2
flushed, medians), each record committed to the tuning DB
as it is made, so a killed or out-of-budget run resumes where it stopped and a repeated run only
reads the DB.  Search: ``two-stage`` measures every access pattern (each tensor's layout, the
vectorised letter and the letter order: ``layouts.space.access_pattern``) with mid-sized knobs,
then every knob setting of the ``--top`` fastest patterns of each operator; ``all`` measures every
configuration.  Then the report: per operator the best variant (layouts, knobs), its median time,
bytes moved (distinct input + output elements x 2 bytes; dropout masks are regenerated, not
read), achieved GB/s and % of the copy bandwidth measured on this device (``measure_ceilings``,
kept in the DB), the eager time and the speedup; totals.  Written to ``fused_ops.md`` / ``.json``
under ``--out`` when run on a GPU; without one the variants are only checked through the Triton
interpreter (in float32, whose fp32 -> bf16 casts truncate) and nothing is measured or written.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from datamove.dtypes import parse as parse_dtype  # noqa: E402
from datamove.harness.bench import CPU_DEVICE, GRAPH_BELOW_MS, Sweep, measure_ceilings, utc_stamp, write_results  # noqa: E402
from datamove.kernels.device import query_device, versions  # noqa: E402
from datamove.harness.sweep_variants import DTYPE, fused_operators, moved_bytes, op_signature, sweep_variants  # noqa: E402
from datamove.harness.tuning_db import TuningDB  # noqa: E402
from datamove.dataflow import snapshot  # noqa: E402


def parse_dims(text: str | None) -> dict:
    if not text:
        return {}
    return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}


def operator_rows(db: TuningDB, device: str, spec: str, training, dtype: str) -> list[dict]:
    """One row per fused operator from the DB: best variant, eager time, counts by status."""
    graph = training.graph
    rows = []
    for op in fused_operators(training):
        sig = op_signature(spec, op)
        common = dict(device=device, versions=versions(), dims=dict(graph.dim_values), dtype=dtype)
        records = db.query(op=sig, **common)
        eager = db.query(op=sig + "#eager", **common)
        best = next((r for r in records if r.status == "ok"), None)
        counts = {}
        for r in records:
            counts[r.status] = counts.get(r.status, 0) + 1
        row = {"spec": spec, "operator": op.name, "phase": op.phase, "class": op.cls, "signature": sig,
               "merges": list(training.merged.get(op.name, ())), "bytes": moved_bytes(graph, op),
               "variants": counts, "best": None, "eager": None}
        if best is not None:
            row["best"] = {"median_ms": best.median_ms, "q20_ms": best.q20_ms, "q80_ms": best.q80_ms,
                           "layout": best.key.layout, "knobs": best.key.knobs, "rel_error": best.rel_error,
                           "baseline_error": best.baseline_error, "gb_per_s": best.bytes_per_s / 1e9}
        failures = [r.detail for r in records if r.status in ("failed", "wrong")]
        if best is None and failures:
            row["why_no_best"] = failures[0][:300]
        if eager and eager[0].status == "ok":
            row["eager"] = {"median_ms": eager[0].median_ms, "q20_ms": eager[0].q20_ms, "q80_ms": eager[0].q80_ms,
                            "steps": eager[0].key.layout["steps"]}
        elif eager:
            row["eager_status"] = f"{eager[0].status}: {(eager[0].detail or '')[:300]}"
        rows.append(row)
    return rows


def add_ratios(rows: list[dict], copy_bytes_per_s: float) -> None:
    for row in rows:
        if row["best"]:
            row["best"]["pct_copy_bw"] = 100 * row["best"]["gb_per_s"] * 1e9 / copy_bytes_per_s
            if row["eager"]:
                row["speedup_vs_eager"] = row["eager"]["median_ms"] / row["best"]["median_ms"]


def totals(rows: list[dict]) -> dict:
    """Sums over the operators that have both a best variant and an eager time, per spec."""
    result = {}
    for row in rows:
        if row["best"] and row["eager"]:
            t = result.setdefault(row["spec"], {"operators": 0, "fused_ms": 0.0, "eager_ms": 0.0, "bytes": 0})
            t["operators"] += 1
            t["fused_ms"] += row["best"]["median_ms"]
            t["eager_ms"] += row["eager"]["median_ms"]
            t["bytes"] += row["bytes"]
    for t in result.values():
        t["speedup_vs_eager"] = t["eager_ms"] / t["fused_ms"]
    return result


def table(rows: list[dict], sums: dict) -> str:
    head = ("| spec | operator | best layouts / knobs | fused ms | MB moved | GB/s | % copy BW | eager ms | speedup | variants |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    lines = [head]
    for r in rows:
        counts = " ".join(f"{n} {s}" for s, n in sorted(r["variants"].items()))
        eager = f"{r['eager']['median_ms']:.4f}" if r["eager"] else r.get("eager_status", "-")[:40]
        if r["best"]:
            b = r["best"]
            knobs = {k: v for k, v in b["knobs"].items() if k != "dropout"}
            lines.append(f"| {r['spec']} | {r['operator']} | {b['layout']} {knobs} | {b['median_ms']:.4f} | "
                         f"{r['bytes'] / 1e6:.1f} | {b['gb_per_s']:.0f} | {b['pct_copy_bw']:.0f} | {eager} | "
                         f"{r.get('speedup_vs_eager', float('nan')):.2f}x | {counts} |")
        else:
            lines.append(f"| {r['spec']} | {r['operator']} | none: {r.get('why_no_best', 'not measured')[:80]} | - | "
                         f"{r['bytes'] / 1e6:.1f} | - | - | {eager} | - | {counts} |")
    for spec, t in sums.items():
        lines.append(f"| {spec} | **total ({t['operators']} ops with both)** | | {t['fused_ms']:.4f} | {t['bytes'] / 1e6:.1f} | "
                     f"{t['bytes'] / (t['fused_ms'] * 1e-3) / 1e9:.0f} | | {t['eager_ms']:.4f} | "
                     f"{t['speedup_vs_eager']:.2f}x | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", nargs="+", default=list(snapshot.SPECS))
    parser.add_argument("--db", default="tuning.db")
    parser.add_argument("--dims", help="dim overrides, e.g. B=2,L=65 (default: the specs' sizes)")
    parser.add_argument("--exhaustive", action="store_true", help="every layout of every tensor (default: pruned)")
    parser.add_argument("--search", choices=("two-stage", "all"), default="two-stage",
                        help="two-stage (default): every access pattern (layouts, vector letter, letter order) with "
                             "default knobs, then every knob setting of the --top fastest patterns per operator; "
                             "all: every configuration")
    parser.add_argument("--top", type=int, default=3, help="access patterns per operator tuned in the second stage")
    parser.add_argument("--budget-s", type=float, default=None, help="stop after this long; rerun to go on")
    parser.add_argument("--limit-ops", type=int, default=None, help="the first N fused operators per spec")
    parser.add_argument("--limit-configs", type=int, default=None, help="the first N configurations per operator")
    parser.add_argument("--compile-workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 2)),
                        help="processes compiling kernels ahead of the timing (GPU only; 0: compile in line)")
    parser.add_argument("--warmup-ms", type=float, default=5.0, help="untimed repetitions per variant, ms")
    parser.add_argument("--rep-ms", type=float, default=25.0, help="timed repetitions per variant, ms")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs measured on, one process each (default: all)")
    parser.add_argument("--retry-failed", action="store_true", help="measure again the variants recorded as failed")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    started = time.monotonic()
    gpu = torch.cuda.is_available()
    dtype = DTYPE if gpu else torch.float32
    device = "cuda" if gpu else "cpu"
    trainings = {name: t.with_dims(parse_dims(args.dims)) for name, t in snapshot.stored_fused().items() if name in args.spec}
    db = TuningDB(args.db)
    spaces, notes = [], {}
    for spec, training in trainings.items():
        spec_spaces, spec_notes = sweep_variants(spec, training, device, dtype=dtype, exhaustive=args.exhaustive,
                                                 limit_ops=args.limit_ops, limit_configs=args.limit_configs)
        spaces += spec_spaces
        notes.update({f"{spec}:{k}": v for k, v in spec_notes.items()})
    total = sum(len(s.variants()) for s in spaces)
    patterns = sum(len(s.patterns) for s in spaces)
    print(f"{total} variants ({patterns} access patterns) over {', '.join(trainings)} "
          f"({'exhaustive' if args.exhaustive else 'pruned'} spaces, search: {args.search})", file=sys.stderr)
    for name, note in notes.items():
        print(f"  {name}: {note}", file=sys.stderr)

    if torch.cuda.is_available():
        ceilings = measure_ceilings(db)  # kept in the DB; measured first, the GPU's clocks are up before the sweep
    stages = []

    def sweep(variants):
        budget = None if args.budget_s is None else max(0.0, args.budget_s - (time.monotonic() - started))
        stages.append(Sweep(db, variants, budget_s=budget, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                            progress=not args.no_progress, compile_workers=args.compile_workers if gpu else 0,
                            processes=args.gpus, retry_failed=args.retry_failed).run())
        return stages[-1]

    if args.search == "all":
        sweep([v for s in spaces for v in s.variants()])
    elif sweep([v for s in spaces for v in s.first_stage()]).stopped is None:
        ranker = Sweep(db, [], progress=False)
        sweep([v for s in spaces for group in s.fastest_patterns(ranker.ranked(s.first_stage()), args.top) for v in group])
    sweep_wall_s = time.monotonic() - started
    report = stages[0]
    for later in stages[1:]:
        report.counts = {k: report.counts[k] + later.counts[k] for k in report.counts}
        report.stopped, report.remaining = later.stopped, later.remaining
    if not report.measured:
        print(f"{CPU_DEVICE}: NOTHING WAS MEASURED (no GPU). {report.summary()}. No results written.")
        return 0 if report.counts["wrong"] == 0 else 1

    dtype_name = parse_dtype(dtype).name
    rows = [row for spec, t in trainings.items() for row in operator_rows(db, report.device, spec, t, dtype_name)]
    if args.limit_ops is not None:
        keep = {s.op.name for s in spaces}
        rows = [r for r in rows if r["operator"] in keep]
    add_ratios(rows, ceilings.copy_bytes_per_s)
    sums = totals(rows)
    facts = query_device()
    result = {
        "date": utc_stamp(),
        "device": report.device, "facts": facts.to_dict(), "versions": versions(), "dtype": dtype_name,
        "copy_bytes_per_s": ceilings.copy_bytes_per_s,
        "sweep": {"counts": report.counts, "stopped": report.stopped, "remaining": report.remaining,
                  "exhaustive": args.exhaustive, "search": args.search, "top": args.top, "variants": total,
                  "access_patterns": patterns, "limit_ops": args.limit_ops, "limit_configs": args.limit_configs,
                  "compile_workers": args.compile_workers, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
                  "wall_s": sweep_wall_s},
        "notes": notes, "dims": {s: t.graph.dim_values for s, t in trainings.items()},
        "operators": rows, "totals": sums,
    }
    text = table(rows, sums)
    write_results(args.out, "fused_ops", result,
        f"# Fused element-wise / normalization operators: best layout vs PyTorch eager\n\n"
        f"{result['date']}, {report.device}, torch {versions().get('torch')}, triton {versions().get('triton')}, "
        f"CUDA {versions().get('cuda_runtime')}; {dtype_name}; measured copy bandwidth {ceilings.copy_bytes_per_s / 1e9:.0f} GB/s.\n"
        f"Sweep ({args.search}, {'exhaustive' if args.exhaustive else 'pruned'} spaces: {total} configurations "
        f"in {patterns} access patterns, top {args.top} patterns tuned): {report.summary()}; "
        f"{sweep_wall_s:.0f} s wall with {args.compile_workers} compile workers.\n\n"
        "Times: medians of CUDA-event timings with L2 flushed (``harness.bench.time_cuda``; calls under "
        f"{GRAPH_BELOW_MS:g} ms, fused or eager, replayed from a CUDA graph: GPU time). Bytes: distinct "
        "input + output elements x 2 (dropout masks regenerated, not read). Eager: the unfused member "
        "operators as PyTorch calls (``harness.eager``), measured in the same sweep.\n\n" + text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
