"""Variants of the training graph's contractions (GEMMs) for ``harness.bench.Sweep``.

``training_gemms`` reads the contractions off a fused training graph (``dataflow.snapshot``'s
``FusedTraining``): each contraction operator gives one einsum, its primitive's; an operator that
stacks several einsums of one pattern (Q/K/V, their dX and dW) gives the stacked einsum of
``kernels.contraction.stacked_spec``, the stack letter over the operand that is not shared
(over both, summed away, when a map adds the einsums' results).  Letter sizes come from the
graph's dims; the label is the graph's operator name.

For one such ``TrainingGemm``, ``pick_layouts`` chooses mappable layout combinations
(``contraction.blas_plans``): spec order first if it is a BLAS GEMM, then one BLAS plan (at most one
batch dim) per new transposition pattern.  ``gemm_variants`` gives, per chosen plan, a
``GemmVariant`` for the cuBLAS path (``run_cublas``; on CUDA one per algorithm of cuBLASLt's
heuristic, ``cublas_algorithms``) and one per Triton config (``run_triton``); with ``residual``,
cuBLASLt adding a tensor as it writes (``D = A B + C``).  The patterns fused onto a GEMM (the
residual add, the epilogues) and their variants are the kernel families of ``datamove.families``.

Operands: random normal in ``dtype`` (never zeros), stored in each variant's layouts; one
``Operands`` per GEMM, computed on first use, holding the float64 reference (``torch.einsum``
on the device) and PyTorch's own result (``torch.einsum`` in ``dtype`` on the same operands,
the baseline of ``harness.accuracy``'s rule); only one GEMM's operands are alive at a time.
Checks: ``harness.sweep_variants.judge`` (error <= 1.5 x PyTorch's + 1e-4, on the device);
outputs are filled with NaN before each checked run, so an unwritten element fails.

Keys: ``op`` = ``"gemm:<einsum>"`` (epilogue: ``"gemm:<einsum>+bias[<letters>]+relu+dropout(<p>)"``; adding a
residual, ``ResidualAdd``: ``"gemm:<einsum>+residual"``),
``dims`` = {letter: size}, ``dtype``, ``layout`` = {"a", "b", "out": storage order}, ``knobs`` =
{"backend": "cublas"} (the heuristic's first algorithm, PyTorch's call; {"backend": "cublas", "algorithm": n}: its
n-th, ``kernels.blas.ALGORITHMS`` of them where cuBLASLt takes the call on a CUDA device) or
{"backend": "triton", <GemmConfig fields>, "template": <its source hash>} (epilogue baseline:
{"backend": "cublas+eager"}).  ``flop`` = 2 x the product of all letter sizes; ``bytes`` =
elements of A, B and the output (plus bias and saved value) x the item size.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from datamove.dtypes import BF16, parse as parse_dtype
from datamove.kernels.blas import LtMatmul, algorithm_count
from datamove.kernels.contraction import (GemmPlan, blas_plans, cublas_views, empty_in_layout, flops, parse,
                                          run_cublas, run_triton, stacked_spec)
from datamove.kernels.gemm import TEMPLATE_ID, GemmConfig, GemmShape, tma_compatible, valid_configs
from datamove.harness.sweep_variants import Verdict, judge

DTYPE = BF16.torch
STACK_LETTERS = "stuvwxyz"  # the first one not in the einsum becomes the stack letter


@dataclass(frozen=True)
class TrainingGemm:
    """One contraction of the training graph as an einsum over sized letters."""

    name: str  # the operator's name in the fused training graph
    phase: str  # "forward" / "backward"
    spec: str  # einsum, e.g. "ui,ibj->ubj"
    sizes: dict  # letter -> size
    stacked: int = 1  # einsums stacked into this one

    @property
    def op(self) -> str:
        return f"gemm:{self.spec}"

    @property
    def flop(self) -> int:
        return flops(parse(self.spec), self.sizes)


def _letter_size(graph, letter: str) -> int:
    return graph.dim_values[graph.letter_dims[letter]]


def _stacked(graph, op, einsums) -> tuple[str, dict]:
    """The stacked einsum of several einsums of one pattern, and its letter sizes."""
    first = einsums[0]
    letters = first.inputs[0].letters + first.inputs[1].letters + first.output.letters
    for other in einsums[1:]:
        other_letters = other.inputs[0].letters + other.inputs[1].letters + other.output.letters
        rename = dict(zip(other_letters, letters))
        if (len(other_letters) != len(letters) or len(set(rename.values())) != len(rename)
                or any(_letter_size(graph, x) != _letter_size(graph, rename[x]) for x in other_letters)):
            raise ValueError(f"{op.name}: einsums {first.expr!r} and {other.expr!r} are not one pattern")
    shared = [i for i in (0, 1) if len({e.inputs[i].tensor for e in einsums}) == 1]
    stacked = [i for i in (0, 1) if i not in shared]
    outputs = {e.output.tensor for e in einsums}
    summed = any(p.kind == "map" and {o.tensor for o in p.inputs} == outputs and p.expression.is_sum_of_inputs()
                 for p in op.primitives)
    if len(stacked) == 2 and not summed:
        raise ValueError(f"{op.name}: no operand shared and the results are not summed: not one stacked GEMM")
    if len(stacked) != 2 and summed:
        raise ValueError(f"{op.name}: results summed but an operand is shared")
    letter = next(x for x in STACK_LETTERS if x not in first.expr)
    spec = stacked_spec(first.expr, stacked, letter)
    sizes = {x: _letter_size(graph, x) for x in set(letters)}
    sizes[letter] = len(einsums)
    return spec, sizes


def training_gemms(training) -> list[TrainingGemm]:
    """The contraction operators of a fused training graph, in execution order, as einsums."""
    graph = training.graph
    result = []
    for op in training.operators:
        if op.cls != "contraction":
            continue
        einsums = [p for p in op.primitives if p.kind == "einsum"]
        if len(einsums) == 1:
            spec = einsums[0].expr
            sizes = {x: _letter_size(graph, x) for x in set(spec) if x.isalpha()}
        else:
            spec, sizes = _stacked(graph, op, einsums)
        result.append(TrainingGemm(op.name, op.phase, spec, sizes, len(einsums)))
    return result


@functools.lru_cache(maxsize=64)
def _blas_plans(spec: str, sizes: tuple) -> tuple[GemmPlan, ...]:
    """The BLAS plans with one batch dim at most of einsum ``spec`` at ``sizes`` ((letter, size), ...)."""
    return tuple(p for p in blas_plans(parse(spec), dict(sizes)) if p.batch_dims <= 1)


def pick_layouts(gemm: TrainingGemm, count: int | None) -> list[GemmPlan]:
    """Spec-order layouts if they are a BLAS GEMM, then the first BLAS plan (one batch dim at most)
    of each new transposition pattern (A, B, C), in enumeration order; the first ``count``."""
    c = parse(gemm.spec)
    plans = _blas_plans(gemm.spec, tuple(sorted(gemm.sizes.items())))
    chosen = [p for p in plans if p.layouts == (c.a, c.b, c.out)]
    seen = {(p.a_transposed, p.b_transposed, p.c_transposed) for p in chosen}
    for p in plans:
        pattern = (p.a_transposed, p.b_transposed, p.c_transposed)
        if pattern not in seen:
            chosen.append(p)
            seen.add(pattern)
    return chosen[:count]


def blas_call(plan: GemmPlan) -> tuple:
    """What cuBLAS (or the Triton template) is called with for ``plan``: sizes and strides.  Plans
    with the same call differ only in which logical index a row or column stands for (e.g. the
    rows of ``bji`` and ``jbi`` as one [b j, i] matrix), so they take the same time by construction."""
    return plan.batch, plan.m, plan.n, plan.k, plan.a_strides, plan.b_strides, plan.c_strides


def same_call_layouts(gemm: TrainingGemm) -> dict:
    """{(A, B, C) layouts of every BLAS plan (one batch dim at most): the layouts of the
    ``pick_layouts`` plan making the same ``blas_call``}, for the plans that have one."""
    picked = {blas_call(p): p.layouts for p in pick_layouts(gemm, None)}
    return {p.layouts: picked[blas_call(p)] for p in _blas_plans(gemm.spec, tuple(sorted(gemm.sizes.items())))
            if blas_call(p) in picked}


class SharedTensors:
    """Tensors the variants of one operator share (its inputs, float64 reference, PyTorch's result):
    made by ``make`` on first use, only one such object's kept at a time (a sweep measures one
    operator's variants, then the next's), and left out of pickles (a measuring process makes
    them again; the variants that share the object travel in one pickle and share it there)."""

    _active: "SharedTensors | None" = None
    _tensors: dict | None = None
    inputs_only = False  # ``make()`` leaves out what only checking reads (``build_ahead``: no float64 reference)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tensors": None}

    def make(self) -> dict:
        raise NotImplementedError

    @staticmethod
    def release() -> None:
        """Let the tensors kept go (those of the object used last)."""
        if SharedTensors._active is not None:
            SharedTensors._active._tensors = None
            SharedTensors._active = None

    def tensors(self) -> dict:
        if SharedTensors._active is not self:
            SharedTensors.release()
            SharedTensors._active = self
        if self._tensors is None:
            self._tensors = self.make()
        return self._tensors


class Operands(SharedTensors):
    """Random logical operands of one GEMM (dims in spec letter order), its float64 reference and
    PyTorch's result in ``dtype`` (``SharedTensors``)."""

    def __init__(self, gemm: TrainingGemm, device, dtype=DTYPE, seed: int = 0):
        self.gemm, self.device, self.dtype, self.seed = gemm, torch.device(device), dtype, seed
        self.c = parse(gemm.spec)

    def make(self) -> dict:
        """{"a", "b", "residual" (over the output's letters; ``dtype``), "reference" (float64),
        "baseline" (``dtype``)}; the first three only with ``inputs_only``."""
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        a, b, residual = (torch.randn([self.gemm.sizes[x] for x in letters], generator=gen, device=self.device,
                                      dtype=torch.float32).to(self.dtype) for letters in (self.c.a, self.c.b, self.c.out))
        if self.inputs_only:
            return {"a": a, "b": b, "residual": residual}
        return {"a": a, "b": b, "residual": residual, "reference": torch.einsum(self.gemm.spec, a.double(), b.double()),
                "baseline": torch.einsum(self.gemm.spec, a, b)}

    def stored(self, name: str, layout: str) -> torch.Tensor:
        """Operand ``name`` ("a", "b" or "residual") stored densely in ``layout`` (a logical view, dims
        in spec order)."""
        letters = {"a": self.c.a, "b": self.c.b, "residual": self.c.out}[name]
        return empty_in_layout(letters, layout, self.gemm.sizes, self.dtype, self.device).copy_(self.tensors()[name])


def numel(letters: str, sizes: dict) -> int:
    """Elements of a tensor over ``letters`` at ``sizes`` ({letter: size})."""
    return math.prod(sizes[x] for x in letters)


def _layout_key(plan: GemmPlan) -> dict:
    return dict(zip(("a", "b", "out"), plan.layouts))


def config_knobs(config: GemmConfig) -> dict:
    """The tuning-DB knobs of a Triton configuration (the module doc's keys), with the template's
    source hash (``kernels.gemm.TEMPLATE_ID``)."""
    return {"backend": "triton", **dataclasses.asdict(config), "template": TEMPLATE_ID}


def cublas_knobs(algorithm: int) -> dict:
    """The tuning-DB knobs of a cuBLAS call with the heuristic's ``algorithm``-th algorithm
    (``kernels.blas.LtMatmul``; 0, its first, as PyTorch calls it: {"backend": "cublas"})."""
    return {"backend": "cublas", **({"algorithm": algorithm} if algorithm else {})}


class GemmVariant:
    """One GEMM in one layout combination through cuBLAS (``config`` None; ``algorithm`` > 0: the
    heuristic's ``algorithm``-th algorithm, called through cuBLASLt on pointers) or a Triton config.
    ``residual``: cuBLAS adding a residual of the output's letters, stored as the output
    (``ResidualAdd``: ``D = A B + C`` through cuBLASLt; op ``residual_op``)."""

    def __init__(self, operands: Operands, plan: GemmPlan, config: GemmConfig | None = None, algorithm: int = 0,
                 residual: bool = False):
        self.operands, self.plan, self.config, self.algorithm, self.residual = operands, plan, config, algorithm, residual
        gemm = operands.gemm
        self.op = residual_op(gemm) if residual else gemm.op
        self.dims, self.dtype = dict(gemm.sizes), parse_dtype(operands.dtype).name
        self.layout = _layout_key(plan)
        self.knobs = cublas_knobs(algorithm) if config is None else config_knobs(config)
        self.direct = self.pointers = None
        c = operands.c
        self.flop = gemm.flop
        moved = (c.a, c.b, c.out) + ((c.out,) if residual else ())  # the residual read as the output is written
        self.bytes = operands.dtype.itemsize * sum(numel(x, gemm.sizes) for x in moved)
        self.a = self.b = self.out = self.added = None

    def build(self) -> None:
        gemm, plan = self.operands.gemm, self.plan
        self.a, self.b = self.operands.stored("a", plan.layouts[0]), self.operands.stored("b", plan.layouts[1])
        self.out = empty_in_layout(self.operands.c.out, plan.layouts[2], gemm.sizes, self.operands.dtype, self.operands.device)
        if self.residual:
            self.added = self.operands.stored("residual", plan.layouts[2])
        if self.algorithm or self.residual:
            views = cublas_views(plan, self.a, self.b, self.out)
            self.direct = LtMatmul.of(*views, self.algorithm) if views is not None else None
            if self.direct is None:
                raise RuntimeError(f"cuBLASLt has no algorithm #{self.algorithm} for {plan.describe()}")
            self.pointers = tuple(v.data_ptr() for v in views)
            if self.residual:  # C: the residual's view at the output's offsets
                self.pointers += (self.added.data_ptr() + (views[2].data_ptr() - self.out.data_ptr()),)
        self.run()

    def compile_task(self) -> tuple | None:
        """(function, args) compiling a Triton configuration in a compile worker ahead of its
        measuring (``harness.bench.Sweep``; built there once: the template compiles at its first
        launch into Triton's disk cache, 0.4 s a configuration that a measuring process no longer
        spends); None through cuBLAS (nothing to compile)."""
        return None if self.config is None else (build_ahead, (self,))

    def run(self) -> torch.Tensor:
        if self.direct is not None:
            self.direct(*self.pointers)
            return self.out
        if self.config is None:
            return run_cublas(self.plan, self.a, self.b, self.out)
        return run_triton(self.plan, self.a, self.b, self.out, config=self.config)

    def check(self) -> Verdict:
        self.out.fill_(float("nan"))
        out = self.run()
        t = self.operands.tensors()
        if self.residual:
            return Verdict(((self.operands.c.out, judge(out, t["baseline"] + t["residual"],
                                                        t["reference"] + t["residual"].double())),))
        return Verdict(((self.operands.c.out, judge(out, t["baseline"], t["reference"])),))


def build_ahead(variant) -> None:
    """The compile task (``compile_task``) of a GEMM variant whose kernels compile at their first
    launch (a Triton configuration, a fused epilogue, a join): built once in a compile worker (on
    its GPU), which leaves them and their launchers in Triton's disk cache for the measuring
    process to load: its inputs only (``SharedTensors.inputs_only``: the GPU the worker shares with
    a measuring process computes no float64 reference), let go afterwards."""
    on_gpu = variant.operands.device.type == "cuda"
    variant.operands.inputs_only = True
    try:
        variant.build()
        if on_gpu:
            torch.cuda.synchronize()
    finally:
        SharedTensors.release()
        del variant.operands.inputs_only
        if on_gpu:
            torch.cuda.empty_cache()  # a dozen workers a GPU hold no operands between tasks


def gemm_variants(gemm: TrainingGemm, device, *, dtype=DTYPE, layouts: int | None = 3, first_configs=None,
                  other_configs=None, seed: int = 0) -> list[GemmVariant]:
    """cuBLAS and Triton variants of ``gemm`` over ``pick_layouts(gemm, layouts)``: the first
    layout with ``first_configs`` (default: every ``valid_configs(dtype)``), the others with
    ``other_configs`` (default: the same); TMA configs only where the layouts allow TMA."""
    operands = Operands(gemm, device, dtype, seed)
    first_configs = list(valid_configs(dtype) if first_configs is None else first_configs)
    other_configs = first_configs if other_configs is None else list(other_configs)
    variants = []
    for index, plan in enumerate(pick_layouts(gemm, layouts)):
        variants += [GemmVariant(operands, plan, algorithm=n)
                     for n in range(cublas_algorithms(plan, gemm.sizes, dtype, device))]
        variants += [GemmVariant(operands, plan, cfg)
                     for cfg in runnable(plan, dtype, first_configs if index == 0 else other_configs)]
    return variants


def layout_variants(gemm: TrainingGemm, device, timed_as: tuple, *, dtype=DTYPE, algorithms: bool = True,
                    configs=(), seed: int = 0) -> list[GemmVariant]:
    """``gemm``'s variants on the ``pick_layouts`` plan whose (A, B, C) layouts are ``timed_as``:
    cuBLAS with each of ``cublas_algorithms`` (``algorithms``) and the Triton template with each of
    ``configs`` its layouts allow (none where no picked plan has them)."""
    plan = next((p for p in pick_layouts(gemm, None) if p.layouts == tuple(timed_as)), None)
    if plan is None:
        return []
    operands = Operands(gemm, device, dtype, seed)
    variants = [GemmVariant(operands, plan, algorithm=n)
                for n in range(cublas_algorithms(plan, gemm.sizes, dtype, device))] if algorithms else []
    return variants + [GemmVariant(operands, plan, cfg) for cfg in runnable(plan, dtype, list(configs))]


def cublas_algorithms(plan: GemmPlan, sizes: dict, dtype, device, direct_only: bool = False) -> int:
    """How many of cuBLASLt's heuristic's algorithms to time for ``plan``'s call at ``sizes``: up to
    ``kernels.blas.ALGORITHMS`` where it is one call cuBLASLt takes on a CUDA ``device``, else 1
    (PyTorch's call; ``direct_only``: 0)."""
    if torch.device(device).type != "cuda" or not plan.blas:
        return 0 if direct_only else 1
    c = plan.contraction
    views = cublas_views(plan, *(empty_in_layout(letters, layout, sizes, dtype, "meta")
                                 for letters, layout in zip((c.a, c.b, c.out), plan.layouts)))
    count = algorithm_count(*views, device) if views is not None else 0
    return count if direct_only else max(1, count)


def runnable(plan: GemmPlan, dtype, configs) -> list:
    """``configs`` whose TMA reads (and stores) ``plan``'s layouts allow, for 16-byte aligned allocations."""
    aligned = torch.empty(0, dtype=dtype, device="meta")  # data_ptr 0; only its item size and address are read
    shape = GemmShape(*plan.batch, plan.m, plan.n, plan.k)
    loads = tma_compatible(aligned, aligned, shape, plan.a_strides, plan.b_strides)
    stores = tma_compatible(aligned, aligned, shape, plan.a_strides, plan.b_strides, aligned, plan.c_strides)
    return [cfg for cfg in configs if (loads or not cfg.tma) and (stores or not cfg.store_tma)]


def residual_op(gemm: TrainingGemm) -> str:
    """The tuning-DB ``op`` of ``gemm`` adding a residual (``families.residual_add``)."""
    return gemm.op + "+residual"


def epilogue_inputs(gemm: TrainingGemm) -> list[tuple[str, str]]:
    """The (A, B) layouts a fused epilogue is timed with: those of ``pick_layouts``' plans that write
    the output in spec order (the consumer's layout), spec order first."""
    out = parse(gemm.spec).out
    return [p.layouts[:2] for p in pick_layouts(gemm, None) if p.layouts[2] == out]
