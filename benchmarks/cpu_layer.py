"""The exported layer on a machine without a GPU (the torch backend) against HF's layer on the same CPU.

    python benchmarks/cpu_layer.py [--artifact DIR] [--repeats 5] [--out benchmarks/results/cpu_layer]

Runs the main job on ``configs/bert.py`` (BERT-large, B=8 L=512, bf16, the cost model's plan) unless
``--artifact`` names one, loads it with every default (``load_layer``: the torch backend on the CPU),
and times one forward and backward per call (wall seconds, medians of ``--repeats`` after one
warm-up call) of: the tuned layer in its dtype, HF's ``BertLayer`` (eager attention, ReLU, dropout
on as the layer's) in float32 and in the same dtype.  Writes ``OUT.md`` and ``OUT.json`` (CPU, cores,
versions, date).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hf_bert_layer(graph, dtype: torch.dtype) -> torch.nn.Module:
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer

    size = lambda name: graph.dim_values[name]  # noqa: E731
    config = transformers.BertConfig(hidden_size=size("N"), num_attention_heads=size("H"), intermediate_size=size("U"),
                                     hidden_act="relu", layer_norm_eps=1e-12)
    config._attn_implementation = "eager"
    return BertLayer(config).to(dtype).train()


def fwd_bwd_seconds(module, x: torch.Tensor, repeats: int) -> list[float]:
    """Wall seconds of one forward and backward per call, after one warm-up call."""
    times = []
    for n in range(repeats + 1):
        x.grad = None
        started = time.perf_counter()
        y = module(x)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(torch.ones_like(y))
        if n:
            times.append(time.perf_counter() - started)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_layer")
    args = parser.parse_args(argv)
    from datamove.cli import main as optimize_layer
    from datamove.export import load_layer

    artifact = args.artifact
    if artifact is None:
        artifact = Path(tempfile.mkdtemp()) / "bert"
        if optimize_layer([str(ROOT / "configs" / "bert.py"), "--out", str(artifact)]) != 0:
            return 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a cost-model plan: nothing measured
        layer = load_layer(artifact)
    graph = layer.graph
    dims = dict(graph.dim_values)
    shape = layer.program(True).torch_shapes[layer.interface.activations[0]]
    rows = []
    cases = [("datamove (torch backend)", layer, layer.dtype)]
    cases += [(f"HF BertLayer {dtype}".replace("torch.", ""), hf_bert_layer(graph, dtype), dtype)
              for dtype in dict.fromkeys((torch.float32, layer.dtype))]
    for name, module, dtype in cases:
        x = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(0)).requires_grad_()
        times = fwd_bwd_seconds(module, x, args.repeats)
        rows.append({"layer": name, "dtype": str(dtype).replace("torch.", ""), "median_s": statistics.median(times),
                     "times_s": times})
        print(f"{name}: {statistics.median(times):.2f} s per forward and backward", flush=True)
    ours = rows[0]["median_s"]
    for row in rows:
        row["ratio"] = row["median_s"] / ours
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_name(),
              "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
              "dims": dims, "dtype": str(layer.dtype), "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# The tuned layer on the CPU against HF ({result['cpu']}, {result['cores']} cores, {result['date']})", "",
             f"torch {torch.__version__}, {result['torch_threads']} threads.  BERT-large layer at "
             + ", ".join(f"{k}={v}" for k, v in dims.items()) + f"; the main job's {layer.dtype} artifact (cost-model "
             "plan) loaded with every default (`load_layer`: the torch backend).  One forward and backward per call "
             f"(dropout on), wall seconds, median of {args.repeats} after one warm-up; ratio = time / the tuned layer's.",
             "", "| layer | dtype | median s | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['dtype']} | {r['median_s']:.2f} | {r['ratio']:.2f} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
