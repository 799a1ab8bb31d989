"""The tuned layer against what users run today, forward and forward+backward, in one GPU run.

    PYTHONPATH=$PWD python3 benchmarks/layer.py --artifact out/<dir> [--artifact ...] [--out benchmarks/results]

Per artifact (written by ``optimize-layer``: its dims and dtype set the case), layers of the same
shape and dtype with the same weights:
- ``datamove``: the exported tuned layer (``datamove.export.load_layer``), replaying its own CUDA graphs;
- ``datamove-plain``: the same with ``cuda_graphs=False`` (every kernel launched on every call);
- ``hf-eager`` / ``hf-sdpa``: HF ``BertLayer`` with eager attention / SDPA;
- ``torch-encoder``: ``nn.TransformerEncoderLayer`` (post-norm, batch_first, the spec's activation);
- ``compile-default`` / ``compile-max-autotune``: ``torch.compile`` of HF ``BertLayer`` with SDPA
  (``mode=None`` / ``"max-autotune-no-cudagraphs"``).
A GPT-2 artifact (``configs/gpt2.py``) is compared with HF's ``GPT2Block`` with SDPA (causal) and
both compiles of it; a Llama artifact (``configs/llama.py``) with HF's ``LlamaDecoderLayer`` with
SDPA (causal, the rotary tables of HF's ``LlamaRotaryEmbedding`` passed in, as the model does),
``torch.compile`` of it (default and max-autotune; ``--no-max-autotune`` leaves that out), and the same with
Liger-Kernel's RMSNorm, SwiGLU and RoPE (``apply_liger_kernel_to_llama``, applied after the others
are measured: it patches HF's module) alone and compiled.
All in training mode (dropout 0.1 as in the spec), inputs N(0, 1), gradients of a fixed N(0, 1)
upstream gradient taken with ``torch.autograd.grad`` (nothing accumulates between calls).

Three times per layer and direction, each the median over repetitions:
- kernel: the GPU's busy time per call, the sum of every kernel's (and copy's) duration in a
  ``torch.profiler`` trace of ``REPS`` calls, divided by ``REPS`` (consecutive calls, L2 warm as
  in training);
- wall: host time per call of ``REPS`` calls made as a user makes them, synchronised at the end;
- graphed: the same calls replayed from one CUDA graph the caller captured (after warm-up; the
  tuned layer launches its kernels into it).
Ratios are against the tuned layer's; the kernel time's median round also gives, per kernel name,
time and launches per call (the Markdown lists the slowest of the tuned layer and both compile
modes side by side: where one spends time the other does not, e.g. work outside the plan's steps).
The tuned layer's breakdown: each plan step timed alone
(``harness.bench.time_cuda``: device events, L2 flushed, medians, replayed from a CUDA graph) beside
the plan's time for it, its configuration (JSON) and, for the generated memory-bound kernels, the
bytes it moves (the tensors it reads and writes; dropout masks are regenerated, not read), its
bandwidth and that as a share of a device copy of the same bytes timed the same way (half of them
read, half written: the ramp and tail of a kernel that size count in both).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from datamove.dtypes import parse as parse_dtype
from datamove.export import load_layer, load_weights, read_manifest
from datamove.layouts.plan import GENERATED
from datamove.runtime.steps import Run
from datamove.harness.bench import capture_graph, require_cuda, time_cuda, utc_stamp, write_results
from datamove.harness.sweep_variants import tensor_bytes
from datamove.kernels.device import query_device, versions

REPS = 20
ROUNDS = 5  # odd: the kernel table is the median round's
KERNEL_TABLE_LAYERS = ("datamove", "compile-default", "compile-max-autotune", "liger")


def _baselines(manifest: dict, dtype: torch.dtype, device, max_autotune: bool = True) -> dict:
    """The PyTorch layers of the artifact's shape and spec (BERT's layer, GPT-2's block, Llama's
    decoder layer), same weights as each other; a value may be a function making the layer when
    it is measured (Liger's, which patches HF's module)."""
    if manifest["spec"] == "gpt2":
        return _gpt2_baselines(manifest, dtype, device)
    if manifest["spec"] == "llama":
        return _llama_baselines(manifest, dtype, device, max_autotune)
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer

    d = manifest["dims"]
    N, H, U = d["N"], d["H"], d["U"]
    activation = "relu"
    config = transformers.BertConfig(hidden_size=N, num_attention_heads=H, intermediate_size=U, hidden_act=activation,
                                     layer_norm_eps=1e-12, attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1)
    layers = {}
    for name, implementation in (("hf-eager", "eager"), ("hf-sdpa", "sdpa")):
        config._attn_implementation = implementation
        layers[name] = BertLayer(config).to(device, dtype).train()
    layers["hf-eager"].load_state_dict(layers["hf-sdpa"].state_dict())
    encoder = torch.nn.TransformerEncoderLayer(N, H, U, dropout=0.1, activation=activation, layer_norm_eps=1e-12,
                                               batch_first=True).to(device, dtype).train()
    layers["torch-encoder"] = encoder
    layers["compile-default"] = torch.compile(layers["hf-sdpa"])
    layers["compile-max-autotune"] = torch.compile(layers["hf-sdpa"], mode="max-autotune-no-cudagraphs")
    return layers


def _gpt2_baselines(manifest: dict, dtype: torch.dtype, device) -> dict:
    """HF's ``GPT2Block`` with SDPA (given no mask, it applies the causal one: flash / cuDNN
    attention) and ``torch.compile`` of it; HF's eager attention is left out (it applies a causal
    mask only when the model hands it one)."""
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    d = manifest["dims"]
    config = transformers.GPT2Config(n_embd=d["D"], n_head=d["H"], n_inner=d["F"], activation_function="gelu_new",
                                     layer_norm_epsilon=1e-5, attn_pdrop=0.1, resid_pdrop=0.1)
    config._attn_implementation = "sdpa"
    block = GPT2Block(config, layer_idx=0).to(device, dtype).train()
    return {"hf-sdpa": block, "compile-default": torch.compile(block),
            "compile-max-autotune": torch.compile(block, mode="max-autotune-no-cudagraphs")}


class _WithRotary(torch.nn.Module):
    """A HF ``LlamaDecoderLayer`` called as the model calls it: with the rotary tables (cos, sin)."""

    def __init__(self, layer: torch.nn.Module, tables: tuple):
        super().__init__()
        self.layer, self.tables = layer, tables

    def forward(self, x):
        return self.layer(x, position_embeddings=self.tables)


def llama_config(manifest: dict):
    import transformers

    d = manifest["dims"]
    return transformers.LlamaConfig(hidden_size=d["D"], num_attention_heads=d["H"], num_key_value_heads=d["KV"],
                                    head_dim=d["E"], intermediate_size=d["F"], rms_norm_eps=1e-5,
                                    max_position_embeddings=max(d["T"], 2048), attn_implementation="sdpa")


def llama_tables(manifest: dict, dtype: torch.dtype, device) -> tuple:
    """HF's rotary (cos, sin) for positions 0..T-1, [1, T, E]."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config, T = llama_config(manifest), manifest["dims"]["T"]
    x = torch.empty(1, T, config.hidden_size, device=device, dtype=dtype)
    return LlamaRotaryEmbedding(config).to(device)(x, torch.arange(T, device=device)[None])


def apply_liger() -> None:
    """Liger-Kernel's RMSNorm, SwiGLU and RoPE in place of HF's, in the ``modeling_llama`` module itself:
    every Llama layer or model made afterwards uses them."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False)


def _llama_baselines(manifest: dict, dtype: torch.dtype, device, max_autotune: bool) -> dict:
    from transformers.models.llama import modeling_llama

    config, tables = llama_config(manifest), llama_tables(manifest, dtype, device)
    hf = _WithRotary(modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to(device, dtype).train(), tables)
    layers = {"hf-sdpa": hf, "compile-default": torch.compile(hf)}
    if max_autotune:
        layers["compile-max-autotune"] = torch.compile(hf, mode="max-autotune-no-cudagraphs")

    def liger():
        apply_liger()
        layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to(device, dtype).train()
        layer.load_state_dict(hf.layer.state_dict())
        return _WithRotary(layer, tables)

    made = {}
    layers["liger"] = lambda: made.setdefault("liger", liger())
    layers["liger-compile"] = lambda: torch.compile(made.setdefault("liger", liger()))
    return layers


def _call(layer, x, dy, backward: bool):
    params = [p for p in layer.parameters() if p.requires_grad]

    def step():
        y = layer(x)
        y = y[0] if isinstance(y, tuple) else y
        if backward:
            return torch.autograd.grad(y, [x, *params], dy)
        return y
    return step


def kernel_profile(step) -> tuple[float, list[dict]]:
    """GPU busy time per call (every device activity's duration over ``REPS`` calls / ``REPS``, ms)
    and the same per kernel name (``per_kernel``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            step()
        torch.cuda.synchronize()
    events = [(e.name, e.device_time_total) for e in prof.events() if e.device_type.name == "CUDA"]
    return sum(us for _, us in events) / 1e3 / REPS, per_kernel(events, REPS)


def per_kernel(events, calls: int) -> list[dict]:
    """Device activities ``(name, us)`` of ``calls`` calls grouped by name, slowest first:
    ``{"name", "us": time per call, "count": launches per call}``."""
    total: dict[str, list] = {}
    for name, us in events:
        entry = total.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    return sorted(({"name": name, "us": us / calls, "count": n / calls} for name, (us, n) in total.items()),
                  key=lambda row: -row["us"])


def wall_ms(step) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(REPS):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / REPS


def measure(step) -> dict:
    for _ in range(3):
        step()
    profiles = sorted((kernel_profile(step) for _ in range(ROUNDS)), key=lambda p: p[0])
    kernel, kernels = profiles[len(profiles) // 2]  # the median round (ROUNDS is odd)
    result = {"kernel_ms": kernel, "kernels": kernels, "wall_ms": statistics.median(wall_ms(step) for _ in range(ROUNDS))}
    try:
        replay, _ = capture_graph(step)
        result["graphed_ms"] = statistics.median(wall_ms(replay) for _ in range(ROUNDS))
    except Exception as exc:  # noqa: BLE001 - a layer that cannot be captured is reported, not fatal
        result["graphed_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return result


def breakdown(layer) -> list[dict]:
    """Each plan step of the tuned layer timed alone, in training mode, beside the plan's time."""
    program = layer.program(True)
    face = program.interface
    gen = torch.Generator(device=program.device).manual_seed(0)
    store = {}
    for t in face.activations:
        store[t] = program.to_spec(t, torch.randn(program.shape(t, face.torch_order[t]), generator=gen,
                                                  device=program.device, dtype=program.dtype), t)
    store.update({t: layer.spec_view(t).detach() for t in face.parameters + face.constants})
    for t, grad in face.grad_outputs.items():
        store[grad] = program.to_spec(t, torch.randn(program.shape(t, face.torch_order[t]), generator=gen,
                                                     device=program.device, dtype=program.dtype), grad)
    run = Run(seed=12345)
    rows, copies = [], {}
    for launcher in program.forward_steps + program.backward_steps:
        launcher(store, run)  # fills what later steps read
        call = lambda launcher=launcher: launcher(store, run)  # noqa: E731
        try:  # replayed from a CUDA graph: a slow host's launch time must not count as the kernel's
            timing = time_cuda(call, cuda_graph=True)
        except Exception:
            timing = time_cuda(call, cuda_graph=False)
        step = launcher.step
        moved = tensor_bytes(program.graph, [*step.reads, *step.writes], program.dtype.itemsize)
        row = {"step": step.name, "phase": step.phase, "kind": step.kind, "ms": timing.median_ms,
               "graphed": timing.cuda_graph, "plan_ms": step.time_ms, "plan_source": step.source,
               "bytes": moved, "reads": step.reads, "writes": step.writes, "config": step.config.to_json()}
        if step.kind == GENERATED:
            if moved not in copies:
                copies[moved] = same_size_copy_ms(moved, program.device)
            row["copy_ms"] = copies[moved]
        rows.append(row)
    return rows


def same_size_copy_ms(moved: int, device) -> float:
    """Median time of a device copy reading ``moved // 2`` bytes and writing as many (``time_cuda``
    as for the steps: L2 flushed, replayed from a CUDA graph)."""
    src = torch.empty(moved // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return time_cuda(lambda: dst.copy_(src), cuda_graph=True).median_ms


def run_case(artifact: Path, max_autotune: bool = True) -> dict:
    manifest = read_manifest(artifact)
    device = torch.device("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(artifact, device=device, allow_mismatch=True).train()
        plain = load_layer(artifact, device=device, allow_mismatch=True, cuda_graphs=False).train()
    dtype = layer.dtype
    baselines = _baselines(manifest, dtype, device, max_autotune)
    source = baselines["hf-sdpa"]
    if manifest["spec"] == "llama":
        source = source.layer
        cos, sin = llama_tables(manifest, dtype, device)
        with torch.no_grad():
            for each in (layer, plain):
                each.spec_view("cos").copy_(cos[0])
                each.spec_view("sin").copy_(sin[0])
    load_weights(layer, source)
    load_weights(plain, source)
    d = manifest["dims"]
    program = layer.program(True)
    x = torch.randn(program.torch_shapes[program.interface.activations[0]], device=device, dtype=dtype,
                    requires_grad=True)
    dy = torch.randn_like(x)
    rows = {}
    for name, module in {"datamove": layer, "datamove-plain": plain, **baselines}.items():
        if not isinstance(module, torch.nn.Module):
            module = module()  # made now: after the layers it would change are measured
        for direction, backward in (("forward", False), ("fwd+bwd", True)):
            print(f"{artifact.name}: {name} {direction}", file=sys.stderr)
            try:
                rows[f"{name}|{direction}"] = measure(_call(module, x, dy, backward))
            except Exception as exc:  # noqa: BLE001 - one failing baseline is reported, the rest go on
                rows[f"{name}|{direction}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"artifact": str(artifact), "dims": d, "dtype": parse_dtype(dtype).name, "date": utc_stamp(),
            "plan_device": manifest["device"], "rows": rows, "breakdown": breakdown(layer)}


def markdown(report: dict) -> str:
    lines = [f"# The tuned layer against PyTorch ({report['device']}, {report['date']})", "",
             f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}.", "",
             "Kernel: GPU busy time per call (profiler sum, consecutive calls); wall: host time per call as a user "
             "calls it (datamove: its own CUDA graphs; datamove-plain: every kernel launched); graphed: the same replayed "
             "from one CUDA graph the caller captured. Medians; ratio = time / tuned layer's.", ""]
    for case in report["cases"]:
        d = case["dims"]
        sizes = (f"B={d['B']} L={d['L']}" if "L" in d else
                 f"Llama layer B={d['B']} T={d['T']} D={d['D']} H={d['H']} KV={d['KV']} E={d['E']} F={d['F']}"
                 if "KV" in d else f"GPT-2 block B={d['B']} T={d['T']}")
        lines += [f"## {sizes} {case['dtype']} (plan timed on: {case['plan_device']['name']}; "
                  f"measured {case.get('date', report['date'])})", "",
                  "| layer | direction | kernel ms | wall ms | graphed ms | kernel ratio |", "|---|---|---|---|---|---|"]
        ours = {k.split("|")[1]: v.get("kernel_ms") for k, v in case["rows"].items() if k.startswith("datamove|")}
        for key, row in case["rows"].items():
            name, direction = key.split("|")
            if "error" in row:
                lines.append(f"| {name} | {direction} | error: {row['error']} | | | |")
                continue
            ratio = row["kernel_ms"] / ours[direction] if ours.get(direction) else float("nan")
            graph = f"{row['graphed_ms']:.3f}" if "graphed_ms" in row else row.get("graphed_error", "")
            lines.append(f"| {name} | {direction} | {row['kernel_ms']:.3f} | {row['wall_ms']:.3f} | {graph} | {ratio:.2f} |")
        lines += ["", "Tuned layer, each step alone (device events, L2 flushed; replayed from a CUDA graph unless "
                  "marked launched, where capture failed and the host's launch time may count); generated kernels: "
                  "bytes moved, bandwidth, and the time of a device copy of the same bytes over the step's "
                  "(% of copy):", "",
                  "| step | phase | kind | ms | plan ms (source) | MB | GB/s | % of copy |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in case["breakdown"]:
            launched = "" if row.get("graphed", True) else " launched"
            bandwidth = ""
            if "copy_ms" in row:
                bandwidth = (f" {row['bytes'] / 1e6:.1f} | {row['bytes'] / row['ms'] / 1e6:.0f} | "
                             f"{100 * row['copy_ms'] / row['ms']:.0f}")
            lines.append(f"| {row['step']} | {row['phase']} | {row['kind']} | {row['ms']:.4f}{launched} | "
                         f"{row['plan_ms']:.4f} ({row['plan_source']}) |{bandwidth or ' | |'} |")
        total = sum(r["ms"] for r in case["breakdown"])
        lines += [f"| total | | | {total:.4f} | | | | |", ""] + kernel_lines(case)
    return "\n".join(lines) + "\n"


def kernel_lines(case: dict, layers=KERNEL_TABLE_LAYERS, most: int = 16) -> list[str]:
    """Markdown: the slowest kernels of one fwd+bwd call of each of ``layers``, side by side."""
    tables = {name: case["rows"].get(f"{name}|fwd+bwd", {}).get("kernels") for name in layers}
    tables = {name: rows for name, rows in tables.items() if rows}
    if not tables:
        return []
    lines = ["Kernels of one fwd+bwd call, slowest first (profiler; us per call, launches per call):", "",
             "| " + " | ".join(f"{name} | us | n" for name in tables) + " |",
             "|" + "---|---|---|" * len(tables)]
    for n in range(min(most, max(len(rows) for rows in tables.values()))):
        cells = []
        for rows in tables.values():
            row = rows[n] if n < len(rows) else None
            cells += [row["name"][:70].replace("|", "/"), f"{row['us']:.1f}", f"{row['count']:g}"] if row else ["", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, nargs="+", required=True, help="optimize-layer output folders")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="layer", help="results file name (OUT/NAME.md, .json)")
    parser.add_argument("--no-max-autotune", dest="max_autotune", action="store_false",
                        help="leave out torch.compile's max-autotune (minutes of autotuning per layer)")
    args = parser.parse_args()
    require_cuda("benchmarks/layer.py")
    report = {"date": utc_stamp(),
              "device": torch.cuda.get_device_name(), "facts": query_device().to_dict(), "versions": versions(),
              "cases": []}
    for artifact in args.artifact:  # the results rewritten after each case: what was measured stays
        report["cases"].append(run_case(artifact, args.max_autotune))
        text = markdown(report)
        write_results(args.out, args.name, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
