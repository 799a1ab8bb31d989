"""A map primitive's expression (``PrimitiveGraph`` text such as ``in0 * exp(in1 - N)``) printed
as Triton code and as the generated kernel's docstring: the one place the code generator reads
expression text (``_Expr``; to be replaced by a shared expression tree of ``datamove.dataflow``)."""
from __future__ import annotations

import ast

_FUNCTIONS = {"exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt_rn", "maximum": "tl.maximum",
              "minimum": "tl.minimum", "abs": "tl.abs", "where": "tl.where", "tanh": "_tanh"}


class _Expr(ast.NodeTransformer):
    """Map expression -> Triton expression: inK -> value variables, dims and scales -> dim_<name> args."""

    def __init__(self, operands: list[str], dims):
        self.operands, self.dims = operands, dims

    def visit_Name(self, node):
        if node.id.startswith("in") and node.id[2:].isdigit():
            return ast.Name(self.operands[int(node.id[2:])], ast.Load())
        if node.id in self.dims:
            return ast.Name(f"dim_{node.id}", ast.Load())
        raise ValueError(f"unknown name {node.id!r} in a map expression")

    def visit_Constant(self, node):
        return ast.Constant(float(node.value)) if isinstance(node.value, (int, float)) else node

    def visit_Call(self, node):
        node.args = [self.visit(arg) for arg in node.args]
        if not (isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS):
            raise ValueError(f"unsupported function in a map expression: {ast.unparse(node.func)}")
        node.func = ast.parse(_FUNCTIONS[node.func.id], mode="eval").body
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Pow):  # small integer powers (derivatives: tanh' = 1 - tanh**2) as products
            power = node.right.value if isinstance(node.right, ast.Constant) else None
            if not (isinstance(power, float) and power.is_integer() and 1 <= power <= 4):
                raise ValueError(f"'**' only with a constant integer exponent 1..4, not {ast.unparse(node.right)}")
            product = node.left
            for _ in range(int(power) - 1):
                product = ast.BinOp(product, ast.Mult(), node.left)
            return product
        return node


def triton_expression(expr: str, operands: list[str], dims) -> str:
    """``expr`` as Triton code: ``inK`` -> ``operands[K]``, a name of ``dims`` -> ``dim_<name>``."""
    return ast.unparse(_Expr(operands, dims).visit(ast.parse(expr, mode="eval")))


def names_used(expr: str, names) -> set[str]:
    """The names of ``names`` that ``expr`` reads."""
    return {node.id for node in ast.walk(ast.parse(expr, mode="eval"))
            if isinstance(node, ast.Name) and node.id in names}


def describe(prim, own: dict) -> str:
    """One line of the generated kernel's docstring for primitive ``prim`` (``own``: its letters ->
    the operator's): ``out[letters] = expression`` over the operands' names and letters."""
    names = {f"in{n}": f"{o.tensor}[{''.join(own[l] for l in o.letters)}]" for n, o in enumerate(prim.inputs)}
    out = f"{prim.output.tensor}[{''.join(own[l] for l in prim.output.letters)}]"
    if prim.kind == "reduce":
        return f"{out} = {prim.expr} over {''.join(own[l] for l in prim.reduced)} of {names['in0']}"
    tree = ast.parse(prim.expr, mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in names:
            node.id = names[node.id]
    return f"{out} = {ast.unparse(tree)}"
