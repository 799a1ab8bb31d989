"""Benchmark harness: CUDA-event timing with L2 flushes, and a resumable sweep over kernel variants.

``time_cuda`` times a callable on the GPU.  ``Sweep`` takes a list of ``Variant``s and, for each
one not yet in the tuning DB, builds it, checks it against its reference and times it, recording
'failed' / 'wrong' / 'ok' as it goes (each record committed on its own, so a sweep that is killed,
interrupted or out of time resumes where it stopped).  Compiling ahead and measuring run in
supervised worker processes (``harness.workers``): a compile or a variant that crashes, hangs or
runs too long is recorded 'failed' with the reason and the sweep goes on; measuring uses every
GPU of the host.  Without a GPU nothing is timed: variants are built and checked through the
Triton interpreter and recorded as 'checked', with no time.
"""
from __future__ import annotations

import collections
import functools
import heapq
import importlib
import itertools
import math
import os
import pickle
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

from datamove.dtypes import BF16
from datamove.kernels.device import DeviceFacts, NoDevice, device_count, query_device, versions
from datamove.harness.tuning_db import Ceilings, Key, Record, TuningDB
from datamove.harness.workers import ABANDON_GRACE_S, Event, Pool, WorkerStartError, note, retire, wait

# Calls whose GPU time is under this are replayed from a CUDA graph when ``cuda_graph=None``: the
# host's launch work (several microseconds per Triton launch, more for a callable that launches
# several kernels, as PyTorch eager sequences do) would otherwise be of the order of the GPU time
# and leave gaps inside the timed interval, the more so while other processes (``Sweep``'s compile
# workers) load the host's cores.  What is timed is GPU time.
GRAPH_BELOW_MS = 0.3
# Without an L2 flush, one graph replay holds enough back-to-back calls to last about this long,
# and the time per call is the replay's time over that count.
GRAPH_MIN_REPLAY_MS = 0.5
# The flush reads a buffer of 4x the L2 size between repetitions.  Reads, not writes: a written
# buffer leaves the L2 full of dirty lines, which the timed kernel's misses then write back to
# memory (up to the L2's size of writes charged to a kernel that moves less).
FLUSH_L2_FACTOR = 4
MIN_REPS, MAX_REPS = 10, 10_000
REASON_CHARS = 4000  # failure reasons (Triton compile errors can be long) are kept up to this length
# Compile workers yield the CPU to the measuring processes, whose CPU work (loading a kernel, making
# its inputs) keeps a GPU waiting: on 2 x H200 (32 cores, 24 compile workers) a variant's build took
# 158 ms against 94 with one GPU and 12 workers (2026-11-28).
COMPILE_NICENESS = 10
# A sweep's timing of each variant (``time_cuda``): about 500 repetitions of a 20 us kernel with its
# L2 flush.  At 25 and 100 ms, timing was 114 of a variant's 142 ms in a measuring process once
# kernels and launchers were compiled ahead (H200, BERT-large's first sweep, 2026-11-28).
SWEEP_WARMUP_MS, SWEEP_REP_MS = 10.0, 40.0
TICK_S = 0.5  # a sweep looks at its budget, its workers and their deadlines at least this often
SLOW_FACTOR = 20.0  # a run this many times slower than its operator's best so far is abandoned

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

    return torch.zeros(nbytes // 8, dtype=torch.int64, device=torch.device("cuda", index))


def time_cuda(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 100.0, flush_l2: bool = True,
              cuda_graph: bool | None = None, limit: RunLimit | None = None) -> Timing:
    """Time ``fn`` (which launches work on the current CUDA stream) with device events.

    ``fn`` runs once (compilation, loading), then for about ``warmup_ms`` untimed, then for about
    ``rep_ms`` timed repetitions (between ``MIN_REPS`` and ``MAX_REPS``), each between its own pair
    of events and, with ``flush_l2``, after reading a buffer of ``FLUSH_L2_FACTOR`` x the L2 size so
    that no repetition finds its inputs in L2 (nor dirty lines of earlier work to write back).  ``cuda_graph``: True captures ``fn`` in a CUDA graph
    and times its replays; None does so when one call takes under ``GRAPH_BELOW_MS`` (falling back
    to plain launches if ``fn`` cannot be captured).  Without a flush, a replay holds as many calls
    as last ``GRAPH_MIN_REPLAY_MS`` and the time is divided among them.  ``limit``: the call after
    the first taking longer raises ``RunTooLong`` before anything else is run.  Raises RuntimeError
    with no GPU: an interpreter's time is not a GPU time.
    """
    import torch

    from datamove.kernels.interpreter import interpreted

    if interpreted():
        raise RuntimeError("TRITON_INTERPRET=1: Triton kernels run on the CPU interpreter, nothing can be timed")
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    facts = _device_facts(index)
    if isinstance(facts, NoDevice):
        raise RuntimeError(f"no CUDA device, nothing can be timed: {facts.reason}")
    flush_buffer = _flush_buffer(index, FLUSH_L2_FACTOR * facts.l2_bytes) if flush_l2 else None

    def flush():
        if flush_buffer is not None:
            flush_buffer.amax()

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
    if limit is not None:
        once_ms = elapsed_ms(fn, 1)
        if once_ms > limit.ms:
            raise RunTooLong(f"{once_ms:.3g} ms per run, > {limit.why}")
    call_ms = elapsed_ms(fn, 5)
    use_graph = call_ms < GRAPH_BELOW_MS if cuda_graph is None else cuda_graph
    calls_per_rep = 1
    call = fn
    if use_graph:
        if not flush_l2:
            calls_per_rep = max(1, math.ceil(GRAPH_MIN_REPLAY_MS / max(call_ms, 1e-4)))
        try:
            call, _ = capture_graph(fn, calls_per_rep)
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


def capture_graph(fn: Callable[[], object], calls: int = 1) -> tuple[Callable[[], None], object]:
    """Capture ``calls`` back-to-back calls of ``fn`` in a CUDA graph (after three warm-up calls on
    a side stream); return its replay and what the last captured call returned (tensors each
    replay rewrites in place)."""
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
            result = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, result


class Variant(Protocol):
    """One kernel configuration to build, check and time.

    Key fields (the tuning-DB key, with the device and software versions): ``op`` (operator
    signature), ``dims`` (dim letter -> size), ``dtype``, ``layout`` (JSON value), ``knobs`` (JSON
    dict of tuning parameters).  ``bytes`` / ``flop``: what one ``run()`` must move / compute (None
    if not counted); stored with the time so that achieved rates can be read off the DB.  A variant
    measured in a measuring process (``Sweep(processes=)``) gets there pickled, before ``build()``:
    it creates its device state on first use.
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
        """Run and compare against the reference; return a verdict with ``.passed`` (``harness.accuracy.Closeness``)."""

    # Optional: ``compile_task() -> (function, args)`` or None, picklable, whose call in a fresh
    # process (on a GPU: of the same model) compiles what ``build()`` needs into the on-disk caches
    # (Triton's); see ``Sweep(compile_workers=)``.


@dataclass(frozen=True)
class RunLimit:
    """How long one run of a variant may take before ``time_cuda`` abandons it (``RunTooLong``)."""

    ms: float
    why: str  # what the bound is, e.g. "20x the operator's best 0.034 ms"


TOO_SLOW = "too slow"  # a sweep's count of variants recorded 'failed' because a run took too long


class RunTooLong(RuntimeError):
    """One run of the timed callable took longer than its ``RunLimit``."""


class PhaseClock:
    """The seconds measuring variants spent in each phase (``seconds``: name -> s, summed over
    variants), each phase announced with ``harness.workers.note`` as it begins (what a measuring
    process that dies or hangs is reported at)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._phase: str | None = None
        self._since = 0.0

    def enter(self, phase: str | None) -> None:
        """``phase`` begins (None: the current one ends)."""
        now = time.perf_counter()
        if self._phase is not None:
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + now - self._since
        self._phase, self._since = phase, now
        if phase is not None:
            note(phase)


def measure(variant, *, measured: bool, timing: dict, limit: RunLimit | None = None,
            clock: PhaseClock | None = None) -> tuple[str, dict]:
    """Build, check and (``measured``) time ``variant``: (status, the other fields of its ``Record``);
    each phase's seconds into ``clock`` (``PhaseClock``).

    ``build()`` or ``check()`` raising: 'failed' with the stage and the exception as the reason; a
    verdict that did not pass: 'wrong' (never timed); then ``time_cuda(variant.run, limit=limit,
    **timing)``: 'ok' with the times, or 'failed' (e.g. ``RunTooLong``).  Not ``measured`` (the
    Triton interpreter): 'checked' instead of timing.
    A phase failing out of GPU memory is tried again once, after the variant's buffers, Python's
    garbage and PyTorch's cached blocks are let go (memory a previous variant left is not this
    one's failure; what fails again is recorded so)."""
    clock = clock or PhaseClock()
    try:
        status, fields = _measure(variant, measured, timing, limit, clock)
        if _out_of_memory(status, fields.get("detail")):
            _let_memory_go(variant)
            status, fields = _measure(variant, measured, timing, limit, clock)
            if _out_of_memory(status, fields.get("detail")):
                fields["detail"] = (OOM_AGAIN + fields["detail"])[:REASON_CHARS]
        return status, fields
    finally:
        clock.enter(None)


OUT_OF_MEMORY = "OutOfMemoryError"  # torch.cuda.OutOfMemoryError's name in a failure's detail
OOM_AGAIN = "again after letting memory go: "  # a failure's detail: out of memory on the second try too


def _out_of_memory(status: str, detail: str | None) -> bool:
    """Whether a measurement failed for want of GPU memory (``detail``: its reason)."""
    return status == "failed" and OUT_OF_MEMORY in (detail or "")


def retried_for_memory(record) -> bool:
    """Whether a sweep measures ``record``'s variant again: failed out of memory on a first try
    only (recorded before ``measure`` tried twice), which says nothing of the variant."""
    return _out_of_memory(record.status, record.detail) and OOM_AGAIN not in record.detail


def _let_memory_go(variant) -> None:
    """Free what ``variant`` and earlier work hold on the GPU before a second try."""
    import gc

    import torch

    getattr(variant, "release", lambda: None)()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _measure(variant, measured: bool, timing: dict, limit: RunLimit | None, clock: PhaseClock) -> tuple[str, dict]:
    fields = {"bytes": getattr(variant, "bytes", None), "flop": getattr(variant, "flop", None)}

    def failed(stage: str, exc: Exception) -> tuple[str, dict]:
        return "failed", {**fields, "detail": f"{stage}: {type(exc).__name__}: {exc}"[:REASON_CHARS]}

    clock.enter("build")
    try:
        variant.build()
    except Exception as exc:  # compile errors, out of resources / shared memory, Triton errors, OOM
        return failed("build", exc)
    clock.enter("check")
    try:
        verdict = variant.check()
    except Exception as exc:
        return failed("check", exc)
    fields.update(rel_error=getattr(verdict, "error", None), baseline_error=getattr(verdict, "baseline_error", None),
                  detail=str(verdict))
    if not verdict.passed:
        return "wrong", fields
    if not measured:
        return "checked", fields
    clock.enter("time")
    try:
        times = time_cuda(variant.run, limit=limit, **timing)
    except Exception as exc:
        return failed("time", exc)
    return "ok", {**fields, "median_ms": times.median_ms, "q20_ms": times.q20_ms, "q80_ms": times.q80_ms,
                  "n_reps": times.n, "cuda_graph": times.cuda_graph}


def _preload(modules: tuple, cuda: bool) -> None:
    """Import ``modules`` (what the tasks will need) and, with ``cuda``, make the CUDA context now."""
    for name in modules:
        importlib.import_module(name)
    if cuda:
        import torch

        torch.zeros(1, device="cuda")


def _measuring(measured: bool, preload: tuple = ()):
    """Setup of a measuring process (``harness.workers.Pool``): ``preload``'s modules imported and
    (``measured``) its CUDA context made, then the handler of tasks ``(sweep, variants, index,
    limit)``, which measures the sweep's ``variants[index]`` (``measure``) and lets it go.
    ``variants``: the sweep's variants and timing settings, pickled, sent with the first task of
    each sweep the process takes (None afterwards; the previous sweep's are dropped then).  A
    failure that left the CUDA context unusable retires the process (a fresh one takes its place)."""
    _preload(preload, measured)
    held = {}

    def handle(task: tuple) -> tuple[str, dict, dict]:
        sweep, blob, index, limit = task
        if blob is not None:
            held.clear()
            held[sweep] = pickle.loads(blob)
        variants, timing = held[sweep]
        variant, variants[index] = variants[index], None
        clock = PhaseClock()
        status, fields = measure(variant, measured=measured, timing=timing, limit=limit, clock=clock)
        if status == "failed" and not _cuda_context_alive(measured):
            retire()
        return status, fields, clock.seconds

    return handle


def _compiling(preload: tuple = ()):
    """Setup of a compile worker (``preload``'s modules imported), run at ``COMPILE_NICENESS`` (with
    the compilers it starts): its tasks are variants' ``compile_task()``, (function, args)."""
    os.nice(COMPILE_NICENESS)
    _preload(preload, False)
    return lambda task: task[0](*task[1])


def _compile_failure(event: Event) -> str:
    return "compile: " + (f"worker {event.value}" if event.kind == "died" else event.value)


def _measure_failure(event: Event) -> str:
    stage = event.note or "measure"
    if event.kind == "died":
        return f"{stage}: measuring process {event.value}"
    if event.kind == "timeout":
        return f"{stage}: {event.value} (measuring process replaced)"
    return f"{stage}: {event.value}"


def gpu_ids(name: str) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` value selecting each visible GPU named ``name``."""
    count = device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",")][:count] if visible else [str(i) for i in range(count)]
    return [ids[i] for i in range(count) if getattr(query_device(i), "name", None) == name]


@dataclass
class PoolLoad:
    """How busy a sweep kept one kind of worker: ``workers`` processes (0: the sweep's own process),
    ``tasks`` ended, ``busy_s`` the seconds from each task's hand-out to its end, summed, and
    ``phases`` the seconds of that the tasks spent in each phase they name (measuring: build, check,
    time: ``PhaseClock``)."""

    workers: int = 0
    tasks: int = 0
    busy_s: float = 0.0
    phases: dict = field(default_factory=dict)

    def add(self, seconds: float, phases: dict | None = None) -> None:
        self.tasks += 1
        self.busy_s += seconds
        self.phases_add(phases or {})

    def phases_add(self, phases: dict) -> None:
        for name, seconds in phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds

    def absorb(self, other: PoolLoad) -> None:
        """``other`` (another sweep's load) summed into this one; ``workers``: the more of the two."""
        self.workers = max(self.workers, other.workers)
        self.tasks += other.tasks
        self.busy_s += other.busy_s
        self.phases_add(other.phases)


@dataclass
class SweepReport:
    """What a sweep did.  ``measured`` False: no GPU, nothing was timed.  ``compiling`` /
    ``measuring``: how busy it kept its compile workers and measuring processes; ``first_result_s``:
    seconds from its start to its first measured variant (workers starting, the first compiles;
    None: nothing measured); ``wall_s``: its whole time."""

    device: str
    measured: bool
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("ok", "checked", "failed", TOO_SLOW, "wrong", "skipped"), 0))  # TOO_SLOW: failed as RunTooLong
    remaining: int = 0
    stopped: str | None = None  # None: all variants done; else why the sweep stopped early
    compiling: PoolLoad = field(default_factory=PoolLoad)
    measuring: PoolLoad = field(default_factory=PoolLoad)
    first_result_s: float | None = None
    wall_s: float = 0.0

    def summary(self) -> str:
        counts = ", ".join(f"{n} {status}" for status, n in self.counts.items())
        text = f"{self.device}: {counts}"
        if not self.measured:
            text += "; no GPU: nothing was measured (variants only built and checked, no times stored)"
        if self.stopped:
            text += f"; stopped ({self.stopped}), {self.remaining} variant(s) left for the next run"
        return text


class WorkerPools:
    """The compile workers and measuring processes of a series of sweeps (a job's tuning: ``Sweep(pools=)``),
    kept from one sweep to the next, so that a sweep does not wait for processes to start, import
    and make a CUDA context (seconds each, the most of a short sweep): ``compile_workers`` and
    ``processes`` of them, worker ``i`` with ``env(i)`` in its environment, importing the modules
    named in ``preload`` (and a measuring process making its CUDA context) before its first task.
    The compile workers start with the first sweep that has something to compile (its measuring
    processes meanwhile time what needs no compiling), the measuring processes then too or at
    ``start()``; ``close()`` ends them.  A sweep that stops with tasks in flight abandons them
    (``harness.workers.Pool.abandon``: finished within ``abandon_grace_s``, or their process replaced)."""

    def __init__(self, compile_workers: int, processes: int, measured: bool, env, preload: tuple = (),
                 abandon_grace_s: float = ABANDON_GRACE_S):
        self.compile_workers, self.processes, self.measured, self.env = compile_workers, processes, measured, env
        self.preload, self.abandon_grace_s = tuple(preload), abandon_grace_s
        self.compiler: Pool | None = None
        self.measurers: Pool | None = None
        self.sweeps = itertools.count()  # each sweep's number, telling a measuring process to load its variants

    def start(self) -> WorkerPools:
        """Start the measuring processes now (they get ready while the caller goes on; a job whose
        sweeps the database answers whole starts nothing more)."""
        if self.processes:
            self.measuring()
        return self

    def compiling(self) -> Pool:
        if self.compiler is None:
            self.compiler = Pool("compile", self.compile_workers, _compiling, (self.preload,), env=self.env)
        return self.compiler

    def measuring(self) -> Pool:
        if self.measurers is None:
            self.measurers = Pool("measure", self.processes, _measuring, (self.measured, self.preload), env=self.env)
        return self.measurers

    def settle(self) -> None:
        """Drop the tasks still running (a stopped sweep's), keeping the pools."""
        for pool in (self.compiler, self.measurers):
            if pool is not None:
                pool.abandon(self.abandon_grace_s)

    def close(self) -> None:
        for pool in (self.compiler, self.measurers):
            if pool is not None:
                pool.close()
        self.compiler = self.measurers = None


class Sweep:
    """Build, check and time ``variants`` into ``db``, skipping those already recorded.

    Each variant not in the DB (``retry_failed``: or recorded 'failed'; of several with one key,
    the first) is measured once (``measure``: 'ok', or 'checked' without a GPU, 'wrong', 'failed'
    with the reason) and its record committed on its own, so a sweep killed at any moment loses no
    finished record and, rerun, measures none again.  Guarantees:

    - Compiling: with ``compile_workers`` > 0, the variants' ``compile_task``s run ahead, in list
      order, in that many worker processes (``harness.workers``; spawned; on a GPU spread over the
      GPUs measured on).  A task that raises, runs over ``compile_timeout_s`` or kills its worker
      (abort, segfault, out of memory) records the variant 'failed' ("compile: RuntimeError: ...",
      "compile: timed out after 120 s", "compile: worker died (SIGABRT)"); such a variant is never
      built, and the worker is replaced.  A variant is measured once its task has succeeded.
    - Measuring: ``processes`` measuring processes (default: one per GPU of the model of GPU 0,
      each seeing only its own through ``CUDA_VISIBLE_DEVICES``; without a GPU, 0), fed from one
      queue in list order; the variants travel to each in one pickle and are built there.  This
      process never runs a variant then; it writes every record.  A variant over
      ``variant_timeout_s`` (build + check + time) or whose process dies is recorded 'failed'
      ("time: timed out after 120 s (measuring process replaced)", "build: measuring process died
      (SIGSEGV)") and the process replaced, as it is after a failure that broke its CUDA context.
      ``processes=0``: variants are measured in this process (the default without a GPU); a CUDA
      context lost there stops the sweep ("rerun in a new process").
    - Per-run limit: a variant whose single run takes over ``slow_factor`` x its operator's
      fastest 'ok' time in the DB (same dims, dtype, device and versions) is abandoned, 'failed'
      ("time: RunTooLong: 3.2 ms per run, > 20x the operator's best 0.034 ms").
    - Budget: once ``budget_s`` seconds have passed the sweep stops within ``TICK_S`` plus the
      time to kill its workers, whatever they run (measuring in this process: at the end of the
      current variant); the unfinished variants are left for the next run (``stopped``).  Ctrl-C:
      the same, then the interrupt is re-raised.
    - Progress (``progress``): variants done / total, counts by status, the budget left.
    - Worker processes: ``pools`` (``WorkerPools``) kept by the caller over several sweeps, or (None)
      the sweep's own, as many as it has tasks for up to ``compile_workers`` / ``processes``, ended with it.
    """

    def __init__(self, db: TuningDB, variants: list, *, budget_s: float | None = None, warmup_ms: float = SWEEP_WARMUP_MS,
                 rep_ms: float = SWEEP_REP_MS, flush_l2: bool = True, cuda_graph: bool | None = None,
                 progress: bool = True, console=None, compile_workers: int = 0, processes: int | None = None,
                 compile_timeout_s: float = 120.0, variant_timeout_s: float = 120.0,
                 slow_factor: float = SLOW_FACTOR, retry_failed: bool = False, pools: WorkerPools | None = None):
        from rich.console import Console

        from datamove.kernels.interpreter import interpreted

        self.db = db
        self.variants = list(variants)
        self.budget_s = budget_s
        self.timing = {"warmup_ms": warmup_ms, "rep_ms": rep_ms, "flush_l2": flush_l2, "cuda_graph": cuda_graph}
        self.progress = progress
        self.compile_workers = compile_workers
        self.compile_timeout_s, self.variant_timeout_s = compile_timeout_s, variant_timeout_s
        self.slow_factor, self.retry_failed, self.pools = slow_factor, retry_failed, pools
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
        self.gpus = gpu_ids(self.device) if self.measured else []
        self.processes = (len(self.gpus) if self.measured else 0) if processes is None else processes
        if self.measured and self.processes > len(self.gpus):
            raise ValueError(f"{self.processes} measuring processes asked for: one per GPU, and there are "
                             f"{len(self.gpus)} {self.device} here")

    def key(self, variant) -> Key:
        return Key(device=self.device, versions=versions(), op=variant.op, dims=variant.dims, dtype=variant.dtype,
                   layout=variant.layout, knobs=variant.knobs)

    def time_ms(self, variant) -> float | None:
        """``variant``'s median time in the DB (ms), or None where it has no 'ok' record."""
        record = self.db.lookup(self.key(variant))
        return record.median_ms if record is not None and record.status == "ok" else None

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
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        report = SweepReport(device=self.device, measured=self.measured)
        if not self.measured:
            self.console.print(f"[bold yellow]No GPU ({self.no_gpu_reason}): nothing will be timed.[/] "
                               "Variants are built and checked through the Triton interpreter and recorded as 'checked'.", soft_wrap=True)
        started = time.monotonic()
        pending = self._pending(report, self.variants)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[counts]}"),
                   TimeElapsedColumn(), TextColumn("{task.fields[budget]}"))
        with Progress(*columns, console=self.console, disable=not self.progress) as bar:
            task = bar.add_task("sweep", total=len(self.variants), counts="", budget="")

            def show(variant=None) -> None:
                described = {} if variant is None else {"description": f"{variant.op} {variant.knobs}"}
                left = "" if self.budget_s is None else \
                    f"{max(0.0, self.budget_s - (time.monotonic() - started)):.0f} s of budget left"
                bar.update(task, completed=sum(report.counts.values()), budget=left, **described,
                           counts=" ".join(f"{s} {n}" for s, n in report.counts.items() if n))

            try:
                report.stopped = self._drive(pending, report, started, show)
            except KeyboardInterrupt:
                report.stopped = "interrupted"
                report.remaining = len(self.variants) - sum(report.counts.values())
                self.console.print(report.summary(), soft_wrap=True)
                raise
            bar.update(task, description="sweep")
        report.remaining = len(self.variants) - sum(report.counts.values())
        report.wall_s = time.monotonic() - started
        self.console.print(report.summary(), soft_wrap=True)
        return report

    def unmeasured(self, variants) -> set:
        """The keys (``Key.columns()``) of the ``variants`` a sweep of them would measure (the rest
        it reads back)."""
        return {key.columns() for key, _ in self._pending(SweepReport(self.device, self.measured), variants)}

    def _pending(self, report: SweepReport, variants: list) -> list[tuple[Key, object]]:
        """(key, variant) of each of ``variants`` to measure; the others are counted 'skipped'."""
        pending, keys = [], set()
        for variant in variants:
            key = self.key(variant)
            record = self.db.lookup(key)
            again = record is not None and ((self.retry_failed and record.status == "failed") or retried_for_memory(record))
            if key.columns() in keys or (record is not None and not again):
                report.counts["skipped"] += 1
            else:
                keys.add(key.columns())
                pending.append((key, variant))
        return pending

    def _drive(self, pending: list, report: SweepReport, started: float, show) -> str | None:
        """Measure ``pending`` ((key, variant), ...), recording each; return why it stopped early, or None."""
        tasks = {}
        for n, (_, variant) in enumerate(pending):
            task = variant.compile_task() if self.compile_workers > 0 and hasattr(variant, "compile_task") else None
            if task is not None:
                tasks[n] = task
        to_compile = collections.deque(tasks)
        ready = [n for n in range(len(pending)) if n not in tasks]  # ascending: a heap
        left = len(pending)
        pools = self.pools or WorkerPools(min(self.compile_workers, len(tasks)), min(self.processes, len(pending)),
                                          self.measured, self._env)
        sweep, blob = next(pools.sweeps), None
        compiler = pools.compiling() if tasks else None
        measurers = pools.measuring() if self.processes and pending else None
        report.compiling.workers = len(compiler.workers) if compiler is not None else 0
        report.measuring.workers = len(measurers.workers) if measurers is not None else 0

        def measuring(state: dict, n: int) -> tuple:
            """Task ``n`` for a measuring process, with this sweep's variants where it lacks them."""
            nonlocal blob
            fresh = state.get("sweep") != sweep
            if fresh and blob is None:
                blob = pickle.dumps(([v for _, v in pending], self.timing))
            state["sweep"] = sweep
            return sweep, blob if fresh else None, n, self._run_limit(pending[n][0])

        try:
            pools_used = [p for p in (compiler, measurers) if p is not None]
            while left:
                if self.budget_s is not None and time.monotonic() - started > self.budget_s:
                    return f"time budget of {self.budget_s:g} s used"
                while to_compile and compiler.idle():
                    if compiler.submit(to_compile[0], tasks[to_compile[0]], self.compile_timeout_s):
                        to_compile.popleft()
                while ready and measurers is not None and measurers.idle():
                    if measurers.submit(ready[0], functools.partial(measuring, n=ready[0]), self.variant_timeout_s):
                        show(pending[heapq.heappop(ready)][1])
                if ready and measurers is None:
                    key, variant = pending[heapq.heappop(ready)]
                    show(variant)
                    began, clock = time.monotonic(), PhaseClock()
                    status, fields = measure(variant, measured=self.measured, timing=self.timing,
                                             limit=self._run_limit(key), clock=clock)
                    report.measuring.add(time.monotonic() - began, clock.seconds)
                    self._first_result(report, started)
                    self._record(report, key, status, fields)
                    left -= 1
                    if status == "failed" and not _cuda_context_alive(self.measured):
                        return "CUDA context lost; rerun in a new process to continue"
                wait(pools_used, 0 if ready and measurers is None else TICK_S)
                for event in compiler.collect() if compiler is not None else []:
                    report.compiling.add(event.seconds)
                    if event.kind == "done":
                        heapq.heappush(ready, event.task)
                    else:
                        self._failed(report, *pending[event.task], _compile_failure(event))
                        left -= 1
                for event in measurers.collect() if measurers is not None else []:
                    report.measuring.add(event.seconds)
                    self._first_result(report, started)
                    if event.kind == "done":
                        status, fields, phases = event.value
                        report.measuring.phases_add(phases)
                        self._record(report, pending[event.task][0], status, fields)
                    else:
                        self._failed(report, *pending[event.task], _measure_failure(event))
                    left -= 1
                show()
            return None
        except WorkerStartError as exc:
            return str(exc)
        finally:
            if self.pools is None:
                pools.close()
            else:
                pools.settle()

    @staticmethod
    def _first_result(report: SweepReport, started: float) -> None:
        if report.first_result_s is None:
            report.first_result_s = time.monotonic() - started

    def _env(self, index: int) -> dict:
        """Environment of worker ``index``: on a GPU, the one GPU it sees (in turn)."""
        return {"CUDA_VISIBLE_DEVICES": self.gpus[index % len(self.gpus)]} if self.gpus else {}

    def _run_limit(self, key: Key) -> RunLimit | None:
        """``slow_factor`` x the fastest 'ok' time of ``key``'s operator (same dims, dtype, device and
        versions) in the DB; None before there is one, or without a GPU."""
        if not self.measured or not self.slow_factor:
            return None
        best = self.db.best(key.op, key.dims, key.dtype, device=key.device, versions=key.versions)
        if not best:
            return None
        ms = best[0].median_ms
        return RunLimit(self.slow_factor * ms, f"{self.slow_factor:g}x the operator's best {ms:.3g} ms")

    def _record(self, report: SweepReport, key: Key, status: str, fields: dict) -> None:
        self.db.put(Record(key, status, **fields))
        abandoned = status == "failed" and RunTooLong.__name__ in (fields.get("detail") or "")
        report.counts[TOO_SLOW if abandoned else status] += 1

    def _failed(self, report: SweepReport, key: Key, variant, reason: str) -> None:
        self._record(report, key, "failed", {"bytes": getattr(variant, "bytes", None),
                                             "flop": getattr(variant, "flop", None), "detail": reason[:REASON_CHARS]})


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
        a = torch.randn(GEMM_N, GEMM_N, device=dev, dtype=BF16.torch)
        b = torch.randn(GEMM_N, GEMM_N, device=dev, dtype=BF16.torch)
        c = torch.empty(GEMM_N, GEMM_N, device=dev, dtype=BF16.torch)
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
            "gemm": {"size": GEMM_N, "dtype": BF16.name, "flop": gemm_flop, **asdict(gemm)},
            "facts": facts.to_dict(),
        },
        versions=versions(),
        timestamp=time.time(),
    )
    db.store_ceilings(ceilings)
    return ceilings


def require_cuda(script: str) -> None:
    """Exit with status 2 and one line where no CUDA GPU is here: ``script`` times GPU kernels."""
    import sys

    import torch

    if not torch.cuda.is_available():
        print(f"{script} times GPU kernels and needs a CUDA GPU: nothing measured", file=sys.stderr)
        raise SystemExit(2)


def utc_stamp() -> str:
    """Now, UTC, to the second (ISO 8601): the date a benchmark result carries."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_results(out_dir, stem: str, report: dict, markdown: str) -> None:
    """Write a benchmark's ``stem.json`` (the full report) and ``stem.md`` under ``out_dir``."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
