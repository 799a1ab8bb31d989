"""A GEMM with the backward of an activation and a bias gradient in its epilogue.

The backward of ``y = act(x @ W + b)`` is a GEMM giving ``dy_act`` (the gradient at the activation's
output), an element-wise product ``dx = dy_act * act'(saved)`` and the bias gradient ``db = sum(dx)``
over every letter but the bias's.  Apart, the product reads the GEMM's output back and writes it
again (BERT-large B=8 L=512: two 33.5 MB tensors read and one written, 36 us on an H100).  The
GEMM template (``kernels.gemm``, ``gradient``) multiplies its accumulator by the derivative,
stores the product and the tile's partial sums, and a second small kernel adds the partials.

``gradient_epilogue_of`` finds such a consumer structurally: the only reader of the GEMM's
output, a map ``in_k * f(in_j)`` whose ``f`` is ReLU's derivative times a constant (BERT: the
dropout mask folded in, ``(hidden > 0) * scale``) or tanh-GELU's (GPT-2; ``dataflow.activations``),
and one sum of the product.  The consumer's other parts, where it has any (none in BERT or GPT-2:
BERT's ``d_b2`` joins its layernorm backward instead; ``tests/bias_join.py`` stacks it into
``d_b1`` as the paper's fusion does), run after the GEMM as one generated kernel
(``layouts.space.rest_part`` in ``rest_configuration``).

``GradientVariant`` is one such kernel (a ``harness.bench.Variant``): a Triton configuration
reading A and B in one layout pair, the output and factor in spec order, the rest reading an
operand of the GEMM in the GEMM's layout (``rest_layouts``), its other tensors in spec order; checked against
the float64 evaluation of the GEMM's and the consumer's primitives, PyTorch's rule (every
primitive in ``dtype``) as the baseline.  Key: ``op`` = ``"gemm:<einsum>+<relu|gelu>'[*scale]+sum[<letters>]"``
(plus ``"+rest:<signature>"``), ``layout`` = {"a", "b", "out"}, ``knobs`` = the Triton config's (and
``"rest"``: the rest's configuration, ``layouts.space.Configuration.key``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from datamove.dataflow.activations import derivative
from datamove.dataflow.executor import dropout_offsets
from datamove.harness.contraction_variants import (DTYPE, SharedTensors, TrainingGemm, config_knobs, epilogue_inputs, numel,
                                                   runnable)
from datamove.harness.sweep_variants import MASK_SEED, Verdict, judge, op_signature, tensor_bytes
from datamove.harness.torch_eval import evaluate, graph_inputs
from datamove.kernels.codegen import allocate, compile_operator
from datamove.kernels.contraction import Epilogue, empty_in_layout, map_layouts, parse, run_triton
from datamove.kernels.gemm import GemmConfig
from datamove.layouts.space import rest_configuration, rest_part


@dataclass(frozen=True)
class GradientEpilogue:
    """A consumer of a GEMM's output that the template's gradient epilogue runs (module doc).

    ``produced``: the GEMM's output it reads; ``factor``: the tensor whose derivative multiplies it
    (``gradient`` "relu": ``scale`` where the factor is positive, else 0; "gelu": tanh-GELU's);
    ``output``: the product; ``summed``: its sum over all letters but ``sum_letters`` (the GEMM's
    names for them); ``primitives``: the consumer's primitives the epilogue runs; ``rest``: the
    names of its other primitives (a generated kernel after the GEMM), empty when none."""

    consumer: str
    produced: str
    factor: str
    gradient: str
    scale: float
    output: str
    summed: str
    sum_letters: str
    primitives: tuple[str, ...]
    rest: tuple[str, ...]


def gradient_epilogue_of(training, gemm: TrainingGemm) -> GradientEpilogue | None:
    """The consumer of ``gemm``'s (single-einsum) output that the gradient epilogue runs (module
    doc), or None."""
    graph = training.graph
    op = next(o for o in training.operators if o.name == gemm.name)
    if len(op.outputs) != 1 or gemm.stacked != 1:
        return None
    produced = op.outputs[0]
    readers = [o for o in training.operators if produced in o.inputs]
    if len(readers) != 1 or readers[0].cls == "contraction" or produced in graph.outputs:
        return None
    consumer = readers[0]
    maps = [p for p in consumer.primitives if any(o.tensor == produced for o in p.inputs)]
    if len(maps) != 1 or maps[0].kind != "map" or len(maps[0].inputs) != 2:
        return None
    product = maps[0]
    position = 0 if product.inputs[0].tensor == produced else 1
    factor = product.inputs[1 - position]
    if product.inputs[position].letters != product.output.letters or factor.letters != product.output.letters \
            or graph.tensors[factor.tensor].letters != graph.tensors[produced].letters \
            or graph.tensors[product.output.tensor].letters != graph.tensors[produced].letters:
        return None
    found = derivative(product.expr, position, graph.scalars())
    if found is None:
        return None
    sums = [p for p in consumer.primitives if any(o.tensor == product.output.tensor for o in p.inputs)]
    if len(sums) != 1 or sums[0].kind != "reduce" or sums[0].expr != "sum" \
            or product.output.tensor not in consumer.outputs or sums[0].output.tensor not in consumer.outputs:
        return None
    total = sums[0]
    axes = total.inputs[0].letters  # the product's axes in the reduction's names
    out_letters = parse(gemm.spec).out  # ... and in the GEMM's (the produced tensor's axes)
    sum_letters = "".join(out_letters[axes.index(x)] for x in total.output.letters)
    if any(o.tensor == total.output.tensor for p in consumer.primitives for o in p.inputs):
        return None
    names = (product.name, total.name)
    try:
        rest = rest_part(consumer, names)
    except ValueError:  # the product or its sum feeds other primitives of the consumer
        return None
    return GradientEpilogue(consumer.name, produced, factor.tensor, found[0], found[1], product.output.tensor,
                            total.output.tensor, sum_letters, names,
                            tuple(p.name for p in rest.primitives) if rest else ())


def gradient_op(spec: str, training, gemm: TrainingGemm, epilogue: GradientEpilogue) -> str:
    """The tuning-DB ``op`` of ``gemm`` with ``epilogue`` (module doc); ``spec``: the spec's name."""
    text = f"{gemm.op}+{epilogue.gradient}'" + (f"*{epilogue.scale:g}" if epilogue.gradient == "relu" else "")
    text += f"+sum[{epilogue.sum_letters}]"
    rest = rest_operator(training, epilogue)
    return text + (f"+rest:{op_signature(spec, rest)}" if rest else "")


def rest_operator(training, epilogue: GradientEpilogue):
    """The consumer's parts the epilogue does not run (``layouts.space.rest_part``), or None."""
    consumer = next(o for o in training.operators if o.name == epilogue.consumer)
    return rest_part(consumer, epilogue.primitives)


def moved_bytes(training, gemm: TrainingGemm, epilogue: GradientEpilogue, itemsize: int) -> int:
    """Bytes the fused kernel and its rest move: A and B read, the output written and the factor
    read (both shaped as the output), the bias gradient written, the rest's tensors."""
    c, rest = parse(gemm.spec), rest_operator(training, epilogue)
    moved = itemsize * (numel(c.a, gemm.sizes) + numel(c.b, gemm.sizes) + 2 * numel(c.out, gemm.sizes))
    return moved + tensor_bytes(training.graph, [epilogue.summed, *((*rest.inputs, *rest.outputs) if rest else ())],
                                itemsize)


def rest_layouts(training, gemm: TrainingGemm, epilogue: GradientEpilogue, inputs: tuple[str, str]) -> dict:
    """{tensor: layout} of the rest's tensors (not its dropout masks) when the GEMM reads A and B in
    ``inputs``: an operand the rest reads too in the GEMM's layout, every other tensor in spec
    order; {} without a rest."""
    rest, graph = rest_operator(training, epilogue), training.graph
    if rest is None:
        return {}
    op = next(o for o in training.operators if o.name == gemm.name)
    einsum = next(p for p in op.primitives if p.kind == "einsum")
    layouts = {t: graph.tensors[t].letters for t in (*rest.inputs, *rest.outputs) if graph.tensors[t].role != "dropout"}
    for operand, layout in zip(einsum.inputs, inputs):
        if operand.tensor in layouts:
            rename = dict(zip(operand.letters, graph.tensors[operand.tensor].letters))
            layouts[operand.tensor] = "".join(rename[x] for x in layout)
    return layouts


class GradientOperands(SharedTensors):
    """The inputs of ``gemm`` and its epilogue's consumer (random, float64), the float64 evaluation
    of their primitives and PyTorch's rule in ``dtype`` (every primitive in that dtype), shared by
    the variants of one epilogue (``SharedTensors``)."""

    def __init__(self, training, gemm: TrainingGemm, epilogue: GradientEpilogue, device, dtype=DTYPE, seed: int = 1):
        self.training, self.gemm, self.epilogue = training, gemm, epilogue
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed

    def primitives(self) -> list:
        ops = {o.name: o for o in self.training.operators}
        return [*ops[self.gemm.name].primitives, *ops[self.epilogue.consumer].primitives]

    def make(self) -> dict:
        """{"values" (float64 inputs by tensor name), "reference" (float64), "baseline" (``dtype``)}."""
        graph, prims = self.training.graph, self.primitives()
        values = graph_inputs(graph, prims, self.seed, self.device, torch.float64, MASK_SEED)
        return {"values": values, "reference": evaluate(graph, prims, values),
                "baseline": evaluate(graph, prims, {t: v.to(self.dtype) for t, v in values.items()}, self.dtype)}


class GradientVariant:
    """``gemm`` with ``epilogue`` fused by Triton config ``config``, A and B read in ``inputs``,
    then the rest's generated kernel (module doc); its inputs and references from ``operands``."""

    def __init__(self, spec: str, operands: GradientOperands, config: GemmConfig, inputs: tuple[str, str]):
        self.operands, self.config = operands, config
        training, gemm, epilogue, dtype = operands.training, operands.gemm, operands.epilogue, operands.dtype
        self.training, self.gemm, self.epilogue = training, gemm, epilogue
        self.device, self.dtype_obj = operands.device, dtype
        c = parse(gemm.spec)
        self.c, self.inputs = c, inputs
        self.plan = map_layouts(c, (*inputs, c.out), gemm.sizes)
        self.op, self.dims, self.dtype = gradient_op(spec, training, gemm, epilogue), dict(gemm.sizes), str(dtype).removeprefix("torch.")
        self.layout = dict(zip(("a", "b", "out"), (*inputs, c.out)))
        self.rest = rest_operator(training, epilogue)
        self.rest_config = None if self.rest is None else \
            rest_configuration(training.graph, self.rest, rest_layouts(training, gemm, epilogue, inputs))
        self.knobs = config_knobs(config) | ({"rest": self.rest_config.key()} if self.rest_config else {})
        self.flop, self.bytes = gemm.flop, moved_bytes(training, gemm, epilogue, dtype.itemsize)
        self.tensors = None

    def build(self) -> None:
        graph, ep = self.training.graph, self.epilogue
        values = self.operands.tensors()["values"]
        einsum = next(p for p in self.operands.primitives() if p.kind == "einsum")
        a, b = (empty_in_layout(letters, layout, self.gemm.sizes, self.dtype_obj, self.device).copy_(values[o.tensor])
                for letters, layout, o in zip((self.c.a, self.c.b), self.inputs, einsum.inputs))
        self.tensors = {"a": a, "b": b, "factor": values[ep.factor].to(self.dtype_obj),
                        "out": empty_in_layout(self.c.out, self.c.out, self.gemm.sizes, self.dtype_obj, self.device),
                        "sums": allocate(graph, ep.summed, graph.tensors[ep.summed].letters, self.dtype_obj, self.device)}
        if self.rest is not None:
            layouts = self.rest_config.layouts
            self.compiled = compile_operator(graph, self.rest, self.rest_config)
            offsets = dropout_offsets(graph)
            masks = [t for t in self.rest.inputs if graph.tensors[t].role == "dropout"]
            self.rest_seeds = {t: (MASK_SEED, offsets[t]) for t in masks}
            self.rest_inputs = {t: allocate(graph, t, layouts[t], self.dtype_obj, self.device).copy_(values[t])
                                for t in self.rest.inputs if t not in masks}
        self.run()

    def run(self) -> dict:
        t, ep = self.tensors, self.epilogue
        epilogue = Epilogue(gradient=ep.gradient, factor=t["factor"], factor_scale=ep.scale, sums=t["sums"],
                            sum_letters=ep.sum_letters)
        run_triton(self.plan, t["a"], t["b"], t["out"], epilogue, self.config)
        result = {ep.output: t["out"], ep.summed: t["sums"]}
        if self.rest is not None:
            result.update(self.compiled.run(self.rest_inputs, self.rest_seeds))
        return result

    def check(self) -> Verdict:
        self.tensors["out"].fill_(float("nan"))
        self.tensors["sums"].fill_(float("nan"))
        results = self.run()
        t = self.operands.tensors()
        return Verdict(tuple((name, judge(value, t["baseline"][name], t["reference"][name]))
                             for name, value in results.items()))


def gradient_variants(spec: str, training, gemm: TrainingGemm, epilogue: GradientEpilogue, configs, device,
                      dtype=DTYPE) -> list[GradientVariant]:
    """The fused kernel with each of ``configs`` (TMA ones where the layouts allow) reading A and B
    in each of ``epilogue_inputs``' pairs (the rest reading an operand it shares in the same layout)."""
    variants, c = [], parse(gemm.spec)
    operands = GradientOperands(training, gemm, epilogue, device, dtype)
    for layouts in epilogue_inputs(gemm):
        plan = map_layouts(c, (*layouts, c.out), gemm.sizes)
        variants += [GradientVariant(spec, operands, cfg, layouts) for cfg in runnable(plan, dtype, configs)]
    return variants
