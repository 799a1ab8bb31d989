"""The forward epilogue: a GEMM and the element-wise consumer the template fuses into its epilogue.

Pattern (``epilogue_of``, by structure): the consumer of a single-einsum GEMM's output is exactly
bias add [+ ReLU or tanh-GELU, in the spec's own spelling] [+ Philox dropout], its other output at
most the value before the activation or the dropout (saved for the backward), as in
linear1 -> bias + ReLU + dropout.  The GEMM template (``kernels.gemm``) adds the bias, applies the
activation, draws the same dropout mask and stores the saved value from its accumulator.

Variants (``epilogue_variants``, op ``epilogue_op``): the fused Triton kernel per configuration
(``families.base.epilogue_configs``) reading A and B in each layout pair that writes the output in
spec order, beside cuBLAS then PyTorch eager and cuBLAS then the consumer's generated kernel.
Candidates: the GEMM with the consumer fused, its output in spec order (the consumer's), per
layout pair timed (others of the same call take its time); without timings spec order only,
priced by the cost model.  Launch (``ForwardEpilogueLaunch``): the template with the bias,
activation, dropout (the graph's ``p``, the call's seed) and save of the step's ``EpilogueConfig``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from datamove.dataflow.activations import PROBE, activation, evaluate
from datamove.dtypes import parse as parse_dtype
from datamove.families.base import (EpilogueLaunch, GemmFamily, GemmSite, Tuning, epilogue_configs, gemm_config_of,
                                    operator_named)
from datamove.harness.contraction_variants import (build_ahead, Operands, TrainingGemm, _layout_key, config_knobs, epilogue_inputs,
                                                   numel, runnable, same_call_layouts)
from datamove.harness.sweep_variants import MASK_SEED, Verdict, judge
from datamove.harness.torch_eval import dropout_offsets, keep_mask_torch
from datamove.kernels.codegen import compile_operator
from datamove.kernels.contraction import Epilogue, contract, empty_in_layout, map_layouts, parse, run_cublas, run_triton
from datamove.kernels.gemm import GemmConfig
from datamove.kernels.philox import dropout_scale
from datamove.layouts.plan import GEMM_EPILOGUE
from datamove.layouts.select import Candidate
from datamove.layouts.space import configurations
from datamove.layouts.step_config import ContractionConfig, EpilogueConfig


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
    op = operator_named(training, gemm.name)
    if len(op.outputs) != 1 or gemm.stacked != 1:
        return None
    produced = op.outputs[0]
    out_letters = parse(gemm.spec).out
    for consumer in training.operators:
        if consumer.cls == "contraction" or produced not in consumer.inputs:
            continue
        prims = list(consumer.primitives)
        first = prims[0]
        if first.kind != "map" or not first.expression.matches("in0 + in1") or first.inputs[0].tensor != produced \
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
            elif prim.kind == "map" and prim.expression.matches("in0 * in1") and mask is None \
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
        self.op, self.dims, self.dtype = epilogue_op(gemm, epilogue), dict(gemm.sizes), parse_dtype(operands.dtype).name
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

    def compile_task(self) -> tuple | None:
        """Built ahead in a compile worker (``harness.contraction_variants.build_ahead``) where it compiles a kernel:
        the fused Triton GEMM, or the consumer's generated kernel; None for cuBLAS + eager."""
        return None if self.config is None and self.consumer is None else (build_ahead, (self,))

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
    op = operator_named(training, epilogue.consumer)
    return [(graph, op, config) for config in configurations(graph, op)
            if all(layout == graph.tensors[t].letters for t, layout in config.layouts.items())
            and config.knobs.get("dropout", "regenerate") == "regenerate"]


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


class ForwardEpilogueLaunch(EpilogueLaunch):
    """The template with a step's ``EpilogueConfig``: bias, activation, dropout (the graph's ``p``: 0
    in evaluation mode; the call's seed, the mask's counter offset) and the saved value."""

    def __init__(self, step, graph, ops: dict):
        config: ContractionConfig = step.config
        self.einsum, self.epilogue = config.einsum, config.epilogue
        self.gemm_config = GemmConfig(**config.gemm) if config.gemm else None
        mask = self.epilogue.mask
        self.offset = dropout_offsets(graph)[mask] if mask else 0
        self.dropout_p = graph.tensors[mask].p if mask else 0.0

    def __call__(self, a, b, read, output, run) -> dict:
        ep = self.epilogue
        out = output(ep.output)
        epilogue = Epilogue(bias=read(ep.bias), bias_letters=ep.bias_letters, activation=ep.activation,
                            dropout_p=self.dropout_p, seed=run.seed, offset=self.offset, save=ep.save)
        result = contract(self.einsum, a, b, out, backend="triton", epilogue=epilogue, config=self.gemm_config)
        return {ep.output: out, **({ep.saved: result[1]} if ep.save else {})}


class ForwardEpilogueFamily(GemmFamily):
    name = "epilogue"
    config_type = EpilogueConfig

    def match(self, fused, gemm: TrainingGemm) -> FusableEpilogue | None:
        return epilogue_of(fused, gemm)

    def variants(self, fused, gemm: TrainingGemm, ep: FusableEpilogue, tuning: Tuning) -> list:
        configs = epilogue_configs(tuning.ranked, ep.mask is not None, ep.save is not None, tuning.dtype)
        return epilogue_variants(Operands(gemm, tuning.device, dtype=tuning.dtype, seed=1), ep, configs,
                                 consumer_configurations(fused, ep), epilogue_inputs(gemm))

    def candidates(self, builder, site: GemmSite, ep: FusableEpilogue) -> list[Candidate]:
        """The GEMM with ``ep`` fused, its output in spec order (the consumer's), reading A and B in
        each layout pair the template was timed with (``epilogue_inputs``; other pairs of the same
        call take that pair's time); without timings, spec order only, priced by the cost model."""
        g, op, graph = site.gemm, site.op, builder.graph
        c = parse(g.spec)
        if any(graph.tensors[t].letters != graph.tensors[ep.produced].letters for t in (ep.output, ep.saved) if t):
            return []
        out_layout = "".join(site.renames[ep.produced][x] for x in c.out)
        elements = math.prod(g.sizes[x] for x in c.out)
        outputs = 2 if ep.save else 1
        moved = builder.itemsize * (sum(math.prod(g.sizes[x] for x in letters) for letters in (c.a, c.b))
                                    + outputs * elements)
        writes = {ep.output: out_layout, **({ep.saved: out_layout} if ep.saved else {})}
        epilogue = EpilogueConfig(ep.consumer, ep.bias, ep.bias_letters, ep.activation, ep.mask, ep.p, ep.save,
                                  ep.produced, ep.output, ep.saved)
        pairs = {layouts[:2]: timed_as for layouts, timed_as in same_call_layouts(g).items()
                 if layouts[2] == c.out and timed_as[2] == c.out}
        fused_op = epilogue_op(g, ep)
        result = []
        for (a_layout, b_layout), timed_as in pairs.items():
            key = dict(zip(("a", "b", "out"), timed_as))
            found = builder.timings.lookup(fused_op, g.sizes, key, lambda knobs: knobs.get("backend") == "triton")
            if found is None and ((a_layout, b_layout) != (c.a, c.b) or builder.timings.broken(fused_op, g.sizes, key)):
                continue  # measured where the template ran; the cost model prices spec order alone
            ms, source, knobs = builder.time(found, "gemm", g.flop, moved)
            reads = {t: "".join(site.renames[t][x] for x in layout) for k, layout in (("a", a_layout), ("b", b_layout))
                     for t in site.members[k]}
            reads[ep.bias] = graph.tensors[ep.bias].letters
            config = ContractionConfig(g.spec, "triton", site.members, gemm_config_of(knobs) if knobs else None,
                                       epilogue=epilogue)
            result.append(Candidate(f"{g.name}+{ep.consumer}", op.phase, GEMM_EPILOGUE, (g.name, ep.consumer), reads,
                                    writes, config, ms, source))
        return result

    def launch(self, step, graph, ops: dict) -> ForwardEpilogueLaunch:
        return ForwardEpilogueLaunch(step, graph, ops)
