"""What a kernel family fused onto a training GEMM provides, and what it is given.

A family (``datamove.families``: the residual add, the forward epilogue, the gradient epilogue)
is one class holding the four things the pipeline asks of it:

- ``match(fused, gemm)``: its graph pattern and legality check on the fused training graph, the
  pattern found (a frozen dataclass) or None;
- ``variants(fused, gemm, pattern, tuning)``: its tuning variants (``harness.bench.Variant``),
  measured by ``datamove.tuning`` with ``timing`` (``Tuner.measure``'s keywords);
- ``candidates(builder, site, pattern)``: its selection candidates (``layouts.select.Candidate``),
  timed by ``builder`` (``datamove.candidates.CandidateBuilder``: the tuning database, else the
  cost model), kept in the run ``f"{gemm}+{name}"``;
- for families with a step configuration of their own (``config_type``, a
  ``layouts.step_config`` class held as ``ContractionConfig.epilogue``): ``launch(step, graph,
  ops)``, the runtime's ``EpilogueLaunch`` for a step of the plan.

``moves_consumer``: the selection runs the pattern's consumer right after its GEMM where nothing
between writes what it reads (``execution_order``), so one candidate can
cover both.

A family that runs a group of the fused graph's operators as steps of its own (the fused
attention) is a ``GraphFamily`` instead: its doc says what it provides.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from datamove.harness.contraction_variants import DTYPE, SharedTensors, TrainingGemm, training_gemms
from datamove.harness.sweep_variants import MASK_SEED
from datamove.harness.torch_eval import evaluate, graph_inputs
from datamove.kernels.gemm import fitted

EPILOGUE_CONFIGS = 3  # the GEMM's fastest Triton configurations a fused epilogue is timed with (epilogue_configs)


@dataclass(frozen=True)
class PlainLayout:
    """One layout combination of a GEMM's plain candidates: its reads and writes ({tensor: layout}),
    the plan it was timed as ((a, b, out) storage orders) and whether that was measured."""

    reads: dict
    writes: dict
    timed_as: tuple
    measured: bool


@dataclass(frozen=True)
class GemmSite:
    """A training GEMM where the selection builds candidates: ``op`` its fused operator,
    ``members`` ({"a", "b", "out": [tensor, ...]}, a stacked operand's members), ``renames``
    ({tensor: {einsum letter: the tensor's own letter}}), ``plain`` its plain candidates' layouts."""

    gemm: TrainingGemm
    op: object
    members: dict
    renames: dict
    plain: list = field(default_factory=list)


@dataclass(frozen=True)
class Tuning:
    """What a family's variants are built with: the spec's name, the dtype, the device, the GEMM's
    Triton configurations measured so far, fastest first (``ranked``), and how many layout
    combinations of the GEMM are measured."""

    spec: str
    dtype: torch.dtype
    device: str
    ranked: list
    layouts: int | None = None  # layout combinations per GEMM (``harness.contraction_variants.pick_layouts``)


class EpilogueLaunch:
    """A plan step's fused epilogue at run time: ``__call__(a, b, read, output, run)`` runs the GEMM
    with it (``a``, ``b``: the operands as the step's einsum reads them; ``read(tensor)`` /
    ``output(tensor)``: a tensor of the store / a new output in the step's layout; ``run``: the
    call's values, its dropout ``seed``) and returns {tensor: written tensor}.  ``after``: (step,
    operator) of a generated kernel to run after it, or None."""

    after: tuple | None = None

    def __call__(self, a: torch.Tensor, b: torch.Tensor, read: Callable, output: Callable, run) -> dict:
        raise NotImplementedError


class GemmFamily:
    """Base of a family fused onto a training GEMM (module doc)."""

    name = ""
    moves_consumer = False
    config_type: type | None = None
    timing: dict = {}

    def match(self, fused, gemm: TrainingGemm):
        raise NotImplementedError

    def consumer(self, pattern) -> str:
        """The fused operator the pattern takes into the GEMM's step."""
        return pattern.consumer

    def variants(self, fused, gemm: TrainingGemm, pattern, tuning: Tuning) -> list:
        raise NotImplementedError

    def candidates(self, builder, site: GemmSite, pattern) -> list:
        raise NotImplementedError

    def launch(self, step, graph, ops: dict) -> EpilogueLaunch:
        raise NotImplementedError(f"{type(self).__name__} has no step configuration of its own")


def epilogue_configs(ranked: list, slices: bool, saves: bool = False, dtype=torch.bfloat16) -> list:
    """The configurations a fused epilogue is timed with: each of the ``EPILOGUE_CONFIGS`` fastest of
    ``ranked`` (its GEMM's Triton configurations, fastest first) with the epilogue split as
    ``kernels.gemm`` chooses (column slices in turn where dropout would hold many elements a thread),
    then, with ``slices`` (an epilogue holding many values a thread: dropout's draws, a gradient
    epilogue's factor; without dropout the split chosen is already 1), on the whole tile and in two
    halves (``epilogue_split`` 1: one pass, more registers, each Philox call drawn once in the
    accumulator's layout; on the H200 BERT-large's FFN GEMM with bias + ReLU + dropout took 0.071 ms
    so against 0.101 in four slices, ``benchmarks/results/README.md``; persistent and stored by TMA
    on an H100, two halves 62.0 us, the whole tile 66.1).  With ``saves`` (the epilogue also writes
    the value before its activation or dropout), each with as many pipeline stages as fit beside
    that store's shared memory (``kernels.gemm.fitted``)."""
    configs = list(ranked[:EPILOGUE_CONFIGS])
    configs += [replace(c, epilogue_split=split) for c in configs for split in (1, 2)
                if slices and c.epilogue_split not in (1, 2)]
    return list(dict.fromkeys(f for f in (fitted(c, dtype, saves) for c in configs) if f is not None))


def gemm_config_of(knobs: dict) -> dict:
    """The ``kernels.gemm.GemmConfig`` fields of a Triton configuration's tuning-DB knobs (not its
    backend, template hash or a gradient epilogue's rest configuration)."""
    return {k: v for k, v in knobs.items() if k not in ("backend", "template", "rest")}


def operator_named(fused, name: str):
    """The fused graph's operator ``name``."""
    return next(o for o in fused.operators if o.name == name)


class ConsumerOperands(SharedTensors):
    """The inputs of ``gemm`` and of its pattern's consumer (``epilogue.consumer``; random, float64),
    the float64 evaluation of their primitives and PyTorch's rule in ``dtype`` (every primitive in
    that dtype), shared by the variants of one fused pattern (``SharedTensors``)."""

    def __init__(self, training, gemm: TrainingGemm, epilogue, device, dtype=DTYPE, seed: int = 1):
        self.training, self.gemm, self.epilogue = training, gemm, epilogue
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed

    def primitives(self) -> list:
        ops = {o.name: o for o in self.training.operators}
        return [*ops[self.gemm.name].primitives, *ops[self.epilogue.consumer].primitives]

    def make(self) -> dict:
        """{"values" (float64 inputs by tensor name), "reference" (float64), "baseline" (``dtype``)};
        the first only with ``inputs_only``."""
        graph, prims = self.training.graph, self.primitives()
        values = graph_inputs(graph, prims, self.seed, self.device, torch.float64, MASK_SEED)
        if self.inputs_only:
            return {"values": values}
        return {"values": values, "reference": evaluate(graph, prims, values),
                "baseline": evaluate(graph, prims, {t: v.to(self.dtype) for t, v in values.items()}, self.dtype)}


def execution_order(fused, gemm_families) -> list[str]:
    """The fused graph's operators in order, but the consumer of a GEMM family that moves it
    (``GemmFamily.moves_consumer``: the gradient epilogue, the residual add) right after its GEMM
    where no operator between writes what it reads (GPT-2's ``d_bfc`` after ``d_gelu``, before
    ``d_wout``), so that one candidate can run both (the selection takes contiguous runs)."""
    order = [op.name for op in fused.operators]
    ops = {op.name: op for op in fused.operators}
    for g in training_gemms(fused):
        found = next((f.consumer(p) for f in gemm_families if f.moves_consumer for p in (f.match(fused, g),)
                      if p is not None), None)
        if found is None:
            continue
        start, at = order.index(g.name), order.index(found)
        between = {t for name in order[start + 1:at] for t in ops[name].outputs}
        if at > start + 1 and not between & set(ops[found].inputs):
            order.insert(start + 1, order.pop(at))
    return order


class GraphFamily:
    """Base of a kernel family that runs a group of the fused graph's operators as steps of its own
    (the fused attention, ``families.attention``), registered in ``GRAPH_FAMILIES``:

    - ``match(fused)``: its pattern (a frozen dataclass), or (None, why not);
    - ``setups(fused, dtype_name)``: what the tuning measures of it (none without its pattern), and
      ``measure(tuner, setups, dtype)``: measures their variants through ``tuner``
      (``datamove.tuning.Tuner``: ``measure(variants, **timing)``, ``ranker.ranked(variants)``);
    - ``offer(builder, pattern, runs, kept)``: its selection candidates, {run name: [Candidate]},
      timed by ``builder`` (``datamove.candidates.CandidateBuilder``); ``runs``: the other
      operators' candidates so far, {run name: [Candidate]}; ``kept(candidates)``: those of a run
      the search keeps;
    - ``fact(pattern, why)``: what the plan's facts say of it, under ``name``;
    - ``launchers``: {plan step kind: factory(step, graph, buffers, saves_mask)} of its steps'
      ``datamove.kernels.launcher.Launcher`` subclasses (``datamove.runtime.steps.build_launcher``)."""

    name = ""
    launchers: dict = {}

    def match(self, fused) -> tuple[object | None, str]:
        raise NotImplementedError

    def setups(self, fused, dtype_name: str) -> list:
        raise NotImplementedError

    def measure(self, tuner, setups: list, dtype) -> None:
        raise NotImplementedError

    def offer(self, builder, pattern, runs: dict, kept) -> dict:
        raise NotImplementedError

    def fact(self, pattern, why: str) -> str:
        raise NotImplementedError
