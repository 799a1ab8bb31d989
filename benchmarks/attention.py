"""Fused attention vs PyTorch SDPA vs the unfused eager chain: forward + backward, bf16, dropout 0.1.

    PYTHONPATH=$PWD python3 benchmarks/attention.py [--db tuning.db] [--budget-s 600] [--dropout 0.1]
        [--setups B=8,H=16,L=512,P=64 B=8,H=8,L=512,P=128] [--limit-configs N] [--gpus N] [--retry-failed]
        [--out benchmarks/results] [--no-progress]

Q/K/V/dO stored as BERT holds them, ``[B, L, H*P]`` = (b, j, h, p), passed as logical (b, h, j, p)
views.  Every implementation is a ``families.attention.variants`` variant that goes through
``harness.bench.Sweep`` into the tuning DB (checked against float64 before it is timed; each
record committed as it is made, so a rerun resumes and a repeated run only reads the DB):
(1) every forward and every backward knob configuration of the fused kernels
(``attention_configs``, compiled ahead in worker processes by ``Sweep(compile_workers=)``; the
forward once per dropout-mask option, writing the mask for "saved" or not for "regenerate", the
backward with the option among its knobs), SDPA forward and forward + backward with each backend
forced and with PyTorch's own choice, the eager chain; (2) per dropout-mask option
(``kernels.attention.DROPOUT_MASK_OPTIONS``: the backward regenerates the mask, or reads the one
the forward saved), the fused forward + backward with the fastest forward and backward configs of
that option, the one with the default configs, and, without dropout, the fused pair and SDPA's
default; all of these timed as CUDA-graph replays (``Sweep(cuda_graph=True)``: GPU time, no host
gaps); (3) the forward + backward variants again launched from Python (``cuda_graph=False``: host
overhead included); (4) the Philox floor: one pass of mask generation alone over the B*H*L*L
probabilities, drawn and stored as the forward saves it for "saved" (``kernels.philox.keep_bits``:
sixteen decisions per Philox call, written as 16 bits per call, B*H*L*L/8 bytes).  Times:
``harness.bench.time_cuda`` medians, L2 flushed before each repetition.  Flop: forward 4*B*H*L*L*P, backward 10*B*H*L*L*P.  The report (from the DB
records) is written as ``attention.md`` / ``.json`` under ``--out`` on a GPU only; without one,
small setups run through the Triton interpreter in float32 and nothing is measured or written.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from datamove.dtypes import parse as parse_dtype  # noqa: E402
from datamove.kernels.attention import DROPOUT_MASK_OPTIONS  # noqa: E402
from datamove.families.attention.variants import (SDPA_BACKENDS, SEED, AttentionCase, EagerVariant,  # noqa: E402
                                                  FusedVariant, SdpaVariant, Workspace, baseline_variants,
                                                  config_variants)
from datamove.harness.bench import CPU_DEVICE, Sweep, time_cuda, utc_stamp, write_results  # noqa: E402
from datamove.kernels.device import query_device, versions  # noqa: E402
from datamove.dataflow.dropout_mask import DECISIONS_PER_CALL  # noqa: E402
from datamove.kernels.philox import keep_bits, keep_threshold  # noqa: E402
from datamove.harness.tuning_db import TuningDB  # noqa: E402

GPU_SETUPS = ["B=8,H=16,L=512,P=64", "B=8,H=8,L=512,P=128"]
CPU_SETUPS = ["B=2,H=3,L=37,P=16"]
COMPILE_WORKERS = max(1, min(16, (os.cpu_count() or 2) - 2))  # fused variants compile ahead in these (GPU only)


@triton.jit
def _mask_pass_kernel(bits_ptr, seed, threshold, BLOCK: tl.constexpr):
    """The decision bits of Philox calls pid * BLOCK .. pid * BLOCK + BLOCK - 1 (what the forward
    draws and saves for a backward with dropout_mask "saved")."""
    calls = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(bits_ptr + calls, keep_bits(seed, calls, threshold).to(tl.int16, bitcast=True))


def philox_floor(elements: int, dropout_p: float) -> tuple[float, float]:
    """(median ms of one mask pass over ``elements`` decisions, kept fraction); elements % 16384 == 0."""
    decision_bits = torch.empty(elements // DECISIONS_PER_CALL, dtype=torch.int16, device="cuda")
    block = 1024

    def run():
        _mask_pass_kernel[(elements // (DECISIONS_PER_CALL * block),)](decision_bits, SEED, keep_threshold(dropout_p),
                                                                       BLOCK=block)
    run()
    kept = sum(int(((decision_bits >> b) & 1).sum()) for b in range(DECISIONS_PER_CALL)) / elements
    return time_cuda(run).median_ms, kept


def parse_setup(text: str) -> dict:
    return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}


class Bench:
    """The sweeps of one run over one DB, with a shared time budget."""

    def __init__(self, db: TuningDB, budget_s: float | None, progress: bool, **sweep):
        self.db, self.budget_s, self.progress, self.options = db, budget_s, progress, sweep
        self.started = time.monotonic()
        self.counts, self.stopped = {}, None
        self.sweep = Sweep(db, [], progress=False)  # keys and rankings

    def run(self, variants, cuda_graph: bool):
        budget = None if self.budget_s is None else max(0.0, self.budget_s - (time.monotonic() - self.started))
        report = Sweep(self.db, variants, budget_s=budget, cuda_graph=cuda_graph, progress=self.progress,
                       **self.options).run()
        for status, n in report.counts.items():
            self.counts[status] = self.counts.get(status, 0) + n
        self.stopped = self.stopped or report.stopped
        return report

    def record(self, variant):
        return self.db.lookup(self.sweep.key(variant))

    def ms(self, variant) -> float | None:
        record = self.record(variant)
        return record.median_ms if record is not None and record.status == "ok" else None


def bench_setup(bench: Bench, setup: dict, dropout_p: float, dtype, device: str, limit_configs: int | None) -> dict:
    """Sweep one setup; return the variants of the report, by role."""
    case = AttentionCase(**setup, dropout_p=dropout_p, dtype=dtype)
    ws = Workspace(case, device)
    configs = config_variants(ws)
    forward, backward = [], []
    for option in DROPOUT_MASK_OPTIONS:  # --limit-configs: the first N of each direction and option
        forward += [v for v in configs if v.direction == "forward" and v.dropout_mask == option][:limit_configs]
        backward += [v for v in configs if v.direction == "backward" and v.dropout_mask == option][:limit_configs]
    baselines = baseline_variants(ws, launches=("cuda-graph",))
    bench.run(forward + backward + baselines, cuda_graph=True)
    pairs = {}  # dropout-mask option -> the fastest forward and backward configs of that option
    for option in DROPOUT_MASK_OPTIONS:
        best_forward = next(iter(bench.sweep.ranked([v for v in forward if v.dropout_mask == option])), None)
        best_backward = next(iter(bench.sweep.ranked([v for v in backward if v.dropout_mask == option])), None)
        if best_forward is not None and best_backward is not None:
            pairs[option] = (best_forward, best_backward)
    roles = {"forward_configs": forward, "backward_configs": backward}
    if not pairs:
        return dict(roles, case=case, error="no option with a forward and a backward configuration that passed")
    fused = {f"fused_{option}": dict(forward=f.forward, backward=b.backward) for option, (f, b) in pairs.items()}
    no_drop_ws = Workspace(AttentionCase(**setup, dropout_p=0.0, dtype=dtype), device)
    for launch in ("cuda-graph", "python"):
        roles[launch] = {**{name: FusedVariant(ws, "fwd+bwd", **pair, launch=launch) for name, pair in fused.items()},
                         "fused_default": FusedVariant(ws, "fwd+bwd", launch=launch),
                         **{f"sdpa_{b}": SdpaVariant(ws, "fwd+bwd", b, launch) for b in SDPA_BACKENDS},
                         "eager": EagerVariant(ws, "fwd+bwd", launch)}
    roles["forward"] = {**{f"fused_{option}": f for option, (f, _) in pairs.items()},
                        **{f"sdpa_{b}": SdpaVariant(ws, "forward", b) for b in SDPA_BACKENDS},
                        "eager": EagerVariant(ws, "forward")}
    roles["no_dropout"] = {"fused": FusedVariant(no_drop_ws, "fwd+bwd", **next(iter(fused.values()))),
                           "sdpa_default": SdpaVariant(no_drop_ws, "fwd+bwd", "default")}
    fused_graph = [v for name, v in roles["cuda-graph"].items() if name.startswith("fused")]
    bench.run([*fused_graph, *roles["no_dropout"].values()], cuda_graph=True)
    bench.run(list(roles["python"].values()), cuda_graph=False)
    if device == "cuda" and dropout_p > 0:
        roles["philox_floor"] = philox_floor(case.B * case.H * case.L * case.L, dropout_p)
    return dict(roles, case=case)


def setup_report(bench: Bench, roles: dict) -> dict:
    case = roles["case"]
    result = {"dims": {k: getattr(case, k) for k in "BHLP"}, "dropout_p": case.dropout_p,
              "layout": "q, k, v, dO stored (b, j, h, p) = [B, L, H*P]",
              "flop_forward": case.flop("forward"), "flop_backward": case.flop("backward")}

    def config_rows(variants, which):
        rows = []
        for v in variants:
            r = bench.record(v)
            rows.append({"config": getattr(v, which), "dropout_mask": v.dropout_mask,
                         "status": None if r is None else r.status,
                         "ms": None if r is None else r.median_ms, "detail": None if r is None else (r.detail or "")[:300]})
        return rows

    result["sweep"] = {"forward": config_rows(roles["forward_configs"], "forward"),
                       "backward": config_rows(roles["backward_configs"], "backward")}
    if "error" in roles:
        result["error"] = roles["error"]
        return result
    impls = {}
    for name, graph_variant in roles["cuda-graph"].items():
        record = bench.record(graph_variant)
        row = {"knobs": graph_variant.knobs, "status": None if record is None else record.status,
               "check": None if record is None else record.detail,
               "ms": bench.ms(graph_variant), "launch_ms": bench.ms(roles["python"][name]),
               "forward_ms": bench.ms(roles["forward"][name]) if name in roles["forward"] else None}
        impls[name] = row
    result["implementations"] = impls
    result["no_dropout"] = {name: bench.ms(v) for name, v in roles["no_dropout"].items()}
    if "philox_floor" in roles:
        result["philox_floor_ms"], result["kept_fraction"] = roles["philox_floor"]
    pairs = {n: r["ms"] for n, r in impls.items()
             if r["ms"] is not None and n.startswith("fused_") and n != "fused_default"}
    timed = {n: r["ms"] for n, r in impls.items() if r["ms"] is not None and n.startswith("sdpa_")}
    if pairs:  # the fastest dropout-mask option's pair is "the fused kernel" of the ratios
        result["fused_best"] = min(pairs, key=pairs.get)
    if pairs and timed:
        fused = pairs[result["fused_best"]]
        best = min(timed, key=timed.get)
        result["ratios"] = {"sdpa_best_over_fused": timed[best] / fused, "sdpa_best_backend": best.removeprefix("sdpa_"),
                            "sdpa_default_over_fused": timed["sdpa_default"] / fused if "sdpa_default" in timed else None,
                            "eager_over_fused": impls["eager"]["ms"] / fused if impls["eager"]["ms"] else None}
    return result


def markdown(report: dict) -> str:
    lines = [f"# Fused attention, forward + backward ({report['dtype']}, dropout {report['dropout_p']})", "",
             f"Device: {report['device']}; " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + f"; {report['date']}.",
             "Q/K/V/dO stored [B, L, H*P] = (b, j, h, p), passed as (b, h, j, p) views. Every row is a variant of "
             "`families.attention.variants` swept by `harness.bench.Sweep` into the tuning DB (checked against float64 "
             "first) and read back from it: medians of `harness.bench.time_cuda` in ms, L2 flushed before each repetition. "
             "'GPU ms': the call replayed from a CUDA graph (no host gaps between its kernels; ratios and TFLOP/s use it). "
             "'launch ms': the call launched from Python, host overhead included. TFLOP/s count 14*B*H*L*L*P flop for "
             "fwd+bwd. SDPA is checked with dropout 0 (its mask cannot be regenerated), the eager chain with the mask "
             "`torch.native_dropout` drew, the fused kernels with the mask regenerated from the seed.",
             f"Sweep: {report['sweep']['summary']}; {report['sweep']['wall_s']:.0f} s wall.", ""]
    for r in report["setups"]:
        d = r["dims"]
        lines += [f"## B={d['B']}, H={d['H']}, L={d['L']}, P={d['P']}", ""]
        if "error" in r:
            lines += [f"No result: {r['error']}.", ""]
            continue
        impls = r["implementations"]
        base = impls[r["fused_best"]]["ms"] if "fused_best" in r else None
        total = r["flop_forward"] + r["flop_backward"]
        lines += ["| implementation | fwd+bwd GPU ms | fwd+bwd launch ms | fwd GPU ms | TFLOP/s "
                  "| time / fastest fused |",
                  "|---|---|---|---|---|---|"]

        def cell(x):
            return "" if x is None else f"{x:.4f}"

        labels = {"fused_regenerate": "fused, best knobs, the backward regenerates the mask",
                  "fused_saved": "fused, best knobs, the forward saves the mask (a bit per key), "
                                 "the backward reads it",
                  "fused_default": "fused, default knobs",
                  "eager": "eager chain (einsum, scale, softmax, native_dropout, einsum)"}
        for name, row in impls.items():
            label = labels.get(name, f"SDPA {name.removeprefix('sdpa_')}")
            if name.startswith("sdpa_") and row["check"] and "kernels:" in row["check"]:
                kernels = row["check"].split("kernels: ", 1)[1]
                label += f" ({kernels[:120]})"
            if row["ms"] is None:
                lines.append(f"| {label} | {row['status']}: {(row['check'] or '')[:80]} | {cell(row['launch_ms'])} | | | |")
                continue
            ratio = f"{row['ms'] / base:.2f}" if base else ""
            lines.append(f"| {label} | {row['ms']:.4f} | {cell(row['launch_ms'])} | {cell(row['forward_ms'])} | "
                         f"{total / row['ms'] / 1e9:.0f} | {ratio} |")
        nd = r["no_dropout"]
        lines.append("")
        for name in [n for n in impls if n.startswith("fused_") and n != "fused_default"]:
            f = impls[name]["knobs"]
            lines.append(f"{labels[name]}: forward knobs {f['forward']}, backward knobs {f['backward']}.")
        lines += [f"(Of {len(r['sweep']['forward'])} forward and {len(r['sweep']['backward'])} backward "
                  "configurations.)",
                  f"Without dropout (GPU ms): fused {cell(nd['fused'])} (the first pair's knobs), "
                  f"SDPA default {cell(nd['sdpa_default'])}."]
        if "philox_floor_ms" in r:
            elements = d["B"] * d["H"] * d["L"] * d["L"]
            lines.append(f"Philox floor: one pass of mask generation alone over B*H*L*L = {elements} probabilities "
                         f"({elements // DECISIONS_PER_CALL} Philox-4x32-10 calls, sixteen 8-bit decisions per call, "
                         f"written as 16 bits per call by kernels.philox.keep_bits) takes {r['philox_floor_ms']:.4f} ms (kept "
                         f"fraction {r['kept_fraction']:.4f}). With dropout_mask 'regenerate' the backward draws the "
                         f"mask again (the dK/dV kernel, and with dQ 'split' the dQ kernel too); with 'saved' the "
                         f"forward writes these bits (1/8 byte per probability) and the backward reads them.")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="tuning.db")
    parser.add_argument("--budget-s", type=float, default=None, help="stop after this long; rerun to go on")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--setups", nargs="+", help=f"e.g. {' '.join(GPU_SETUPS)} (the default on a GPU; {CPU_SETUPS[0]} without)")
    parser.add_argument("--limit-configs", type=int, default=None, help="the first N forward and N backward configurations")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs measured on, one process each (default: all)")
    parser.add_argument("--retry-failed", action="store_true", help="measure again the variants recorded as failed")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32  # the interpreter's bf16 dots and casts are wrong
    setups = [parse_setup(s) for s in (args.setups or (GPU_SETUPS if gpu else CPU_SETUPS))]
    db = TuningDB(args.db)
    bench = Bench(db, args.budget_s, not args.no_progress, compile_workers=COMPILE_WORKERS if gpu else 0,
                  processes=args.gpus, retry_failed=args.retry_failed)
    roles = [bench_setup(bench, s, args.dropout, dtype, device, args.limit_configs) for s in setups]
    summary = ", ".join(f"{n} {s}" for s, n in bench.counts.items())
    if bench.stopped:
        summary += f"; stopped ({bench.stopped}), rerun to go on"
    if not bench.sweep.measured:
        print(f"{CPU_DEVICE}: NOTHING WAS MEASURED (no GPU). {summary}. No results written.")
        return 0 if bench.counts.get("wrong", 0) == 0 else 1
    report = {"date": utc_stamp(),
              "device": bench.sweep.device, "facts": query_device().to_dict(), "versions": versions(),
              "dtype": parse_dtype(dtype).name, "dropout_p": args.dropout,
              "sweep": {"summary": summary, "counts": bench.counts, "limit_configs": args.limit_configs,
                        "wall_s": time.monotonic() - bench.started},
              "setups": [setup_report(bench, r) for r in roles]}
    text = markdown(report)
    write_results(args.out, "attention", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
