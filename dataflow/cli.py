"""``optimize-layer``: the command-line entry point."""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from dataflow.spec import SpecError, parse_assignments


def _dims(text: str | None) -> dict[str, int]:
    if not text:
        return {}
    dims = {}
    for name, value in parse_assignments(text, "--dims").items():
        try:
            dims[name] = int(value)
        except ValueError:
            raise SpecError(f"--dims: {name}={value} is not an integer") from None
    return dims


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optimize-layer",
        description="Analyse a transformer layer written as a NumPy spec (after Ivanov et al., "
                    "'Data Movement Is All You Need').")
    parser.add_argument("spec", help="spec file, e.g. configs/bert.py")
    parser.add_argument("--analyze", action="store_true", required=True,
                        help="print every training operator's class, phase, flop and minimal I/O (forward and "
                             "derived backward), the fused operators, and unfused vs fused data movement")
    parser.add_argument("--dims", help="dim values, e.g. B=8,L=512 (default: the spec's)")
    parser.add_argument("--set", dest="options", help="spec options, e.g. activation=gelu")
    parser.add_argument("--json", type=Path, help="also write the analysis as JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", module="dace")
    try:
        from dataflow.pipeline import analyse_spec

        started = time.perf_counter()
        options = parse_assignments(args.options or "", "--set")
        result = analyse_spec(args.spec, _dims(args.dims), options)
    except SpecError as err:
        print(f"optimize-layer: error: {err}", file=sys.stderr)
        return 2
    print(result.table)
    print(f"\nanalysed {args.spec} in {time.perf_counter() - started:.1f} s (no GPU needed: counts are exact)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(result.json, indent=1))
        tmp.replace(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
