"""The join epilogue: a GEMM, or a pair of GEMMs sharing A, with the element-wise operator that
joins their products fused into the template's epilogue (``kernels.gemm_join``).

Pattern (``join_of``): the GEMM is one einsum, or two einsums stacked on a shared A (a Llama MLP's
gate and up projections: ``stack(gate, up)``); the first operator reading a product is element-wise
and reads every product (later readers read them stored); it is
maps only (no reduction, no dropout mask), and every tensor it reads or writes, each of its
primitives' operands and the products are over the same letters (no broadcast: a bias add is the
forward epilogue's, ``families.forward_epilogue``); it is not a lone add of two tensors (the residual
add's, ``families.residual_add``); it reads at most ``MAX_LOADS`` other tensors and writes at most
``MAX_STORES``.  SwiGLU is the case this serves: forward, ``silu(gate) * up`` (and ``silu(gate)``
kept for the backward) in the gate/up GEMM's epilogue, the products stored too where the backward
reads them; backward, ``d_up`` and ``d_gate`` from ``dh = dy @ W_down^T`` in that GEMM's epilogue,
``dh`` never stored.

The epilogue function is generated from the consumer's primitives (``join_source``: one
``@triton.jit`` function of the products and the loaded tiles, returning the consumer's outputs,
the graph's scalars as constants), compiled once per consumer.

Variants (``JoinVariant``, op ``join_op``): the template with the join per configuration whose
accumulators fit (pair mode: ``kernels.gemm.pair_fits``), in each layout combination of one
product's GEMM that ``pick_layouts`` gives, the loaded and written tensors in the products'
layout; checked against the float64 evaluation of the GEMM's and the consumer's primitives.
Candidates: the join in every layout combination, the consumer's tensors in the products' layout;
measured, else priced by the cost model where nothing of the plain GEMM was measured.  Launch (``JoinLaunch``): ``kernels.gemm_join.gemm_join`` on the step's
tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from datamove.dtypes import parse as parse_dtype
from datamove.families.base import (ConsumerOperands, EpilogueLaunch, GemmFamily, GemmSite, Tuning, epilogue_configs,
                                    gemm_config_of, operator_named)
from datamove.harness.contraction_variants import (build_ahead, TrainingGemm, config_knobs, numel, pick_layouts, runnable,
                                                   same_call_layouts)
from datamove.harness.sweep_variants import Verdict, judge, op_signature
from datamove.kernels.codegen.compiled import load_module
from datamove.kernels.codegen.expressions import names_used, triton_expression
from datamove.kernels.codegen.source import PRELUDE, with_called_helpers
from datamove.kernels.contraction import _dim_strides, empty_in_layout, gemm_plan, map_layouts, parse
from datamove.kernels.gemm import GemmConfig, GemmShape, fitted, pair_fits
from datamove.kernels.gemm_join import JOIN_TEMPLATE_ID, MAX_LOADS, MAX_STORES, JoinEpilogue, gemm_join
from datamove.kernels.launch import check_offsets
from datamove.layouts.plan import GEMM_EPILOGUE
from datamove.layouts.select import Candidate
from datamove.layouts.step_config import ContractionConfig, register_epilogue


@register_epilogue
@dataclass(frozen=True)
class Join:
    """A consumer joining a GEMM's products (module doc), also the plan step's epilogue configuration
    (``layouts.step_config.ContractionConfig.epilogue``).  ``einsum``: one product's einsum (the
    first member's, in its own letters); ``products``: the GEMM's outputs as the kernel's acc0
    (, acc1); ``loads``: the other tensors the consumer reads; ``outputs``: what it writes, in the
    epilogue function's order; ``stored``: the products also written (something else reads them)."""

    consumer: str
    einsum: str
    products: tuple[str, ...]
    loads: tuple[str, ...]
    outputs: tuple[str, ...]
    stored: tuple[str, ...]

    @property
    def pair(self) -> bool:
        return len(self.products) == 2


def join_of(training, gemm: TrainingGemm) -> Join | None:
    """The consumer of ``gemm``'s products the join epilogue runs (module doc), or None."""
    graph, op = training.graph, operator_named(training, gemm.name)
    einsums = [p for p in op.primitives if p.kind == "einsum"]
    if len(einsums) != len(op.primitives) or len(einsums) > 2 or len(op.outputs) != len(einsums):
        return None  # a summed stack (one output), or more than a pair
    if len(einsums) == 2 and (einsums[0].inputs[0].tensor != einsums[1].inputs[0].tensor
                              or einsums[0].inputs[1].tensor == einsums[1].inputs[1].tensor):
        return None  # a pair shares A and has two B
    products = tuple(e.output.tensor for e in einsums)
    readers = [o for o in training.operators if set(products) & set(o.inputs)]
    if not readers or readers[0].cls == "contraction" or not set(products) <= set(readers[0].inputs):
        return None  # the first reader of the products joins them (others read them stored)
    consumer, letters = readers[0], graph.tensors[products[0]].letters
    prims = list(consumer.primitives)
    if any(p.kind != "map" or any(x.letters != p.output.letters for x in p.inputs) for p in prims) \
            or any(graph.tensors[t].letters != letters or graph.tensors[t].role == "dropout"
                   for t in (*products, *consumer.inputs, *consumer.outputs)):
        return None
    if len(prims) == 1 and prims[0].expression.is_sum_of_inputs(2):
        return None  # the residual add's
    loads = tuple(t for t in consumer.inputs if t not in products)
    if len(loads) > MAX_LOADS or len(consumer.outputs) > MAX_STORES:
        return None
    others = {t for o in training.operators if o is not consumer for t in o.inputs}
    stored = tuple(t for t in products if t in others or t in graph.outputs)
    return Join(consumer.name, einsums[0].expr, products, loads, tuple(consumer.outputs), stored)


def join_op(spec: str, training, gemm: TrainingGemm, join: Join) -> str:
    """The tuning-DB ``op`` of ``gemm`` with ``join`` (the consumer's signature names its work)."""
    return f"gemm:{join.einsum}{'+pair' if join.pair else ''}+join:{op_signature(spec, operator_named(training, join.consumer))}"


def join_source(graph, consumer, join: Join, name: str) -> str:
    """The module text of the epilogue function ``name``: ``name(acc0[, acc1], in_0, ...)`` returns
    the consumer's outputs, its primitives evaluated in order on fp32 tiles."""
    scalars = graph.scalars()
    values = {t: f"acc{k}" for k, t in enumerate(join.products)}
    values.update({t: f"in_{k}" for k, t in enumerate(join.loads)})
    lines, used = [], set()
    for n, prim in enumerate(consumer.primitives):
        operands = [values[x.tensor] for x in prim.inputs]
        lines.append(f"    t{n} = {triton_expression(prim.expr, operands, scalars)}  # {prim.output.tensor}")
        used |= names_used(prim.expr, scalars)
        values[prim.output.tensor] = f"t{n}"
    constants = [f"    dim_{x} = {float(scalars[x])!r}" for x in sorted(used)]
    arguments = ", ".join([*(f"acc{k}" for k in range(len(join.products))), *(f"in_{k}" for k in range(len(join.loads)))])
    returned = ", ".join(values[t] for t in join.outputs)
    return with_called_helpers("\n".join([
        PRELUDE, "", "@triton.jit", f"def {name}({arguments}):",
        f'    """{consumer.name} on the products{" and loaded tiles" if join.loads else ""} (fp32 tiles)."""',
        *constants, *lines, f"    return ({returned},)", ""]))


def join_function(graph, consumer, join: Join):
    """The compiled epilogue function of ``join_source`` (one module per source text)."""
    name = "join_" + "".join(c if c.isalnum() else "_" for c in consumer.name)
    module, _ = load_module(join_source(graph, consumer, join, name))
    return getattr(module, name)


def product_gemm(gemm: TrainingGemm, join: Join) -> TrainingGemm:
    """One product's GEMM (``join.einsum``, the first member's, at ``gemm``'s sizes): what the kernel
    runs once (single) or twice sharing A (pair), and what its layouts and timings are keyed by."""
    c = parse(join.einsum)
    return TrainingGemm(gemm.name, gemm.phase, join.einsum, {x: gemm.sizes[x] for x in set(c.a + c.b + c.out)})


def moved_bytes(join: Join, product: TrainingGemm, itemsize: int) -> int:
    """Bytes the join's kernel moves: A once, each product's B, and the loaded, written and stored
    tensors (each over the products' letters)."""
    c = parse(join.einsum)
    tiles = len(join.loads) + len(join.outputs) + len(join.stored)
    return itemsize * (numel(c.a, product.sizes) + len(join.products) * numel(c.b, product.sizes)
                       + tiles * numel(c.out, product.sizes))


def run_join(join: Join, fn, plan, a, b, b1, products: dict, loads: list, outputs: list, config: GemmConfig | None):
    """``gemm_join`` on one product's ``plan`` (its layouts: ``a``, ``b`` and the products'),
    ``products``: {index: stored product tensor}; every tensor addressed by its strides."""
    out = parse(join.einsum).out
    reference = products.get(0, outputs[0] if outputs else products.get(1))
    stored1 = products.get(1)
    epilogue = JoinEpilogue(fn, b1, tuple(loads), tuple(_dim_strides(plan, out, t, "load") for t in loads),
                            tuple(outputs), tuple(_dim_strides(plan, out, t, "store") for t in outputs),
                            stored1, _dim_strides(plan, out, stored1, "acc1") if stored1 is not None else None)
    check_offsets("the join epilogue's GEMM", a, b, b1, *products.values(), *loads, *outputs)
    gemm_join(a, b, products.get(0), GemmShape(*plan.batch, plan.m, plan.n, plan.k), plan.a_strides, plan.b_strides,
              _dim_strides(plan, out, reference, "out"), epilogue, config=config)


class JoinLaunch(EpilogueLaunch):
    """``run_join`` on a plan step's tensors (its ``Join``; the GEMM's operands by member)."""

    def __init__(self, step, graph, ops: dict):
        config: ContractionConfig = step.config
        self.join: Join = config.epilogue
        self.fn = join_function(graph, ops[self.join.consumer], self.join)
        self.a, self.b = config.operands["a"][0], list(config.operands["b"])
        self.gemm_config = GemmConfig(**config.gemm) if config.gemm else None
        self.plan = None

    def __call__(self, a, b, read, output, run) -> dict:
        join = self.join
        a, b = read(self.a), [read(t) for t in self.b]
        products = {k: output(t) for k, t in enumerate(join.products) if t in join.stored}
        outputs = [output(t) for t in join.outputs]
        if self.plan is None:  # the layouts are the plan's on every call: map them once
            self.plan = gemm_plan(join.einsum, a, b[0], products.get(0, outputs[0] if outputs else None))
        run_join(join, self.fn, self.plan, a, b[0], b[1] if join.pair else None, products, [read(t) for t in join.loads],
                 outputs, self.gemm_config)
        return {**{join.products[k]: t for k, t in products.items()}, **dict(zip(join.outputs, outputs))}


class JoinVariant:
    """``gemm`` with ``join`` by Triton config ``config``, one product's A, B and output in
    ``layouts`` (its einsum's letters), the loaded and written tensors in the output's layout."""

    def __init__(self, spec: str, operands: ConsumerOperands, config: GemmConfig, layouts: tuple[str, str, str]):
        training, gemm, join, dtype = operands.training, operands.gemm, operands.epilogue, operands.dtype
        self.operands, self.config, self.join, self.layouts = operands, config, join, layouts
        product = product_gemm(gemm, join)
        self.c, self.sizes = parse(join.einsum), product.sizes
        self.plan = map_layouts(self.c, layouts, self.sizes)
        self.op, self.dims, self.dtype = join_op(spec, training, gemm, join), dict(self.sizes), parse_dtype(dtype).name
        self.layout = dict(zip(("a", "b", "out"), layouts))
        self.knobs = {**config_knobs(config), "template": JOIN_TEMPLATE_ID}  # the join's kernel is gemm_join's too
        self.flop, self.bytes = gemm.flop, moved_bytes(join, product, dtype.itemsize)
        self.tensors = None

    def compile_task(self) -> tuple:
        """Built ahead in a compile worker (``harness.contraction_variants.build_ahead``): the joined kernel compiles there."""
        return build_ahead, (self,)

    def build(self) -> None:
        join, ops = self.join, self.operands
        values, graph = ops.tensors()["values"], ops.training.graph
        consumer = operator_named(ops.training, join.consumer)
        gemm_op = operator_named(ops.training, ops.gemm.name)
        einsums = [p for p in gemm_op.primitives if p.kind == "einsum"]
        dtype, device = ops.dtype, ops.device

        def stored(tensor: str, letters: str, layout: str) -> torch.Tensor:
            return empty_in_layout(letters, layout, self.sizes, dtype, device).copy_(values[tensor])

        a = stored(einsums[0].inputs[0].tensor, self.c.a, self.layouts[0])
        bs = [stored(e.inputs[1].tensor, self.c.b, self.layouts[1]) for e in einsums]
        out = lambda: empty_in_layout(self.c.out, self.layouts[2], self.sizes, dtype, device)  # noqa: E731
        self.tensors = {"a": a, "b": bs, "loads": [stored(t, self.c.out, self.layouts[2]) for t in join.loads],
                        "products": {k: out() for k, t in enumerate(join.products) if t in join.stored},
                        "outputs": [out() for _ in join.outputs]}
        self.fn = join_function(graph, consumer, join)
        self.run()

    def run(self) -> dict:
        t, join = self.tensors, self.join
        run_join(join, self.fn, self.plan, t["a"], t["b"][0], t["b"][1] if join.pair else None, t["products"],
                 t["loads"], t["outputs"], self.config)
        return {**{join.products[k]: v for k, v in t["products"].items()}, **dict(zip(join.outputs, t["outputs"]))}

    def check(self) -> Verdict:
        for tensor in (*self.tensors["products"].values(), *self.tensors["outputs"]):
            tensor.fill_(float("nan"))
        results = self.run()
        t = self.operands.tensors()
        return Verdict(tuple((name, judge(value, t["baseline"][name], t["reference"][name]))
                             for name, value in results.items()))


def pair_sized(config: GemmConfig) -> GemmConfig:
    """``config`` with its longer tile side halved until pair mode's two accumulators fit
    (``kernels.gemm.pair_fits``): the GEMM's fastest tiles (128 x 256 at 8 warps, most often) as
    the pair's."""
    while not pair_fits(config):
        config = replace(config, block_n=config.block_n // 2) if config.block_n >= config.block_m \
            else replace(config, block_m=config.block_m // 2)
    return config


def join_variants(spec: str, training, gemm: TrainingGemm, join: Join, configs, device, dtype) -> list[JoinVariant]:
    """The join with each of ``configs`` whose accumulators fit (TMA ones where the layouts allow) in
    each layout combination ``pick_layouts`` gives for one product's GEMM (``product_gemm``)."""
    operands = ConsumerOperands(training, gemm, join, device, dtype)
    product = product_gemm(gemm, join)
    fits = list(dict.fromkeys(f for f in (fitted(x, dtype, True, join.pair) for x in configs)
                              if f is not None and (not join.pair or pair_fits(f))))
    variants = []
    for plan in pick_layouts(product, None):
        variants += [JoinVariant(spec, operands, cfg, plan.layouts) for cfg in runnable(plan, dtype, fits)]
    return variants


class JoinEpilogueFamily(GemmFamily):
    name = "join"
    moves_consumer = True
    config_type = Join

    def match(self, fused, gemm: TrainingGemm) -> Join | None:
        return join_of(fused, gemm)

    def variants(self, fused, gemm: TrainingGemm, join: Join, tuning: Tuning) -> list:
        ranked = [pair_sized(c) for c in tuning.ranked] if join.pair else tuning.ranked
        configs = epilogue_configs(list(dict.fromkeys(ranked)), True, True, tuning.dtype)
        return join_variants(tuning.spec, fused, gemm, join, configs, tuning.device, tuning.dtype)

    def candidates(self, builder, site: GemmSite, join: Join) -> list[Candidate]:
        """The join in every layout combination of one product's GEMM (``same_call_layouts`` of
        ``product_gemm``: a combination takes the time of the one making the same call), the
        loaded and written tensors in the products' layout; measured, else priced by the cost
        model where nothing of the plain GEMM was measured either (a prediction must not beat
        measurements)."""
        g, op = site.gemm, site.op
        product = product_gemm(g, join)
        fused_op = join_op(builder.spec, builder.fused, g, join)
        moved = moved_bytes(join, product, builder.itemsize)
        plain_measured = any(plain.measured for plain in site.plain)
        own = site.renames[join.products[0]]  # the products' (and every joined tensor's) letters
        result = []
        for (a_layout, b_layout, out_layout), timed_as in same_call_layouts(product).items():
            key = dict(zip(("a", "b", "out"), timed_as))
            found = builder.timings.lookup(fused_op, product.sizes, key)
            if found is None and (plain_measured or builder.timings.broken(fused_op, product.sizes, key)):
                continue
            ms, source, knobs = builder.time(found, "gemm", g.flop, moved)
            reads = {t: "".join(site.renames[t][x] for x in layout) for k, layout in (("a", a_layout), ("b", b_layout))
                     for t in site.members[k]}
            joined = "".join(own[x] for x in out_layout)
            reads |= {t: joined for t in join.loads}
            writes = {t: joined for t in (*join.stored, *join.outputs)}
            step_config = ContractionConfig(g.spec, "triton", site.members, gemm_config_of(knobs) if knobs else None,
                                            epilogue=join)
            result.append(Candidate(f"{g.name}+{join.consumer}", op.phase, GEMM_EPILOGUE, (g.name, join.consumer),
                                    reads, writes, step_config, ms, source))
        return result

    def launch(self, step, graph, ops: dict) -> JoinLaunch:
        return JoinLaunch(step, graph, ops)
