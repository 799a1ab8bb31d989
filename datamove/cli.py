"""``optimize-layer``: the command-line entry point (the main job, or ``--analyze`` alone).

Only the standard library is imported at module level: the datamove modules (DaCe's import alone
takes a second or two) are imported inside ``main``'s Ctrl-C handler, so that Ctrl-C while they
load ends in one line too."""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import warnings
from pathlib import Path

HELP = "optimize-layer --help lists the options"
MAX_DIM = 2**31 - 1  # a dim's largest size: kernels take sizes as int32 arguments


class _Once(argparse.Action):
    """An option given at most once (argparse keeps the last of several: ``--dims B=3 --dims L=5``
    ran at the spec's B without a word)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice: give all its values in one, e.g. {option_string} "
                         f"{getattr(namespace, self.dest)},{values}")
        setattr(namespace, self.dest, values)


class UsageError(Exception):
    """A bad command line or option value: printed in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage + error (and no SystemExit)
        raise UsageError(f"{message} ({HELP})")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of GPUs, e.g. --gpus 2; "
                                         "leave it out for all GPUs")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # also nan
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds >= 0, e.g. --budget-s 600")
    return value


def _dims(text: str | None) -> list[dict[str, int]]:
    """``--dims``: every shape to tune, e.g. ``B=8,L=128|512`` -> [{B: 8, L: 128}, {B: 8, L: 512}]
    (``|`` separates alternatives; every combination, the first written first)."""
    from datamove.dataflow.spec import SpecError, parse_assignments

    if not text:
        return [{}]
    choices = {}
    for name, value in parse_assignments(text, "--dims").items():
        try:
            values = [int(v) for v in value.split("|")]
        except ValueError:
            raise SpecError(f"--dims: {name}={value}: expected an integer or integers separated by '|', "
                            f"e.g. --dims '{name}=128|512' (quoted for the shell)") from None
        if len(set(values)) != len(values):
            raise SpecError(f"--dims: {name}={value}: each value given once")
        choices[name] = values
    bad = [f"{name}={v}" for name, values in choices.items() for v in values if v < 1]
    if bad:
        raise SpecError(f"--dims: {', '.join(bad)}: dims must be positive integers")
    huge = [f"{name}={v}" for name, values in choices.items() for v in values if v > MAX_DIM]
    if huge:
        raise SpecError(f"--dims: {', '.join(huge)}: a dim must be at most {MAX_DIM} (2**31 - 1, what a kernel's "
                        "index arguments hold)")
    return [dict(zip(choices, combination)) for combination in itertools.product(*choices.values())]


def build_parser() -> argparse.ArgumentParser:
    from datamove.dtypes import BF16, FP16

    choices = (BF16, FP16)  # what --dtype offers, by short name (float32: the CPU checks', not tuned)
    parser = _Parser(
        prog="optimize-layer",
        description="Optimize a transformer layer written as a NumPy spec (after Ivanov et al., 'Data Movement Is "
                    "All You Need'): analysis, fusion, tuning (on a GPU), layout selection, export of the tuned "
                    "layer as a PyTorch module, and an MUE / roofline report.")
    parser.add_argument("spec", help="spec file, e.g. configs/bert.py")
    parser.add_argument("--out", type=Path, help="output folder (default: out/<spec>-<dims>-<dtype>-<device>)")
    parser.add_argument("--dims", action=_Once, help="dim values, e.g. B=8,L=512 (default: the spec's); alternatives of the batch "
                                         "and sequence dims tune one plan per combination into one artifact, "
                                         "e.g. 'B=8,L=128|256|512' (quoted: the shell reads | as a pipe)")
    parser.add_argument("--set", dest="options", action=_Once, help="spec options, e.g. activation=gelu (the default output "
                                                      "folder's name includes them)")
    parser.add_argument("--dtype", choices=sorted(p.short for p in choices), default=BF16.short,
                        help="precision of the tuned layer")
    parser.add_argument("--budget-s", type=_seconds, default=600.0,
                        help="tuning time limit in seconds (GPU only; a rerun resumes from the tuning database)")
    parser.add_argument("--db", type=Path, help="tuning database (default: ~/.cache/datamove/tuning.db)")
    parser.add_argument("--gpus", type=_positive_int, help="GPUs to tune on, one measuring process each (default: all GPUs "
                                                 "of the model of GPU 0)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="measure again the variants the tuning database records as failed (crashed, hung, "
                             "too slow, did not compile) instead of skipping them")
    # measure what the tuning's rules prune too: the reference benchmarks/tuning_cost.py compares the
    # default plan with (far longer than the default; not for users, so not in the help)
    parser.add_argument("--exhaustive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cost-model-device", default="H100",
                        help="device whose figures the cost model uses where nothing is measured (default: H100)")
    parser.add_argument("--analyze", action="store_true",
                        help="only print every training operator's class, phase, flop and minimal I/O (forward and "
                             "derived backward), the fused operators, and unfused vs fused data movement")
    parser.add_argument("--json", type=Path, help="with --analyze: also write the analysis as JSON to this file")
    return parser


def _analyze(args) -> int:
    from datamove.dataflow.pipeline import analyse_spec
    from datamove.dataflow.spec import SpecError, parse_assignments

    started = time.perf_counter()
    shapes = _dims(args.dims)
    if len(shapes) > 1:
        raise SpecError(f"--analyze: one shape at a time, not {len(shapes)} (--dims {args.dims})")
    result = analyse_spec(args.spec, shapes[0], parse_assignments(args.options or "", "--set"))
    print(result.table)
    print(f"\nanalysed {args.spec} in {time.perf_counter() - started:.1f} s (no GPU needed: counts are exact)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(result.json, indent=1))
        tmp.replace(args.json)
        print(f"wrote {args.json}")
    return 0


def _file_place(path: Path, flag: str) -> None:
    """``path`` can be a file: not a folder, no file where a folder above it must be."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: a folder: name a file, e.g. {flag} {path / 'x'}")
    place = path.absolute().parent
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise UsageError(f"{flag} {path}: {place} is a file, not a folder: name a file elsewhere")


def check_arguments(args) -> None:
    """What can be checked before the analysis starts (each a one-line ``UsageError``,
    ``SpecError`` or ``OutputError``), so that a bad option never waits for the long stages."""
    from datamove.dataflow.spec import SpecError
    from datamove.layouts.cost_model import DEVICES, device_figures
    from datamove.output import check_default_parent, check_out

    spec = Path(args.spec)
    if spec.is_dir():
        raise SpecError(f"{spec}: a folder, not a spec file: give the spec's .py file, e.g. configs/bert.py")
    if not spec.exists():
        raise SpecError(f"{spec}: no such spec file")
    try:
        device_figures(args.cost_model_device)
    except KeyError:
        raise UsageError(f"--cost-model-device {args.cost_model_device}: no cost-model figures for this device; "
                         f"known: {', '.join(DEVICES)}") from None
    if args.json is not None and not args.analyze:
        raise UsageError(f"--json {args.json}: only with --analyze (the main job writes report.json into --out)")
    if args.json is not None:
        _file_place(args.json, "--json")
    if args.db is not None:
        _file_place(args.db, "--db")
    if not args.analyze:
        if args.out is not None:
            check_out(args.out)
        else:
            check_default_parent(Path("out"))
    if args.gpus is not None and not args.analyze:
        _check_gpus(args.gpus)


def _check_gpus(gpus: int) -> None:
    """``--gpus`` within the GPUs of GPU 0's model here (without a GPU it is unused, as the job says)."""
    from datamove.harness.bench import gpu_ids
    from datamove.kernels.device import DeviceFacts, query_device

    facts = query_device()
    if isinstance(facts, DeviceFacts) and gpus > len(here := gpu_ids(facts.name)):
        raise UsageError(f"--gpus {gpus}: this host has {len(here)} {facts.name} GPU(s) to measure on; "
                         f"give at most {len(here)}, or leave --gpus out for all of them")


def main(argv: list[str] | None = None) -> int:
    """The command line; every bad input ends in one line on stderr and exit status 2, Ctrl-C (also
    while the datamove modules load) in "optimize-layer: interrupted" and 130 (the output folder as
    it was: ``datamove.output``)."""
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("optimize-layer: interrupted", file=sys.stderr)
        return 130


def _run(argv: list[str] | None) -> int:
    """``main`` inside its Ctrl-C handler: the datamove modules imported, the options checked, then
    the analysis or the job."""
    from datamove.dataflow.spec import SpecError, parse_assignments
    from datamove.dtypes import parse as parse_dtype
    from datamove.harness.tuning_db import TuningDBError
    from datamove.layouts.plan import PlanNotRunnable
    from datamove.output import OutputError

    try:
        args = build_parser().parse_args(argv)
        warnings.filterwarnings("ignore", module="dace")
        check_arguments(args)
        dims = _dims(args.dims)
        options = parse_assignments(args.options or "", "--set")
        if args.analyze:
            return _analyze(args)
        from datamove.job import JobOptions, run_job

        return run_job(JobOptions(spec=Path(args.spec), dims=dims, options=options, dtype=parse_dtype(args.dtype),
                                  out=args.out, budget_s=args.budget_s, db=args.db,
                                  cost_model_device=args.cost_model_device, gpus=args.gpus,
                                  retry_failed=args.retry_failed, exhaustive=args.exhaustive))
    except (SpecError, TuningDBError, UsageError, OutputError, PlanNotRunnable) as err:
        print(f"optimize-layer: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
