"""Where the host's time goes in one call of the tuned layer: Python's profiler over repeated fwd+bwd calls.

    PYTHONPATH=$PWD python3 benchmarks/host_time.py --artifact out/<dir> [--calls 50] [--top 30]

For the layer replaying its CUDA graphs and for the same with ``cuda_graphs=False`` (every kernel
launched): host time per fwd+bwd call (``time.perf_counter``; the device synchronised only at the
end, so a host slower than the kernels shows here) and the functions taking the most of it
(``cProfile``, own time per call, µs).  The profiler's own overhead inflates the split, not the
first number, which is timed without it.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

from datamove.export import load_layer
from datamove.harness.bench import require_cuda


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    require_cuda("benchmarks/host_time.py")
    for graphs in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layer = load_layer(args.artifact, allow_mismatch=True, cuda_graphs=graphs).train()
        program = layer.program(True)  # the layer's first activation, in its torch order
        x = torch.randn(program.torch_shapes[program.interface.activations[0]], device="cuda", dtype=layer.dtype,
                        requires_grad=True)
        dy = torch.randn_like(x)

        def step():  # as in a training loop: gradients set to None, then accumulated into by the backward
            layer.zero_grad(set_to_none=True)
            layer(x).backward(dy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(args.calls):
            step()
        torch.cuda.synchronize()
        per_call = (time.perf_counter() - started) * 1e3 / args.calls
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            step()
        torch.cuda.synchronize()
        profiler.disable()
        print(f"\n## cuda_graphs={graphs}: {per_call:.3f} ms host per fwd+bwd (unprofiled)\n")
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
        print("| own us/call | total us/call | calls/call | function |\n|---|---|---|---|")
        for (file, line, name), (_, ncalls, own, total, _) in rows:
            print(f"| {own * 1e6 / args.calls:.1f} | {total * 1e6 / args.calls:.1f} | {ncalls / args.calls:g} | "
                  f"{Path(file).name}:{line} {name} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
