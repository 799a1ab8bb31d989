"""What a shape the layer was not tuned for costs: the nearest tuned plan run at the call's sizes,
against the plan tuned at that shape and HF's layer, in one GPU run.

    PYTHONPATH=$PWD python3 benchmarks/shapes.py --tuned out/<A> --at out/<B> [--out benchmarks/results]

``--tuned`` and ``--at``: artifacts of one spec and dtype tuned at different shapes.  At ``--at``'s
shape, fwd+bwd in training mode (dropout 0.1), same weights, N(0, 1) inputs and upstream gradient:
- ``untuned``: ``--tuned``'s layer called at that shape: its plan fitted to the call's sizes
  (``datamove.runtime.shapes``), its kernels compiled on the first call;
- ``tuned``: ``--at``'s layer, running the plan tuned at that shape;
- ``hf-sdpa``: HF ``BertLayer`` with SDPA attention.
Per row: the first call's seconds (compiling, capturing the graphs), kernel time per call (profiler
sum, median of rounds; ``layer.kernel_profile``), wall time per call as called (the layers' own CUDA
graphs).  Ratios are against ``tuned``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from datamove.export import load_layer, load_weights, read_manifest
from datamove.harness.bench import require_cuda, utc_stamp, write_results
from datamove.kernels.device import versions
from layer import ROUNDS, _baselines, _call, kernel_profile, wall_ms


def _row(step) -> dict:
    torch.cuda.synchronize()
    started = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - started
    for _ in range(3):
        step()
    kernel = statistics.median(kernel_profile(step)[0] for _ in range(ROUNDS))
    return {"first_call_s": first_s, "kernel_ms": kernel, "wall_ms": statistics.median(wall_ms(step) for _ in range(ROUNDS))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuned", type=Path, required=True, help="the artifact run at a shape it was not tuned for")
    parser.add_argument("--at", type=Path, required=True, help="an artifact tuned at that shape")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    require_cuda("benchmarks/shapes.py")
    tuned_at, shape_of = read_manifest(args.tuned)["dims"], read_manifest(args.at)
    d = shape_of["dims"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers = {name: load_layer(path, device="cuda", allow_mismatch=True).train()
                  for name, path in (("untuned", args.tuned), ("tuned", args.at))}
        hf = _baselines(shape_of, layers["tuned"].dtype, torch.device("cuda"))["hf-sdpa"]
        for layer in layers.values():
            load_weights(layer, hf)
        x = torch.randn(d["B"], d["L"], d["N"], device="cuda", dtype=layers["tuned"].dtype, requires_grad=True)
        dy = torch.randn_like(x)
        rows = {name: _row(_call(module, x, dy, True)) for name, module in {**layers, "hf-sdpa": hf}.items()}
    report = {"date": utc_stamp(),
              "device": torch.cuda.get_device_name(), "versions": versions(), "dtype": shape_of["dtype"],
              "shape": {k: d[k] for k in ("B", "L")}, "untuned_plan_shape": {k: tuned_at[k] for k in ("B", "L")},
              "rows": rows, "warnings": sorted({str(w.message) for w in caught if "tuned" in str(w.message)})}
    tuned = rows["tuned"]
    lines = [f"# The layer at a shape it was not tuned for ({report['device']}, {report['date']})", "",
             f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}.", "",
             f"BERT-large fwd+bwd at B={d['B']} L={d['L']} {shape_of['dtype']}, dropout 0.1. `untuned`: the plan tuned at "
             f"B={tuned_at['B']} L={tuned_at['L']} run at this shape; `tuned`: the plan tuned here. First call: "
             "seconds (compiling, capturing); kernel: GPU busy time per call; wall: per call as called (own CUDA "
             "graphs). Medians; ratio = kernel time / tuned's.", "",
             "| layer | first call s | kernel ms | wall ms | kernel ratio |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['first_call_s']:.2f} | {row['kernel_ms']:.3f} | {row['wall_ms']:.3f} | "
                     f"{row['kernel_ms'] / tuned['kernel_ms']:.2f} |")
    lines += ["", "Warnings: " + ("; ".join(report["warnings"]) or "none"), ""]
    text = "\n".join(lines)
    write_results(args.out, "shapes", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
