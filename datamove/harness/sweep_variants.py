"""Variants of the fused element-wise / normalization operators of a training graph, for ``harness.bench.Sweep``.

For each such operator of a ``dataflow.snapshot.FusedTraining`` and each configuration of
``layouts.space.configurations`` (pruned, or ``exhaustive``), a ``FusedVariant`` compiles the
generated kernel (``kernels.codegen``), runs it on bf16 inputs stored in the configuration's
layouts and checks every output; an ``EagerVariant`` per operator runs PyTorch eager's sequence
of the unfused operators it replaces (``harness.eager``), checked the same way, so its time lands
in the same tuning DB in the same run.

Inputs are realistic: one ``Workspace`` per graph evaluates the whole fused training graph in
float64 torch on the device (``harness.torch_eval.evaluate_training_graph``: layer inputs and
incoming gradients N(0, 1), Philox dropout masks), so each operator reads what training gives it
(softmax probabilities, normalised values with their standard deviations ...).  Check: every
output against that float64 value, by ``harness.accuracy``'s rule, with PyTorch's error taken
from the operator's primitives evaluated in bf16 on the same bf16 inputs.  The workspace is built
on first use only, so a sweep whose variants are all in the DB never computes it.

Keys: ``op`` = ``"<spec>:<operator>:<hash of its primitives>"`` (``#eager`` appended for the
baseline), ``dims`` = the graph's dim values, ``dtype`` = "bfloat16" (``DTYPE``), ``layout`` = {tensor: storage
order}, ``knobs`` = the configuration's knobs (eager: {"impl": "torch-eager"}).
"""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass

import torch

from datamove.dataflow.shuffle import shuffle_of
from datamove.dtypes import BF16, parse
from datamove.harness.accuracy import Closeness
from datamove.kernels.codegen import GENERATOR_VERSION, allocate, compile_operator
from datamove.harness.eager import EagerRun, eager_inputs, eager_layout, eager_plan, normalised_letters
from datamove.harness.torch_eval import dropout_offsets, evaluate, evaluate_training_graph, keep_mask_torch
from datamove.layouts.space import (access_pattern, column_sum_joins, configurations, default_configuration,
                                    join_members, masks_grouped, parts, representatives)

DTYPE = BF16.torch  # what the sweep measures; the Triton interpreter rounds fp32 -> bf16 toward
# zero (GPUs round to nearest), so CPU checks of generated kernels use float32 instead
MASK_SEED = 0x5EED
CANCELLED_RMS = 1e-3  # a reference output with a smaller RMS is a cancellation (see ``judge``)


def op_signature(spec: str, op) -> str:
    """``spec:name:hash``: the hash covers the primitives (kinds, expressions, operands' letters) and
    ``kernels.codegen.GENERATOR_VERSION`` (a configuration's timing holds for the kernel it generated)."""
    text = json.dumps([GENERATOR_VERSION] + [[p.name, p.kind, p.expr, [[o.tensor, o.letters] for o in p.inputs],
                                              [p.output.tensor, p.output.letters]] for p in op.primitives])
    return f"{spec}:{op.name}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def fused_operators(training) -> list:
    """The element-wise and normalization operators of the fused graph (contractions are swept elsewhere)."""
    return [op for op in training.operators if op.cls != "contraction"]


def moved_bytes(graph, op, itemsize: int = 2) -> int:
    """Distinct elements of the operator's inputs and outputs x ``itemsize``; dropout masks are
    regenerated from (seed, offset), so not counted."""
    return tensor_bytes(graph, list(op.inputs) + list(op.outputs), itemsize)


def tensor_bytes(graph, tensors, itemsize: int = 2) -> int:
    """Distinct elements of the graph tensors among ``tensors`` x ``itemsize``, dropout masks not
    counted (regenerated, never stored), nor names the graph does not hold (a plan's own tensors,
    e.g. attention's logsumexp)."""
    held = [t for t in dict.fromkeys(tensors) if t in graph.tensors and graph.tensors[t].role != "dropout"]
    return itemsize * sum(graph.size(graph.tensors[t].letters) for t in held)


def judge(result: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor) -> Closeness:
    """``harness.accuracy``'s rule (error <= 1.5 x PyTorch's error + 1e-4), errors relative to
    ``max(||reference||, CANCELLED_RMS * sqrt(numel))``.  The workspace's tensors are of unit
    scale, so a float64 reference far below it is a cancellation, not a value: the key-bias
    gradient is exactly zero (softmax is shift-invariant), and relative to its float64 rounding
    noise every result would be wrong by 1e8 or right by chance."""
    reference = reference.detach().double()
    if not torch.isfinite(result).all():
        return Closeness(float("inf"), float("nan"), False)
    scale = max(float(torch.linalg.vector_norm(reference)), CANCELLED_RMS * reference.numel() ** 0.5)
    error = float(torch.linalg.vector_norm(result.double() - reference)) / scale
    baseline_error = float(torch.linalg.vector_norm(baseline.double() - reference)) / scale
    return Closeness(error, baseline_error, error <= 1.5 * baseline_error + 1e-4)


@dataclass(frozen=True)
class Verdict:
    """Every output's ``harness.accuracy.Closeness``; ``error`` / ``baseline_error`` of the worst."""

    results: tuple  # ((tensor, Closeness), ...)

    @property
    def passed(self) -> bool:
        return all(c.passed for _, c in self.results)

    def _worst(self):
        return max(self.results, key=lambda r: r[1].error / (1.5 * r[1].baseline_error + 1e-4))[1]

    @property
    def error(self) -> float:
        return self._worst().error

    @property
    def baseline_error(self) -> float:
        return self._worst().baseline_error

    def __str__(self) -> str:
        return "; ".join(f"{t}: {c}" for t, c in self.results)


_VALUES: dict[str, dict] = {}  # Workspace.token -> its float64 values (the last workspace's, in this process)
KEPT_SHARE = 0.25  # of a GPU's memory, the most a workspace's values hold between sweeps (Llama-8B's: more)


def _keepable(values: dict, device: torch.device) -> bool:
    """Whether ``values`` may stay in this process between sweeps (``KEPT_SHARE``; on the CPU: always)."""
    if device.type != "cuda":
        return True
    held = sum(t.numel() * t.element_size() for t in values.values())
    return held <= KEPT_SHARE * torch.cuda.get_device_properties(device).total_memory


class Workspace:
    """Tensors shared by the variants of one graph on one device, computed on first use.

    ``values``: float64 value of every tensor of the training graph; ``baseline(op)``: the
    operator's primitives in ``dtype`` on its inputs rounded to ``dtype``; ``keep(mask)``: boolean masks.
    Only one variant's buffers are alive at a time (``activate``)."""

    def __init__(self, training, device, dtype=DTYPE, seed: int = 0, mask_seed: int = MASK_SEED):
        self.training, self.graph, self.dtype = training, training.graph, dtype
        self.device, self.seed, self.mask_seed = torch.device(device), seed, mask_seed
        self.offsets = dropout_offsets(self.graph)
        self.token = uuid.uuid4().hex  # names its values in ``_VALUES``, in any process it travels to
        self._active = None
        self._baselines: dict[str, dict] = {}
        self._masks: dict[str, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        """Pickled (for a measuring process) without what it holds: rebuilt there on first use."""
        return {k: v for k, v in self.__dict__.items() if k != "_values"} | {"_active": None, "_baselines": {}, "_masks": {}}

    @property
    def values(self) -> dict:
        """Float64 value of every tensor of the training graph, evaluated on first use; kept for the
        process (``_VALUES``: a measuring process then finds them in the next sweep's copy of this
        workspace, through the other sweeps between) where they take at most ``KEPT_SHARE`` of the
        device's memory, else with this object only."""
        held = _VALUES.get(self.token, self.__dict__.get("_values"))
        if held is None:
            _VALUES.clear()  # one workspace's at a time: the previous one's memory first
            held = evaluate_training_graph(self.graph, self.training.operators, self.seed, self.device, self.mask_seed)
            if _keepable(held, self.device):
                _VALUES[self.token] = held
            else:
                self._values = held
        return held

    def baseline(self, op) -> dict:
        """``op``'s primitives in ``dtype`` on its inputs rounded to ``dtype`` (and its shuffles' constants,
        ``dataflow.shuffle``: no inputs, exact in any dtype) (computed once per operator)."""
        if op.name not in self._baselines:
            shuffled = [s.constant for p in op.primitives if (s := shuffle_of(self.graph, p)) is not None]
            inputs = {t: self.values[t].to(torch.float32) if self.graph.tensors[t].role == "dropout"
                      else self.values[t].to(self.dtype) for t in [*op.inputs, *shuffled]}
            self._baselines[op.name] = evaluate(self.graph, op.primitives, inputs, self.dtype)
        return self._baselines[op.name]

    def keep(self, mask: str) -> torch.Tensor:
        """Dropout mask ``mask``'s keep decisions (bool, its letters' order), drawn once per object
        (held by it, not by a cache outside: a measuring process lets each sweep's copy go)."""
        if mask not in self._masks:
            info = self.graph.tensors[mask]
            shape = tuple(self.graph.dim_values[self.graph.letter_dims[l]] for l in info.letters)
            self._masks[mask] = keep_mask_torch(self.mask_seed, self.offsets[mask], shape, info.p, self.device)
        return self._masks[mask]

    def seeds(self, op) -> dict:
        return {t: (self.mask_seed, self.offsets[t]) for t in op.inputs if self.graph.tensors[t].role == "dropout"}

    def activate(self, variant) -> None:
        """Make ``variant`` the one holding buffers; the previous one lets its buffers go."""
        if self._active is not None and self._active is not variant:
            self._active.release()
        self._active = variant

    def verdict(self, op, results: dict) -> Verdict:
        """Closeness of every output of ``op`` found in ``results`` (at least one)."""
        baseline = self.baseline(op)
        checked = [(t, judge(results[t], baseline[t], self.values[t])) for t in op.outputs if t in results]
        if not checked:
            raise ValueError(f"{op.name}: none of its outputs {op.outputs} was produced")
        return Verdict(tuple(checked))


class FusedVariant:
    """One configuration of a generated fused kernel (the ``harness.bench.Variant`` protocol)."""

    flop = None

    def __init__(self, workspace: Workspace, spec: str, op, config):
        self.ws, self.op_obj, self.config = workspace, op, config
        self.op = op_signature(spec, op)
        self.dims, self.dtype = dict(workspace.graph.dim_values), parse(workspace.dtype).name
        self.layout = dict(config.layouts)
        self.knobs = dict(config.knobs)
        self.bytes = moved_bytes(workspace.graph, op, workspace.dtype.itemsize)
        self.compiled = self.tensors = None

    def build(self) -> None:
        self.ws.activate(self)
        graph, values = self.ws.graph, self.ws.values
        self.compiled = compile_operator(graph, self.op_obj, self.config)
        self.tensors = {}
        regenerate = self.config.knobs.get("dropout", "regenerate") == "regenerate"
        for t in self.op_obj.inputs:
            if regenerate and graph.tensors[t].role == "dropout":
                continue
            stored = allocate(graph, t, self.config.layouts.get(t, graph.tensors[t].letters), self.ws.dtype, self.ws.device)
            stored.copy_(values[t])
            self.tensors[t] = stored
        self.seeds = self.ws.seeds(self.op_obj)
        self.run()

    def run(self) -> dict:
        return self.compiled.run(self.tensors, self.seeds)

    def check(self) -> Verdict:
        return self.ws.verdict(self.op_obj, self.run())

    def compile_task(self) -> tuple:
        """(function, args) compiling this variant's kernel in another process (``harness.bench.Sweep``)."""
        return _compile_ahead, (self.ws.graph, self.op_obj, self.config, self.ws.dtype, self.ws.seeds(self.op_obj))

    def release(self) -> None:
        self.tensors = None


def _compile_ahead(graph, op, config, dtype, seeds) -> None:
    compile_operator(graph, op, config).warmup(dtype, seeds)


class EagerVariant:
    """PyTorch eager's unfused sequence for one fused operator (``harness.eager``)."""

    flop = None
    bytes = None

    def __init__(self, workspace: Workspace, spec: str, op):
        self.ws, self.op_obj = workspace, op
        self.op = op_signature(spec, op) + "#eager"
        self.dims, self.dtype = dict(workspace.graph.dim_values), parse(workspace.dtype).name
        last, steps = normalised_letters(workspace.training, op), eager_plan(workspace.training, op)
        self.layout = {"steps": [s.kind for s in steps],
                       "storage": {t: eager_layout(workspace.graph.tensors[t].letters, last)
                                   for t in eager_inputs(workspace.training, steps, op)}}
        self.knobs = {"impl": "torch-eager"}
        self.runner = None

    def build(self) -> None:
        self.ws.activate(self)
        masks = {t: self.ws.keep(t) for t in self.ws.graph.tensors if self.ws.graph.tensors[t].role == "dropout"}
        self.runner = EagerRun(self.ws.training, self.op_obj, self.ws.values, masks, self.ws.dtype)
        self.runner()

    def run(self) -> dict:
        return self.runner()

    def check(self) -> Verdict:
        return self.ws.verdict(self.op_obj, self.run())

    def release(self) -> None:
        self.runner = None


@dataclass
class OperatorSpace:
    """One fused operator's variants: ``eager`` (PyTorch's unfused sequence; None for a join of
    fused operators, ``layouts.space.column_sum_joins``, whose members have theirs) and, per access
    pattern of its configurations (``layouts.space.access_pattern``), the variants of that pattern
    with ``representatives``' choice first."""

    op: object
    eager: EagerVariant | None
    patterns: dict  # access pattern -> [FusedVariant, ...]
    spec: str
    ws: Workspace

    def variant(self, config) -> "FusedVariant":
        """A variant of any configuration of this operator, in or out of ``patterns`` (a combination
        of its parts' own configurations, ``datamove.candidates.CandidateBuilder.composed``)."""
        return FusedVariant(self.ws, self.spec, self.op, config)

    def variants(self) -> list:
        """The eager baseline and every configuration."""
        return [v for v in [self.eager] if v] + [v for group in self.patterns.values() for v in group]

    def first_stage(self) -> list:
        """The eager baseline and one configuration per access pattern (every layout, default knobs)."""
        return [v for v in [self.eager] if v] + [group[0] for group in self.patterns.values()]

    def fastest_patterns(self, ranked: list, top: int | None) -> list[list]:
        """The variants of each of the ``top`` access patterns (None: all) whose first-stage
        variants come first in ``ranked`` (``harness.bench.Sweep.ranked`` of ``first_stage()``),
        one list a pattern, its first-stage variant first."""
        best = [access_pattern(v.config) for v in ranked if isinstance(v, FusedVariant)][:top]
        return [self.patterns[pattern] for pattern in best]


def sweep_variants(spec: str, training, device, *, dtype=DTYPE, exhaustive: bool = False,
                   limit_ops: int | None = None, limit_configs: int | None = None,
                   seed: int = 0) -> tuple[list[OperatorSpace], dict]:
    """(spaces, notes): one ``OperatorSpace`` per fused operator (the first ``limit_ops``), then one
    per join of them (``layouts.space.column_sum_joins``), with at most ``limit_configs``
    configurations each.  ``notes``: {operator: why it has no configurations}."""
    ws = Workspace(training, device, dtype, seed)
    spaces, notes = [], {}
    ops = fused_operators(training)[:limit_ops]
    names = {op.name for op in ops}
    joins = [join for join in column_sum_joins(training.graph, training.operators)
             if set(join_members(join, training.operators)) <= names]
    for op, eager in [(op, EagerVariant(ws, spec, op)) for op in ops] + [(join, None) for join in joins]:
        try:
            configs = configurations(training.graph, op, exhaustive=exhaustive)[:limit_configs]
        except Exception as exc:  # an operator the layout space cannot describe yet
            configs, notes[op.name] = [], f"no configurations: {type(exc).__name__}: {exc}"
        first = {access_pattern(c): c for c in representatives(configs, masks_grouped(training.graph, op))}
        base = default_configuration(training.graph, op) if len(parts(op)) > 1 else None
        if base is not None and any(c.key() == base.key() for c in configs):  # what the parts' times are taken against
            first[access_pattern(base)] = next(c for c in configs if c.key() == base.key())
        patterns: dict = {}
        for config in configs:
            patterns.setdefault(access_pattern(config), []).append(config)
        spaces.append(OperatorSpace(op, eager, {
            pattern: [FusedVariant(ws, spec, op, c) for c in [first[pattern]] + [c for c in group if c is not first[pattern]]]
            for pattern, group in patterns.items()}, spec, ws))
    return spaces, notes
