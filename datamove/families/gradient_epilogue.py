"""The gradient epilogue: a GEMM with the backward of an activation and a bias gradient in its epilogue.

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

Candidates (``GradientEpilogueFamily.candidates``): the output and factor in spec order, A and B
in each layout pair timed, the rest reading what it shares with them alike; without timings spec
order only, priced by the cost model.  Launch (``GradientEpilogueLaunch``): the template with the
derivative the step's ``GradientEpilogueConfig`` names (checked against the graph's expression),
then the rest's generated kernel.

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

from datamove.dataflow.activations import derivative
from datamove.dataflow.executor import dropout_offsets
from datamove.dtypes import parse as parse_dtype
from datamove.families.base import (ConsumerOperands, EpilogueLaunch, GemmFamily, GemmSite, Tuning, epilogue_configs,
                                    gemm_config_of, operator_named)
from datamove.harness.contraction_variants import (build_ahead, DTYPE, TrainingGemm, config_knobs, epilogue_inputs, numel,
                                                   runnable)
from datamove.harness.sweep_variants import MASK_SEED, Verdict, judge, op_signature, tensor_bytes
from datamove.kernels.codegen import allocate, compile_operator
from datamove.kernels.contraction import Epilogue, contract, empty_in_layout, map_layouts, parse, run_triton
from datamove.kernels.gemm import GemmConfig
from datamove.layouts.plan import GEMM_EPILOGUE, GENERATED, Step
from datamove.layouts.select import Candidate
from datamove.layouts.space import rest_configuration, rest_part
from datamove.layouts.step_config import ContractionConfig, GeneratedConfig, GradientEpilogueConfig


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
    op = operator_named(training, gemm.name)
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
    return rest_part(operator_named(training, epilogue.consumer), epilogue.primitives)


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
    einsum = next(p for p in operator_named(training, gemm.name).primitives if p.kind == "einsum")
    layouts = {t: graph.tensors[t].letters for t in (*rest.inputs, *rest.outputs) if graph.tensors[t].role != "dropout"}
    for operand, layout in zip(einsum.inputs, inputs):
        if operand.tensor in layouts:
            rename = dict(zip(operand.letters, graph.tensors[operand.tensor].letters))
            layouts[operand.tensor] = "".join(rename[x] for x in layout)
    return layouts


class GradientVariant:
    """``gemm`` with ``epilogue`` fused by Triton config ``config``, A and B read in ``inputs``,
    then the rest's generated kernel (module doc); its inputs and references from ``operands``."""

    def __init__(self, spec: str, operands: ConsumerOperands, config: GemmConfig, inputs: tuple[str, str]):
        self.operands, self.config = operands, config
        training, gemm, epilogue, dtype = operands.training, operands.gemm, operands.epilogue, operands.dtype
        self.training, self.gemm, self.epilogue = training, gemm, epilogue
        self.device, self.dtype_obj = operands.device, dtype
        c = parse(gemm.spec)
        self.c, self.inputs = c, inputs
        self.plan = map_layouts(c, (*inputs, c.out), gemm.sizes)
        self.op, self.dims, self.dtype = gradient_op(spec, training, gemm, epilogue), dict(gemm.sizes), parse_dtype(dtype).name
        self.layout = dict(zip(("a", "b", "out"), (*inputs, c.out)))
        self.rest = rest_operator(training, epilogue)
        self.rest_config = None if self.rest is None else \
            rest_configuration(training.graph, self.rest, rest_layouts(training, gemm, epilogue, inputs))
        self.knobs = config_knobs(config) | ({"rest": self.rest_config.key()} if self.rest_config else {})
        self.flop, self.bytes = gemm.flop, moved_bytes(training, gemm, epilogue, dtype.itemsize)
        self.tensors = None

    def compile_task(self) -> tuple:
        """Built ahead in a compile worker (``harness.contraction_variants.build_ahead``): the Triton GEMM with its
        epilogue and the rest's generated kernel compile there."""
        return build_ahead, (self,)

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
    operands = ConsumerOperands(training, gemm, epilogue, device, dtype)
    for layouts in epilogue_inputs(gemm):
        plan = map_layouts(c, (*layouts, c.out), gemm.sizes)
        variants += [GradientVariant(spec, operands, cfg, layouts) for cfg in runnable(plan, dtype, configs)]
    return variants


def epilogue_rest(graph, ops: dict, epilogue: GradientEpilogueConfig) -> tuple:
    """(operator, configuration) of the generated kernel a gradient epilogue's step runs after its
    GEMM (``epilogue``: the step's; ``ops``: the fused graph's operators by name)."""
    rest = rest_part(ops[epilogue.consumer], list(epilogue.primitives))
    return rest, rest_configuration(graph, rest, epilogue.rest_layouts)


class GradientEpilogueLaunch(EpilogueLaunch):
    """The template with a step's ``GradientEpilogueConfig``: the product by the derivative (its kind
    and scale read off the graph's expression at the graph's scalars, 1 in evaluation mode, and
    checked against the plan's) and the bias gradient; ``after``: the rest's generated kernel."""

    def __init__(self, step, graph, ops: dict):
        config: ContractionConfig = step.config
        self.einsum, self.epilogue = config.einsum, config.epilogue
        self.gemm_config = GemmConfig(**config.gemm) if config.gemm else None
        ep = self.epilogue
        product = next(p for p in ops[ep.consumer].primitives if p.name == ep.primitives[0])
        self.gradient = derivative(product.expr, int(product.inputs[0].tensor != ep.produced), graph.scalars())
        if self.gradient is None or self.gradient[0] != ep.gradient:
            raise ValueError(f"{step.name}: {product.expr!r} is not the {ep.gradient} derivative "
                             f"the plan's epilogue computes")
        if ep.rest:
            rest, rest_config = epilogue_rest(graph, ops, ep)
            masks = {t: rest_config.layouts[t] for t in rest.inputs if graph.tensors[t].role == "dropout"}
            self.after = (Step(rest.name, step.phase, GENERATED, (),
                               {t: rest_config.layouts[t] for t in rest.inputs if t not in masks},
                               {t: rest_config.layouts[t] for t in rest.outputs}, GeneratedConfig(rest_config.knobs, masks),
                               0.0, step.source), rest)

    def __call__(self, a, b, read, output, run) -> dict:
        ep = self.epilogue
        out, sums = output(ep.output), output(ep.summed)
        epilogue = Epilogue(gradient=self.gradient[0], factor=read(ep.factor), factor_scale=self.gradient[1], sums=sums,
                            sum_letters=ep.sum_letters)
        contract(self.einsum, a, b, out, backend="triton", epilogue=epilogue, config=self.gemm_config)
        return {ep.output: out, ep.summed: sums}


class GradientEpilogueFamily(GemmFamily):
    name = "gradient"
    moves_consumer = True
    config_type = GradientEpilogueConfig
    # three launches with host work between them (descriptors, the partial sums' buffer, the rest's
    # kernel): timed replayed from a CUDA graph, or the host's time counts (H100: 0.3-0.4 ms against 0.085)
    timing = {"cuda_graph": True}

    def match(self, fused, gemm: TrainingGemm) -> GradientEpilogue | None:
        return gradient_epilogue_of(fused, gemm)

    def variants(self, fused, gemm: TrainingGemm, ep: GradientEpilogue, tuning: Tuning) -> list:
        # the factor's tile takes shared memory for its layout change, as a saved value's store does
        return gradient_variants(tuning.spec, fused, gemm, ep, epilogue_configs(tuning.ranked, True, True, tuning.dtype),
                                 tuning.device, tuning.dtype)

    def candidates(self, builder, site: GemmSite, ep: GradientEpilogue) -> list[Candidate]:
        """The GEMM with the backward of an activation and a bias gradient in its epilogue, then the
        consumer's other parts by their generated kernel: the output and factor in spec order, A and
        B in each layout pair it was timed with (``epilogue_inputs``), the rest reading what it
        shares with them alike (``rest_layouts``); without timings, spec order only, priced by the
        cost model."""
        g, op, graph, fused = site.gemm, site.op, builder.graph, builder.fused
        c = parse(g.spec)
        rest = rest_operator(fused, ep)
        moved = moved_bytes(fused, g, ep, builder.itemsize)
        fused_op = gradient_op(builder.spec, fused, g, ep)
        result = []
        for layouts in epilogue_inputs(g):
            key = dict(zip(("a", "b", "out"), (*layouts, c.out)))
            found = builder.timings.lookup(fused_op, g.sizes, key)
            if found is None and (layouts != (c.a, c.b) or builder.timings.broken(fused_op, g.sizes, key)):
                continue  # measured where the template ran; the cost model prices spec order alone
            own = rest_layouts(fused, g, ep, layouts)
            reads = {t: "".join(site.renames[t][x] for x in layout) for k, layout in zip(("a", "b"), layouts)
                     for t in site.members[k]}
            reads |= {ep.factor: graph.tensors[ep.factor].letters, **{t: own[t] for t in (rest.inputs if rest else ())
                                                                     if t in own}}
            writes = {ep.output: graph.tensors[ep.output].letters, ep.summed: graph.tensors[ep.summed].letters,
                      **{t: own[t] for t in (rest.outputs if rest else ())}}
            ms, source, knobs = builder.time(found, "gemm", g.flop, moved)
            config = ContractionConfig(g.spec, "triton", site.members, gemm_config_of(knobs) if knobs else None,
                                       epilogue=GradientEpilogueConfig(
                                           ep.consumer, ep.gradient, ep.factor, ep.produced, ep.output, ep.summed,
                                           ep.sum_letters, tuple(ep.primitives), tuple(ep.rest), own))
            result.append(Candidate(f"{g.name}+{ep.consumer}", op.phase, GEMM_EPILOGUE, (g.name, ep.consumer),
                                    reads, writes, config, ms, source))
        return result

    def launch(self, step, graph, ops: dict) -> GradientEpilogueLaunch:
        return GradientEpilogueLaunch(step, graph, ops)
