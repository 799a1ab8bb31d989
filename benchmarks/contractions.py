"""BERT-large encoder-layer contractions, per storage layout: cuBLAS (torch) vs the Triton template.

    PYTHONPATH=$PWD python3 benchmarks/contractions.py [--out benchmarks/results] [--budget-s 330]

For each training GEMM of the layer (table ``GEMMS``: einsum strings over the paper's letters) and
up to ``LAYOUTS_PER_GEMM`` mappable layout combinations with a unit-stride matrix dim in every
operand, it times the cuBLAS path (``kernels.contraction.run_cublas``) and the Triton template
(``run_triton``) over its knob configs (every config for the first layout of a GEMM, that layout's
best three for the others), checks both against a float64 einsum (``kernels.accuracy`` rule,
baseline: torch's bf16 einsum), and reports TFLOP/s, % of a bf16 GEMM peak measured in the same
run (8192^3 ``torch.mm``), and whether the best Triton config is within 5% of cuBLAS.  Then the
epilogue fusion: linear1 + bias + ReLU + dropout in one Triton kernel vs the cuBLAS GEMM followed
by torch eager bias add, ReLU and dropout.  Times: ``kernels.bench.time_cuda`` medians (CUDA
events, L2 flushed before every repetition).  Writes ``contractions.md`` and ``contractions.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from dataflow.dropout_mask import keep_mask
from kernels.bench import time_cuda
from kernels.contraction import (Epilogue, GemmPlan, empty_in_layout, enumerate_variants, flops, map_layouts, parse,
                                 run_cublas, run_triton)
from kernels.device import query_device, versions
from kernels.gemm import GemmShape, tma_compatible, valid_configs

# BERT-large: batch B=8, sequence L=512 (j queries, k keys), model N=1024 (i), heads H=16,
# head dim P=64 (p for queries/keys, w for values), FFN U=4096 (u); s stacks Q, K, V.
SIZES = dict(b=8, j=512, k=512, i=1024, h=16, p=64, w=64, u=4096, s=3)

# Flop of a contraction: 2 x the product of the sizes of ALL its letters (one multiply-add per
# point of the iteration space), e.g. linear1 "ui,ibj->ubj": 2 * U * N * B * L.
GEMMS = [
    # (name, einsum)                      forward
    ("QKV stacked", "sphi,ibj->sphbj"),
    ("QK^T (beta)", "phbk,phbj->hbjk"),
    ("gamma (V x probabilities)", "whbk,hbjk->whbj"),
    ("out projection", "whi,whbj->ibj"),
    ("linear1 N->U", "ui,ibj->ubj"),
    ("linear2 U->N", "iu,ubj->ibj"),
    # backward: the gradient of each operand
    ("QKV stacked dX", "sphi,sphbj->ibj"),
    ("QKV stacked dW", "sphbj,ibj->sphi"),
    ("QK^T d(queries)", "hbjk,phbk->phbj"),
    ("QK^T d(keys)", "hbjk,phbj->phbk"),
    ("gamma d(values)", "whbj,hbjk->whbk"),
    ("gamma d(probabilities)", "whbk,whbj->hbjk"),
    ("out projection dX", "whi,ibj->whbj"),
    ("out projection dW", "whbj,ibj->whi"),
    ("linear1 dX", "ui,ubj->ibj"),
    ("linear1 dW", "ubj,ibj->ui"),
    ("linear2 dX", "iu,ibj->ubj"),
    ("linear2 dW", "ibj,ubj->iu"),
]
LAYOUTS_PER_GEMM = 3
CONFIGS_FOR_OTHER_LAYOUTS = 2
CONFIGS_FOR_EPILOGUE = 4
WARMUP_MS, REP_MS = 10.0, 40.0
DTYPE = torch.bfloat16


def pick_layouts(spec: str, count: int) -> list[GemmPlan]:
    """Spec-order layouts if they are a BLAS GEMM, then the first BLAS plan (one batch dim at most)
    of each new transposition pattern (A, B, C), in enumeration order."""
    c = parse(spec)
    plans = [p for p in enumerate_variants(c, SIZES).blas_plans if p.batch_dims <= 1]
    chosen = [p for p in plans if p.layouts == (c.a, c.b, c.out)]
    seen = {(p.a_transposed, p.b_transposed, p.c_transposed) for p in chosen}
    for p in plans:
        pattern = (p.a_transposed, p.b_transposed, p.c_transposed)
        if pattern not in seen:
            chosen.append(p)
            seen.add(pattern)
    return chosen[:count]


def in_layout(logical: torch.Tensor, letters: str, layout: str) -> torch.Tensor:
    return empty_in_layout(letters, layout, SIZES, DTYPE, "cuda").copy_(logical)


def rel_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """``||result - reference|| / ||reference||`` in float64 on the GPU (``kernels.accuracy`` does it on the CPU)."""
    if not torch.isfinite(result).all():
        return float("inf")
    return float(torch.linalg.vector_norm(result.double() - reference) / torch.linalg.vector_norm(reference))


def verdict(result: torch.Tensor, baseline_error: float, reference: torch.Tensor) -> str:
    """The ``kernels.accuracy`` rule (error <= 1.5 x PyTorch's bf16 error + 1e-4), as text."""
    error = rel_error(result, reference)
    ok = error <= 1.5 * baseline_error + 1e-4
    return f"rel.err {error:.3e} vs PyTorch {baseline_error:.3e}: {'ok' if ok else 'FAILED'}"


def tflops(flop: int, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def measure_peak() -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=DTYPE)
    b = torch.randn(n, n, device="cuda", dtype=DTYPE)
    t = time_cuda(lambda: torch.mm(a, b), warmup_ms=100.0, rep_ms=300.0)
    return {"what": "torch.mm bf16 8192^3, random normal", "median_ms": t.median_ms, "tflops": tflops(2 * n**3, t.median_ms)}


def bench_gemm(name: str, spec: str, peak: float, deadline: float) -> list[dict]:
    c = parse(spec)
    gen = torch.Generator(device="cuda").manual_seed(len(spec))
    a_logical = torch.randn([SIZES[x] for x in c.a], device="cuda", dtype=DTYPE, generator=gen)
    b_logical = torch.randn([SIZES[x] for x in c.b], device="cuda", dtype=DTYPE, generator=gen)
    reference = torch.einsum(spec, a_logical.double(), b_logical.double())
    baseline_error = rel_error(torch.einsum(spec, a_logical, b_logical), reference)
    flop = flops(c, SIZES)
    rows, ranked = [], None
    for plan in pick_layouts(spec, LAYOUTS_PER_GEMM):
        a = in_layout(a_logical, c.a, plan.layouts[0])
        b = in_layout(b_logical, c.b, plan.layouts[1])
        out = empty_in_layout(c.out, plan.layouts[2], SIZES, DTYPE, "cuda")
        row = {"gemm": name, "einsum": spec, "layouts": ",".join(plan.layouts[:2]) + "->" + plan.layouts[2],
               "plan": plan.describe(), "gflop": flop / 1e9}
        out.fill_(float("nan"))
        run_cublas(plan, a, b, out)
        row["cublas_check"] = verdict(out, baseline_error, reference)
        row["cublas_ms"] = time_cuda(lambda: run_cublas(plan, a, b, out), warmup_ms=WARMUP_MS, rep_ms=REP_MS).median_ms
        tma_ok = tma_compatible(a, b, GemmShape(*plan.batch, plan.m, plan.n, plan.k), plan.a_strides, plan.b_strides)
        configs = valid_configs() if ranked is None else ranked[:CONFIGS_FOR_OTHER_LAYOUTS]
        configs = [cfg for cfg in configs if tma_ok or not cfg.tma]
        triton_ms = {}
        for config in configs:
            if time.monotonic() > deadline:
                row["note"] = "time budget used: not every config was timed"
                break
            try:
                out.fill_(float("nan"))
                run_triton(plan, a, b, out, config=config)
                check = verdict(out, baseline_error, reference)
                if "FAILED" in check:
                    triton_ms[str(config)] = f"wrong: {check}"
                    continue
                triton_ms[str(config)] = time_cuda(lambda: run_triton(plan, a, b, out, config=config),
                                                   warmup_ms=WARMUP_MS, rep_ms=REP_MS).median_ms
            except Exception as exc:  # e.g. out of shared memory for a config
                triton_ms[str(config)] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        timed = {k: v for k, v in triton_ms.items() if isinstance(v, float)}
        row["triton_ms_by_config"] = triton_ms
        if ranked is None:
            ranked = sorted((cfg for cfg in configs if isinstance(triton_ms.get(str(cfg)), float)), key=lambda cfg: triton_ms[str(cfg)])
        row["cublas_tflops"] = tflops(flop, row["cublas_ms"])
        row["cublas_pct_peak"] = 100 * row["cublas_tflops"] / peak
        if timed:
            best = min(timed, key=timed.get)
            row.update(triton_best_config=best, triton_ms=timed[best], triton_tflops=tflops(flop, timed[best]),
                       triton_pct_peak=100 * tflops(flop, timed[best]) / peak,
                       triton_over_cublas_time=timed[best] / row["cublas_ms"],
                       triton_within_5pct=timed[best] <= 1.05 * row["cublas_ms"])
        rows.append(row)
        print(f"{name:28s} {row['layouts']:24s} cuBLAS {row['cublas_ms']:.4f} ms {row['cublas_tflops']:6.1f} TF/s | "
              + (f"Triton {row['triton_ms']:.4f} ms {row['triton_tflops']:6.1f} TF/s x{row['triton_over_cublas_time']:.2f} "
                 f"[{row['triton_best_config']}]" if timed else "Triton: none timed"), flush=True)
    return rows


def bench_epilogue(configs) -> dict:
    """linear1 + bias[u] + ReLU + dropout(0.1), layouts ui, ibj -> ubj: fused vs cuBLAS + eager.

    The fused kernel is timed with each of ``configs`` (the plain GEMM's best); the best is reported."""
    spec, p = "ui,ibj->ubj", 0.1
    plan = map_layouts(spec, ("ui", "ibj", "ubj"), SIZES)
    gen = torch.Generator(device="cuda").manual_seed(99)
    w = torch.randn(SIZES["u"], SIZES["i"], device="cuda", dtype=DTYPE, generator=gen)
    x = torch.randn(SIZES["i"], SIZES["b"], SIZES["j"], device="cuda", dtype=DTYPE, generator=gen)
    bias = torch.randn(SIZES["u"], device="cuda", dtype=DTYPE, generator=gen)
    out = torch.empty(SIZES["u"], SIZES["b"], SIZES["j"], device="cuda", dtype=DTYPE)
    saved = torch.empty_like(out)
    fused = Epilogue(bias=bias, bias_letters="u", activation="relu", dropout_p=p, seed=1234, offset=0)
    fused_save = Epilogue(bias=bias, bias_letters="u", activation="relu", dropout_p=p, seed=1234, offset=0, save="pre_dropout")
    no_dropout = Epilogue(bias=bias, bias_letters="u", activation="relu")
    fused_ms = {str(cfg): time_cuda(lambda: run_triton(plan, w, x, out, fused, cfg), warmup_ms=WARMUP_MS, rep_ms=REP_MS).median_ms
                for cfg in configs}
    config = min(configs, key=lambda cfg: fused_ms[str(cfg)])

    def eager():
        y = run_cublas(plan, w, x, out)
        return torch.nn.functional.dropout(torch.relu(y + bias[:, None, None]), p=p, training=True)

    result = {"what": "linear1 ui,ibj->ubj (U=4096, N=1024, B*L=4096) + bias[u] + ReLU + dropout p=0.1, bf16",
              "triton_config": str(config), "triton_fused_ms_by_config": fused_ms}
    run_triton(plan, w, x, out, fused, config)
    y = torch.relu(torch.einsum(spec, w.double(), x.double()) + bias.double()[:, None, None])
    keep = torch.from_numpy(keep_mask(1234, 0, tuple(out.shape), p)).cuda()
    reference = torch.where(keep, y / (1 - p), 0.0)
    eager_same_mask = torch.where(keep, torch.relu(torch.einsum(spec, w, x) + bias[:, None, None]) / (1 - p), 0.0)
    result["fused_check"] = verdict(out, rel_error(eager_same_mask, reference), reference)
    for label, fn in (("triton_gemm_only_ms", lambda: run_triton(plan, w, x, out, Epilogue(), config)),
                      ("triton_bias_relu_no_dropout_ms", lambda: run_triton(plan, w, x, out, no_dropout, config)),
                      ("triton_fused_ms", lambda: run_triton(plan, w, x, out, fused, config)),
                      ("triton_fused_save_pre_dropout_ms", lambda: run_triton(plan, w, x, saved, fused_save, config)),
                      ("cublas_gemm_only_ms", lambda: run_cublas(plan, w, x, out)),
                      ("cublas_then_eager_ms", eager)):
        result[label] = time_cuda(fn, warmup_ms=WARMUP_MS, rep_ms=REP_MS).median_ms
    result["fused_speedup_vs_eager"] = result["cublas_then_eager_ms"] / result["triton_fused_ms"]
    result["fused_save_speedup_vs_eager"] = result["cublas_then_eager_ms"] / result["triton_fused_save_pre_dropout_ms"]
    return result


def write_markdown(path: Path, report: dict) -> None:
    peak = report["peak"]
    lines = [
        "# Contraction variants of a BERT-large encoder layer: cuBLAS vs Triton template",
        "",
        f"Written by `benchmarks/contractions.py` on {report['date']}. Device: {report['device']}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".",
        f"Sizes: {report['sizes']}; bf16 in/out, fp32 accumulation. Flop = 2 x product of the sizes of all letters.",
        f"Peak: {peak['what']}, median {peak['median_ms']:.4f} ms = **{peak['tflops']:.0f} TFLOP/s** (same run; % peak below is of this).",
        "Times: medians of `kernels.bench.time_cuda` (CUDA events, L2 flushed before each repetition, "
        f"{WARMUP_MS:g} ms warm-up, {REP_MS:g} ms of repetitions). Triton: best of the knob configs tried "
        f"(all {len(valid_configs())} for a GEMM's first layout, that layout's best {CONFIGS_FOR_OTHER_LAYOUTS} for the others; "
        "`tma` configs read A and B through tensor descriptors, the others through pointer tiles). "
        "Layouts are written A,B->C (storage order of each operand, row-major); plan: batch, M, N, K, "
        "A/B/C N = row-major (K-major A, N-major B, N-major C), T = transposed.",
        "",
        "| GEMM | einsum | layouts | plan | GFLOP | cuBLAS ms | TFLOP/s | % peak | Triton ms | TFLOP/s | % peak | Triton/cuBLAS time | within 5% | best config |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in report["variants"]:
        plan = r["plan"].split(": ", 1)[1]
        if "triton_ms" in r:
            tri = (f"{r['triton_ms']:.4f} | {r['triton_tflops']:.0f} | {r['triton_pct_peak']:.0f}% | "
                   f"{r['triton_over_cublas_time']:.2f} | {'yes' if r['triton_within_5pct'] else 'no'} | {r['triton_best_config']}")
        else:
            tri = "- | - | - | - | no | none timed"
        lines.append(f"| {r['gemm']} | `{r['einsum']}` | `{r['layouts']}` | {plan} | {r['gflop']:.1f} | {r['cublas_ms']:.4f} | "
                     f"{r['cublas_tflops']:.0f} | {r['cublas_pct_peak']:.0f}% | {tri} |")
    within = sum(1 for r in report["variants"] if r.get("triton_within_5pct"))
    lines += ["", f"Best Triton config within 5% of cuBLAS (or faster): **{within} of {len(report['variants'])}** variants.", ""]
    checks = [(r["layouts"], r["cublas_check"], r["triton_ms_by_config"]) for r in report["variants"]]
    wrong = [c for c in checks if "FAILED" in c[1] or any(isinstance(v, str) for v in c[2].values())]
    lines.append(f"Accuracy (rule of `kernels.accuracy`, float64 einsum reference, torch bf16 einsum baseline): "
                 f"{len(checks) - len(wrong)} of {len(checks)} variants passed for cuBLAS and every Triton config tried"
                 + ("." if not wrong else f"; problems: {wrong}"))
    if report.get("epilogue"):
        e = report["epilogue"]
        lines += ["", "## Epilogue fusion", "",
                  f"{e['what']}; best fused Triton config {e['triton_config']} (fused ms by config: "
                  + ", ".join(f"{k}: {v:.4f}" for k, v in e["triton_fused_ms_by_config"].items())
                  + f"); check: {e['fused_check']}.", "",
                  "| variant | ms |", "| --- | ---: |"]
        for key in ("triton_gemm_only_ms", "triton_bias_relu_no_dropout_ms", "triton_fused_ms", "triton_fused_save_pre_dropout_ms",
                    "cublas_gemm_only_ms", "cublas_then_eager_ms"):
            lines.append(f"| {key[:-3].replace('_', ' ')} | {e[key]:.4f} |")
        lines += ["", f"Fused vs cuBLAS + eager: **{e['fused_speedup_vs_eager']:.2f}x** "
                      f"(with the pre-dropout value also stored for backward: {e['fused_save_speedup_vs_eager']:.2f}x)."]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop trying Triton configs after this long")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("No CUDA GPU: nothing measured, nothing written.")
        return 1
    started = time.monotonic()
    deadline = started + args.budget_s
    facts = query_device()
    peak = measure_peak()
    print(f"{facts.name}: bf16 8192^3 peak {peak['tflops']:.0f} TFLOP/s", flush=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": facts.name,
              "versions": versions(), "sizes": SIZES, "peak": peak, "gemms": GEMMS,
              "flop_formula": "2 * product of the sizes of all letters of the einsum", "variants": []}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    linear1_ranked = list(valid_configs())
    for name, spec in GEMMS:
        rows = bench_gemm(name, spec, peak["tflops"], deadline)
        report["variants"] += rows
        if spec == "ui,ibj->ubj":
            times = rows[0]["triton_ms_by_config"]
            linear1_ranked = sorted((c for c in valid_configs() if isinstance(times.get(str(c)), float)), key=lambda c: times[str(c)])
        (out_dir / "contractions.json").write_text(json.dumps(report, indent=1))
    report["epilogue"] = bench_epilogue(linear1_ranked[:CONFIGS_FOR_EPILOGUE])
    print(json.dumps(report["epilogue"], indent=1))
    report["elapsed_s"] = time.monotonic() - started
    (out_dir / "contractions.json").write_text(json.dumps(report, indent=1))
    write_markdown(out_dir / "contractions.md", report)
    print((out_dir / "contractions.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
