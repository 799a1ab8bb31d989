"""Map expressions differentiated and inlined, on their ASTs (operands ``in0``, ``in1``, ...).

``derivative``: the symbolic derivative of +, -, *, /, **, exp, log, sqrt, tanh, abs,
maximum/minimum (a mask, ReLU's ``in0 > 0``) and where, simplified as it is built (``add``,
``multiply``, ... fold 0 and 1).  ``elementwise_chains``: a forward element-wise operator of several
maps (GELU written out) whose inner tensors nobody else reads, inlined into one map, so that its
backward is one map reading the operator's inputs.
"""
from __future__ import annotations

import ast

from datamove.dataflow.graph import Operand, Primitive, PrimitiveGraph
from datamove.dataflow.operators import FORWARD, NORMALIZATION, group_operators


def is_constant(node: ast.expr, value: float) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == value


def number(value: float) -> ast.expr:
    return ast.Constant(value)


def add(a: ast.expr, b: ast.expr) -> ast.expr:
    if is_constant(a, 0):
        return b
    if is_constant(b, 0):
        return a
    return ast.BinOp(a, ast.Add(), b)


def _neg(a: ast.expr) -> ast.expr:
    if is_constant(a, 0):
        return a
    if isinstance(a, ast.UnaryOp) and isinstance(a.op, ast.USub):
        return a.operand
    return ast.UnaryOp(ast.USub(), a)


def _sub(a: ast.expr, b: ast.expr) -> ast.expr:
    if is_constant(b, 0):
        return a
    if is_constant(a, 0):
        return _neg(b)
    return ast.BinOp(a, ast.Sub(), b)


def multiply(a: ast.expr, b: ast.expr) -> ast.expr:
    if is_constant(a, 0) or is_constant(b, 0):
        return number(0)
    if is_constant(a, 1):
        return b
    if is_constant(b, 1):
        return a
    if is_constant(b, -1):
        return _neg(a)
    if isinstance(b, ast.BinOp) and isinstance(b.op, ast.Div) and is_constant(b.left, 1):
        return ast.BinOp(a, ast.Div(), b.right)
    return ast.BinOp(a, ast.Mult(), b)


def _div(a: ast.expr, b: ast.expr) -> ast.expr:
    if is_constant(a, 0):
        return a
    if is_constant(b, 1):
        return a
    return ast.BinOp(a, ast.Div(), b)


def _call(name: str, *args: ast.expr) -> ast.expr:
    return ast.Call(ast.Name(name, ast.Load()), list(args), [])


def _compare(a: ast.expr, op: ast.cmpop, b: ast.expr) -> ast.expr:
    return ast.Compare(a, [op], [b])


def derivative(node: ast.expr, var: str) -> ast.expr:
    """d(node)/d(var) as a simplified AST; ``var`` is an operand name such as ``"in0"``.

    maximum(a, b) sends the gradient to a where a > b and to b elsewhere (so ReLU, maximum(x, 0),
    gives ``x > 0``, as torch.relu); minimum(a, b) to a where a < b.
    """
    d = lambda n: derivative(n, var)  # noqa: E731
    if isinstance(node, ast.Name):
        return number(1) if node.id == var else number(0)
    if isinstance(node, (ast.Constant, ast.Compare)):
        return number(0)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = d(node.operand)
        return _neg(inner) if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp):
        a, b = node.left, node.right
        if isinstance(node.op, ast.Add):
            return add(d(a), d(b))
        if isinstance(node.op, ast.Sub):
            return _sub(d(a), d(b))
        if isinstance(node.op, ast.Mult):
            return add(multiply(d(a), b), multiply(a, d(b)))
        if isinstance(node.op, ast.Div):
            return _sub(_div(d(a), b), _div(multiply(a, d(b)), ast.BinOp(b, ast.Mult(), b)))
        if isinstance(node.op, ast.Pow):
            da, db = d(a), d(b)
            power = multiply(multiply(b, ast.BinOp(a, ast.Pow(), _sub(b, number(1)))), da)
            if is_constant(db, 0):
                return power
            return add(power, multiply(multiply(node, _call("log", a)), db))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name, args = node.func.id, node.args
        if name == "exp":
            return multiply(node, d(args[0]))
        if name == "log":
            return _div(d(args[0]), args[0])
        if name == "sqrt":
            return _div(d(args[0]), multiply(number(2), node))
        if name == "tanh":
            return multiply(_sub(number(1), ast.BinOp(node, ast.Pow(), number(2))), d(args[0]))
        if name == "abs":
            return multiply(_call("sign", args[0]), d(args[0]))
        if name in ("maximum", "minimum"):
            a, b = args
            first = _compare(a, ast.Gt() if name == "maximum" else ast.Lt(), b)
            second = _compare(a, ast.LtE() if name == "maximum" else ast.GtE(), b)
            return add(multiply(d(a), first), multiply(d(b), second))
        if name == "where":
            cond, a, b = args
            da, db = d(a), d(b)
            if is_constant(da, 0) and is_constant(db, 0):
                return number(0)
            return _call("where", cond, da, db)
    raise ValueError(f"cannot differentiate {ast.unparse(node)!r}: unsupported construct")


class Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def visit_Name(self, node: ast.Name):
        return ast.Name(self.names.get(node.id, node.id), ast.Load())


def operand_names(node: ast.expr) -> list[str]:
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id.startswith("in") and n.id[2:].isdigit()}
    return sorted(names, key=lambda n: int(n[2:]))


def _composed_map(prims: list[Primitive]) -> Primitive | None:
    """Maps ``prims`` (in order) inlined into one map named after the last; None when an inner
    tensor is read under other letters than it was written with."""
    exprs: dict[str, tuple[ast.expr, str]] = {}
    operands: list[Operand] = []
    for prim in prims:
        names = {}
        for k, op in enumerate(prim.inputs):
            if op.tensor in exprs:
                expr, letters = exprs[op.tensor]
                if letters != op.letters:
                    return None
                names[f"in{k}"] = expr
            else:
                if op not in operands:
                    operands.append(op)
                names[f"in{k}"] = ast.Name(f"in{operands.index(op)}", ast.Load())
        exprs[prim.output.tensor] = (_Inline(names).visit(ast.parse(prim.expr, mode="eval").body), prim.output.letters)
    last = prims[-1]
    return Primitive(last.name, "map", tuple(operands), last.output, ast.unparse(exprs[last.output.tensor][0]))


class _Inline(ast.NodeTransformer):
    def __init__(self, names: dict[str, ast.expr]):
        self.names = names

    def visit_Name(self, node: ast.Name):
        return self.names.get(node.id, node)


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
