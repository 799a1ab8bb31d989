"""A whole model's training step on several GPUs under DDP and FSDP2: a HF BERT, GPT-2 or Llama model, layers replaced or not.

    PYTHONPATH=$PWD torchrun --nproc_per_node N benchmarks/distributed.py --artifact out/<dir> [--layers N]
        [--steps 10] [--models hf-sdpa,datamove,...] [--wrappers ddp,fsdp2] [--out benchmarks/results]

One process per GPU (NCCL; ``--device cpu``: gloo on the CPU and the tuned layer's torch backend, a
smoke check at an artifact's small dims).  Per process, ``benchmarks/model.py``'s model of the
artifact's spec (``build``: BERT-large ``BertModel``, 24 layers by default, ``GPT2Model``, 12, or ``LlamaModel``, 16;
SDPA attention), its batches (``batches``: the artifact's B x sequence per GPU, padded tails; rank r
takes batch (step + r) mod 4, so ranks train on different data), a token-tagging head and
``torch.optim.AdamW`` (lr 1e-5) as its ``Trainer``, except that the head and the loss are inside the
wrapped module here, so that DDP reduces and FSDP2 shards the head too.  Dropout off throughout
(``eval()``, autograd on; no key-value cache): each step's loss is the same function on every model.
Models, one after the other, each from the same initial weights on every rank:
- ``hf-sdpa``: the model untouched, measured first: the others' losses are compared with its;
- ``datamove``: every layer replaced by the tuned layer (``replace_bert_layers`` /
  ``replace_gpt2_blocks`` / ``replace_llama_layers``, its own CUDA graphs on);
- ``compile-default``, ``compile-reduce-overhead``: ``torch.compile`` of the wrapped HF model in those
  modes (under both wrappers: DDP's documentation asks for it, dynamo then splitting the graph at
  DDP's buckets; under FSDP2 dynamo breaks it at FSDP's hooks; reduce-overhead: CUDA graphs, each
  step starting with ``cudagraph_mark_step_begin``); dynamo is reset before each row.
Wrappers, the same for each model: ``ddp`` (``DistributedDataParallel``); ``fsdp2`` (``fully_shard``
of each layer, then of the whole module; a replaced layer's unit is the tuned layer, the module
holding its parameters).
Per (wrapper, model): ``LOSS_STEPS`` steps first (their losses, averaged over ranks, are the loss
trace; they also warm up: compilation, graph capture; their seconds are reported), then wall time
per step (host clock over ``--steps`` steps, synchronised at the end; median of ``ROUNDS``; the
slowest rank's), tokens/s per GPU (B x sequence, padding included, over that time), peak memory
allocated over the timed steps (the largest rank's), and for DDP whether every rank's parameters
equal rank 0's bit for bit after training.  A row failing on any rank (an error, a refusal) records
that rank's error, and the other rows run.
Each loss trace is compared with ``hf-sdpa``'s under the same wrapper (the largest absolute
difference over the steps); compile rows also give the graphs dynamo compiled and its graph breaks.
Rank 0 writes ``OUT/distributed.md`` / ``.json`` (Llama: ``distributed_llama``) after each row, one
section per GPU count: a run at N GPUs replaces the rows it measures at N and keeps that section's
other rows where device, versions and case are the same (so ``--models`` can add rows in a later
run), else replaces the section.
Time (estimated, not measured yet): BERT-large B=8 L=512, all four models under both wrappers at
N=2 on H100s, about 5-6 minutes, mostly the four ``torch.compile`` warm-ups (~40-80 s each;
``benchmarks/model.py``'s single-GPU compile warm-up took 42 s); ``--models`` splits it over runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.cpu_layer import cpu_name
from benchmarks.model import LAYERS, ROUNDS, TAGS, TITLES, batches, build
from datamove.export import read_manifest
from datamove.harness.bench import utc_stamp, write_results
from datamove.hf import BertLayerReplacement
from datamove.kernels.device import versions

LOSS_STEPS = 20
MODELS = ("hf-sdpa", "datamove", "compile-default", "compile-reduce-overhead")
WRAPPERS = ("ddp", "fsdp2")
COLLECTIVE_TIMEOUT_S = 300  # a rank that stopped answering (a row failing on one rank only) ends the run
HF_LAYERS = ("BertLayer", "GPT2Block", "LlamaDecoderLayer")


class Tagger(torch.nn.Module):
    """``benchmarks/model.py``'s ``Trainer`` as one module for the wrappers: the model, its tagging head
    (same seed) and the loss over the unpadded positions (``Trainer`` keeps the head outside the model)."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        super().__init__()
        model.config.use_cache = False  # in eval mode HF's Llama would fill a key-value cache
        torch.manual_seed(2)
        self.model = model
        self.head = torch.nn.Linear(model.config.hidden_size, TAGS, device=device, dtype=dtype)

    def forward(self, ids, mask, tags):
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = self.head(hidden).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tags.flatten(), reduction="none")
        return (loss * mask.flatten()).sum() / mask.sum()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _layer_units(model) -> list[torch.nn.Module]:
    """Each layer's module for ``fully_shard``: HF's layer, or the tuned layer a replacement wraps."""
    return [m.layer if isinstance(m, BertLayerReplacement) else m for m in model.modules()
            if isinstance(m, BertLayerReplacement) or type(m).__name__ in HF_LAYERS]


def _wrapped(name: str, wrapper: str, tagger: Tagger, device: torch.device):
    """``tagger`` as the row runs it: wrapped, compiled."""
    if wrapper == "ddp":
        ids = [device] if device.type == "cuda" else None
        module = torch.nn.parallel.DistributedDataParallel(tagger, device_ids=ids)
    else:
        from torch.distributed.fsdp import fully_shard

        for unit in _layer_units(tagger.model):
            fully_shard(unit)
        module = fully_shard(tagger)
    if name.startswith("compile-"):
        module = torch.compile(module, mode=name.removeprefix("compile-"))
    return module


def _train(name: str, wrapper: str, case: dict, steps: int, device: torch.device,
           initial_weights: dict) -> tuple[dict, Tagger]:
    """This rank's measurements of one row (no collectives but the wrapper's own) and its model."""
    dtype, rank = getattr(torch, case["dtype"]), dist.get_rank()
    artifact = Path(case["artifact"])
    model, vocab = build("datamove" if name == "datamove" else "hf-sdpa", artifact, read_manifest(artifact),
                         case["layers"], dtype, device, initial_weights)
    tagger = Tagger(model, dtype, device).eval()
    data = batches(case["dims"], vocab, device)
    module = _wrapped(name, wrapper, tagger, device)
    optimizer = torch.optim.AdamW(tagger.parameters(), lr=1e-5)
    graphed = name == "compile-reduce-overhead"
    n = 0

    def step() -> torch.Tensor:
        nonlocal n
        ids, mask, tags = data[(n + rank) % len(data)]
        n += 1
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        loss = module(ids, mask, tags)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach().clone()  # a CUDA graph's output is overwritten by its next replay

    started = time.perf_counter()
    losses = torch.stack([step() for _ in range(LOSS_STEPS)]).float()
    _sync(device)
    warmup_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rounds = []
    for _ in range(ROUNDS):
        _sync(device)
        started = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        rounds.append((time.perf_counter() - started) * 1e3 / steps)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    local = {"wall_ms": statistics.median(rounds), "peak_mib": peak, "warmup_s": warmup_s, "losses": losses}
    if name.startswith("compile-"):
        from torch._dynamo.utils import counters

        local["dynamo"] = {"graphs": counters["stats"]["unique_graphs"],
                           "graph_breaks": sum(counters["graph_break"].values())}
    return local, tagger


def _replicas(tagger: Tagger, device: torch.device) -> dict:
    """Every rank's parameters against rank 0's (broadcast): how many differ, and by how much at most."""
    differing, largest = 0, 0.0
    params = list(tagger.parameters())
    for p in params:
        ref = p.detach().clone()
        dist.broadcast(ref, 0)
        if not torch.equal(ref, p.detach()):
            differing += 1
            largest = max(largest, float((ref.float() - p.detach().float()).abs().max()))
    stats = torch.tensor([differing, largest], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {"parameters": len(params), "differing": int(stats[0]), "max_abs_diff": float(stats[1])}


def measure(name: str, wrapper: str, case: dict, steps: int, device: torch.device, initial_weights: dict) -> dict:
    """One row, agreed over the ranks: the first rank's error where any rank failed, else the slowest
    rank's time, the largest rank's peak memory, the loss trace averaged over ranks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # a compile row starts from nothing: no recompile limit carried over, no graphs held
    counters.clear()
    try:
        local, tagger = _train(name, wrapper, case, steps, device, initial_weights)
        error = None
    except Exception as exc:  # noqa: BLE001 - a failing row is recorded, the others run
        error = f"{type(exc).__name__}: {exc}"[:400]
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    if failed:
        return {"error": failed[0], "date": utc_stamp()}
    stats = torch.tensor([local["wall_ms"], local["peak_mib"], local["warmup_s"]], dtype=torch.float64,
                         device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    losses = local["losses"]
    dist.all_reduce(losses)
    tokens = case["dims"]["B"] * _sequence(case["dims"])
    row = {"wall_ms": float(stats[0]), "tokens_per_s_per_gpu": tokens / float(stats[0]) * 1e3,
           "peak_mib": float(stats[1]) if device.type == "cuda" else None, "warmup_s": float(stats[2]),
           "losses": (losses / dist.get_world_size()).tolist(), "date": utc_stamp()}
    if "dynamo" in local:
        row["dynamo"] = local["dynamo"]
    if wrapper == "ddp":
        row["replicas"] = _replicas(tagger, device)
    return row


def _sequence(dims: dict) -> int:
    return dims["L"] if "L" in dims else dims["T"]


def compare_losses(rows: dict) -> None:
    """Each row's loss trace against ``hf-sdpa``'s under the same wrapper: ``loss_vs_hf``."""
    for models in rows.values():
        hf = models.get("hf-sdpa", {}).get("losses")
        for name, row in models.items():
            if hf and row.get("losses") and name != "hf-sdpa":
                per_step = [abs(a - b) for a, b in zip(row["losses"], hf)]
                row["loss_vs_hf"] = {"max_abs": max(per_step), "per_step": per_step}


def _same_case(old: dict, run: dict) -> bool:
    return all(old.get(k) == run[k] for k in ("device", "versions", "case", "steps"))


def merged(previous: dict, run: dict) -> dict:
    """The report with ``run`` as its section for ``run``'s GPU count (see the module's docstring)."""
    runs = dict(previous.get("runs", {}))
    old = runs.get(str(run["world_size"]))
    rows = {w: dict(models) for w, models in old["rows"].items()} if old and _same_case(old, run) else {}
    for wrapper, models in run["rows"].items():
        rows.setdefault(wrapper, {}).update(models)
    compare_losses(rows)
    runs[str(run["world_size"])] = {**run, "rows": rows}
    return {"spec": run["case"]["spec"], "runs": dict(sorted(runs.items(), key=lambda kv: int(kv[0])))}


def _sizes(case: dict) -> str:
    return f"{' '.join(f'{k}={v}' for k, v in case['dims'].items())} {case['dtype']}, {case['layers']} layers"


def _fmt(value, spec: str) -> str:
    return "" if value is None or value != value else format(value, spec)


def markdown(report: dict) -> str:
    lines = [f"# A HF {TITLES[report['spec']]}'s training step on several GPUs: DDP and FSDP2", "",
             "One AdamW step (forward, loss, zero_grad, backward, optimizer step) per GPU on its own batch (the "
             "artifact's B x sequence, padded tails), dropout off. Wall: host clock per step (median of rounds, "
             "slowest rank); tokens/s per GPU: B x sequence over that time; peak: memory allocated over the timed "
             "steps (largest rank); "
             f"first {LOSS_STEPS}: seconds of the first {LOSS_STEPS} steps (compilation, graph capture); "
             f"loss: the mean over ranks at step {LOSS_STEPS}, same seed and data for every model; "
             f"max |d loss|: the largest difference from hf-sdpa's loss under the same wrapper over {LOSS_STEPS} "
             "steps; replicas: DDP ranks whose parameters equal rank 0's bit for bit after training "
             "(`benchmarks/distributed.py`).", ""]
    for world, run in report["runs"].items():
        case = run["case"]
        dates = sorted({row["date"][:10] for models in run["rows"].values() for row in models.values()})
        span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
        lines += [f"## {world} x {run['device']} (measured {span})", "",
                  f"Versions: {', '.join(f'{k} {v}' for k, v in run['versions'].items())}.  "
                  f"{_sizes(case)}, {run['steps']} steps per round; "
                  f"artifact `{case['artifact']}` (plan timed on {case['plan_device']['name']}).", "",
                  f"| wrapper | model | wall ms | tokens/s per GPU | peak MiB | first {LOSS_STEPS} s | "
                  f"loss at {LOSS_STEPS} | max \\|d loss\\| vs hf | replicas | notes |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for wrapper, models in run["rows"].items():
            for name, row in models.items():
                if "error" in row:
                    lines.append(f"| {wrapper} | {name} | {row['error']} | | | | | | | |")
                    continue
                replicas = row.get("replicas")
                equal = "" if replicas is None else (
                    f"all equal ({replicas['parameters']} tensors)" if not replicas["differing"] else
                    f"{replicas['differing']} of {replicas['parameters']} differ (max {replicas['max_abs_diff']:.3g})")
                notes = (f"dynamo: {row['dynamo']['graphs']} graphs, {row['dynamo']['graph_breaks']} breaks"
                         if "dynamo" in row else "")
                lines.append(f"| {wrapper} | {name} | {row['wall_ms']:.2f} | {row['tokens_per_s_per_gpu']:,.0f} | "
                             f"{_fmt(row['peak_mib'], '.0f')} | {row['warmup_s']:.1f} | {row['losses'][-1]:.4f} | "
                             f"{_fmt(row.get('loss_vs_hf', {}).get('max_abs'), '.2e')} | {equal} | {notes} |")
        lines.append("")
    if len(report["runs"]) > 1:
        worlds = list(report["runs"])
        lines += ["## Tokens/s per GPU by GPU count", "", "| wrapper | model | " + " | ".join(worlds) + " |",
                  "|---|---|" + "---|" * len(worlds)]
        keys = dict.fromkeys((w, m) for run in report["runs"].values() for w, models in run["rows"].items()
                             for m in models)
        for wrapper, name in keys:
            cells = [report["runs"][n]["rows"].get(wrapper, {}).get(name, {}).get("tokens_per_s_per_gpu")
                     for n in worlds]
            lines.append(f"| {wrapper} | {name} | " + " | ".join(_fmt(c, ",.0f") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _names(text: str, known: tuple) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}: expected some of {', '.join(known)}")
    return [n for n in known if n in names]  # hf-sdpa first: the others are compared with it


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True,
                        help="an optimize-layer output folder (configs/bert.py or configs/llama.py)")
    parser.add_argument("--layers", type=int, help="encoder / decoder layers (default: BERT 24, Llama 16)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--models", type=lambda s: _names(s, MODELS), default=None,
                        help=f"some of {','.join(MODELS)} (default: all; on the CPU hf-sdpa,datamove)")
    parser.add_argument("--wrappers", type=lambda s: _names(s, WRAPPERS), default=list(WRAPPERS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    manifest = read_manifest(args.artifact)
    if manifest["spec"] not in LAYERS:
        parser.error(f"{args.artifact}: a {manifest['spec']} artifact; this benchmark runs "
                     f"{' and '.join(LAYERS)} models")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/distributed.py needs CUDA GPUs (or --device cpu): nothing measured", file=sys.stderr)
        return 2
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        models = args.models or (list(MODELS) if device.type == "cuda" else ["hf-sdpa", "datamove"])
        spec = manifest["spec"]
        case = {"artifact": str(args.artifact), "spec": spec, "dims": manifest["dims"], "dtype": manifest["dtype"],
                "layers": args.layers or LAYERS[spec], "plan_device": manifest["device"]}
        stem = "distributed" if spec == "bert" else f"distributed_{spec}"
        run = {"world_size": world, "date": utc_stamp(), "steps": args.steps, "case": case, "versions": versions(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu_name()}",
               "rows": {}}
        path = Path(args.out) / f"{stem}.json"
        previous = json.loads(path.read_text()) if rank == 0 and path.is_file() else {}
        if rank == 0:
            print(f"{world} x {run['device']}: {_sizes(case)}", file=sys.stderr)
        initial_weights = {}  # every model starts from the first one's weights (benchmarks/model.py's build)
        for wrapper in args.wrappers:
            for name in models:
                row = measure(name, wrapper, case, args.steps, device, initial_weights)
                if rank == 0:
                    run["rows"].setdefault(wrapper, {})[name] = row
                    report = merged(previous, run)  # rewritten after each row: what was measured stays
                    write_results(args.out, stem, report, markdown(report))
                    said = row.get("error") or (f"wall {row['wall_ms']:.2f} ms, "
                                                f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                                                f"loss {row['losses'][-1]:.4f}")
                    print(f"  {wrapper} {name}: {said}", file=sys.stderr)
                gc.collect()  # the row's model (FSDP's modules hold cycles) before the next one's
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if rank == 0:
            print(markdown(merged(previous, run)))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
