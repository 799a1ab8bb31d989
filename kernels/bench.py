"""Benchmark harness: CUDA-event timing with L2 flushes, and a resumable sweep over kernel variants.

``time_cuda`` times a callable on the GPU.  ``Sweep`` takes a list of ``Variant``s and, for each
one not yet in the tuning DB, builds it, checks it against its reference and times it, recording
'failed' / 'wrong' / 'ok' as it goes (each record committed on its own, so a sweep that is killed,
interrupted or out of time resumes where it stopped).  Without a GPU nothing is timed: variants are
built and checked through the Triton interpreter and recorded as 'checked', with no time.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

from kernels.device import DeviceFacts, NoDevice, query_device, versions
from kernels.tuning_db import Ceilings, Key, Record, TuningDB

# Calls whose GPU time is under this are replayed from a CUDA graph when ``cuda_graph=None``: the
# host's launch work (several microseconds per Triton launch, more for a callable that launches
# several kernels, as PyTorch eager sequences do) would otherwise be of the order of the GPU time
# and leave gaps inside the timed interval, the more so while other processes (``Sweep``'s compile
# workers) load the host's cores.  What is timed is GPU time.
GRAPH_BELOW_MS = 0.3
# Without an L2 flush, one graph replay holds enough back-to-back calls to last about this long,
# and the time per call is the replay's time over that count.
GRAPH_MIN_REPLAY_MS = 0.5
FLUSH_L2_FACTOR = 4  # the flush writes a buffer of 4x the L2 size between repetitions
MIN_REPS, MAX_REPS = 10, 10_000
REASON_CHARS = 4000  # failure reasons (Triton compile errors can be long) are kept up to this length

CPU_DEVICE = "cpu (triton interpreter)"  # the device column of records made without a GPU


@dataclass(frozen=True)
class Timing:
    """Per-call GPU time of a callable in ms: median and 20%/80% quantiles over ``n`` repetitions."""

    median_ms: float
    q20_ms: float
    q80_ms: float
    n: int
    cuda_graph: bool  # True: each repetition replayed a captured CUDA graph


@functools.cache
def _device_facts(index: int) -> DeviceFacts | NoDevice:
    return query_device(index)


@functools.cache
def _flush_buffer(index: int, nbytes: int):
    import torch

    return torch.empty(nbytes, dtype=torch.int8, device=torch.device("cuda", index))


def time_cuda(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 100.0, flush_l2: bool = True,
              cuda_graph: bool | None = None) -> Timing:
    """Time ``fn`` (which launches work on the current CUDA stream) with device events.

    ``fn`` runs once (compilation, loading), then for about ``warmup_ms`` untimed, then for about
    ``rep_ms`` timed repetitions (between ``MIN_REPS`` and ``MAX_REPS``), each between its own pair
    of events and, with ``flush_l2``, after writing a buffer of ``FLUSH_L2_FACTOR`` x the L2 size so
    that no repetition finds its inputs in L2.  ``cuda_graph``: True captures ``fn`` in a CUDA graph
    and times its replays; None does so when one call takes under ``GRAPH_BELOW_MS`` (falling back
    to plain launches if ``fn`` cannot be captured).  Without a flush, a replay holds as many calls
    as last ``GRAPH_MIN_REPLAY_MS`` and the time is divided among them.  Raises RuntimeError with
    no GPU: an interpreter's time is not a GPU time.
    """
    import torch

    from kernels.interpreter import interpreted

    if interpreted():
        raise RuntimeError("TRITON_INTERPRET=1: Triton kernels run on the CPU interpreter, nothing can be timed")
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    facts = _device_facts(index)
    if isinstance(facts, NoDevice):
        raise RuntimeError(f"no CUDA device, nothing can be timed: {facts.reason}")
    flush_buffer = _flush_buffer(index, FLUSH_L2_FACTOR * facts.l2_bytes) if flush_l2 else None

    def flush():
        if flush_buffer is not None:
            flush_buffer.zero_()

    def elapsed_ms(call, repeats: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

    fn()
    torch.cuda.synchronize()
    call_ms = elapsed_ms(fn, 5)
    use_graph = call_ms < GRAPH_BELOW_MS if cuda_graph is None else cuda_graph
    calls_per_rep = 1
    call = fn
    if use_graph:
        if not flush_l2:
            calls_per_rep = max(1, math.ceil(GRAPH_MIN_REPLAY_MS / max(call_ms, 1e-4)))
        try:
            call = _capture(fn, calls_per_rep)
        except Exception:
            if cuda_graph:
                raise
            use_graph, calls_per_rep, call = False, 1, fn

    def rep():
        flush()
        call()

    rep_cost_ms = max(elapsed_ms(rep, 3), 1e-4)
    for _ in range(max(1, int(warmup_ms / rep_cost_ms))):
        rep()
    n = min(MAX_REPS, max(MIN_REPS, int(rep_ms / rep_cost_ms)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for start, end in zip(starts, ends):
        flush()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) / calls_per_rep for s, e in zip(starts, ends)], dtype=torch.float64)
    q20, median, q80 = torch.quantile(times, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
    return Timing(median_ms=median, q20_ms=q20, q80_ms=q80, n=n * calls_per_rep, cuda_graph=use_graph)


def _capture(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """Capture ``calls`` back-to-back calls of ``fn`` in a CUDA graph; return its replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as CUDA graph capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay


class Variant(Protocol):
    """One kernel configuration to build, check and time.

    Key fields (the tuning-DB key, with the device and software versions): ``op`` (operator
    signature), ``dims`` (dim letter -> size), ``dtype``, ``layout`` (JSON value), ``knobs`` (JSON
    dict of tuning parameters).  ``bytes`` / ``flop``: what one ``run()`` must move / compute (None
    if not counted); stored with the time so that achieved rates can be read off the DB.
    """

    op: str
    dims: dict
    dtype: str
    layout: object
    knobs: dict
    bytes: int | None
    flop: int | None

    def build(self) -> None:
        """Allocate inputs and compile (e.g. one launch); may raise (compile error, out of resources)."""

    def run(self) -> None:
        """Launch the kernel once on the current stream (what is timed)."""

    def check(self):
        """Run and compare against the reference; return a verdict with ``.passed`` (``kernels.accuracy.Closeness``)."""

    # Optional: ``compile_task() -> (function, args)``, picklable, whose call in a fresh process on
    # the same GPU model compiles what ``build()`` needs into the on-disk caches (Triton's); see
    # ``Sweep(compile_workers=)``.


@dataclass
class SweepReport:
    """What a sweep did.  ``measured`` False: no GPU, nothing was timed."""

    device: str
    measured: bool
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("ok", "checked", "failed", "wrong", "skipped"), 0))
    remaining: int = 0
    stopped: str | None = None  # None: all variants done; else why the sweep stopped early

    def summary(self) -> str:
        counts = ", ".join(f"{n} {status}" for status, n in self.counts.items())
        text = f"{self.device}: {counts}"
        if not self.measured:
            text += "; no GPU: nothing was measured (variants only built and checked, no times stored)"
        if self.stopped:
            text += f"; stopped ({self.stopped}), {self.remaining} variant(s) left for the next run"
        return text


class Sweep:
    """Build, check and time ``variants`` into ``db``, skipping those already recorded.

    ``compile_workers`` > 0 (GPU only): variants with a ``compile_task`` are compiled ahead in that
    many worker processes (spawned: each compiles into Triton's on-disk cache, in the sweep's order),
    while the main process builds, checks and times the variants whose compilation has finished;
    ``build()`` then only loads binaries.  A task that fails is not recorded by the worker: ``build()``
    meets the same error and records it.

    For each variant not in the DB: ``build()`` -- any exception records 'failed' with the reason;
    ``check()`` -- an exception records 'failed', a verdict that did not pass records 'wrong' (never
    timed); then ``time_cuda(run)`` records 'ok' (or 'failed' if timing raised).  Without a GPU
    (Triton interpreter) the last step is replaced by recording 'checked', with no time.  Stops
    cleanly once ``budget_s`` seconds have passed or when the CUDA context is lost (rerun to go on);
    on Ctrl-C, finished records stay in the DB and the interrupt is re-raised.
    """

    def __init__(self, db: TuningDB, variants: list, *, budget_s: float | None = None, warmup_ms: float = 25.0,
                 rep_ms: float = 100.0, flush_l2: bool = True, cuda_graph: bool | None = None,
                 progress: bool = True, console=None, compile_workers: int = 0):
        from rich.console import Console

        from kernels.interpreter import interpreted

        self.db = db
        self.variants = list(variants)
        self.budget_s = budget_s
        self.timing = {"warmup_ms": warmup_ms, "rep_ms": rep_ms, "flush_l2": flush_l2, "cuda_graph": cuda_graph}
        self.progress = progress
        self.compile_workers = compile_workers
        self.console = console or Console(stderr=True)
        facts = query_device()
        interpreting = interpreted()
        self.measured = isinstance(facts, DeviceFacts) and not interpreting
        if self.measured:
            self.device = facts.name
        elif interpreting:
            self.device = CPU_DEVICE
            self.no_gpu_reason = facts.reason if isinstance(facts, NoDevice) else "TRITON_INTERPRET=1"
        else:
            raise RuntimeError(f"no CUDA device ({facts.reason}) and TRITON_INTERPRET is not 1: "
                               "variants can be neither timed nor run through the interpreter")

    def key(self, variant) -> Key:
        return Key(device=self.device, versions=versions(), op=variant.op, dims=variant.dims, dtype=variant.dtype,
                   layout=variant.layout, knobs=variant.knobs)

    def ranked(self, variants) -> list:
        """``variants`` ordered by their 'ok' times in the DB, fastest first; with no 'ok' record
        among them (no GPU), those recorded 'checked', in list order.  Failed, wrong and missing
        ones are left out.  What a later sweep phase uses to pick configurations to try further."""
        timed, checked = [], []
        for variant in variants:
            record = self.db.lookup(self.key(variant))
            if record is not None and record.status == "ok":
                timed.append((record.median_ms, len(timed), variant))
            elif record is not None and record.status == "checked":
                checked.append(variant)
        return [v for *_, v in sorted(timed, key=lambda t: t[:2])] or checked

    def run(self) -> SweepReport:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        report = SweepReport(device=self.device, measured=self.measured)
        if not self.measured:
            self.console.print(f"[bold yellow]No GPU ({self.no_gpu_reason}): nothing will be timed.[/] "
                               "Variants are built and checked through the Triton interpreter and recorded as 'checked'.", soft_wrap=True)
        started = time.monotonic()
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[counts]}"),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        pending = [v for v in self.variants if self.db.lookup(self.key(v)) is None]
        with _Compiler(self.compile_workers if self.measured else 0, pending) as compiler, \
                Progress(*columns, console=self.console, disable=not self.progress) as bar:
            task = bar.add_task("sweep", total=len(self.variants), counts="")
            done = 0
            try:
                for variant in self.variants:
                    if self.budget_s is not None and time.monotonic() - started > self.budget_s:
                        report.stopped = f"time budget of {self.budget_s:g} s used"
                        break
                    key = self.key(variant)
                    if self.db.lookup(key) is not None:
                        status = "skipped"
                    else:
                        bar.update(task, description=f"{variant.op} {variant.knobs}")
                        compiler.wait(variant)
                        status = self._measure(key, variant)
                    report.counts[status] += 1
                    done += 1
                    bar.update(task, advance=1, counts=" ".join(f"{s} {n}" for s, n in report.counts.items() if n))
                    if status == "failed" and not _cuda_context_alive(self.measured):
                        report.stopped = "CUDA context lost; rerun in a new process to continue"
                        break
            except KeyboardInterrupt:
                report.stopped = "interrupted"
                report.remaining = len(self.variants) - done
                self.console.print(report.summary(), soft_wrap=True)
                raise
            bar.update(task, description="sweep")
        report.remaining = len(self.variants) - done
        self.console.print(report.summary(), soft_wrap=True)
        return report

    def _measure(self, key: Key, variant) -> str:
        """Build, check and (on a GPU) time one variant; store and return its status."""
        counts = {"bytes": getattr(variant, "bytes", None), "flop": getattr(variant, "flop", None)}
        try:
            variant.build()
        except Exception as exc:  # compile errors, out of resources / shared memory, Triton errors, OOM
            return self._failed(key, "build", exc, counts)
        try:
            verdict = variant.check()
        except Exception as exc:
            return self._failed(key, "check", exc, counts)
        errors = {"rel_error": getattr(verdict, "error", None), "baseline_error": getattr(verdict, "baseline_error", None)}
        if not verdict.passed:
            self.db.put(Record(key, "wrong", detail=str(verdict), **errors, **counts))
            return "wrong"
        if not self.measured:
            self.db.put(Record(key, "checked", detail=str(verdict), **errors, **counts))
            return "checked"
        try:
            timing = time_cuda(variant.run, **self.timing)
        except Exception as exc:
            return self._failed(key, "time", exc, counts)
        self.db.put(Record(key, "ok", median_ms=timing.median_ms, q20_ms=timing.q20_ms, q80_ms=timing.q80_ms,
                           n_reps=timing.n, cuda_graph=timing.cuda_graph, detail=str(verdict), **errors, **counts))
        return "ok"

    def _failed(self, key: Key, stage: str, exc: Exception, counts: dict) -> str:
        reason = f"{stage}: {type(exc).__name__}: {exc}"[:REASON_CHARS]
        self.db.put(Record(key, "failed", detail=reason, **counts))
        return "failed"


class _Compiler:
    """Worker processes running the ``compile_task`` of each variant, in order (``Sweep(compile_workers=)``).
    Leaving the ``with`` block drops the tasks not yet started."""

    def __init__(self, workers: int, variants: list):
        tasks = {id(v): v.compile_task() for v in variants if workers > 0 and hasattr(v, "compile_task")}
        tasks = {k: t for k, t in tasks.items() if t is not None}
        self.pool, self.futures = None, {}
        if tasks:
            import concurrent.futures
            import multiprocessing

            self.pool = concurrent.futures.ProcessPoolExecutor(min(workers, len(tasks)),
                                                               mp_context=multiprocessing.get_context("spawn"))
            self.futures = {k: self.pool.submit(fn, *args) for k, (fn, args) in tasks.items()}

    def wait(self, variant) -> None:
        """Until ``variant``'s task (if any) has run; its failure is left to ``build()``."""
        future = self.futures.get(id(variant))
        if future is not None:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - build() meets the same error in this process and records it
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            # a sweep stopped by its budget leaves compiles running: end them now, not at interpreter exit
            for process in list(getattr(self.pool, "_processes", {}).values()):
                process.kill()
            self.pool.shutdown(wait=False, cancel_futures=True)


def _cuda_context_alive(measured: bool) -> bool:
    """After a failure: False when the CUDA context is broken (e.g. an illegal address), so nothing more can run."""
    if not measured:
        return True
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # give back what a failed (e.g. out-of-memory) variant left
        return True
    except Exception:
        return False


COPY_BYTES = 1 << 30  # ceiling copy: a 1 GiB source copied into a 1 GiB destination
GEMM_N = 8192  # ceiling GEMM: (8192 x 8192) @ (8192 x 8192) in bf16, random normal data


def measure_ceilings(db, index: int = 0, force: bool = False) -> Ceilings:
    """Copy bandwidth and bf16 GEMM rate of device ``index``, measured once and kept in ``db``.

    A later call returns the stored ``Ceilings`` unless ``force``.  Copy: ``dst.copy_(src)`` of
    ``COPY_BYTES`` (bytes read + written over the median time).  GEMM: ``GEMM_N``^3 bf16 ``torch.mm`` on
    random normal data (2 N^3 flop over the median time).  Raises RuntimeError without a GPU.
    """
    facts = query_device(index)
    if isinstance(facts, NoDevice):
        raise RuntimeError(f"no CUDA device, no ceilings: {facts.reason}")
    if not force:
        stored = db.ceilings(facts.name)
        if stored is not None:
            return stored

    import torch

    dev = torch.device("cuda", index)
    with torch.cuda.device(dev):
        src = torch.randn(COPY_BYTES // 4, device=dev, dtype=torch.float32)
        dst = torch.empty_like(src)
        copy = time_cuda(lambda: dst.copy_(src), warmup_ms=100, rep_ms=400, flush_l2=False, cuda_graph=False)
        torch.testing.assert_close(dst, src, rtol=0, atol=0)
        del src, dst
        a = torch.randn(GEMM_N, GEMM_N, device=dev, dtype=torch.bfloat16)
        b = torch.randn(GEMM_N, GEMM_N, device=dev, dtype=torch.bfloat16)
        c = torch.empty(GEMM_N, GEMM_N, device=dev, dtype=torch.bfloat16)
        gemm = time_cuda(lambda: torch.mm(a, b, out=c), warmup_ms=300, rep_ms=600, flush_l2=False, cuda_graph=False)
        del a, b, c
        torch.cuda.empty_cache()
    copy_bytes = 2 * COPY_BYTES
    gemm_flop = 2 * GEMM_N**3
    ceilings = Ceilings(
        device=facts.name,
        copy_bytes_per_s=copy_bytes / (copy.median_ms * 1e-3),
        gemm_flop_per_s=gemm_flop / (gemm.median_ms * 1e-3),
        details={
            "copy": {"bytes_read_plus_written": copy_bytes, **asdict(copy)},
            "gemm": {"size": GEMM_N, "dtype": "bfloat16", "flop": gemm_flop, **asdict(gemm)},
            "facts": facts.to_dict(),
        },
        versions=versions(),
        timestamp=time.time(),
    )
    db.store_ceilings(ceilings)
    return ceilings


def write_results(out_dir, stem: str, report: dict, markdown: str) -> None:
    """Write a benchmark's ``stem.json`` (the full report) and ``stem.md`` under ``out_dir``."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
