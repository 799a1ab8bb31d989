"""Grouped-query attention at Llama sizes: the fused kernels reading K/V over the K/V heads
(``groups`` = H / KV) against the same kernels on K/V repeated over the query heads first (as the
plan ran Llama before: the repeat, the attention over H heads, the sum of dK/dV over each group),
and PyTorch's SDPA (``enable_gqa``), bf16, causal, no dropout:

    PYTHONPATH=$PWD python3 benchmarks/attention_gqa.py [--setups B=4,H=32,KV=8,L=2048,P=64 ...]
        [--all-configs] [--json FILE]

Per setup and pass, every knob configuration of ``attention_configs`` (``--all-configs``; else
the default and the configurations with 3 stages), each timed with ``harness.bench.time_cuda``
(median, L2 flushed, replayed from a CUDA graph), the grouped one checked against the repeated
one (the same arithmetic per query head, so bitwise but for dK/dV's sum order).  Prints the
default and the fastest configuration of each, the repeat and the group sums timed apart.
"""
from __future__ import annotations

import argparse
import json

import torch

from datamove.harness.bench import require_cuda, time_cuda
from datamove.kernels.attention import attention_backward, attention_configs, attention_forward, default_config
from datamove.kernels.device import versions

SETUPS = ["B=4,H=32,KV=8,L=2048,P=64", "B=2,H=32,KV=8,L=2048,P=128"]


def parse(setup: str) -> dict:
    return {k: int(v) for k, v in (part.split("=") for part in setup.split(","))}


def ms(fn) -> float:
    return time_cuda(fn, cuda_graph=True).median_ms


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_setup(s: dict, all_configs: bool) -> dict:
    B, H, KV, L, P = s["B"], s["H"], s["KV"], s["L"], s["P"]
    G = H // KV
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(B, H, L, P, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, KV, L, P, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    kr, vr = (t.repeat_interleave(G, dim=1) for t in (k, v))
    args = dict(scale=P ** -0.5, causal=True)
    result = {"setup": s, "forward": {}, "backward": {}}
    o_ref, lse_ref = attention_forward(q, kr, vr, **args)
    grads_ref = attention_backward(do, q, kr, vr, o_ref, lse_ref, **args)
    dk_ref, dv_ref = (g.view(B, KV, G, L, P).float().sum(2) for g in grads_ref[1:])

    def pick(direction):
        configs = attention_configs(P, direction)
        default = default_config(P, direction)
        if not all_configs:
            configs = [c for c in configs if c["num_stages"] == 3 or c == default]
        if direction == "backward":
            configs = [c for c in configs if c["dropout_mask"] == "regenerate"]
        return configs, default

    for direction in ("forward", "backward"):
        configs, default = pick(direction)
        for name, kk, vv in (("grouped", k, v), ("repeated", kr, vr)):
            rows = []
            for c in configs:
                try:
                    if direction == "forward":
                        fn = lambda c=c: attention_forward(q, kk, vv, **args, **c)  # noqa: E731
                        out = fn()[0]
                        err = rel(out, o_ref)
                    else:
                        fn = lambda c=c: attention_backward(do, q, kk, vv, o_ref, lse_ref, **args, **c)  # noqa: E731
                        dq, dk, dv = fn()
                        if name == "grouped":
                            err = max(rel(dq, grads_ref[0]), rel(dk, dk_ref), rel(dv, dv_ref))
                        else:
                            err = max(rel(dq, grads_ref[0]), rel(dk, grads_ref[1]), rel(dv, grads_ref[2]))
                    rows.append(dict(config=c, ms=ms(fn), error=err, default=c == default))
                except Exception as exc:  # noqa: BLE001 (a configuration that fails to build is reported)
                    rows.append(dict(config=c, ms=None, error=None, failed=repr(exc)[:200], default=c == default))
            result[direction][name] = rows
    result["repeat_ms"] = ms(lambda: (k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)))
    result["group_sum_ms"] = ms(lambda: tuple(g.view(B, KV, G, L, P).sum(2) for g in grads_ref[1:]))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    result["sdpa_gqa_forward_ms"] = ms(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))

    def sdpa_fwd_bwd():
        for t in (qs, ks, vs):
            t.grad = None
        sdpa(qs, ks, vs, is_causal=True, enable_gqa=True).backward(do)
    result["sdpa_gqa_fwd_bwd_ms"] = ms(sdpa_fwd_bwd)
    return result


def summary(result: dict) -> list[str]:
    s = result["setup"]
    lines = [f"## B={s['B']} H={s['H']} KV={s['KV']} L={s['L']} P={s['P']} bf16 causal"]
    for direction in ("forward", "backward"):
        for name, rows in result[direction].items():
            ok = [r for r in rows if r["ms"] is not None]
            best = min(ok, key=lambda r: r["ms"])
            default = next((r for r in ok if r["default"]), None)
            worst = max(r["error"] for r in ok)
            failed = len(rows) - len(ok)
            lines.append(f"{direction:8s} {name:8s} default {default['ms'] if default else float('nan'):.4f} ms  "
                         f"best {best['ms']:.4f} ms {best['config']}  max rel.err {worst:.1e}  "
                         f"({len(ok)} configs{f', {failed} failed' if failed else ''})")
    lines.append(f"repeat of K and V {result['repeat_ms']:.4f} ms; dK/dV group sums {result['group_sum_ms']:.4f} ms; "
                 f"SDPA enable_gqa forward {result['sdpa_gqa_forward_ms']:.4f} ms, fwd+bwd {result['sdpa_gqa_fwd_bwd_ms']:.4f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=SETUPS)
    parser.add_argument("--all-configs", action="store_true")
    parser.add_argument("--json")
    a = parser.parse_args()
    require_cuda("benchmarks/attention_gqa.py")
    results = [run_setup(parse(s), a.all_configs) for s in a.setups]
    text = [f"# {torch.cuda.get_device_name()} {versions()}"] + [line for r in results for line in summary(r)]
    print("\n".join(text), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
