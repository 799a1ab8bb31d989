"""Where the fused attention's time goes: each pass alone, with and without dropout, per tile config.

    PYTHONPATH=$PWD python3 benchmarks/attention_breakdown.py [--out benchmarks/results]

BERT-large attention (B=8, H=16, L=512, P=64, bf16, Q/K/V/dO stored [B, L, H*P] and passed as
(b, h, j, p) views). For each forward knob configuration: ``attention_forward`` without dropout,
with dropout 0.1 drawing the mask ("regenerate"), and drawing and saving it ("saved"). For each
backward configuration and dQ mode: ``attention_backward`` (preprocess, dK/dV, dQ kernels and the
dQ cast) without dropout, regenerating the mask, and reading the saved one. Differences between
the columns place the cost of the mask. Medians of ``harness.bench.time_cuda`` (L2 flushed, CUDA
graph replay: GPU time) in ms; a configuration that fails to compile or launch shows its error.
Not checked against float64 here (``benchmarks/attention.py`` and the tests do that). Writes
``attention_breakdown.md`` under ``--out``; needs a GPU.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from datamove.kernels.attention import attention_backward, attention_forward, new_saved_mask
from datamove.harness.bench import require_cuda, time_cuda, utc_stamp
from datamove.kernels.device import versions

B, H, L, P = 8, 16, 512, 64
DROPOUT = 0.1
FORWARD_TILES = [(64, 128, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
                 (64, 128, 4, 4), (128, 64, 4, 3)]  # (block_j, block_k, num_warps, num_stages)
BACKWARD_TILES = [(64, 64, 4, 3), (32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 4, 5), (64, 128, 4, 3), (64, 128, 8, 3),
                  (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4), (32, 64, 4, 4), (128, 32, 4, 3)]


def _median_ms(fn) -> str:
    try:
        return f"{time_cuda(fn, warmup_ms=5, rep_ms=25).median_ms:.4f}"
    except Exception as error:  # a config out of resources is reported, not fatal
        return f"{type(error).__name__}: {str(error)[:60]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    require_cuda("benchmarks/attention_breakdown.py")
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, L, H * P, device="cuda", dtype=torch.bfloat16).view(B, L, H, P).permute(0, 2, 1, 3)
                   for _ in range(4))
    scale = P ** -0.5
    saved = new_saved_mask(q, k, dropout_p=DROPOUT)
    lines = ["| pass | block_j | block_k | warps | stages | dQ mode | no dropout | regenerate | saved |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for bj, bk, warps, stages in FORWARD_TILES:
        knobs = dict(block_j=bj, block_k=bk, num_warps=warps, num_stages=stages)
        times = [_median_ms(lambda: attention_forward(q, k, v, scale=scale, dropout_p=0.0, **knobs)),
                 _median_ms(lambda: attention_forward(q, k, v, scale=scale, dropout_p=DROPOUT, seed=1, **knobs)),
                 _median_ms(lambda: attention_forward(q, k, v, scale=scale, dropout_p=DROPOUT, seed=1, saved_mask=saved,
                                                      **knobs))]
        lines.append(f"| forward | {bj} | {bk} | {warps} | {stages} | | " + " | ".join(times) + " |")
        print(lines[-1], flush=True)
    o, lse = attention_forward(q, k, v, scale=scale, dropout_p=DROPOUT, seed=1, saved_mask=saved)
    for (bj, bk, warps, stages), dq_mode in itertools.product(BACKWARD_TILES, ("atomic", "split")):
        knobs = dict(block_j=bj, block_k=bk, num_warps=warps, num_stages=stages, dq_mode=dq_mode)
        times = [_median_ms(lambda: attention_backward(do, q, k, v, o, lse, scale=scale, dropout_p=0.0, **knobs)),
                 _median_ms(lambda: attention_backward(do, q, k, v, o, lse, scale=scale, dropout_p=DROPOUT, seed=1,
                                                       dropout_mask="regenerate", **knobs)),
                 _median_ms(lambda: attention_backward(do, q, k, v, o, lse, scale=scale, dropout_p=DROPOUT, seed=1,
                                                       dropout_mask="saved", saved_mask=saved, **knobs))]
        lines.append(f"| backward | {bj} | {bk} | {warps} | {stages} | {dq_mode} | " + " | ".join(times) + " |")
        print(lines[-1], flush=True)
    stamp = utc_stamp()
    header = (f"# Fused attention, pass by pass (B={B}, H={H}, L={L}, P={P}, bf16, dropout {DROPOUT})\n\n"
              f"{stamp}, {torch.cuda.get_device_name()}, {versions()}. Medians in ms (GPU time, L2 flushed).\n\n")
    with open(f"{args.out}/attention_breakdown.md", "w") as out:
        out.write(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
