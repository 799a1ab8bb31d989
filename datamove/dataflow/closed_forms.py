"""Normalizations recognised structurally inside the forward normalization operators
(``dataflow.operators``), to be differentiated in closed form by ``dataflow.autodiff``.

The maps between the reductions are composed into one symbolic expression per tensor (sympy) and
compared with the defining formula of

- softmax over R: ``y = exp(x - max_R x) / sum_R exp(x - max_R x)`` (max optional), whose backward
  is emitted in closed form ``dx = y * (dy - sum_R(dy * y))``;
- layernorm over R: ``xhat = (x - mean_R x) / sqrt(mean_R (x - mean)^2 + eps)`` (or times the
  inverse square root), backward ``dx = (g - (sum_R g + xhat * sum_R(g * xhat)) / |R|) / std``;
  the per-feature affine tail (gamma, beta) goes through the generic rules, which gives
  dgamma and dbeta as reductions.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from datamove.dataflow.graph import Operand, Primitive, PrimitiveGraph
from datamove.dataflow.operators import FORWARD, NORMALIZATION, group_operators


@dataclass(frozen=True)
class ClosedForm:
    """A normalization recognised in the forward graph, differentiated in closed form.

    ``kind``: "softmax" or "layernorm"; ``members``: the forward primitives from ``input`` to
    ``output`` that the closed form replaces; ``reduced``: the normalised letters R (in the
    members' naming); ``scale``: layernorm's tensor over the letters outside R holding
    sqrt(var + eps) (``inverted``: it holds 1 / sqrt(var + eps) instead).
    """

    kind: str
    members: tuple[str, ...]
    input: str
    output: str
    reduced: str
    scale: str | None = None
    inverted: bool = False


SYMPY_FUNCTIONS = {"exp": sympy.exp, "log": sympy.log, "sqrt": sympy.sqrt, "tanh": sympy.tanh,
                   "log1p": lambda x: sympy.log(1 + x), "expm1": lambda x: sympy.exp(x) - 1,
                   "maximum": sympy.Max, "minimum": sympy.Min, "abs": sympy.Abs, "sign": sympy.sign,
                   "where": sympy.Function("where")}


def _sympy_number(value: int | float) -> sympy.Number:
    """A number of a map expression as ``sympy.sympify`` reads its text (an int exact, a float at
    the digits written)."""
    return sympy.Integer(value) if isinstance(value, int) else sympy.Float(repr(value))


class _Symbols(dict):
    """The dims' symbols; any other scalar name (``scale_<mask>``) a symbol of its own."""

    def __missing__(self, name: str) -> sympy.Symbol:
        return sympy.Symbol(name)


@dataclass
class _Composed:
    """Symbolic values of an operator's tensors: leaves are outside tensors and reductions."""

    values: dict[str, sympy.Expr]
    reductions: dict[str, tuple[str, sympy.Expr, Primitive]]  # output -> (sum|max, body, primitive)
    leaves: dict[sympy.Symbol, str]


def _compose(graph: PrimitiveGraph, prims: list[Primitive]) -> _Composed | None:
    """Inline the maps of ``prims`` into one expression per tensor; None if letters are not used
    consistently (a tensor read under other letters than it has)."""
    letters = {p.output.tensor: p.output.letters for p in prims}
    values: dict[str, sympy.Expr] = {}
    reductions, leaves = {}, {}

    def value(operand: Operand):
        name = operand.tensor
        if letters.setdefault(name, operand.letters) != operand.letters:
            return None
        if name not in values:
            symbol = sympy.Symbol(f"t_{name}")
            values[name], leaves[symbol] = symbol, name
        return values[name]

    dims = _Symbols({dim: sympy.Symbol(dim, positive=True) for dim in set(graph.letter_dims.values())})
    for prim in prims:
        operands = [value(op) for op in prim.inputs]
        if any(v is None for v in operands):
            return None
        if prim.kind == "reduce":
            symbol = sympy.Symbol(f"r_{prim.output.tensor}")
            reductions[prim.output.tensor] = (prim.expr, operands[0], prim)
            values[prim.output.tensor] = symbol
        elif prim.kind == "map":
            values[prim.output.tensor] = prim.expression.evaluate(operands, dims, SYMPY_FUNCTIONS, _sympy_number)
        else:
            return None
    return _Composed(values, reductions, leaves)


def _same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.simplify(a - b) == 0


def _closed_form_members(prims: list[Primitive], output: str) -> list[Primitive]:
    """The primitives of ``prims`` that ``output`` depends on."""
    producer = {p.output.tensor: p for p in prims}
    needed, stack = set(), [output]
    while stack:
        tensor = stack.pop()
        prim = producer.get(tensor)
        if prim is not None and prim.name not in needed:
            needed.add(prim.name)
            stack.extend(op.tensor for op in prim.inputs)
    return [p for p in prims if p.name in needed]


def _match(graph: PrimitiveGraph, prims: list[Primitive], x_name: str) -> ClosedForm | None:
    """A softmax or layernorm of tensor ``x_name`` computed by ``prims`` (which do not make it)."""
    composed = _compose(graph, prims)
    if composed is None:
        return None
    x = next((symbol for symbol, name in composed.leaves.items() if name == x_name), None)
    if x is None:
        return None
    dims = {dim: sympy.Symbol(dim, positive=True) for dim in set(graph.letter_dims.values())}
    sums = [(name, body, prim) for name, (kind, body, prim) in composed.reductions.items() if kind == "sum"]
    maxes = [(name, prim) for name, (kind, body, prim) in composed.reductions.items() if kind == "max" and body == x]
    candidates = [p for p in prims if p.kind == "map"]

    def found(kind: str, target: Primitive, reduced: str, **extra) -> ClosedForm | None:
        members = _closed_form_members(prims, target.output.tensor)
        inside = {p.name for p in members}
        consumers = graph.consumers()
        for prim in members:  # the core's intermediates must not be read outside it
            if prim is not target and any(c.name not in inside for c in consumers[prim.output.tensor]):
                return None
        return ClosedForm(kind, tuple(p.name for p in members), x_name, target.output.tensor, reduced, **extra)

    for z_name, z_body, z_prim in sums:  # softmax: exp(x - max x) / sum exp(x - max x), max optional
        reduced = z_prim.reduced
        for m_name in [None] + [m for m, m_prim in maxes if m_prim.reduced == reduced]:
            shifted = sympy.exp(x - composed.values[m_name]) if m_name else sympy.exp(x)
            if not _same(z_body, shifted):
                continue
            for target in candidates:
                if set(target.output.letters) == set(z_prim.inputs[0].letters) and \
                        _same(composed.values[target.output.tensor], shifted / composed.values[z_name]):
                    return found("softmax", target, reduced)
    for a_name, a_body, a_prim in sums:  # layernorm: (x - mean x) / sqrt(mean (x - mean x)^2 + eps)
        if a_body != x:
            continue
        reduced = a_prim.reduced
        count = sympy.Mul(*[dims[graph.letter_dims[letter]] for letter in reduced])
        centred = x - composed.values[a_name] / count
        for b_name, b_body, b_prim in sums:
            if b_prim.reduced != reduced or not _same(b_body, centred ** 2):
                continue
            variance = composed.values[b_name] / count
            for target in candidates:
                value = composed.values[target.output.tensor]
                if set(target.output.letters) != set(a_prim.inputs[0].letters) or not value.has(x):
                    continue
                eps = sympy.simplify((centred / value) ** 2 - variance)
                if not (eps.is_number and eps >= 0):
                    continue
                std = sympy.sqrt(variance + eps)
                for scale in candidates:
                    if set(scale.output.letters) != set(a_prim.output.letters):
                        continue
                    s = composed.values[scale.output.tensor]
                    if _same(s, std) or _same(s * std, 1):
                        return found("layernorm", target, reduced, scale=scale.output.tensor,
                                     inverted=not _same(s, std))
    return None


def recognise_normalizations(graph: PrimitiveGraph) -> list[ClosedForm]:
    """Softmax and layernorm cores in the forward normalization operators of ``graph``.

    Every tensor read inside an operator is tried as the core's input x (an operator may chain
    several normalizations over the same letters); cores do not overlap."""
    result = []
    for op in group_operators(graph, FORWARD):
        if op.cls != NORMALIZATION:
            continue
        prims, taken = list(op.primitives), set()
        for x_name in dict.fromkeys(o.tensor for p in prims for o in p.inputs):
            upstream = {p.name for p in _closed_form_members(prims, x_name)}
            match = _match(graph, [p for p in prims if p.name not in upstream], x_name)
            if match is not None and not taken & set(match.members):
                result.append(match)
                taken |= set(match.members)
    return result
