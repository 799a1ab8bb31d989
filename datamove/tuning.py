"""The main job's tuning: every kernel family of a fused training graph through the tuning database.

Sweeps (``harness.bench.Sweep``: compiled ahead, checked against float64, timed with device
events, on every GPU of the host; each record committed as it is made, so a second run only reads
the database; a variant that crashes or hangs is recorded failed and the sweep goes on), sharing one
time budget (``tune``'s doc gives the order): the fused element-wise / normalization operators
(``harness.sweep_variants``, two-stage, each with its PyTorch eager sequence, the report's
baseline), the contractions and fused epilogues (``harness.contraction_variants``, the GEMM
families'), the fused attention (``families.attention``: its tuning) at the layout of its inputs in
the spec, and the layout changes the selection asks for (``kernels.layout_change``).  What is not measured (layouts not
swept) the selection prices with the cost model.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from datamove.dtypes import parse as parse_dtype
from datamove.harness.bench import PoolLoad, Sweep, WorkerPools
from datamove.harness.tuning_db import canonical_json
from datamove.families import ATTENTION, GEMM_FAMILIES
from datamove.families.base import Tuning
from datamove.harness.contraction_variants import gemm_variants, layout_variants, training_gemms
from datamove.kernels.gemm import valid_configs
from datamove.harness.layout_change_variants import LayoutChangeVariant
from datamove.harness.sweep_variants import sweep_variants
from datamove.knob_climb import CLIMB_BEAM, next_round, variant_key
from datamove.layouts.plan import GENERATED
from datamove.layouts.space import Configuration, access_pattern, configurations, parts

# Triton GEMM configurations every GEMM tries first (and the fused epilogues take the fastest of):
# the ones fastest at BERT-large sizes on Hopper (benchmarks/results/contractions.md), TMA tiles
# where the layouts allow them, else the same tiles without TMA.
# The persistent ones: the same tiles looping over output tiles on one program per multiprocessor,
# storing C by TMA (where C's layout allows).
ALGORITHM_LAYOUTS = 3  # per GEMM: the layouts (fastest by cuBLAS's first algorithm) whose other algorithms are timed
MIN_COMPILE_WORKERS = 8
# A generated kernel took 2.3 s to compile and a variant 0.24 s to measure (H200, BERT-large's
# first sweep, 2026-11-28): about 10 compiles in flight keep one GPU measuring.
COMPILE_WORKERS_PER_GPU = 12
PRELOAD = ("datamove.harness.sweep_variants", "datamove.harness.contraction_variants",  # the variants' modules:
           "datamove.families.attention.variants", "datamove.harness.layout_change_variants")  # workers import them first
FIRST_STAGE = "fused operators: every access pattern; GEMMs: first layout, cuBLAS and Triton"
PLAN_SHARE = 0.25  # of the budget, kept from ``tune``'s sweeps for measuring what the plan chose (knobs of its layouts)
CHOSEN_LAYOUT_CONFIGS = 3  # Triton configurations timed on the layouts a plan runs (``chosen_layout_configs``)
COMPETITIVE = 1.02  # ... for GEMMs where the template came within this factor of cuBLAS on the first layout
FIRST_CONFIGS = ("128x256x64 g8 s3 w8 tma", "256x128x64 g8 s3 w8 tma", "128x128x64 g8 s2 w4 tma",
                 "64x128x64 g8 s4 w4 tma", "128x256x64 g8 s3 w8", "64x128x64 g8 s4 w4",
                 "128x256x64 g8 s3 w8 tma store-tma persistent", "128x256x64 g8 s4 w8 tma store-tma e2 persistent")


@dataclass
class StageCost:
    """What one stage of the tuning cost: its variants by outcome (``counts``: 'ok' measured,
    'failed', 'too slow', 'wrong', 'skipped' read back from the database), those its rule left out
    unmeasured (``pruned``, ``pruned_why``), those the budget left (``left_keys``: their database
    keys, not measured and not in the database) and its wall time (s); where that time went: its
    sweeps' compile workers and measuring processes (``compiling`` / ``measuring``, ``PoolLoad``s
    summed: the most workers of a sweep, busy seconds, the measuring's seconds per phase: build,
    check, time) and their seconds before a first result (``startup_s``)."""

    name: str
    counts: dict = field(default_factory=dict)
    pruned: int = 0
    pruned_why: str = ""
    left_keys: set = field(default_factory=set)
    wall_s: float = 0.0
    compiling: PoolLoad = field(default_factory=PoolLoad)
    measuring: PoolLoad = field(default_factory=PoolLoad)
    startup_s: float = 0.0

    def add_loads(self, report) -> None:
        """A sweep's ``harness.bench.SweepReport`` loads and startup into the stage's."""
        self.compiling.absorb(report.compiling)
        self.measuring.absorb(report.measuring)
        self.startup_s += report.first_result_s if report.first_result_s is not None else report.wall_s

    @property
    def left(self) -> int:
        return len(self.left_keys)

    def to_json(self) -> dict:
        return {"stage": self.name, "counts": {k: n for k, n in self.counts.items() if n}, "pruned": self.pruned,
                "pruned_why": self.pruned_why, "left": self.left, "wall_s": round(self.wall_s, 1),
                "startup_s": round(self.startup_s, 1),
                **{f"{name}_{key}": round(value, 1) if key == "busy_s" else value
                   for name, load in (("compile", self.compiling), ("measure", self.measuring))
                   for key, value in (("workers", load.workers), ("busy_s", load.busy_s))},
                "measure_phases_s": {phase: round(s, 2) for phase, s in self.measuring.phases.items()}}


@dataclass
class TuningReport:
    """What the sweeps of one job did (``budget_s``: its budget): counts by status, wall time, why
    they stopped early (None: finished), and the same per stage (``stages``, in the order they ran)."""

    counts: dict = field(default_factory=dict)
    wall_s: float = 0.0
    stopped: str | None = None
    stages: dict = field(default_factory=dict)  # name -> StageCost
    budget_s: float | None = None

    def stage(self, name: str) -> StageCost:
        return self.stages.setdefault(name, StageCost(name))

    def add(self, report, stage: StageCost) -> None:
        for status, n in report.counts.items():
            self.counts[status] = self.counts.get(status, 0) + n
            stage.counts[status] = stage.counts.get(status, 0) + n
        self.stopped = self.stopped or report.stopped

    def left(self) -> int:
        """Variants the budget left, each once (a selection round may ask for one again)."""
        return len(set().union(*(s.left_keys for s in self.stages.values())))

    def to_json(self) -> dict:
        return {"budget_s": self.budget_s, "wall_s": round(self.wall_s, 1), "counts": {k: n for k, n in self.counts.items() if n},
                "stopped": self.stop_message() or None, "left": self.left(),
                "stages": [s.to_json() for s in self.stages.values()]}

    def lines(self) -> list[str]:
        """The job's summary of the tuning: the totals, why it stopped, then one line per stage."""
        lines = [f"Tuning: {describe(self.counts)} in {self.wall_s:.0f} s"
                 + (f"; {self.stop_message()}" if self.stopped else "")]
        for s in self.stages.values():
            lines.append(f"  {s.name}: {describe(s.counts) or 'nothing'}"
                         + (f"; {s.pruned} pruned ({s.pruned_why})" if s.pruned else "")
                         + (f"; {s.left} left by the budget" if s.left else "") + f"; {s.wall_s:.0f} s")
        return lines

    def rate_s(self) -> float | None:
        """Seconds of the stages that measured per variant measured (None: none was)."""
        measured = sum(n for s in self.stages.values() for status, n in s.counts.items() if status != "skipped")
        seconds = sum(s.wall_s for s in self.stages.values() if any(n for k, n in s.counts.items() if k != "skipped"))
        return seconds / measured if measured else None

    def stop_message(self) -> str:
        """Why the tuning stopped and what finishing it takes ('' where it finished)."""
        if not self.stopped:
            return ""
        left, rate = self.left(), self.rate_s()
        text = f"stopped: {self.stopped}; {left} variant(s) not measured"
        if rate is not None and left:
            more = left * rate  # rounded up: a budget that rounds down to the one given stops again
            text += f" (about {math.ceil(more)} s more at this run's {rate:.2f} s a variant)"
            if self.budget_s is not None:
                text += f": rerun to go on, or give --budget-s {math.ceil(self.budget_s + more / (1 - PLAN_SHARE))}"
                return text
        return text + ": rerun to go on"


OUTCOMES = {"ok": "timed", "checked": "checked", "failed": "failed", "too slow": "too slow", "wrong": "wrong",
            "skipped": "read back"}  # a sweep's counts (``harness.bench.SweepReport``) as the summary names them


def default_compile_workers(gpus: int) -> int:
    """Processes compiling kernels ahead of ``gpus`` measuring ones: ``COMPILE_WORKERS_PER_GPU`` a
    GPU, within the cores this process may run on less one for each measuring process and one for
    this one; at least ``MIN_COMPILE_WORKERS``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(MIN_COMPILE_WORKERS, min(COMPILE_WORKERS_PER_GPU * gpus, cores - gpus - 1))


def describe(counts: dict) -> str:
    """``counts`` (status -> variants) as '12 timed, 3 failed, 40 read back'."""
    return ", ".join(f"{n} {OUTCOMES.get(status, status)}" for status, n in counts.items() if n)


def tuning_pools(gpus: int | None = None, compile_workers: int | None = None) -> WorkerPools:
    """The worker processes of a tuning (``harness.bench.WorkerPools``, not started): a measuring
    process per GPU (``gpus``: the first that many; None: every GPU of the model of GPU 0) and
    ``compile_workers`` (None: ``default_compile_workers``), importing ``PRELOAD`` as they start on
    a GPU.  The main job starts the measuring processes before its analysis, so they are ready by
    its first sweep."""
    probe = Sweep(None, [], progress=False, processes=gpus)
    workers = default_compile_workers(probe.processes) if compile_workers is None else compile_workers
    return WorkerPools(workers, probe.processes, probe.measured, probe._env, preload=PRELOAD if probe.measured else ())


class Tuner:
    """The sweeps of one job over one database and one budget (its clock starts here), sharing their
    worker processes (``pools``: ``tuning_pools(gpus, compile_workers)`` unless given; ``close()`` ends
    them).  ``gpus``: measuring processes, one per GPU (None: every GPU of the model of GPU 0);
    ``compile_workers``: processes compiling kernels ahead of them (None: ``default_compile_workers``);
    ``retry_failed``: measure again the variants recorded 'failed' (e.g. timed out on a loaded machine)
    instead of skipping them."""

    def __init__(self, db, *, budget_s: float | None, progress: bool = True, compile_workers: int | None = None,
                 gpus: int | None = None, retry_failed: bool = False, pools: WorkerPools | None = None):
        self.db, self.budget_s, self.progress = db, budget_s, progress
        self.pools = pools or tuning_pools(gpus, compile_workers)
        self.compile_workers = self.pools.compile_workers
        self.retry_failed = retry_failed
        self.started = time.monotonic()
        self.report = TuningReport(budget_s=budget_s)
        self.ranker = Sweep(db, [], progress=False, processes=self.pools.processes)
        self.gpus = self.ranker.processes

    def close(self) -> None:
        """End the worker processes the sweeps shared."""
        self.pools.close()

    def __enter__(self) -> Tuner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def left(self, reserve: bool = False) -> float | None:
        """Seconds of the budget left (None: no budget); ``reserve``: less ``PLAN_SHARE`` of it."""
        if self.budget_s is None:
            return None
        kept = PLAN_SHARE * self.budget_s if reserve else 0.0
        return max(0.0, self.budget_s - kept - (time.monotonic() - self.started))

    def measure(self, variants, *, stage: str, pruned: int = 0, pruned_why: str = "", reserve: bool = True,
                past_budget: bool = False, **timing) -> None:
        """Sweep ``variants`` within what is left of the budget, less ``PLAN_SHARE`` of it where
        ``reserve`` (``tune``'s sweeps: the rest is for what the plan chose, ``tune_chosen`` and
        ``tune_chosen_gemms``), only counting those not measured yet where nothing is left; with
        ``past_budget``, whatever is left (the plan's own layout changes: ``measure_layout_changes``).
        Their cost goes to ``stage`` (``StageCost``), with the ``pruned`` variants its rule left out and why."""
        cost = self.report.stage(stage)
        cost.pruned += pruned
        cost.pruned_why = pruned_why or cost.pruned_why
        limit = None if past_budget else self.left(reserve)
        if limit == 0.0:
            left = self.ranker.unmeasured(variants)
            cost.left_keys |= left
            if left:  # a stage the database answers whole is not cut short
                self.report.stopped = self.report.stopped or self._used()
            return
        started = time.monotonic()
        swept = Sweep(self.db, variants, budget_s=limit, progress=self.progress, compile_workers=self.compile_workers,
                      processes=self.gpus, retry_failed=self.retry_failed, pools=self.pools, **timing).run()
        if swept.stopped:  # by the time limit: the job's budget, not what was left of it for this sweep
            swept.stopped = self._used()
            cost.left_keys |= self.ranker.unmeasured(variants)
        cost.wall_s += time.monotonic() - started
        cost.add_loads(swept)
        self.report.add(swept, cost)
        self.report.wall_s = time.monotonic() - self.started

    def _used(self) -> str:
        return f"time budget of {self.budget_s:g} s used ({PLAN_SHARE:.0%} of it kept for what the plan chose)"


def first_gemm_configs(dtype, count: int) -> list:
    """``FIRST_CONFIGS`` among ``valid_configs(dtype)``, then the others, ``count`` in all (the
    interpreter's tiny configurations: its first ``count``; ``dtype``: any spelling, ``dtypes.parse``)."""
    configs = valid_configs(parse_dtype(dtype).torch)
    preferred = [c for name in FIRST_CONFIGS for c in configs if str(c) == name]
    return (preferred + [c for c in configs if c not in preferred])[:count]


def tune(tuner: Tuner, fused, spaces: list, *, spec: str, dtype, attention: list, top: int = 1,
         layouts: int | None = None, first_configs: int = len(FIRST_CONFIGS), exhaustive: bool = False) -> TuningReport:
    """Run the sweeps on ``fused`` (a ``dataflow.snapshot.FusedTraining``; ``spaces``: its fused
    operators' variants, ``fused_spaces``) into ``db``, the most
    decisive first so that a budget cut leaves the least to the cost model: every access pattern
    of the fused operators and every GEMM through cuBLAS and ``first_configs`` Triton configurations
    (``first_gemm_configs``) on its first layout, in one sweep (``FIRST_STAGE``), then cuBLAS on the
    GEMMs' other layouts (``layouts`` of
    ``pick_layouts``; None: one per transposition pattern) with the heuristic's first algorithm, and the
    variants of each kernel family of ``datamove.families.GEMM_FAMILIES`` its pattern matches
    (grouped by the family's timing keywords; ``spec``: the spec's name); cuBLASLt's other
    algorithms on each GEMM's ``ALGORITHM_LAYOUTS`` fastest layouts (``fastest_layouts_algorithms``); the fused attention's
    configurations at each of ``attention`` (its family's setups, ``AttentionFamily.setups``, as
    ``datamove.job.attention_setups`` gives them; where the spec's Q/K/V bias add can fold into it,
    the fastest again with the biases: ``AttentionFamily.measure``); last, the knob settings of
    each fused operator's ``top`` fastest patterns, climbed round by round from the first stage's
    (``climb``).  The layout changes a plan inserts are measured
    afterwards (``measure_layout_changes``), once the selection has said which it wants.  ``dtype``:
    any spelling (``dtypes.parse``); the sweeps run in its torch dtype.  ``exhaustive``: what those
    rules prune is measured too (the reference ``benchmarks/tuning_cost.py`` compares the default
    plan with): cuBLASLt's algorithms on every layout, the Triton template's ``CHOSEN_LAYOUT_CONFIGS``
    fastest configurations of the first layout on every other, every knob setting of every access
    pattern, in one sweep."""
    dtype = parse_dtype(dtype).torch
    top, algorithm_layouts = (None, None) if exhaustive else (top, ALGORITHM_LAYOUTS)
    configs = first_gemm_configs(dtype, first_configs)
    gemms = training_gemms(fused)
    first = {g.name: gemm_variants(g, "cuda", dtype=dtype, layouts=1, first_configs=configs) for g in gemms}
    # one sweep: the GPUs time cuBLAS's GEMMs while the compile workers have no fused kernel ready
    tuner.measure([v for s in spaces for v in s.first_stage()] + [v for vs in first.values() for v in vs],
                  stage=FIRST_STAGE)
    later: dict[tuple, list] = {(): []}  # Tuner.measure's keywords -> the variants measured so
    deferred: dict[str, tuple] = {}  # GEMM -> (its variants timed, cuBLASLt's other algorithms on its other layouts)
    for g in gemms:
        ranked = [v.config for v in tuner.ranker.ranked(first[g.name]) if v.config is not None]
        others = gemm_variants(g, "cuda", dtype=dtype, layouts=layouts, first_configs=configs,
                               other_configs=ranked[:CHOSEN_LAYOUT_CONFIGS] if exhaustive else [])[len(first[g.name]):]
        later[()] += [v for v in others if v.algorithm == 0]
        deferred[g.name] = (first[g.name] + [v for v in others if v.algorithm == 0], [v for v in others if v.algorithm])
        tuning = Tuning(spec, dtype, "cuda", ranked, layouts)
        for family in GEMM_FAMILIES:
            pattern = family.match(fused, g)
            if pattern is not None:
                later.setdefault(tuple(sorted(family.timing.items())), []).extend(
                    family.variants(fused, g, pattern, tuning))
    for timing, variants in later.items():
        tuner.measure(variants, stage="GEMMs: other layouts, fused epilogues", **dict(timing))
    algorithms = [v for g in gemms for v in fastest_layouts_algorithms(tuner.ranker, *deferred[g.name], algorithm_layouts)]
    tuner.measure(algorithms, stage="GEMMs: cuBLASLt's other algorithms",
                  pruned=sum(len(deferred[g.name][1]) for g in gemms) - len(algorithms),
                  pruned_why=f"timed on each GEMM's {ALGORITHM_LAYOUTS} fastest layouts only")

    ATTENTION.measure(tuner, attention, dtype)

    groups = [group for s in spaces for group in s.fastest_patterns(tuner.ranker.ranked(s.first_stage()), top)]
    stage = "fused operators: knobs of the fastest patterns"
    if exhaustive:
        tuner.measure([v for group in groups for v in group], stage=stage)
        return tuner.report
    offered = climb(tuner, groups, stage=stage)
    considered = offered | {variant_key(v) for s in spaces for v in s.first_stage() if v is not s.eager}
    cost = tuner.report.stage(stage)
    cost.pruned += sum(variant_key(v) not in considered for s in spaces for v in s.variants() if v is not s.eager)
    cost.pruned_why = (f"only the knob settings next to the {CLIMB_BEAM} fastest found so far of each operator's "
                       f"{top} fastest access pattern(s), round by round")
    return tuner.report


def climb(tuner: Tuner, groups: list[list], *, stage: str, reserve: bool = True) -> set:
    """Climb each group's knob settings (one access pattern's variants; ``knob_climb``): sweep the
    settings next to the fastest found so far, round by round, until a round has nothing new;
    returns the keys of the variants offered (``knob_climb.variant_key``).  A spent budget ends it
    (the round's settings counted as left)."""
    offered: set = set()
    while True:
        new = next_round(groups, tuner.ranker.ranked, offered)
        if not new:
            return offered
        tuner.measure(new, stage=stage, reserve=reserve)


def fastest_layouts_algorithms(ranker, timed: list, deferred: list, keep: int | None = ALGORITHM_LAYOUTS) -> list:
    """The variants of ``deferred`` (a GEMM's cuBLASLt algorithms after the heuristic's first) on
    the ``keep`` layouts where ``timed``'s algorithm 0 of that GEMM is fastest (``ranker``:
    ``Sweep.ranked``).  Replayed on the H200 tuning database of the Llama 1B and 8B layers
    (52 GEMM calls, 38 of them over 8 layouts x 8 algorithms): with ``keep`` = 3, 895 of
    the 2225 other-algorithm variants are measured, and each GEMM's fastest time found is within
    0.27% of the exhaustive one on average, 3.75% at worst (1: 363, 0.58%, 5.1%)."""
    fastest: list[str] = []
    for v in ranker.ranked([v for v in timed if v.config is None and v.algorithm == 0]):
        key = canonical_json(v.layout)
        if key not in fastest:
            fastest.append(key)
    chosen = set(fastest[:keep])
    return [v for v in deferred if canonical_json(v.layout) in chosen]


def chosen_patterns(spaces: list, plan) -> tuple[list[list], list]:
    """(groups, composed): the variants of each access pattern that ``plan``'s generated steps run
    (``spaces``: ``sweep_variants``' ``OperatorSpace`` list), one list a pattern; and for a step
    combining its parts' own configurations (``composed``: in no pattern), that configuration at
    each warp count they were measured with and with each part's every knob setting of its layouts
    in turn, the others as chosen (``composed_neighbours``)."""
    chosen = {(s.name, access_pattern(_configuration(s))) for s in plan.steps if s.kind == GENERATED}
    groups = [group for space in spaces for pattern, group in space.patterns.items() if (space.op.name, pattern) in chosen]
    by_op = {space.op.name: space for space in spaces}
    composed = []
    for s in plan.steps:
        if s.kind == GENERATED and s.config.composed and s.name in by_op:
            space = by_op[s.name]
            composed += [space.variant(c) for c in composed_neighbours(space.ws.graph, space.op,
                                                                       _configuration(s), s.config.composed)]
    return groups, composed


def composed_neighbours(graph, op, config: Configuration, warps) -> list[Configuration]:
    """``config`` (an operator of several parts) at each of ``warps``, then with one part's knobs
    replaced by each other setting of that part's layouts, vector and order (its own
    ``configurations``), the other parts as they are: one round of tuning the parts together."""
    result = {}
    for w in warps:
        at_warps = Configuration(config.layouts, {**config.knobs, "num_warps": w})
        result.setdefault(at_warps.key(), at_warps)
    own = tuple(config.knobs["parts"])
    for k, part in enumerate(parts(op)):
        for candidate in configurations(graph, part):
            knobs = candidate.knobs
            if knobs["vector"] != own[k]["vector"] or knobs["order"] != own[k]["order"] \
                    or any(config.layouts[t] != layout for t, layout in candidate.layouts.items()):
                continue
            mine = {n: v for n, v in knobs.items() if n not in ("num_warps", "dropout")}
            neighbour = Configuration(config.layouts, {**config.knobs, "parts": own[:k] + (mine,) + own[k + 1:]})
            result.setdefault(neighbour.key(), neighbour)
    return list(result.values())


def _configuration(step) -> Configuration:
    return Configuration({**step.reads, **step.writes, **step.config.masks}, step.config.knobs)


def fused_spaces(fused, spec: str, dtype) -> list:
    """The variants of ``fused``'s element-wise / normalization operators on the GPU, per operator
    and access pattern (``harness.sweep_variants``): built once per job, swept by ``tune`` and
    ``tune_chosen``.  ``dtype``: any spelling (``dtypes.parse``)."""
    return sweep_variants(spec, fused, "cuda", dtype=parse_dtype(dtype).torch)[0]


def tune_chosen(tuner: Tuner, spaces: list, plan) -> int:
    """The knob settings of the layouts the plan chose for its generated operators (``spaces``:
    ``fused_spaces``), where ``tune`` measured only one (it tunes each operator's fastest
    first-stage layout; the selection may take another for the layout changes it saves), climbed
    from the fastest measured (``climb``), and its composed steps' neighbours (``chosen_patterns``);
    returns how many variants were measured, not read back."""
    before = sum(n for status, n in tuner.report.counts.items() if status != "skipped")
    groups, composed = chosen_patterns(spaces, plan)
    stage = "plan: knobs of its layouts"
    tuner.measure(composed, stage=stage, reserve=False)
    climb(tuner, groups, stage=stage, reserve=False)
    return sum(n for status, n in tuner.report.counts.items() if status != "skipped") - before


def change_free_algorithms(fused, plan, dtype) -> list:
    """cuBLASLt's algorithms of every plain GEMM step of ``plan`` that reads a tensor through a
    layout change, on the layouts where it reads that tensor as written (its other tensors as the
    step has them): ``tune`` times the other algorithms on each GEMM's fastest layouts by the first
    only, and one of them can make the change unnecessary (Llama-8B at B=1: ``d_w_down`` reading
    the SwiGLU product fbs had only its first algorithm, 0.696 ms, while bsf with the second took
    0.604, so the plan copied the product to bsf, 0.061 ms).  ``dtype``: torch."""
    from datamove.layouts.plan import LAYOUT_CHANGE

    sources = {(s.config.tensor, s.config.target): s.config.source for s in plan.steps if s.kind == LAYOUT_CHANGE}
    variants = []
    for step, g, layouts in _plain_gemm_steps(fused, plan):
        unchanged = {t: sources[(t, layout)] for t, layout in step.reads.items() if (t, layout) in sources}
        if unchanged:
            variants += [v for timed_as in layouts({**step.reads, **unchanged})
                         for v in layout_variants(g, "cuda", timed_as, dtype=dtype)]
    return variants


def chosen_layout_configs(ranker, fused, plan, dtype) -> list:
    """The Triton template on the layouts ``plan``'s plain GEMM steps run, with the
    ``CHOSEN_LAYOUT_CONFIGS`` configurations fastest on the GEMM's first layout, for each GEMM where
    the template came within ``COMPETITIVE`` of cuBLAS there (``ranker``: ``Sweep.ranked`` over the
    database): ``tune`` times it on each GEMM's first layout only, and on the H200 it beat cuBLAS
    at the large MLP GEMMs (Llama-1B's up/gate weight gradients 0.704 ms against 0.759, Llama-8B's
    SwiGLU input gradient 0.631 against 0.675) while the plan ran them in other layouts.  ``dtype``: torch."""
    configs = first_gemm_configs(dtype, len(FIRST_CONFIGS))
    variants = []
    for step, g, layouts in _plain_gemm_steps(fused, plan):
        first = gemm_variants(g, "cuda", dtype=dtype, layouts=1, first_configs=configs)
        ranked = ranker.ranked(first)
        triton, cublas = [v for v in ranked if v.config is not None], [v for v in ranked if v.config is None]
        fastest = [ranker.time_ms(v[0]) for v in (triton, cublas) if v]
        if len(fastest) < 2 or None in fastest or fastest[0] > COMPETITIVE * fastest[1]:
            continue
        chosen = [v.config for v in triton[:CHOSEN_LAYOUT_CONFIGS]]
        variants += [v for timed_as in layouts(step.reads) - {first[0].plan.layouts}
                     for v in layout_variants(g, "cuda", timed_as, dtype=dtype, algorithms=False, configs=chosen)]
    return variants


def _plain_gemm_steps(fused, plan) -> list:
    """(step, training GEMM, layouts) of each step of ``plan`` that runs one GEMM alone (no
    residual, no epilogue); ``layouts(reads)``: the (a, b, out) storage orders the GEMM is timed as
    where it reads ``reads`` and writes as the step does (``candidates.gemm_layouts``)."""
    from datamove.candidates import gemm_layouts
    from datamove.layouts.plan import GEMM

    gemms, ops = {g.name: g for g in training_gemms(fused)}, {op.name: op for op in fused.operators}
    result = []
    for step in plan.steps:
        if step.kind == GEMM and step.name in gemms and not step.config.residual and not step.config.epilogue:
            g = gemms[step.name]
            found = gemm_layouts(fused.graph, ops[g.name], g)[2]
            result.append((step, g, lambda reads, step=step, found=found: {
                timed_as for r, w, timed_as in found if r == reads and w == step.writes}))
    return result


def tune_chosen_gemms(tuner: Tuner, fused, plan, dtype) -> int:
    """Time ``plan``'s GEMMs where a measurement can change it: ``change_free_algorithms`` past the
    budget (a few variants a change), ``chosen_layout_configs`` within it; returns how many
    variants were new."""
    algorithms, configs = change_free_algorithms(fused, plan, dtype), chosen_layout_configs(tuner.ranker, fused, plan, dtype)
    new = len(tuner.ranker.unmeasured(algorithms)) + (len(tuner.ranker.unmeasured(configs)) if tuner.left() != 0.0 else 0)
    tuner.measure(algorithms, stage="plan: GEMM algorithms without its layout changes", past_budget=True)
    tuner.measure(configs, stage="plan: Triton GEMMs on its layouts", reserve=False)
    return new


def measure_layout_changes(tuner: Tuner, graph, changes, dtype) -> int:
    """Time the layout changes ``changes`` ((tensor, from, to), ...) of ``graph``, past the budget
    (``job.refine_plan`` says why); returns how many."""
    variants = {}
    for tensor, source, target in changes:
        letters = graph.tensors[tensor].letters
        sizes = {x: graph.size(x) for x in letters}
        variants[(letters, source, target)] = LayoutChangeVariant(letters, sizes, source, target, dtype, "cuda")
    tuner.measure(list(variants.values()), stage="plan: its layout changes", past_budget=True)
    return len(variants)
