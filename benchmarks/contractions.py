"""The training graph's contractions (GEMMs) per storage layout: cuBLAS vs the Triton template, and epilogue fusion.

    PYTHONPATH=$PWD python3 benchmarks/contractions.py [--spec bert] [--db tuning.db] [--budget-s 330]
        [--dims B=8,L=512] [--layouts 3] [--limit-configs N] [--other-configs 3] [--limit-gemms N]
        [--gpus N] [--retry-failed] [--out benchmarks/results] [--no-progress]

The GEMMs come from the stored fused training graph (``dataflow.snapshot``; stacked Q/K/V and
their dX/dW as one einsum each; ``harness.contraction_variants.training_gemms``).  Everything
goes through ``harness.bench.Sweep`` into the tuning DB (each record committed as it is made:
a killed or out-of-budget run resumes where it stopped, a repeated run only reads the DB), in
two phases: (1) per GEMM, its first layout combination (spec order when it is a BLAS GEMM) with
cuBLAS and every Triton config of ``valid_configs`` (the first ``--limit-configs``); (2) the
other ``--layouts`` - 1 combinations with cuBLAS and the ``--other-configs`` configs fastest on
the first layout (read from the DB; without a GPU, the first ones checked), and each epilogue
the template can fuse (linear1 + bias + ReLU + dropout, found structurally) as one Triton kernel
(the GEMM's ``EPILOGUE_CONFIGS`` fastest configs) vs the cuBLAS GEMM then PyTorch eager and vs
the cuBLAS GEMM then the consumer's generated kernel (``kernels.codegen``; every configuration
with spec-order layouts, the report keeps the fastest).  Every
variant is checked against a float64 einsum (``harness.accuracy``'s rule, baseline: torch's
einsum in bf16 on the same operands) before it is timed.  Times: ``harness.bench.time_cuda``
medians (CUDA events, L2 flushed before every repetition).  Then the report from the DB records:
per layout, TFLOP/s of cuBLAS and of the best Triton config, % of the bf16 GEMM rate measured on
this device (``measure_ceilings``, kept in the DB), Triton/cuBLAS time; per GEMM, the best
variant of each backend; the epilogue fusion.  ``contractions.md`` / ``.json`` under ``--out``,
written only on a GPU; without one the variants are checked through the Triton interpreter
(give small ``--dims``) and nothing is measured or written.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from datamove.dataflow import snapshot  # noqa: E402
from datamove.dtypes import parse as parse_dtype  # noqa: E402
from datamove.harness.bench import CPU_DEVICE, Sweep, measure_ceilings, utc_stamp, write_results  # noqa: E402
from datamove.families.forward_epilogue import consumer_configurations, epilogue_of, epilogue_variants  # noqa: E402
from datamove.harness.contraction_variants import DTYPE, Operands, gemm_variants, pick_layouts, training_gemms  # noqa: E402
from datamove.kernels.device import query_device, versions  # noqa: E402
from datamove.kernels.gemm import valid_configs  # noqa: E402
from datamove.harness.tuning_db import TuningDB  # noqa: E402

EPILOGUE_CONFIGS = 4
WARMUP_MS, REP_MS = 10.0, 40.0


def parse_dims(text: str | None) -> dict:
    if not text:
        return {}
    return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}


def config_text(knobs: dict) -> str:
    text = f"{knobs['block_m']}x{knobs['block_n']}x{knobs['block_k']} g{knobs['group_m']} s{knobs['num_stages']} w{knobs['num_warps']}"
    return text + (" tma" if knobs["tma"] else "") + (f" e{knobs['epilogue_split']}" if knobs["epilogue_split"] else "")


def tflops(flop: int, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def layout_rows(db: TuningDB, device: str, gemms, layouts: int, dtype: str, peak: float) -> list[dict]:
    """Per GEMM and layout combination: the cuBLAS record and the fastest Triton record."""
    rows = []
    for g in gemms:
        for plan in pick_layouts(g, layouts):
            layout = dict(zip(("a", "b", "out"), plan.layouts))
            records = db.query(op=g.op, device=device, versions=versions(), dims=g.sizes, dtype=dtype, layout=layout)
            cublas = next((r for r in records if r.key.knobs["backend"] == "cublas"), None)
            triton = [r for r in records if r.key.knobs["backend"] == "triton"]
            if cublas is None and not triton:
                continue
            row = {"gemm": g.name, "phase": g.phase, "einsum": g.spec, "layouts": ",".join(plan.layouts[:2]) + "->" + plan.layouts[2],
                   "plan": plan.describe().split(": ", 1)[1], "gflop": g.flop / 1e9,
                   "triton_statuses": {s: sum(r.status == s for r in triton) for s in ("ok", "failed", "wrong") if any(r.status == s for r in triton)}}
            if cublas is not None:
                row["cublas_status"] = cublas.status if cublas.status == "ok" else f"{cublas.status}: {(cublas.detail or '')[:200]}"
            if cublas is not None and cublas.status == "ok":
                row.update(cublas_ms=cublas.median_ms, cublas_tflops=tflops(g.flop, cublas.median_ms),
                           cublas_pct_peak=100 * cublas.flop_per_s / peak, cublas_check=cublas.detail)
            best = next((r for r in triton if r.status == "ok"), None)
            if best is not None:
                row.update(triton_ms=best.median_ms, triton_tflops=tflops(g.flop, best.median_ms),
                           triton_pct_peak=100 * best.flop_per_s / peak, triton_best_config=config_text(best.key.knobs),
                           triton_check=best.detail)
                if "cublas_ms" in row:
                    row.update(triton_over_cublas_time=best.median_ms / row["cublas_ms"],
                               triton_within_5pct=best.median_ms <= 1.05 * row["cublas_ms"])
            problems = [f"{config_text(r.key.knobs)}: {r.status}: {(r.detail or '')[:160]}" for r in triton if r.status != "ok"]
            if problems:
                row["triton_problems"] = problems
            rows.append(row)
    return rows


def gemm_summary(rows: list[dict]) -> list[dict]:
    """Per GEMM: the fastest cuBLAS and the fastest Triton variant over all its layouts, and the
    best variant of all against cuBLAS in the spec's layouts (the first row: what PyTorch runs)."""
    result = []
    for name in dict.fromkeys(r["gemm"] for r in rows):
        mine = [r for r in rows if r["gemm"] == name]
        cublas = min((r for r in mine if "cublas_ms" in r), key=lambda r: r["cublas_ms"], default=None)
        triton = min((r for r in mine if "triton_ms" in r), key=lambda r: r["triton_ms"], default=None)
        entry = {"gemm": name, "einsum": mine[0]["einsum"]}
        if cublas:
            entry["cublas"] = {"layouts": cublas["layouts"], "ms": cublas["cublas_ms"]}
        if triton:
            entry["triton"] = {"layouts": triton["layouts"], "ms": triton["triton_ms"], "config": triton["triton_best_config"]}
        if cublas and triton:
            entry["triton_over_cublas_time"] = triton["triton_ms"] / cublas["cublas_ms"]
        candidates = [(impl, entry[key]) for impl, key in (("cuBLAS", "cublas"), ("Triton", "triton")) if key in entry]
        if "cublas_ms" in mine[0] and candidates:
            impl, best = min(candidates, key=lambda c: c[1]["ms"])
            reference = mine[0]["cublas_ms"]
            entry["best"] = {"impl": impl, **best}
            entry["reference"] = {"layouts": mine[0]["layouts"], "ms": reference}
            entry["best_over_reference_time"] = best["ms"] / reference
            entry["best_within_5pct"] = best["ms"] <= 1.05 * reference
        result.append(entry)
    return result


def _consumer_knobs(knobs: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in knobs.items() if k not in ("backend", "dropout"))


def epilogue_rows(db: TuningDB, device: str, variants, dtype: str) -> list[dict]:
    """Per fused-epilogue op: the fused Triton configs vs cuBLAS + eager and vs cuBLAS + the
    consumer's generated kernel (its fastest configuration)."""
    rows = []
    for op in dict.fromkeys(v.op for v in variants):
        v = next(x for x in variants if x.op == op)
        records = db.query(op=op, device=device, versions=versions(), dims=v.dims, dtype=dtype)
        eager = next((r for r in records if r.key.knobs["backend"] == "cublas+eager"), None)
        fused = [r for r in records if r.key.knobs["backend"] == "triton"]
        generated = [r for r in records if r.key.knobs["backend"] == "cublas+fused" and r.status == "ok"]
        best = next((r for r in fused if r.status == "ok"), None)
        row = {"op": op, "gemm": v.operands.gemm.name, "consumer": v.epilogue.consumer, "layouts": v.layout,
               "fused_ms_by_config": {config_text(r.key.knobs): r.median_ms if r.status == "ok" else r.status for r in fused}}
        if eager is not None:
            row["cublas_then_eager"] = {"ms": eager.median_ms, "status": eager.status, "check": eager.detail}
        if generated:
            row["cublas_then_generated"] = {"ms": generated[0].median_ms, "knobs": _consumer_knobs(generated[0].key.knobs),
                                            "check": generated[0].detail, "configs": len(generated)}
        if best is not None:
            row["fused"] = {"ms": best.median_ms, "config": config_text(best.key.knobs), "check": best.detail}
            if eager is not None and eager.status == "ok":
                row["fused_speedup_vs_eager"] = eager.median_ms / best.median_ms
            if generated:
                row["fused_speedup_vs_generated"] = generated[0].median_ms / best.median_ms
        rows.append(row)
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# Contraction variants of the training graph: cuBLAS vs Triton template",
        "",
        f"Written by `benchmarks/contractions.py` on {report['date']}. Device: {report['device']}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".",
        f"Spec {report['spec']}, dims {report['dims']}; {report['dtype']} in/out, fp32 accumulation. "
        "GEMMs from the fused training graph (operator names; `stack(...)`: several einsums as one). "
        "Flop = 2 x product of the sizes of all letters.",
        f"Peak: bf16 {report['peak']['what']} measured on this device (`measure_ceilings`, tuning DB) = "
        f"**{report['peak']['tflops']:.0f} TFLOP/s**; % peak below is of this.",
        f"Sweep: {report['sweep']['summary']}; {report['sweep']['wall_s']:.0f} s wall.",
        "Times: medians of `harness.bench.time_cuda` through `harness.bench.Sweep` (CUDA events, L2 flushed before each "
        f"repetition, {WARMUP_MS:g} ms warm-up, {REP_MS:g} ms of repetitions), read back from the tuning DB. Triton: best of the "
        f"configs tried (every one of `valid_configs` for a GEMM's first layout, the {report['sweep']['other_configs']} fastest "
        "there for its other layouts; `tma` configs read A and B through tensor descriptors, only where the layouts allow). "
        "Layouts are written A,B->C (storage order of each operand, row-major); plan: batch, M, N, K, "
        "A/B/C N = row-major (K-major A, N-major B, N-major C), T = transposed. Every timed variant passed the float64 check first.",
        "",
        "| GEMM | einsum | layouts | plan | GFLOP | cuBLAS ms | TFLOP/s | % peak | Triton ms | TFLOP/s | % peak | Triton/cuBLAS time | within 5% | best config |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in report["variants"]:
        cub = (f"{r['cublas_ms']:.4f} | {r['cublas_tflops']:.0f} | {r['cublas_pct_peak']:.0f}%" if "cublas_ms" in r
               else f"{r.get('cublas_status', 'not run')[:40]} | - | -")
        if "triton_ms" in r:
            ratio = (f"{r['triton_over_cublas_time']:.2f} | {'yes' if r['triton_within_5pct'] else 'no'}"
                     if "triton_over_cublas_time" in r else "- | -")
            tri = f"{r['triton_ms']:.4f} | {r['triton_tflops']:.0f} | {r['triton_pct_peak']:.0f}% | {ratio} | {r['triton_best_config']}"
        else:
            tri = f"- | - | - | - | no | none timed {r['triton_statuses']}"
        lines.append(f"| {r['gemm']} | `{r['einsum']}` | `{r['layouts']}` | {r['plan']} | {r['gflop']:.1f} | {cub} | {tri} |")
    within = sum(1 for r in report["variants"] if r.get("triton_within_5pct"))
    best_within = sum(1 for s in report["gemms"] if s.get("best_within_5pct"))
    lines += ["", f"Best Triton config within 5% of cuBLAS (or faster), per layout: **{within} of {len(report['variants'])}**.", "",
              "## Best variant per GEMM (over its layouts)", "",
              "Best: the fastest variant of any implementation and layouts; reference: cuBLAS on the spec's layouts "
              "(the first row of the GEMM above, what PyTorch runs).", "",
              "| GEMM | einsum | cuBLAS ms (layouts) | Triton ms (layouts, config) | Triton/cuBLAS time | best | best / reference time |",
              "| --- | --- | --- | --- | ---: | --- | ---: |"]
    for s in report["gemms"]:
        cub = f"{s['cublas']['ms']:.4f} (`{s['cublas']['layouts']}`)" if "cublas" in s else "-"
        tri = f"{s['triton']['ms']:.4f} (`{s['triton']['layouts']}`, {s['triton']['config']})" if "triton" in s else "-"
        ratio = f"{s['triton_over_cublas_time']:.2f}" if "triton_over_cublas_time" in s else "-"
        best = f"{s['best']['impl']} `{s['best']['layouts']}`" if "best" in s else "-"
        verdict = f"{s['best_over_reference_time']:.2f}" if "best" in s else "-"
        lines.append(f"| {s['gemm']} | `{s['einsum']}` | {cub} | {tri} | {ratio} | {best} | {verdict} |")
    lines += ["", f"Best variant within 5% of the reference (or faster): **{best_within} of {len(report['gemms'])}** GEMMs."]
    problems = [(r["gemm"], r["layouts"], p) for r in report["variants"] for p in r.get("triton_problems", [])]
    lines += ["", f"Accuracy: rule of `harness.accuracy` (float64 einsum reference, torch bf16 einsum baseline); "
              f"Triton configs failed or wrong: {len(problems)}" + ("." if not problems else ":")]
    lines += [f"- {g} `{lay}`: {p}" for g, lay, p in problems[:20]]
    for e in report["epilogue"]:
        lines += ["", f"## Epilogue fusion: {e['gemm']} + {e['consumer']}", "", f"`{e['op']}`, layouts {e['layouts']}.", "",
                  "| variant | ms |", "| --- | ---: |"]
        for config, ms in e["fused_ms_by_config"].items():
            lines.append(f"| fused Triton {config} | {ms:.4f} |" if isinstance(ms, float) else f"| fused Triton {config} | {ms} |")
        if "cublas_then_eager" in e:
            ce = e["cublas_then_eager"]
            lines.append(f"| cuBLAS GEMM then eager bias, ReLU, dropout | {ce['ms']:.4f} |" if ce["ms"] is not None
                         else f"| cuBLAS GEMM then eager | {ce['status']} |")
        if "cublas_then_generated" in e:
            cg = e["cublas_then_generated"]
            lines.append(f"| cuBLAS GEMM then the generated {e['consumer']} kernel (fastest of {cg['configs']} "
                         f"configurations: {cg['knobs']}) | {cg['ms']:.4f} |")
        if "fused_speedup_vs_eager" in e:
            lines += ["", f"Fused vs cuBLAS + eager: **{e['fused_speedup_vs_eager']:.2f}x** (fused check: {e['fused']['check']})."]
        if "fused_speedup_vs_generated" in e:
            lines += [f"Fused vs cuBLAS + the generated element-wise kernel: **{e['fused_speedup_vs_generated']:.2f}x**."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="bert", choices=list(snapshot.SPECS))
    parser.add_argument("--db", default="tuning.db")
    parser.add_argument("--dims", help="dim overrides, e.g. B=2,L=65 (default: the spec's sizes)")
    parser.add_argument("--budget-s", type=float, default=None, help="stop after this long; rerun to go on")
    parser.add_argument("--layouts", type=int, default=3, help="layout combinations per GEMM")
    parser.add_argument("--limit-configs", type=int, default=None, help="the first N Triton configs on a GEMM's first layout")
    parser.add_argument("--other-configs", type=int, default=3, help="configs tried on the other layouts (fastest on the first)")
    parser.add_argument("--limit-gemms", type=int, default=None, help="the first N GEMMs of the training graph")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs measured on, one process each (default: all)")
    parser.add_argument("--retry-failed", action="store_true", help="measure again the variants recorded as failed")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    started = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    training = snapshot.stored_fused()[args.spec].with_dims(parse_dims(args.dims))
    gemms = training_gemms(training)[:args.limit_gemms]
    configs = list(valid_configs(DTYPE))[:args.limit_configs]
    db = TuningDB(args.db)

    def remaining():
        return None if args.budget_s is None else max(0.0, args.budget_s - (time.monotonic() - started))

    def sweep(variants):
        return Sweep(db, variants, budget_s=remaining(), warmup_ms=WARMUP_MS, rep_ms=REP_MS, progress=not args.no_progress,
                     processes=args.gpus, retry_failed=args.retry_failed)

    first = {g.name: gemm_variants(g, device, layouts=1, first_configs=configs) for g in gemms}
    phase1 = sweep([v for vs in first.values() for v in vs])
    print(f"phase 1: {len(phase1.variants)} variants, {len(gemms)} GEMMs x first layout x (cuBLAS + {len(configs)} configs)",
          file=sys.stderr)
    report1 = phase1.run()
    second, epilogue = [], []
    for g in gemms:
        ranked = [v.config for v in phase1.ranked(first[g.name]) if v.config is not None]
        second += gemm_variants(g, device, layouts=args.layouts, first_configs=configs,
                                other_configs=ranked[:args.other_configs])[len(first[g.name]):]
        fusable = epilogue_of(training, g)
        if fusable is not None:
            epilogue += epilogue_variants(Operands(g, device, seed=1), fusable, ranked[:EPILOGUE_CONFIGS],
                                          consumer_configurations(training, fusable))
    phase2 = sweep(second + epilogue)
    print(f"phase 2: {len(second)} variants over the other layouts, {len(epilogue)} epilogue-fusion variants", file=sys.stderr)
    report2 = phase2.run()
    counts = {s: report1.counts[s] + report2.counts[s] for s in report1.counts}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    if report1.stopped or report2.stopped:
        summary += f"; stopped ({report2.stopped or report1.stopped}), rerun to go on"
    if not report2.measured:
        print(f"{CPU_DEVICE}: NOTHING WAS MEASURED (no GPU). {summary}. No results written.")
        return 0 if counts["wrong"] == 0 else 1

    ceilings = measure_ceilings(db)
    dtype = parse_dtype(DTYPE).name
    rows = layout_rows(db, report2.device, gemms, args.layouts, dtype, ceilings.gemm_flop_per_s)
    facts = query_device()
    report = {
        "date": utc_stamp(), "device": report2.device,
        "facts": facts.to_dict(), "versions": versions(), "spec": args.spec, "dims": training.graph.dim_values, "dtype": dtype,
        "peak": {"what": "torch.mm 8192^3, random normal", "tflops": ceilings.gemm_flop_per_s / 1e12},
        "flop_formula": "2 * product of the sizes of all letters of the einsum",
        "sweep": {"summary": summary, "counts": counts, "layouts": args.layouts, "limit_configs": args.limit_configs,
                  "other_configs": args.other_configs, "wall_s": time.monotonic() - started},
        "gemm_list": [{"name": g.name, "phase": g.phase, "einsum": g.spec, "sizes": g.sizes} for g in gemms],
        "variants": rows, "gemms": gemm_summary(rows), "epilogue": epilogue_rows(db, report2.device, epilogue, dtype),
    }
    text = markdown(report)
    write_results(args.out, "contractions", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
