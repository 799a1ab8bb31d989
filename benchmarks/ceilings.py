"""Print the GPU's facts and its measured ceilings; write them to <out>/ceilings.md and ceilings.json.

    PYTHONPATH=$PWD python3 benchmarks/ceilings.py [--db tuning.db] [--out benchmarks/results] [--force]

Ceilings are measured once per device and kept in the tuning DB (``harness.bench.measure_ceilings``);
``--force`` measures again.  Without a GPU it says why and exits with status 1, writing nothing.
"""
import argparse
import datetime
import json
import sys
from pathlib import Path

from datamove.harness.bench import measure_ceilings
from datamove.kernels.device import NoDevice, query_device, versions
from datamove.harness.tuning_db import TuningDB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="tuning.db", help="tuning database (SQLite) path")
    parser.add_argument("--out", default="benchmarks/results", help="folder for ceilings.md / ceilings.json")
    parser.add_argument("--force", action="store_true", help="measure again even if the DB has this device's ceilings")
    args = parser.parse_args()

    facts = query_device()
    if isinstance(facts, NoDevice):
        print(f"No CUDA device ({facts.reason}): nothing measured, nothing written.")
        return 1
    with TuningDB(args.db) as db:
        ceilings = measure_ceilings(db, force=args.force)

    copy, gemm = ceilings.details["copy"], ceilings.details["gemm"]
    rows = [
        ("device", facts.name),
        ("compute capability", "%d.%d" % facts.compute_capability),
        ("SMs", facts.sm_count),
        ("L2", f"{facts.l2_bytes / 2**20:.1f} MiB"),
        ("memory", f"{facts.memory_bytes / 2**30:.1f} GiB"),
        ("max shared memory per block (opt-in)", f"{facts.shared_memory_per_block_optin / 1024:.0f} KiB"),
        ("memory clock x bus", f"{facts.memory_clock_hz / 1e6:.0f} MHz x {facts.memory_bus_bits} bit"),
        ("max SM clock", f"{facts.sm_clock_hz / 1e6:.0f} MHz"),
        ("peak memory bandwidth (2 x clock x bus)", f"{facts.peak_memory_bytes_per_s / 1e9:.0f} GB/s"),
        ("peak dense bf16 (SMs x max clock x rate)",
         "unknown" if facts.peak_bf16_flops is None else f"{facts.peak_bf16_flops / 1e12:.0f} TFLOP/s"),
        ("measured copy (read + write)",
         f"{ceilings.copy_bytes_per_s / 1e9:.0f} GB/s = {ceilings.copy_bytes_per_s / facts.peak_memory_bytes_per_s:.1%}"
         f" of peak; median {copy['median_ms']:.4f} ms (q20 {copy['q20_ms']:.4f}, q80 {copy['q80_ms']:.4f}, "
         f"n {copy['n']}) for {copy['bytes_read_plus_written'] / 2**30:.0f} GiB"),
        ("measured bf16 GEMM (random normal data)",
         f"{ceilings.gemm_flop_per_s / 1e12:.0f} TFLOP/s"
         + ("" if facts.peak_bf16_flops is None else f" = {ceilings.gemm_flop_per_s / facts.peak_bf16_flops:.1%} of peak")
         + f"; median {gemm['median_ms']:.4f} ms (q20 {gemm['q20_ms']:.4f}, q80 {gemm['q80_ms']:.4f}, n {gemm['n']})"
         f" for {gemm['size']}^3"),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions().items())),
        ("ceilings measured", datetime.datetime.fromtimestamp(ceilings.timestamp, datetime.UTC).isoformat(timespec="seconds")),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    (out / "ceilings.md").write_text(
        "# Device facts and measured ceilings\n\n"
        "Written by `benchmarks/ceilings.py`. Copy: `dst.copy_(src)`, bytes read + written over the median time "
        "(CUDA events). GEMM: `torch.mm` bf16, random normal inputs, 2 n^3 flop over the median time. "
        "Peaks use the maximum SM clock the device reports, so they are upper bounds.\n\n"
        f"| | |\n| --- | --- |\n{table}\n"
    )
    (out / "ceilings.json").write_text(json.dumps({
        "facts": facts.to_dict(),
        "ceilings": {"copy_bytes_per_s": ceilings.copy_bytes_per_s, "gemm_flop_per_s": ceilings.gemm_flop_per_s,
                     "details": ceilings.details, "versions": ceilings.versions, "timestamp": ceilings.timestamp},
        "versions": versions(),
    }, indent=2) + "\n")
    print(f"wrote {out / 'ceilings.md'} and {out / 'ceilings.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
