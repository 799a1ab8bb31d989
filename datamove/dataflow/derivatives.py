"""Element-wise chains inlined into one map, for the derivation (``dataflow.autodiff``).

``elementwise_chains``: a forward element-wise operator of several maps (GELU written out) whose
inner tensors nobody else reads, inlined into one map (the maps' expression trees substituted into
each other, ``dataflow.expression``), so that its backward is one map reading the operator's
inputs.  The derivatives themselves: ``Expression.derivative``.
"""
from __future__ import annotations

from datamove.dataflow.expression import Expression, Input
from datamove.dataflow.graph import Operand, Primitive, PrimitiveGraph
from datamove.dataflow.operators import FORWARD, NORMALIZATION, group_operators


def _composed_map(prims: list[Primitive]) -> Primitive | None:
    """Maps ``prims`` (in order) inlined into one map named after the last; None when an inner
    tensor is read under other letters than it was written with."""
    exprs: dict[str, tuple[Expression, str]] = {}
    operands: list[Operand] = []
    for prim in prims:
        values = {}
        for k, op in enumerate(prim.inputs):
            if op.tensor in exprs:
                expr, letters = exprs[op.tensor]
                if letters != op.letters:
                    return None
                values[k] = expr
            else:
                if op not in operands:
                    operands.append(op)
                values[k] = Input(operands.index(op))
        exprs[prim.output.tensor] = (prim.expression.substitute(values), prim.output.letters)
    last = prims[-1]
    return Primitive(last.name, "map", tuple(operands), last.output, exprs[last.output.tensor][0].source())


def elementwise_chains(graph: PrimitiveGraph) -> list[tuple[tuple[str, ...], Primitive]]:
    """Forward element-wise operators of several maps (e.g. GELU written out) whose inner tensors
    nobody else reads: (member names, the maps inlined into one).  Differentiating the inlined map
    gives one backward map reading only the operator's inputs, not its inner tensors."""
    consumers = graph.consumers()
    result = []
    for op in group_operators(graph, FORWARD):
        prims = list(op.primitives)
        if op.cls == NORMALIZATION or len(prims) < 2 or any(p.kind != "map" for p in prims):
            continue
        inside = {p.name for p in prims}
        if any(c.name not in inside for p in prims[:-1] for c in consumers[p.output.tensor]) \
                or any(p.output.tensor in graph.outputs for p in prims[:-1]):
            continue
        composed = _composed_map(prims)
        if composed is not None:
            result.append((tuple(p.name for p in prims), composed))
    return result
