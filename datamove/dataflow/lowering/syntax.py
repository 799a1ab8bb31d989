"""The pieces the lowering builds its output from: AST nodes of the DaCe dialect (``np.einsum``,
``np.float32(...)`` calls, names), sizes as sympy expressions over the dims and back as Python
integer arithmetic, the names of a constant's index variables, and the spec's letter -> dim table
with the letters lowering invents (``Letters``)."""
from __future__ import annotations

import ast
import copy
import itertools

import numpy
import sympy

from datamove.dataflow.spec import LayerSpec, SpecError

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def load_name(name: str) -> ast.Name:
    return ast.Name(name, ast.Load())


def np_attr(attr: str) -> ast.expr:
    return ast.Attribute(load_name("np"), attr, ast.Load())


def make_call(func: ast.expr, *args: ast.expr, **keywords: ast.expr) -> ast.Call:
    return ast.Call(func, list(args), [ast.keyword(k, v) for k, v in keywords.items()])


def float32_of(value: ast.expr) -> ast.Call:
    return make_call(np_attr("float32"), value)


def int_node(values: list[int]) -> ast.expr:
    if len(values) == 1:
        return ast.Constant(values[0])
    return ast.Tuple([ast.Constant(v) for v in values], ast.Load())


def dim_symbol(dim: str) -> sympy.Symbol:
    return sympy.Symbol(dim, integer=True, positive=True)


def sympy_size(value) -> sympy.Expr:
    """A dim symbol (``dace.symbol``), an expression of them (``H // KV``) or an int as a sympy size over
    ``dim_symbol``s."""
    if isinstance(value, (int, numpy.integer)) and not isinstance(value, bool):
        return sympy.Integer(int(value))
    expr = sympy.sympify(value)
    return expr.subs({s: dim_symbol(str(s)) for s in expr.free_symbols})


def same_size(a, b) -> bool:
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def int_source(expr) -> str:
    """A sympy size as Python integer arithmetic over the dim names (``floor(E/2)`` -> ``(E // 2)``)."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return expr.name
    if isinstance(expr, sympy.floor):
        num, den = sympy.fraction(sympy.together(expr.args[0]))
        return f"({int_source(num)} // {int_source(den)})"
    if expr.is_Add:
        terms = sorted(expr.args, key=lambda a: (a.could_extract_minus_sign(), a.is_Number, str(a)))
        text = int_source(terms[0])
        for term in terms[1:]:
            text += f" - {int_source(-term)}" if term.could_extract_minus_sign() else f" + {int_source(term)}"
        return f"({text})"
    if expr.is_Mul and all(a.is_Integer or not a.is_Rational for a in expr.args):
        if expr.could_extract_minus_sign():
            return f"(-{int_source(-expr)})"
        return "(" + " * ".join(int_source(a) for a in expr.args) + ")"
    raise SpecError(f"size {expr} is not an integer expression of the dims")


def substitute(expr: str, names: dict[str, str]) -> str:
    """``expr`` with the names in ``names`` replaced, all at once."""
    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name):
            return ast.copy_location(ast.Name(names.get(node.id, node.id), ast.Load()), node)
    return ast.unparse(Rename().visit(ast.parse(expr, mode="eval")))


def index_name(letter: str) -> str:
    return f"_i_{letter}"


class Letters:
    """The spec's letter -> dim table, extended with letters that lowering invents."""

    def __init__(self, spec: LayerSpec, reserved: set[str]):
        self.dims = dict(spec.letter_dims)
        self.index = dict(spec.letter_dims)
        self.reserved = set(reserved)

    def dim(self, letter: str | None) -> str | None:
        return None if letter is None else self.dims[letter]

    def fresh(self, dim: str, avoid: set[str]) -> str:
        """Another letter for ``dim``: INDEX's, then one invented before, then a new one."""
        for letter, known in itertools.chain(self.index.items(), self.dims.items()):
            if known == dim and letter not in avoid:
                return letter
        for letter in _LETTERS:
            if letter not in self.dims and letter not in self.reserved and letter not in avoid:
                self.dims[letter] = dim
                return letter
        raise SpecError(f"out of einsum letters for dim {dim}")


def static_node(value) -> ast.expr:
    return ast.parse(repr(value), mode="eval").body


def as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def axes_text(visible) -> str:
    return "(" + ", ".join("1" if l is None else l for l in visible) + ")"


def with_body(node: ast.FunctionDef, body: list[ast.stmt], name: str | None = None) -> ast.FunctionDef:
    new = copy.copy(node)
    new.body, new.decorator_list, new.name = body, [], name or node.name
    return new
