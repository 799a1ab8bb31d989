"""Fused attention vs PyTorch SDPA vs the unfused eager chain: forward + backward, bf16, dropout 0.1.

    PYTHONPATH=$PWD python3 benchmarks/attention.py [--out benchmarks/results] [--configs all|default]

BERT-large sizes (B=8, L=512; H=16, P=64 and H=8, P=128), Q/K/V/dO stored as BERT holds them,
``[B, L, H*P]`` = (b, j, h, p), passed as logical (b, h, j, p) views. Times are medians of
``triton.testing.do_bench`` (L2 flushed between repetitions) in ms. For this kernel every knob
configuration of ``attention_configs`` is compiled (in parallel processes, filling Triton's disk
cache), checked against PyTorch's eager chain and timed; forward and backward are tuned separately
and the best pair is timed end to end. SDPA is timed with each backend forced through
``torch.nn.attention.sdpa_kernel`` and with PyTorch's own choice (named from the profiler's kernel
names). The "Philox floor" is one pass of the dropout mask generation alone (``dropout_keep`` over
B*H*L*L elements): the fused forward and backward each regenerate the mask once.
Flop counts: forward 4*B*H*L*L*P, backward 10*B*H*L*L*P (5 matrix products, dQ included).
Writes attention.md and attention.json.
"""
import argparse
import concurrent.futures
import contextlib
import datetime
import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from kernels.accuracy import relative_error
from kernels.attention import (_philox_keep, attention_backward, attention_configs, attention_forward,
                               default_config, fused_attention, keep_threshold)
from kernels.philox import dropout_keep

DROPOUT, SEED = 0.1, 0x5EED
SETUPS = [dict(B=8, H=16, L=512, P=64), dict(B=8, H=8, L=512, P=128)]


def median_ms(fn, grad_to_none=None) -> float:
    """Median ms per call of ``fn`` launched from Python (host launch gaps included)."""
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def gpu_ms(fn, leaves=()) -> float:
    """Median GPU ms per call of ``fn`` replayed from a CUDA graph: no host gaps between its kernels.
    ``leaves``: tensors whose .grad ``fn`` fills (cleared before capture, so the graph owns them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as capture requires
        for _ in range(3):
            for t in leaves:
                t.grad = None
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def timed(fn, leaves=()) -> dict:
    """Both times of ``fn``: ``ms`` (CUDA-graph replay, GPU time) and ``launch_ms`` (plain launches)."""
    return dict(ms=gpu_ms(fn, leaves), launch_ms=median_ms(fn, list(leaves)))


def inputs(B, H, L, P):
    """q, k, v (requires grad) and do: logical (b, h, j, p) views of [B, L, H*P] storage."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def bert(grad):
        t = torch.randn(B, L, H, P, device="cuda", dtype=torch.bfloat16, generator=gen).permute(0, 2, 1, 3)
        return t.requires_grad_(grad)

    return bert(True), bert(True), bert(True), bert(False)


def _compile_one(job):
    """Worker: run one configuration once at the benchmark's sizes (fills Triton's cache)."""
    setup, direction, config = job
    try:
        q, k, v, do = inputs(**setup)
        args = dict(scale=setup["P"] ** -0.5, dropout_p=DROPOUT, seed=SEED, offset=0)
        if direction == "forward":
            attention_forward(q, k, v, **args, **config)
        else:
            o, lse = attention_forward(q, k, v, **args)
            attention_backward(do, q, k, v, o, lse, **args, **config)
        torch.cuda.synchronize()
        return None
    except Exception as error:  # noqa: BLE001 - an out-of-resources config is a result, reported
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def precompile(jobs):
    context = multiprocessing.get_context("spawn")
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 16))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(_compile_one, jobs))


@triton.jit
def _philox_count_kernel(count_ptr, n, seed, p, threshold, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                         CHEAP: tl.constexpr):
    # count_ptr: (programs,) int32; each program tests ITERS*BLOCK consecutive indices
    start = tl.program_id(0) * (BLOCK * ITERS)
    kept = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        idx = start + i * BLOCK + tl.arange(0, BLOCK)
        if CHEAP:
            keep = _philox_keep(seed, 0, idx, threshold)
        else:
            keep = dropout_keep(seed, 0, idx, p)
        kept += (keep & (idx < n)).to(tl.int32)
    tl.store(count_ptr + tl.program_id(0), tl.sum(kept, 0))


def philox_floor(n: int) -> dict:
    """ms of one mask pass over n elements: kernels.philox.dropout_keep and the kernels' _philox_keep."""
    block, iters = 1024, 8
    counts = torch.empty(triton.cdiv(n, block * iters), device="cuda", dtype=torch.int32)
    result = {}
    for name, cheap in (("dropout_keep_ms", False), ("philox_keep_ms", True)):
        run = lambda: _philox_count_kernel[(counts.numel(),)](counts, n, SEED, DROPOUT, keep_threshold(DROPOUT),
                                                              BLOCK=block, ITERS=iters, CHEAP=cheap)
        result[name] = median_ms(run)
        result["kept_fraction"] = counts.sum().item() / n
    return result


def eager_chain(q, k, v, scale):
    s = torch.einsum("bhjp,bhkp->bhjk", q, k) * scale
    return torch.einsum("bhjk,bhkp->bhjp", torch.nn.functional.dropout(torch.softmax(s, -1), DROPOUT), v)


def sdpa_backend_names(fn) -> list[str]:
    """Names of the attention kernels one call of ``fn`` launched (from the profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    keys = ("flash", "fmha", "efficient", "cudnn", "attention", "mem_eff")
    return sorted(n[:90] for n in names if any(key in n.lower() for key in keys))


def bench_setup(setup, config_mode):
    B, H, L, P = setup["B"], setup["H"], setup["L"], setup["P"]
    scale = P**-0.5
    q, k, v, do = inputs(B, H, L, P)
    args = dict(scale=scale, dropout_p=DROPOUT, seed=SEED, offset=0)
    result = dict(dims=setup, layout="q, k, v, dO stored (b, j, h, p) = [B, L, H*P]",
                  flop_forward=4 * B * H * L * L * P, flop_backward=10 * B * H * L * L * P)

    # --- this kernel: sweep forward and backward knobs separately
    if config_mode == "all":
        fwd_configs, bwd_configs = attention_configs(P, "forward"), attention_configs(P, "backward")
    else:
        fwd_configs, bwd_configs = [default_config(P, "forward")], [default_config(P, "backward")]
    jobs = [(setup, "forward", c) for c in fwd_configs] + [(setup, "backward", c) for c in bwd_configs]
    errors = precompile(jobs)
    o_default, lse_default = attention_forward(q, k, v, **args)
    dq_default = attention_backward(do, q, k, v, o_default, lse_default, **args)
    sweep = {"forward": [], "backward": []}
    for (_, direction, config), error in zip(jobs, errors):
        row = dict(config=config)
        if error is None:
            try:
                if direction == "forward":
                    o, _ = attention_forward(q, k, v, **args, **config)
                    row["rel_diff_vs_default"] = relative_error(o, o_default)
                    row["ms"] = gpu_ms(lambda: attention_forward(q, k, v, **args, **config))
                else:
                    grads = attention_backward(do, q, k, v, o_default, lse_default, **args, **config)
                    row["rel_diff_vs_default"] = max(relative_error(g, d) for g, d in zip(grads, dq_default))
                    row["ms"] = gpu_ms(lambda: attention_backward(do, q, k, v, o_default, lse_default,
                                                                  **args, **config))
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if error is not None:
            row["error"] = error
        sweep[direction].append(row)
    best = {d: min((r for r in rows if "ms" in r and r["rel_diff_vs_default"] < 2e-2), key=lambda r: r["ms"])
            for d, rows in sweep.items()}
    ours = lambda fc, bc: fused_attention(q, k, v, **args, forward_config=fc, backward_config=bc).backward(do)
    result["fused"] = dict(
        best_forward=best["forward"], best_backward=best["backward"],
        fwd_bwd=timed(lambda: ours(best["forward"]["config"], best["backward"]["config"]), [q, k, v]),
        default_fwd_bwd=timed(lambda: ours(None, None), [q, k, v]),
        forward_ms=best["forward"]["ms"], sweep=sweep)

    # --- PyTorch SDPA, each backend forced, and PyTorch's own choice
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT, scale=scale)
    sdpa_rows = {}
    for name, backend in [("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("math", SDPBackend.MATH)]:
        row = {}
        try:
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                row["kernels"] = sdpa_backend_names(lambda: sdpa().backward(do))
                row["fwd_bwd"] = timed(lambda: sdpa().backward(do), [q, k, v])
                with torch.no_grad():
                    row["forward_ms"] = gpu_ms(sdpa)
        except Exception as exc:  # noqa: BLE001 - a backend that refuses these inputs is reported
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        sdpa_rows[name] = row
    result["sdpa"] = sdpa_rows

    # --- the unfused eager chain
    result["eager"] = dict(fwd_bwd=timed(lambda: eager_chain(q, k, v, scale).backward(do), [q, k, v]))
    with torch.no_grad():
        result["eager"]["forward_ms"] = gpu_ms(lambda: eager_chain(q, k, v, scale))

    result["philox_floor"] = philox_floor(B * H * L * L)

    # --- without dropout (no mask generation): what the rest of each implementation costs
    no_drop = dict(args, dropout_p=0.0)
    fc, bc = best["forward"]["config"], best["backward"]["config"]
    result["no_dropout"] = dict(
        fused_fwd_bwd_ms=gpu_ms(lambda: fused_attention(q, k, v, **no_drop, forward_config=fc,
                                                        backward_config=bc).backward(do), [q, k, v]),
        sdpa_default_fwd_bwd_ms=gpu_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, scale=scale).backward(do), [q, k, v]))
    fused_ms = result["fused"]["fwd_bwd"]["ms"]
    fastest_sdpa = min((r["fwd_bwd"]["ms"], n) for n, r in sdpa_rows.items() if "fwd_bwd" in r)
    result["ratios"] = dict(sdpa_best_over_fused=fastest_sdpa[0] / fused_ms, sdpa_best_backend=fastest_sdpa[1],
                            sdpa_default_over_fused=sdpa_rows["default"]["fwd_bwd"]["ms"] / fused_ms
                            if "fwd_bwd" in sdpa_rows["default"] else None,
                            eager_over_fused=result["eager"]["fwd_bwd"]["ms"] / fused_ms)
    return result


def markdown(report) -> str:
    lines = [f"# Fused attention, forward + backward (bf16, dropout {DROPOUT})", "",
             f"Device: {report['device']}; torch {report['torch']}, triton {report['triton']}; {report['date']}.",
             "Q/K/V/dO stored [B, L, H*P] = (b, j, h, p), passed as (b, h, j, p) views. Medians of "
             "triton.testing.do_bench in ms, L2 flushed between repetitions. 'GPU ms': the call replayed from a "
             "CUDA graph (no host gaps between its kernels; ratios and TFLOP/s use it). 'launch ms': the call "
             "launched from Python, host overhead included. TFLOP/s count 14*B*H*L*L*P flop for fwd+bwd.", ""]
    for r in report["setups"]:
        d, f = r["dims"], r["fused"]
        total_flop = r["flop_forward"] + r["flop_backward"]
        base = f["fwd_bwd"]["ms"]

        def row(name, fwd_bwd, forward_ms):
            return (f"| {name} | {fwd_bwd['ms']:.4f} | {fwd_bwd['launch_ms']:.4f} | "
                    + ("" if forward_ms is None else f"{forward_ms:.4f}")
                    + f" | {total_flop / fwd_bwd['ms'] / 1e9:.0f} | {fwd_bwd['ms'] / base:.2f} |")

        lines += [f"## B={d['B']}, H={d['H']}, L={d['L']}, P={d['P']}", "",
                  "| implementation | fwd+bwd GPU ms | fwd+bwd launch ms | fwd GPU ms | TFLOP/s | time / fused |",
                  "|---|---|---|---|---|---|",
                  row("fused (this kernel, best knobs)", f["fwd_bwd"], f["forward_ms"]),
                  row("fused, default knobs", f["default_fwd_bwd"], None)]
        for name, sdpa in r["sdpa"].items():
            if "fwd_bwd" in sdpa:
                kernels = ", ".join(k.split("(")[0][:60] for k in sdpa["kernels"][:2]) or "no attention kernel named"
                lines.append(row(f"SDPA {name} ({kernels})", sdpa["fwd_bwd"], sdpa["forward_ms"]))
            else:
                lines.append(f"| SDPA {name} | refused: {sdpa['error'][:80]} | | | | |")
        lines.append(row("eager chain (einsum, scale, softmax, dropout, einsum)", r["eager"]["fwd_bwd"],
                         r["eager"]["forward_ms"]))
        fl, nd = r["philox_floor"], r["no_dropout"]
        lines += ["", f"Best forward knobs {f['best_forward']['config']} ({f['best_forward']['ms']:.4f} ms); "
                  f"best backward knobs {f['best_backward']['config']} ({f['best_backward']['ms']:.4f} ms).", "",
                  f"Philox floor: one pass of mask generation over B*H*L*L = {d['B'] * d['H'] * d['L'] ** 2} "
                  f"elements (one Philox-4x32-10 per element, the project's convention) takes "
                  f"{fl['dropout_keep_ms']:.4f} ms with kernels.philox.dropout_keep and "
                  f"{fl['philox_keep_ms']:.4f} ms with the kernels' bit-identical _philox_keep (kept fraction "
                  f"{fl['kept_fraction']:.4f}); the fused forward and backward each regenerate the mask once, "
                  f"so about {2 * fl['philox_keep_ms']:.4f} ms of the fused time is mask generation.",
                  f"Without dropout (GPU ms): fused {nd['fused_fwd_bwd_ms']:.4f} (same knobs), SDPA default "
                  f"{nd['sdpa_default_fwd_bwd_ms']:.4f}.", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--configs", choices=("all", "default"), default="all")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("No CUDA GPU: nothing measured, nothing written.")
        return 1
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  dropout_p=DROPOUT, dtype="bfloat16", setups=[])
    for setup in SETUPS:
        report["setups"].append(bench_setup(setup, args.configs))
        print(json.dumps({k: v for k, v in report["setups"][-1].items() if k != "fused"}, indent=1), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(report, indent=1))
    (out / "attention.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
