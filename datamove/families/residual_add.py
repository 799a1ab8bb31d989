"""The residual add: a GEMM adding the tensor its consumer adds to its output, ``D = A B + C``.

Pattern (``match``): the GEMM's output has one consumer, an element-wise operator whose one
primitive is ``in0 + in1`` over the output and another tensor of the same letters, writing one
output (BERT's input gradient: the residual branch's gradient plus the stacked Q/K/V GEMM's).
cuBLASLt adds the residual (``C``, read in the output's layout) as it writes ``D``, so the
consumer's kernel goes.

Variants: cuBLASLt with each of its heuristic's algorithms over ``pick_layouts``
(``harness.contraction_variants.GemmVariant`` with ``residual``; op ``"gemm:<einsum>+residual"``).
Candidates: per layout of the plain GEMM's candidates, the GEMM adding the residual, read and
written in the layout the plain GEMM writes; measured, else priced by the cost model only where
the plain GEMM was not measured either (a prediction must not beat measurements).
Launch: a ``ContractionConfig`` with ``residual`` (``layouts.step_config.Residual``): the GEMM
step itself adds it (``datamove.runtime.steps.GemmLauncher``: cuBLAS with beta 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from datamove.families.base import GemmFamily, GemmSite, Tuning, operator_named
from datamove.harness.contraction_variants import (DTYPE, GemmVariant, Operands, TrainingGemm, cublas_algorithms, pick_layouts,
                                                   residual_op)
from datamove.kernels.contraction import parse
from datamove.layouts.plan import GEMM
from datamove.layouts.select import Candidate
from datamove.layouts.step_config import ContractionConfig, Residual


@dataclass(frozen=True)
class ResidualAdd:
    """An element-wise consumer that only adds a tensor to a GEMM's output, ``output = produced +
    residual`` (all three over the same letters)."""

    consumer: str
    produced: str
    residual: str
    output: str


def residual_add_of(training, gemm: TrainingGemm) -> ResidualAdd | None:
    """``gemm``'s output's one consumer when it is exactly that add (its one primitive ``in0 + in1``
    on the output and another tensor of the same letters, its one output), else None."""
    op = operator_named(training, gemm.name)
    if len(op.outputs) != 1:
        return None
    produced = op.outputs[0]
    consumers = [o for o in training.operators if produced in o.inputs]
    if len(consumers) != 1 or consumers[0].cls == "contraction" or len(consumers[0].primitives) != 1 \
            or len(consumers[0].outputs) != 1:
        return None
    (add,) = consumers[0].primitives
    operands = [x.tensor for x in add.inputs]
    if add.kind != "map" or not add.expression.is_sum_of_inputs(2) or produced not in operands \
            or len(set(operands)) != 2 or any(x.letters != add.output.letters for x in add.inputs):
        return None
    residual = operands[1 - operands.index(produced)]
    letters = {training.graph.tensors[t].letters for t in (produced, residual, add.output.tensor)}
    return ResidualAdd(consumers[0].name, produced, residual, add.output.tensor) if len(letters) == 1 else None


def residual_variants(gemm: TrainingGemm, device, *, dtype=DTYPE, layouts: int | None = 3, seed: int = 0) -> list[GemmVariant]:
    """``gemm`` adding a residual through cuBLASLt, each of ``cublas_algorithms``, over
    ``pick_layouts(gemm, layouts)`` where cuBLASLt takes the call (none off CUDA)."""
    operands = Operands(gemm, device, dtype, seed)
    return [GemmVariant(operands, plan, algorithm=n, residual=True) for plan in pick_layouts(gemm, layouts)
            for n in range(cublas_algorithms(plan, gemm.sizes, dtype, device, direct_only=True))]


class ResidualAddFamily(GemmFamily):
    name = "residual"
    moves_consumer = True

    def match(self, fused, gemm: TrainingGemm) -> ResidualAdd | None:
        return residual_add_of(fused, gemm)

    def variants(self, fused, gemm: TrainingGemm, pattern: ResidualAdd, tuning: Tuning) -> list:
        return residual_variants(gemm, tuning.device, dtype=tuning.dtype, layouts=tuning.layouts)

    def candidates(self, builder, site: GemmSite, res: ResidualAdd) -> list[Candidate]:
        g, op = site.gemm, site.op
        if site.members["out"] != list(op.outputs):
            return []
        c = parse(g.spec)
        moved = builder.itemsize * sum(math.prod(g.sizes[x] for x in letters) for letters in (c.a, c.b, c.out, c.out))
        result = []
        for plain in site.plain:
            key = dict(zip(("a", "b", "out"), plain.timed_as))
            found = builder.timings.lookup(residual_op(g), g.sizes, key)
            if found is None and (plain.measured or builder.timings.broken(residual_op(g), g.sizes, key)):
                continue
            ms, source, knobs = builder.time(found, "gemm", g.flop, moved)
            layout = plain.writes[res.produced]
            config = ContractionConfig(g.spec, "cublas", site.members, None, (knobs or {}).get("algorithm", 0),
                                       Residual(res.consumer, res.residual, res.output))
            result.append(Candidate(f"{g.name}+{res.consumer}", op.phase, GEMM, (g.name, res.consumer),
                                    {**plain.reads, res.residual: layout}, {res.output: layout}, config, ms, source))
        return result
