"""Dropout drawn sixteen decisions per Philox call vs one call per element, at BERT-large, bf16.

    PYTHONPATH=$PWD python3 benchmarks/dropout_grouped.py [--out benchmarks/results] [--rep-ms 50]

Two consumers of the dropout convention (``dataflow.dropout_mask``) are timed with both paths:
- generated fused operators of the BERT training graph that regenerate a mask along the tile's
  columns (``alpha``: softmax + scale + dropout, mask drop_attn[h, b, j, k]; ``d_k_q``: its
  backward), in the best layout of ``benchmarks/results/fused_ops.md`` (all hbjk, vector k, whole
  rows) and two other row/warp knobs, next to PyTorch eager's unfused sequence
  (``harness.sweep_variants.EagerVariant``);
- the linear1 GEMM (``ui,ibj->ubj``) with its fused epilogue (bias[u] + ReLU + dropout p=0.1,
  with and without the saved pre-activation) through the Triton template, next to cuBLAS +
  PyTorch eager (``harness.contraction_variants.EpilogueVariant``).
"grouped" is the path the generators choose (one Philox call per sixteen elements of a group of 64,
``kernels.philox.dropout_keep_grouped``); "per element" is their fallback (one call per element,
``kernels.philox.dropout_keep``), forced by making the grouping tests answer no
(``kernels.codegen._grouped_masks`` returning no mask while the kernel is generated;
``kernels.gemm._grouped`` returning "none" around each launch).  Each variant is checked against the
float64 reference (``harness.accuracy``'s rule, ``Verdict``), and the two paths' outputs must be
bit-identical (same mask, same arithmetic).  Times: ``harness.bench.time_cuda`` medians (CUDA
events, L2 flushed).  Writes ``dropout_grouped.md`` / ``.json`` under ``--out`` (``dropout_octets.*`` and ``dropout_quads.*``
there hold former conventions' measurements: eight 16-bit and four 32-bit decisions per call).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

import torch

import datamove.kernels.codegen as codegen
import datamove.kernels.gemm as gemm
from datamove.dataflow import snapshot
from datamove.families import forward_epilogue as fe
from datamove.harness import contraction_variants as cv
from datamove.harness.bench import require_cuda, time_cuda, utc_stamp, write_results
from datamove.kernels.contraction import dropout_digits, map_layouts
from datamove.kernels.device import query_device, versions
from datamove.kernels.gemm import GemmConfig
from datamove.harness.sweep_variants import EagerVariant, FusedVariant, Workspace, fused_operators
from datamove.layouts.space import Configuration

HBJK = {t: "hbjk" for t in ("alpha", "drop_attn", "k_q", "probs", "d_alpha", "d_k_q")}
FUSED_KNOBS = [dict(block_row=1, num_warps=1), dict(block_row=2, num_warps=2), dict(block_row=4, num_warps=4)]
GEMM_CONFIGS = [GemmConfig(128, 256, 64, 8, 4, 8, tma=True, epilogue_split=1),  # the fastest config of contractions.md
                GemmConfig(128, 256, 64, 8, 4, 8, tma=True, epilogue_split=4)]


@contextlib.contextmanager
def per_element():
    """Both generators' grouping tests answer no: masks are drawn one Philox call per element."""
    grouped_masks, grouped = codegen._grouped_masks, gemm._grouped
    codegen._grouped_masks = lambda *args: ()
    gemm._grouped = lambda *args: "none"
    codegen._compiled.clear()
    try:
        yield
    finally:
        codegen._grouped_masks, gemm._grouped = grouped_masks, grouped
        codegen._compiled.clear()


def measure(variant, args, path: str) -> tuple[dict, dict]:
    """Build, check and time ``variant`` under ``path`` ("grouped" / "per element" / "baseline");
    returns (row, outputs of the checked run, on the device)."""
    scope = per_element if path == "per element" else contextlib.nullcontext
    with scope():
        variant.build()
        verdict = variant.check()
        outputs = {k: v.clone() for k, v in variant.run().items()}
        timing = time_cuda(variant.run, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    row = {"path": path, "median_ms": timing.median_ms, "q20_ms": timing.q20_ms, "q80_ms": timing.q80_ms,
           "reps": timing.n, "cuda_graph": timing.cuda_graph, "passed": verdict.passed, "error": verdict.error,
           "baseline_error": verdict.baseline_error}
    print(f"  {path:12s} {timing.median_ms:.4f} ms  check {'ok' if verdict.passed else 'FAILED'} "
          f"(rel.err {verdict.error:.2e} vs PyTorch {verdict.baseline_error:.2e})", flush=True)
    return row, outputs


def identical(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def fused_rows(args) -> list[dict]:
    training = snapshot.stored_fused()["bert"]
    ws = Workspace(training, "cuda")
    ops = {op.name: op for op in fused_operators(training)}
    rows = []
    for name in ("alpha", "d_k_q"):
        op = ops[name]
        print(f"{name}: eager", flush=True)
        eager, _ = measure(EagerVariant(ws, "bert", op), args, "baseline")
        for knobs in FUSED_KNOBS:
            config = Configuration({t: HBJK[t] for t in (*op.inputs, *op.outputs)},
                                   {"vector": "k", "order": "hbjk", "mode": "row", "block_col": 512, **knobs,
                                    "dropout": "regenerate"})
            print(f"{name} {knobs}", flush=True)
            fused, single_fused = FusedVariant(ws, "bert", op, config), FusedVariant(ws, "bert", op, config)
            grouped, out_o = measure(fused, args, "grouped")
            single, out_s = measure(single_fused, args, "per element")
            paths = ("dropout_keep_grouped(" in fused.compiled.source, "dropout_keep_grouped(" in single_fused.compiled.source)
            rows.append({"operator": name, "layouts": dict(config.layouts), "knobs": dict(config.knobs),
                         "grouped": grouped, "per_element": single, "eager": eager, "bit_identical": identical(out_o, out_s),
                         "paths_as_named": paths == (True, False)})
    return rows


def gemm_rows(args) -> list[dict]:
    training = snapshot.stored_fused()["bert"]
    linear1 = next(g for g in cv.training_gemms(training) if g.name == "w1_x1")
    operands = cv.Operands(linear1, "cuda")
    rows = []
    for save in ("pre_activation", None):
        epilogue = dataclasses.replace(fe.epilogue_of(training, linear1), save=save)
        print(f"linear1 epilogue save={save}: cuBLAS + eager", flush=True)
        eager, _ = measure(fe.EpilogueVariant(operands, epilogue), args, "baseline")
        for config in GEMM_CONFIGS:
            print(f"linear1 save={save} {config}", flush=True)
            grouped, out_o = measure(fe.EpilogueVariant(operands, epilogue, config), args, "grouped")
            single, out_s = measure(fe.EpilogueVariant(operands, epilogue, config), args, "per element")
            digits = dropout_digits(map_layouts(linear1.spec, (operands.c.a, operands.c.b, operands.c.out),
                                                linear1.sizes), linear1.sizes)
            tile = (config.block_m, config.block_n // gemm._epilogue_split(config, True))
            rows.append({"operator": f"linear1 {linear1.spec} + bias[u] + relu + dropout({epilogue.p:g})"
                                     + (f" + save({save})" if save else ""),
                         "config": str(config), "grouped": grouped, "per_element": single, "eager": eager,
                         "bit_identical": identical(out_o, out_s),
                         "paths_as_named": gemm._grouped(digits, epilogue.offset, tile) == "n"})
    return rows


def markdown(report: dict) -> str:
    v, d = report["versions"], report["device"]
    lines = ["# Dropout: sixteen 8-bit decisions per Philox call (grouped) vs one call per element", "",
             f"{report['date']}, {d}, torch {v['torch']}, triton {v['triton']}, CUDA runtime {v.get('cuda_runtime')}; "
             "BERT-large (B=8, L=512, N=1024, H=16, P=64, U=4096), bfloat16, p=0.1. Medians of "
             f"`harness.bench.time_cuda` (CUDA events, L2 flushed, {report['rep_ms']:g} ms of repetitions), ms. "
             "'per element' is the fallback path (the grouping tests forced to answer no); 'identical': the two paths' "
             "outputs are bit-identical; 'check': both pass `harness.accuracy`'s rule against float64 and each path "
             "drew the mask as named (generated source / `kernels.gemm._grouped`).", "",
             "## Generated fused operators (all tensors hbjk, vector k, whole rows of 512)", "",
             "| operator | knobs | grouped ms | per element ms | per element / grouped | eager ms | eager / grouped | identical | check |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in report["fused"]:
        knobs = f"block_row {r['knobs']['block_row']}, warps {r['knobs']['num_warps']}"
        o, s, e = r["grouped"]["median_ms"], r["per_element"]["median_ms"], r["eager"]["median_ms"]
        ok = all(x["passed"] for x in (r["grouped"], r["per_element"], r["eager"]))
        lines.append(f"| {r['operator']} | {knobs} | {o:.4f} | {s:.4f} | {s / o:.2f}x | {e:.4f} | {e / o:.2f}x | "
                     f"{r['bit_identical']} | {'ok' if ok and r['paths_as_named'] else 'FAILED'} |")
    lines += ["", "## linear1 GEMM with the fused epilogue (Triton template) vs cuBLAS + eager", "",
              "| epilogue | config | grouped ms | per element ms | per element / grouped | cuBLAS + eager ms | eager / grouped | identical | check |",
              "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in report["gemm"]:
        o, s, e = r["grouped"]["median_ms"], r["per_element"]["median_ms"], r["eager"]["median_ms"]
        ok = all(x["passed"] for x in (r["grouped"], r["per_element"], r["eager"]))
        lines.append(f"| {r['operator']} | {r['config']} | {o:.4f} | {s:.4f} | {s / o:.2f}x | {e:.4f} | {e / o:.2f}x | "
                     f"{r['bit_identical']} | {'ok' if ok and r['paths_as_named'] else 'FAILED'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--warmup-ms", type=float, default=10.0)
    parser.add_argument("--rep-ms", type=float, default=50.0)
    args = parser.parse_args()
    require_cuda("benchmarks/dropout_grouped.py")
    report = {"date": utc_stamp(),
              "device": query_device(0).name, "versions": versions(), "rep_ms": args.rep_ms}
    report["fused"] = fused_rows(args)
    report["gemm"] = gemm_rows(args)
    text = markdown(report)
    write_results(args.out, "dropout_grouped", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
