"""A whole model's training step, as a user runs it: HF ``BertModel`` with its layers replaced, in a plain loop.

    PYTHONPATH=$PWD python3 benchmarks/model.py --artifact out/<dir> [--artifact ...] [--layers 24] [--out benchmarks/results]

Per artifact (its dims and dtype set the case): a HF ``BertModel`` of the artifact's sizes (BERT-large
for ``configs/bert.py``; ``--layers`` deep, dropout 0.1, SDPA attention, padded tails: each sequence
keeps between half and all of its positions), a token-tagging head and ``torch.optim.AdamW``; one
training step = forward, loss over the unpadded positions, ``zero_grad(set_to_none=True)``,
backward, optimizer step.  Models, same initial weights, one after the other in one run:
- ``datamove``: every ``BertLayer`` replaced by the tuned layer (``datamove.hf.replace_bert_layers``),
  its own CUDA graphs on (the default);
- ``datamove-plain``: the same with ``cuda_graphs=False`` (every kernel launched on every call);
- ``hf-sdpa``: the model untouched;
- ``compile``: ``torch.compile(model)`` (default mode).
Per model: wall time per step (host clock over ``STEPS`` steps, synchronised at the end; median of
``ROUNDS``), kernel time per step (the sum of every device activity's duration in a profiler trace
of ``PROFILED`` steps), peak memory allocated over the timed steps, and for the tuned layers the
bytes their graphs hold (``TunedLayer.cuda_graph_bytes``).  Warm-up steps first (compilation,
graph capture).  Ratios are against ``datamove``'s wall time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from datamove.export import read_manifest
from datamove.hf import replace_bert_layers
from datamove.harness.bench import utc_stamp, write_results
from datamove.kernels.device import versions

WARMUP, STEPS, ROUNDS, PROFILED, BATCHES = 4, 10, 3, 5, 4
TAGS = 7


def _model(dims: dict, layers: int, dtype: torch.dtype):
    import transformers

    config = transformers.BertConfig(hidden_size=dims["N"], num_attention_heads=dims["H"], intermediate_size=dims["U"],
                                     num_hidden_layers=layers, hidden_act="relu", layer_norm_eps=1e-12,
                                     max_position_embeddings=max(512, dims["L"]), attention_probs_dropout_prob=0.1,
                                     hidden_dropout_prob=0.1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).cuda().to(dtype).train()
    return model, config.vocab_size


def _batches(dims: dict, vocab: int) -> list[tuple]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    B, L = dims["B"], dims["L"]
    result = []
    for _ in range(BATCHES):
        ids = torch.randint(0, vocab, (B, L), device="cuda", generator=gen)
        kept = torch.randint(L // 2, L + 1, (B, 1), device="cuda", generator=gen)
        mask = (torch.arange(L, device="cuda")[None, :] < kept).long()
        result.append((ids, mask, (ids * 5 + 1) % TAGS))
    return result


class Trainer:
    """``model`` + a tagging head + AdamW; ``step()`` is one training step on the next batch."""

    def __init__(self, model, batches: list[tuple], dims: dict, dtype: torch.dtype):
        torch.manual_seed(2)
        self.model, self.batches, self.n = model, batches, 0
        self.head = torch.nn.Linear(dims["N"], TAGS, device="cuda", dtype=dtype)
        self.optimizer = torch.optim.AdamW(list(model.parameters()) + list(self.head.parameters()), lr=1e-5)

    def step(self) -> torch.Tensor:
        ids, mask, tags = self.batches[self.n % len(self.batches)]
        self.n += 1
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = self.head(hidden).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tags.flatten(), reduction="none")
        loss = (loss * mask.flatten()).sum() / mask.sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def _wall_ms(trainer: Trainer) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(STEPS):
        trainer.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / STEPS


def _kernel_ms(trainer: Trainer) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            trainer.step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.events() if e.device_type.name == "CUDA") / 1e3 / PROFILED


def measure(name: str, model, batches, dims: dict, dtype: torch.dtype) -> dict:
    trainer = Trainer(model, batches, dims, dtype)
    started = time.perf_counter()
    losses = [float(trainer.step()) for _ in range(WARMUP)]
    warmup_s = time.perf_counter() - started
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    wall = statistics.median(_wall_ms(trainer) for _ in range(ROUNDS))
    peak = torch.cuda.max_memory_allocated() / 2**20
    kernel = _kernel_ms(trainer)
    layers = [m.layer for m in model.modules() if type(m).__name__ == "BertLayerReplacement"]
    row = {"wall_ms": wall, "kernel_ms": kernel, "peak_mib": peak, "warmup_s": warmup_s,
           "first_losses": losses, "last_loss": float(trainer.step())}
    if layers:
        row["graph_held_mib"] = sum(layer.cuda_graph_bytes() for layer in layers) / 2**20
    print(f"  {name}: wall {wall:.2f} ms, kernel {kernel:.2f} ms, peak {peak:.0f} MiB", file=sys.stderr)
    return row


def run_case(artifact: Path, layers: int) -> dict:
    manifest = read_manifest(artifact)
    dims, dtype = manifest["dims"], getattr(torch, manifest["dtype"])
    print(f"{artifact.name}: B={dims['B']} L={dims['L']} {manifest['dtype']}, {layers} layers", file=sys.stderr)
    rows = {}
    for name in ("datamove", "datamove-plain", "hf-sdpa", "compile"):
        model, vocab = _model(dims, layers, dtype)
        batches = _batches(dims, vocab)
        try:
            if name.startswith("datamove"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    replace_bert_layers(model, artifact, allow_mismatch=True, cuda_graphs=name == "datamove")
            elif name == "compile":
                model = torch.compile(model)
            rows[name] = measure(name, model, batches, dims, dtype)
        except Exception as exc:  # noqa: BLE001 - one failing model is reported, the rest go on
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"  {name}: {rows[name]['error']}", file=sys.stderr)
        del model, batches
        torch.cuda.empty_cache()
    return {"artifact": str(artifact), "dims": dims, "dtype": manifest["dtype"], "layers": layers,
            "plan_device": manifest["device"], "date": utc_stamp(), "rows": rows}


def markdown(report: dict) -> str:
    lines = [f"# A HF BertModel's training step ({report['device']}, {report['date']})", "",
             f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}.", "",
             "One AdamW step (forward, loss, zero_grad, backward, optimizer step), padded tails, dropout 0.1. "
             f"Wall: host clock per step over {STEPS} steps (median of {ROUNDS}); kernel: device busy time per step "
             f"(profiler, {PROFILED} steps); peak: memory allocated over the timed steps; graphs: static buffers the "
             "tuned layers' CUDA graphs hold. Ratio: wall time / datamove's.", ""]
    for case in report["cases"]:
        d = case["dims"]
        lines += [f"## B={d['B']} L={d['L']} {case['dtype']}, {case['layers']} layers (plan timed on "
                  f"{case['plan_device']['name']}; measured {case['date']})", "",
                  "| model | wall ms | kernel ms | wall / kernel | peak MiB | graphs MiB | wall ratio |",
                  "|---|---|---|---|---|---|---|"]
        ours = case["rows"].get("datamove", {}).get("wall_ms")
        for name, row in case["rows"].items():
            if "error" in row:
                lines.append(f"| {name} | error: {row['error']} | | | | | |")
                continue
            held = f"{row['graph_held_mib']:.0f}" if "graph_held_mib" in row else ""
            ratio = f"{row['wall_ms'] / ours:.2f}" if ours else ""
            lines.append(f"| {name} | {row['wall_ms']:.2f} | {row['kernel_ms']:.2f} | "
                         f"{row['wall_ms'] / row['kernel_ms']:.2f} | {row['peak_mib']:.0f} | {held} | {ratio} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, nargs="+", required=True, help="optimize-layer output folders")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/model.py needs a CUDA GPU: nothing measured", file=sys.stderr)
        return 2
    report = {"date": utc_stamp(), "device": torch.cuda.get_device_name(), "versions": versions(), "cases": []}
    for artifact in args.artifact:  # rewritten after each case: what was measured stays
        report["cases"].append(run_case(artifact, args.layers))
        text = markdown(report)
        write_results(args.out, "model", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
