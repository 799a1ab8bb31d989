"""Variants of the training graph's contractions (GEMMs) for ``harness.bench.Sweep``.

``training_gemms`` reads the contractions off a fused training graph (``dataflow.snapshot``'s
``FusedTraining``): each contraction operator gives one einsum, its primitive's; an operator that
stacks several einsums of one pattern (Q/K/V, their dX and dW) gives the stacked einsum of
``kernels.contraction.stacked_spec``, the stack letter over the operand that is not shared
(over both, summed away, when a map adds the einsums' results).  Letter sizes come from the
graph's dims; the label is the graph's operator name.

For one such ``TrainingGemm``, ``pick_layouts`` chooses mappable layout combinations
(``enumerate_variants``): spec order first if it is a BLAS GEMM, then one BLAS plan (at most one
batch dim) per new transposition pattern.  ``gemm_variants`` gives, per chosen plan, a
``GemmVariant`` for the cuBLAS path (``run_cublas``; on CUDA one per algorithm of cuBLASLt's
heuristic, ``cublas_algorithms``) and one per Triton config (``run_triton``).  ``residual_add_of``
finds a consumer that only adds a tensor to the GEMM's output; ``residual_variants`` time cuBLASLt
adding it (``D = A B + C``).
``epilogue_of`` finds, structurally, the element-wise consumer that the GEMM template can fuse
(bias add over whole output groups, ReLU, Philox dropout, the saved pre-activation), as in
linear1 -> bias + ReLU + dropout; ``epilogue_variants`` gives the fused Triton kernel per config
and the cuBLAS GEMM followed by PyTorch eager (bias add, ReLU, dropout with the same mask).

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

from datamove.dataflow.activations import PROBE, activation, evaluate
from datamove.kernels.blas import LtMatmul, algorithm_count
from datamove.kernels.contraction import (Epilogue, GemmPlan, cublas_views, empty_in_layout, enumerate_variants, flops,
                                          map_layouts, parse, run_cublas, run_triton, stacked_spec)
from datamove.kernels.codegen import compile_operator
from datamove.kernels.gemm import TEMPLATE_ID, GemmConfig, GemmShape, tma_compatible, valid_configs
from datamove.kernels.philox import dropout_scale
from datamove.harness.sweep_variants import MASK_SEED, Verdict, judge
from datamove.harness.torch_eval import dropout_offsets, keep_mask_torch
from datamove.layouts.space import configurations

DTYPE = torch.bfloat16
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
    summed = any(p.kind == "map" and {o.tensor for o in p.inputs} == outputs and set(p.expr.replace(" ", "")) <= set("in0123456789+")
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
    return tuple(p for p in enumerate_variants(parse(spec), dict(sizes)).blas_plans if p.batch_dims <= 1)


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

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tensors": None}

    def make(self) -> dict:
        raise NotImplementedError

    def tensors(self) -> dict:
        if SharedTensors._active is not self:
            if SharedTensors._active is not None:
                SharedTensors._active._tensors = None
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
        "baseline" (``dtype``)}."""
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        a, b, residual = (torch.randn([self.gemm.sizes[x] for x in letters], generator=gen, device=self.device,
                                      dtype=torch.float32).to(self.dtype) for letters in (self.c.a, self.c.b, self.c.out))
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
        self.dims, self.dtype = dict(gemm.sizes), str(operands.dtype).removeprefix("torch.")
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


def residual_variants(gemm: TrainingGemm, device, *, dtype=DTYPE, layouts: int | None = 3, seed: int = 0) -> list[GemmVariant]:
    """``gemm`` adding a residual (``ResidualAdd``) through cuBLASLt, each of ``cublas_algorithms``,
    over ``pick_layouts(gemm, layouts)`` where cuBLASLt takes the call (none off CUDA)."""
    operands = Operands(gemm, device, dtype, seed)
    return [GemmVariant(operands, plan, algorithm=n, residual=True) for plan in pick_layouts(gemm, layouts)
            for n in range(cublas_algorithms(plan, gemm.sizes, dtype, device, direct_only=True))]


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


# ---------------------------------------------------------------------------------------------
# Epilogue fusion


@dataclass(frozen=True)
class FusableEpilogue:
    """An element-wise consumer of a GEMM's output the template fuses: y = dropout(act(gemm + bias)).

    ``bias``: graph tensor over ``bias_letters`` (output letters, spec letter names of the GEMM);
    ``mask``: dropout tensor (logical index over the output letters in spec order), ``p``, ``offset``;
    ``save``: what else the consumer writes ("pre_activation" / "pre_dropout") or None.
    ``produced`` / ``output`` / ``saved``: the graph tensors the consumer reads from the GEMM,
    writes as its result and (with ``save``) writes as the saved value."""

    consumer: str
    bias: str
    bias_letters: str
    activation: str
    mask: str | None
    p: float
    offset: int
    save: str | None
    produced: str
    output: str
    saved: str | None


def _activation(prims: list, start: int, source: str, namespace: dict) -> tuple[str, int] | None:
    """(activation, index of its last primitive) when ``prims[start:end + 1]`` are maps of
    ``source`` alone (and constants) whose last output equals one of the template's activations
    (``dataflow.activations.activation``, on its probe in float64): the spec's own spelling of ReLU
    or tanh-GELU, in one expression or a chain; None when no prefix is.  ``namespace``: the graph's
    scalars."""
    values = {source: PROBE}
    for end in range(start, len(prims)):
        prim = prims[end]
        if prim.kind != "map" or any(operand.tensor not in values for operand in prim.inputs):
            return None
        arguments = {f"in{n}": values[operand.tensor] for n, operand in enumerate(prim.inputs)}
        values[prim.output.tensor] = value = evaluate(prim.expr, arguments, namespace)
        name = activation(value)
        if name is not None:
            return name, end
    return None


def epilogue_of(training, gemm: TrainingGemm) -> FusableEpilogue | None:
    """The consumer of ``gemm``'s (single-einsum) output when it is exactly bias add [+ ReLU or
    tanh-GELU] [+ dropout] on that output, its other outputs the bias-added or activated value;
    else None."""
    graph = training.graph
    op = next(o for o in training.operators if o.name == gemm.name)
    if len(op.outputs) != 1 or gemm.stacked != 1:
        return None
    produced = op.outputs[0]
    out_letters = parse(gemm.spec).out
    for consumer in training.operators:
        if consumer.cls == "contraction" or produced not in consumer.inputs:
            continue
        prims = list(consumer.primitives)
        first = prims[0]
        if first.kind != "map" or first.expr.replace(" ", "") != "in0+in1" or first.inputs[0].tensor != produced \
                or first.inputs[0].letters != first.output.letters:
            return None
        rename = dict(zip(first.inputs[0].letters, out_letters))
        bias = first.inputs[1]
        if graph.tensors[bias.tensor].role != "input" or not set(bias.letters) <= set(rename):
            return None
        chain = {"pre_activation": first.output.tensor}
        current, activation, mask, p = first.output.tensor, "none", None, 0.0
        scalars = graph.scalars()
        n = 1
        while n < len(prims):
            prim = prims[n]
            found = _activation(prims, n, current, scalars) if activation == "none" and mask is None else None
            if found is not None:
                activation, n = found
                current = prims[n].output.tensor
                chain["pre_dropout"] = current
            elif prim.kind == "map" and prim.expr.replace(" ", "") == "in0*in1" and mask is None \
                    and prim.inputs[0].tensor == current and graph.tensors[prim.inputs[1].tensor].role == "dropout" \
                    and prim.inputs[1].letters == prim.inputs[0].letters:
                mask, current = prim.inputs[1].tensor, prim.output.tensor
                p = graph.tensors[mask].p
            else:
                return None
            n += 1
        if current not in consumer.outputs:
            return None
        extra = [t for t in consumer.outputs if t != current]
        saves = [name for name, t in chain.items() if t in extra]
        if len(extra) > 1 or len(saves) != len(extra):
            return None
        offset = dropout_offsets(graph)[mask] if mask is not None else 0
        return FusableEpilogue(consumer.name, bias.tensor, "".join(rename[x] for x in bias.letters), activation,
                               mask, p, offset, saves[0] if saves else None, produced, current,
                               extra[0] if extra else None)
    return None


@dataclass(frozen=True)
class ResidualAdd:
    """An element-wise consumer that only adds a tensor to a GEMM's output, ``output = produced +
    residual`` (all three over the same letters): cuBLAS's ``D = A B + C`` with ``C`` the residual,
    so the GEMM writes ``output`` and the consumer's kernel goes (BERT's input gradient: the residual
    branch's gradient plus the stacked Q/K/V GEMM's)."""

    consumer: str
    produced: str
    residual: str
    output: str


def residual_add_of(training, gemm: TrainingGemm) -> ResidualAdd | None:
    """``gemm``'s output's one consumer when it is exactly that add (its one primitive ``in0 + in1``
    on the output and another tensor of the same letters, its one output), else None."""
    op = next(o for o in training.operators if o.name == gemm.name)
    if len(op.outputs) != 1:
        return None
    produced = op.outputs[0]
    consumers = [o for o in training.operators if produced in o.inputs]
    if len(consumers) != 1 or consumers[0].cls == "contraction" or len(consumers[0].primitives) != 1 \
            or len(consumers[0].outputs) != 1:
        return None
    (add,) = consumers[0].primitives
    operands = [x.tensor for x in add.inputs]
    if add.kind != "map" or add.expr.replace(" ", "") != "in0+in1" or produced not in operands \
            or len(set(operands)) != 2 or any(x.letters != add.output.letters for x in add.inputs):
        return None
    residual = operands[1 - operands.index(produced)]
    letters = {training.graph.tensors[t].letters for t in (produced, residual, add.output.tensor)}
    return ResidualAdd(consumers[0].name, produced, residual, add.output.tensor) if len(letters) == 1 else None


def residual_op(gemm: TrainingGemm) -> str:
    """The tuning-DB ``op`` of ``gemm`` adding a residual (``ResidualAdd``)."""
    return gemm.op + "+residual"


def epilogue_op(gemm: TrainingGemm, epilogue: FusableEpilogue) -> str:
    """The tuning-DB ``op`` of ``gemm`` with ``epilogue`` fused (see the module doc's keys)."""
    tail = f"+bias[{epilogue.bias_letters}]" + (f"+{epilogue.activation}" if epilogue.activation != "none" else "")
    tail += f"+dropout({epilogue.p:g})" if epilogue.mask else ""
    return gemm.op + tail + (f"+save({epilogue.save})" if epilogue.save else "")


class EpilogueVariant:
    """``gemm`` + its epilogue, three ways: one Triton kernel (``config``, the epilogue fused); the
    cuBLAS GEMM then the consumer's generated kernel (``consumer``: (graph, operator, its
    ``layouts.space.Configuration`` with spec-order layouts), i.e. "GEMM then fused element-wise
    kernel"); neither: the cuBLAS GEMM then PyTorch eager (bias add, activation, dropout). All
    apply the same regenerated mask."""

    def __init__(self, operands: Operands, epilogue: FusableEpilogue, config: GemmConfig | None = None,
                 consumer: tuple | None = None, inputs: tuple[str, str] | None = None):
        gemm, c = operands.gemm, operands.c
        self.operands, self.epilogue, self.config, self.consumer = operands, epilogue, config, consumer
        self.inputs = inputs or (c.a, c.b)  # A's and B's layouts; the output in spec order
        self.plan = map_layouts(c, (*self.inputs, c.out), gemm.sizes)
        self.op, self.dims, self.dtype = epilogue_op(gemm, epilogue), dict(gemm.sizes), str(operands.dtype).removeprefix("torch.")
        self.layout = _layout_key(self.plan)
        if config is not None:
            self.knobs = config_knobs(config)
        elif consumer is not None:
            self.knobs = {"backend": "cublas+fused", **consumer[2].knobs}
        else:
            self.knobs = {"backend": "cublas+eager"}
        self.flop = gemm.flop
        outputs = 2 if epilogue.save else 1
        self.bytes = operands.dtype.itemsize * (numel(c.a, gemm.sizes) + numel(c.b, gemm.sizes)
                                                + numel(epilogue.bias_letters, gemm.sizes) + outputs * numel(c.out, gemm.sizes))
        self.tensors = None

    @functools.cached_property
    def _keep(self) -> torch.Tensor | None:
        ep, gemm = self.epilogue, self.operands.gemm
        if ep.mask is None:
            return None
        shape = tuple(gemm.sizes[x] for x in self.operands.c.out)
        return keep_mask_torch(MASK_SEED, ep.offset, shape, ep.p, self.operands.device)

    def build(self) -> None:
        ops, ep = self.operands, self.epilogue
        t = ops.tensors()
        if "bias" not in t:
            gen = torch.Generator(device=ops.device).manual_seed(ops.seed + 1)
            t["bias"] = torch.randn([ops.gemm.sizes[x] for x in ep.bias_letters], generator=gen, device=ops.device,
                                    dtype=torch.float32).to(ops.dtype)
        a, b, bias = ops.stored("a", self.inputs[0]), ops.stored("b", self.inputs[1]), t["bias"]
        out = empty_in_layout(ops.c.out, ops.c.out, ops.gemm.sizes, ops.dtype, ops.device)
        self.tensors = dict(a=a, b=b, bias=bias, out=out)
        self.fused = Epilogue(bias=bias, bias_letters=ep.bias_letters, activation=ep.activation, dropout_p=ep.p,
                              seed=MASK_SEED, offset=ep.offset, save=ep.save)
        if self.consumer is not None:
            self.compiled = compile_operator(*self.consumer)
        self.run()

    def _broadcast_bias(self, bias: torch.Tensor) -> torch.Tensor:
        out = self.operands.c.out
        letters = self.epilogue.bias_letters
        order = sorted(letters, key=out.index)
        view = bias.permute([letters.index(x) for x in order])
        return view.reshape([self.operands.gemm.sizes[x] if x in letters else 1 for x in out])

    def _eager(self, y: torch.Tensor, bias: torch.Tensor) -> dict:
        """bias add, activation, dropout with the regenerated mask, at ``y``'s precision."""
        ep = self.epilogue
        pre = y + self._broadcast_bias(bias)
        act = {"relu": torch.relu, "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
               "none": lambda t: t}[ep.activation](pre)
        result = {"out": act if self._keep is None else torch.where(self._keep, act * dropout_scale(ep.p), 0.0)}
        if ep.save:
            result[ep.save] = pre if ep.save == "pre_activation" else act
        return result

    def _generated(self, y: torch.Tensor, bias: torch.Tensor) -> dict:
        """The consumer's generated kernel on the GEMM's output ``y`` (spec-order letters)."""
        ep = self.epilogue
        seeds = {ep.mask: (MASK_SEED, ep.offset)} if ep.mask else {}
        outputs = self.compiled.run({ep.produced: y, ep.bias: bias}, seeds)
        return {"out": outputs[ep.output], **({ep.save: outputs[ep.saved]} if ep.save else {})}

    def run(self) -> dict:
        t = self.tensors
        if self.config is None:
            finish = self._eager if self.consumer is None else self._generated
            return finish(run_cublas(self.plan, t["a"], t["b"], t["out"]), t["bias"])
        result = run_triton(self.plan, t["a"], t["b"], t["out"], self.fused, self.config)
        return {"out": result[0], self.epilogue.save: result[1]} if self.epilogue.save else {"out": result}

    def check(self) -> Verdict:
        self.tensors["out"].fill_(float("nan"))
        results = self.run()
        t = self.operands.tensors()
        reference = self._eager(t["reference"], t["bias"].double())
        baseline = self._eager(t["baseline"], t["bias"])
        return Verdict(tuple((name, judge(results[name], baseline[name], reference[name])) for name in results))


def consumer_configurations(training, epilogue: FusableEpilogue) -> list[tuple]:
    """(graph, operator, configuration) of the epilogue's consumer for every configuration of its
    generated kernel that keeps the spec-order layouts (the GEMM writes its output in spec order)
    and regenerates the dropout mask."""
    graph = training.graph
    op = next(o for o in training.operators if o.name == epilogue.consumer)
    return [(graph, op, config) for config in configurations(graph, op)
            if all(layout == graph.tensors[t].letters for t, layout in config.layouts.items())
            and config.knobs.get("dropout", "regenerate") == "regenerate"]


def epilogue_inputs(gemm: TrainingGemm) -> list[tuple[str, str]]:
    """The (A, B) layouts a fused epilogue is timed with: those of ``pick_layouts``' plans that write
    the output in spec order (the consumer's layout), spec order first."""
    out = parse(gemm.spec).out
    return [p.layouts[:2] for p in pick_layouts(gemm, None) if p.layouts[2] == out]


def epilogue_variants(operands: Operands, epilogue: FusableEpilogue, configs, consumers=(),
                      inputs: list[tuple[str, str]] | None = None) -> list[EpilogueVariant]:
    """cuBLAS + eager, cuBLAS + the consumer's generated kernel per ``consumers`` entry
    (``consumer_configurations``), both in spec-order layouts, then the fused kernel with each of
    ``configs`` (TMA ones where allowed) reading A and B in each of ``inputs`` (default: spec order),
    the output in spec order."""
    variants = [EpilogueVariant(operands, epilogue)]
    variants += [EpilogueVariant(operands, epilogue, consumer=consumer) for consumer in consumers]
    for layouts in inputs or [(operands.c.a, operands.c.b)]:
        plan = map_layouts(operands.c, (*layouts, operands.c.out), operands.gemm.sizes)
        variants += [EpilogueVariant(operands, epilogue, cfg, inputs=layouts) for cfg in runnable(plan, operands.dtype, configs)]
    return variants
