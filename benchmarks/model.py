"""A whole model's training step, as a user runs it: a HF BERT, GPT-2 or Llama model, layers replaced, in a plain loop.

    PYTHONPATH=$PWD python3 benchmarks/model.py --artifact out/<dir> [--artifact ...] [--layers N] [--batch B]
                                                [--models NAME ...] [--out benchmarks/results] [--name model]

Per artifact (its spec, dims and dtype set the case; ``--batch`` another batch size than the tuned
one): a HF model of the artifact's sizes, ``--layers`` deep, SDPA attention, padded tails (each
sequence keeps between half and all of its positions, [batch, sequence] ``attention_mask``), a
token-tagging head (``TAGS`` classes) and ``torch.optim.AdamW``; one training step = forward, loss
over the unpadded positions, ``zero_grad(set_to_none=True)``, backward, optimizer step.
- BERT (``configs/bert.py``): ``BertModel`` (BERT-large: 24 layers by default), dropout 0.1.
- GPT-2 (``configs/gpt2.py``): ``GPT2Model`` (GPT-2 small: 12 blocks by default), dropout 0.1,
  causal, HF's vocabulary of 50257; the tagging head as Llama's.
- Llama (``configs/llama.py``): ``LlamaModel`` (16 layers by default: Llama-3.2-1B's depth; HF's
  vocabulary of 32000), no dropout.  The tagging head, not a causal LM head: the cheapest loss,
  where an LM head would add float32 logits of [batch, sequence, vocabulary] (1 GB at B=4 T=2048)
  and ~3 TFLOP to every model's step alike.
Models (``--models``: some of them), same initial weights (the first model's state dict), one after
the other in one run:
- ``datamove``: every ``BertLayer`` / ``GPT2Block`` / ``LlamaDecoderLayer`` replaced by the tuned layer
  (``datamove.hf.replace_bert_layers`` / ``replace_gpt2_blocks`` / ``replace_llama_layers``), its own
  CUDA graphs on (the default);
- ``datamove-plain``: the same with ``cuda_graphs=False`` (every kernel launched on every call);
- ``hf-sdpa``: the model untouched;
- ``compile``: ``torch.compile(model)`` (default mode); ``compile-reduce-overhead``: with CUDA graphs
  (``mode="reduce-overhead"``, compile's best mode for wall time), each step starting with
  ``torch.compiler.cudagraph_mark_step_begin()``;
- Llama only, made last (Liger-Kernel patches HF's module): ``liger``, HF's model with Liger's
  RMSNorm, SwiGLU and RoPE (``benchmarks/layer.py``'s ``apply_liger``), and ``liger+compile``,
  ``torch.compile`` of it.
Per model: wall time per step (host clock over ``STEPS`` steps, synchronised at the end; median of
``ROUNDS``), kernel time per step (the sum of every device activity's duration in a profiler trace
of ``PROFILED`` steps), peak memory allocated over the timed steps, and for the tuned layers the
bytes their graphs hold (``TunedLayer.cuda_graph_bytes``).  Warm-up steps first (compilation,
graph capture).  Ratios are against ``datamove``'s wall time.  Results: ``OUT/NAME.md`` / ``.json`` for
BERT, ``OUT/NAME_<spec>.md`` / ``.json`` for GPT-2 and Llama, rewritten after each model.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks.layer import apply_liger, llama_config
from datamove.export import read_manifest
from datamove.hf import BertLayerReplacement, replace_bert_layers, replace_gpt2_blocks, replace_llama_layers
from datamove.harness.bench import require_cuda, utc_stamp, write_results
from datamove.kernels.device import versions

WARMUP, STEPS, ROUNDS, PROFILED, BATCHES = 4, 10, 3, 5, 4
TAGS = 7
MODELS = {"bert": ("datamove", "datamove-plain", "hf-sdpa", "compile", "compile-reduce-overhead"),
          "gpt2": ("datamove", "datamove-plain", "hf-sdpa", "compile", "compile-reduce-overhead"),
          "llama": ("datamove", "datamove-plain", "hf-sdpa", "compile", "compile-reduce-overhead", "liger",
                    "liger+compile")}
LAYERS = {"bert": 24, "gpt2": 12, "llama": 16}  # --layers' default per spec
TITLES = {"bert": "BertModel", "gpt2": "GPT2Model", "llama": "LlamaModel"}
REPLACE = {"bert": replace_bert_layers, "gpt2": replace_gpt2_blocks, "llama": replace_llama_layers}
SETTINGS = {"bert": "dropout 0.1",  # the Markdown's description of a case
            "gpt2": "dropout 0.1, causal",
            "llama": "no dropout; liger: HF's model with Liger-Kernel's RMSNorm, SwiGLU and RoPE"}


def _bert(manifest: dict, layers: int, dtype: torch.dtype, device):
    import transformers

    dims = manifest["dims"]
    config = transformers.BertConfig(hidden_size=dims["N"], num_attention_heads=dims["H"], intermediate_size=dims["U"],
                                     num_hidden_layers=layers, hidden_act="relu", layer_norm_eps=1e-12,
                                     max_position_embeddings=max(512, dims["L"]), attention_probs_dropout_prob=0.1,
                                     hidden_dropout_prob=0.1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).to(device, dtype).train()
    return model, config.vocab_size


def _gpt2(manifest: dict, layers: int, dtype: torch.dtype, device):
    import transformers

    dims = manifest["dims"]
    config = transformers.GPT2Config(n_embd=dims["D"], n_head=dims["H"], n_inner=dims["F"], n_layer=layers,
                                     n_positions=max(1024, dims["T"]))  # GELU's tanh form, dropouts 0.1: the spec's
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.GPT2Model(config)
    return model.to(dtype).train(), config.vocab_size


def _llama(manifest: dict, layers: int, dtype: torch.dtype, device):
    import transformers

    config = llama_config(manifest)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 1B model's weights take seconds on the host
        model = transformers.LlamaModel(config)
    return model.to(dtype).train(), config.vocab_size


def build(name: str, artifact: Path, manifest: dict, layers: int, dtype: torch.dtype, device,
          initial_weights: dict):
    """Model ``name`` (one of ``MODELS[spec]``) of the artifact's spec on ``device``, ``layers`` deep,
    in training mode; -> (model, vocabulary size).  ``initial_weights``: the state dict every model
    starts from (on the host), filled from the first model made when empty."""
    spec = manifest["spec"]
    if name.startswith("liger"):
        apply_liger()
    model, vocab = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}[spec](manifest, layers, dtype, device)
    if initial_weights:
        model.load_state_dict(initial_weights)
    else:
        initial_weights.update({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
    if name.startswith("datamove"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            REPLACE[spec](model, artifact, allow_mismatch=True, cuda_graphs=name == "datamove")
    elif name.endswith("compile"):
        model = torch.compile(model)
    elif name == "compile-reduce-overhead":
        model = torch.compile(model, mode="reduce-overhead")
    return model, vocab


def batches(dims: dict, vocab: int, device) -> list[tuple]:
    """``BATCHES`` batches of (token ids, attention mask: 1 = kept, tags), each [B, sequence]; each
    sequence keeps its first half to all positions."""
    gen = torch.Generator(device=device).manual_seed(1)
    B, L = dims["B"], (dims["L"] if "L" in dims else dims["T"])
    result = []
    for _ in range(BATCHES):
        ids = torch.randint(0, vocab, (B, L), device=device, generator=gen)
        kept = torch.randint(L // 2, L + 1, (B, 1), device=device, generator=gen)
        mask = (torch.arange(L, device=device)[None, :] < kept).long()
        result.append((ids, mask, (ids * 5 + 1) % TAGS))
    return result


class Trainer:
    """``model`` + a tagging head (``hidden`` features in) + AdamW; ``step()`` is one training step on
    the next batch and returns its loss."""

    def __init__(self, model, batches: list[tuple], hidden: int, dtype: torch.dtype, device, graphed: bool = False):
        torch.manual_seed(2)
        self.model, self.batches, self.n, self.graphed = model, batches, 0, graphed
        self.head = torch.nn.Linear(hidden, TAGS, device=device, dtype=dtype)
        self.optimizer = torch.optim.AdamW(list(model.parameters()) + list(self.head.parameters()), lr=1e-5)

    def step(self) -> torch.Tensor:
        ids, mask, tags = self.batches[self.n % len(self.batches)]
        self.n += 1
        if self.graphed:  # compile's CUDA graphs: the previous step's outputs are not read again
            torch.compiler.cudagraph_mark_step_begin()
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


def measure(name: str, trainer: Trainer) -> dict:
    started = time.perf_counter()
    losses = [float(trainer.step()) for _ in range(WARMUP)]
    warmup_s = time.perf_counter() - started
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    wall = statistics.median(_wall_ms(trainer) for _ in range(ROUNDS))
    peak = torch.cuda.max_memory_allocated() / 2**20
    kernel = _kernel_ms(trainer)
    layers = [m.layer for m in trainer.model.modules() if isinstance(m, BertLayerReplacement)]
    row = {"wall_ms": wall, "kernel_ms": kernel, "peak_mib": peak, "warmup_s": warmup_s,
           "first_losses": losses, "last_loss": float(trainer.step())}
    if layers:
        row["graph_held_mib"] = sum(layer.cuda_graph_bytes() for layer in layers) / 2**20
    print(f"  {name}: wall {wall:.2f} ms, kernel {kernel:.2f} ms, peak {peak:.0f} MiB", file=sys.stderr)
    return row


def run_case(artifact: Path, layers: int, batch: int | None, models: list[str] | None, report: dict, save) -> None:
    """Measure the models of the artifact's spec (those in ``models`` where given) into a case appended
    to ``report["cases"]``, calling ``save()`` after each."""
    manifest = read_manifest(artifact)
    dims, dtype = {**manifest["dims"], **({"B": batch} if batch else {})}, getattr(torch, manifest["dtype"])
    sizes = " ".join(f"{k}={v}" for k, v in dims.items())
    print(f"{artifact.name}: {sizes} {manifest['dtype']}, {layers} layers", file=sys.stderr)
    rows, initial_weights = {}, {}
    report["cases"].append({"artifact": str(artifact), "dims": dims, "dtype": manifest["dtype"], "layers": layers,
                            "plan_device": manifest["device"], "date": utc_stamp(), "rows": rows})
    for name in [name for name in MODELS[manifest["spec"]] if not models or name in models]:
        try:
            model, vocab = build(name, artifact, manifest, layers, dtype, "cuda", initial_weights)
            rows[name] = measure(name, Trainer(model, batches(dims, vocab, "cuda"), model.config.hidden_size, dtype,
                                               "cuda", graphed=name == "compile-reduce-overhead"))
        except Exception as exc:  # noqa: BLE001 - one failing model is reported, the rest go on
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"  {name}: {rows[name]['error']}", file=sys.stderr)
        model = None  # freed before the next model is made
        torch.cuda.empty_cache()
        save()


def markdown(report: dict) -> str:
    spec = report["spec"]
    lines = [f"# A HF {TITLES[spec]}'s training step ({report['device']}, {report['date']})", "",
             f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}.", "",
             f"One AdamW step (forward, loss, zero_grad, backward, optimizer step), padded tails, {SETTINGS[spec]}. "
             f"Wall: host clock per step over {STEPS} steps (median of {ROUNDS}); kernel: device busy time per step "
             f"(profiler, {PROFILED} steps); peak: memory allocated over the timed steps; graphs: static buffers the "
             "tuned layers' CUDA graphs hold. Ratio: wall time / datamove's.", ""]
    for case in report["cases"]:
        d = case["dims"]
        sizes = " ".join(f"{k}={d[k]}" for k in ("B", "T", "D", "H", "KV", "E", "F") if k in d) if spec != "bert" else \
            f"B={d['B']} L={d['L']}"
        lines += [f"## {sizes} {case['dtype']}, {case['layers']} layers (plan timed on "
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
    parser.add_argument("--layers", type=int, help="decoder / encoder layers (default: BERT 24, GPT-2 12, Llama 16)")
    parser.add_argument("--batch", type=int, help="batch size (default: the artifact's B; another runs the nearest "
                                                  "tuned plan)")
    parser.add_argument("--models", nargs="+", help="measure only these (names as in the docstring)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="model", help="results file name: OUT/NAME.md (BERT), OUT/NAME_<spec>.md "
                                                        "(GPT-2, Llama)")
    args = parser.parse_args()
    require_cuda("benchmarks/model.py")
    specs = {artifact: read_manifest(artifact)["spec"] for artifact in args.artifact}
    for artifact, spec in specs.items():
        if spec not in MODELS:
            parser.error(f"{artifact}: a {spec} artifact; this benchmark runs {' and '.join(MODELS)} models")
    reports = {}
    for artifact, spec in specs.items():  # rewritten after each model: what was measured stays
        report = reports.setdefault(spec, {"date": utc_stamp(), "device": torch.cuda.get_device_name(), "spec": spec,
                                           "versions": versions(), "cases": []})
        stem = args.name if spec == "bert" else f"{args.name}_{spec}"
        run_case(artifact, args.layers or LAYERS[spec], args.batch, args.models, report,
                 lambda: write_results(args.out, stem, report, markdown(report)))
    print("".join(markdown(report) for report in reports.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
