"""Map expressions as immutable trees, parsed once from the strings the graph stores.

A map primitive's ``expr`` (``dataflow.graph.Primitive``) is a Python expression over

- its inputs ``in0, in1, ...`` (``Input``),
- scalar names (``Name``): dim names such as ``N``, and ``scale_<mask>``, the keep factor of a
  dropout tensor (``PrimitiveGraph.scalars`` gives their values),
- numbers (``Constant``: ints and floats, kept as written so that printing gives the same text),
- unary ``-`` / ``+`` (``Unary``), ``+ - * / **`` (``Binary``), one comparison ``< <= > >= == !=``
  (``Compare``),
- calls of ``FUNCTIONS``: exp, log, sqrt, tanh, log1p, expm1, abs, sign, maximum, minimum, where
  (``Call``).

Anything else (another function, a chained comparison, ``//``, ``and``, subscripts, ...) is refused
by ``parse`` with an ``ExpressionError`` naming it.  ``parse`` caches by text, so a string is
parsed once however often it is asked for; ``Primitive.expression`` holds a map's tree.

The visitors: ``evaluate`` (NumPy, torch or any other table of functions), ``source`` (Python
source, as ``ast.unparse`` prints it, with hooks for the names, the functions and the constants:
the Triton code generator's form), ``derivative`` (symbolic, simplified as the reverse-mode
derivation needs), ``substitute``, and the structural queries ``inputs``, ``names``, ``matches``,
``scale_of``, ``input_index``, ``is_sum_of_inputs``, ``linear_factor``, ``flop``.  Equality and
hashing are structural: spacing and parentheses never matter, nor ``0`` against ``0.0``;
``matches(..., commutative=True)`` also ignores the order of the operands of ``+`` and ``*``.

Plain Python and NumPy: the graph imports this module, not the reverse.
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

# The functions a map expression may call, as NumPy (float64 arrays); their names are the whole set, and
# each is NumPy's of that name.  The lowering's element-wise functions and the SDFG reader's are these
# (``lowering.support``, ``sdfg_reader``); every backend's table holds exactly these names (torch:
# ``harness.torch_eval.FUNCTIONS``, Triton: ``kernels.codegen.expressions``, sympy: ``closed_forms``).
FUNCTIONS = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh, "log1p": np.log1p, "expm1": np.expm1,
             "maximum": np.maximum, "minimum": np.minimum, "abs": np.abs, "where": np.where, "sign": np.sign}
ARITY = {"exp": 1, "log": 1, "sqrt": 1, "tanh": 1, "log1p": 1, "expm1": 1, "abs": 1, "sign": 1, "maximum": 2,
         "minimum": 2, "where": 3}
FREE_FUNCTIONS = frozenset({"maximum", "minimum", "abs", "where"})  # selections: no flop (as the paper's ReLU)

_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
_COMPARE = {ast.Gt: ">", ast.GtE: ">=", ast.Lt: "<", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!="}
_UNARY = {ast.USub: "-", ast.UAdd: "+"}
_AST = {symbol: node for table in (_BINARY, _COMPARE) for node, symbol in table.items()}
_AST_UNARY = {symbol: node for node, symbol in _UNARY.items()}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "**": operator.pow,
          ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq,
          "!=": operator.ne}
_INPUT = re.compile(r"in(0|[1-9][0-9]*)")


class ExpressionError(ValueError):
    """A map expression outside the language (see the module doc)."""


@dataclass(frozen=True, repr=False)
class Expression:
    """A node of a map expression; the subclasses are the node kinds."""

    def children(self) -> tuple["Expression", ...]:
        return ()

    def rebuild(self, children: tuple["Expression", ...]) -> "Expression":
        return self

    def __repr__(self) -> str:
        return f"parse({self.source()!r})"

    def __str__(self) -> str:
        return self.source()

    # --- structure --------------------------------------------------------------------------

    def walk(self) -> Iterator["Expression"]:
        """Every node, this one first (pre-order)."""
        yield self
        for child in self.children():
            yield from child.walk()

    @property
    def inputs(self) -> tuple[int, ...]:
        """The indices of the inputs read, ascending (``in2 * in0`` -> (0, 2))."""
        return tuple(sorted({node.index for node in self.walk() if isinstance(node, Input)}))

    @property
    def names(self) -> frozenset[str]:
        """The scalar names used (dims, ``scale_<mask>``)."""
        return frozenset(node.id for node in self.walk() if isinstance(node, Name))

    @property
    def functions(self) -> frozenset[str]:
        return frozenset(node.function for node in self.walk() if isinstance(node, Call))

    @property
    def reads_input(self) -> bool:
        return any(isinstance(node, Input) for node in self.walk())

    @property
    def input_index(self) -> int | None:
        """k when the expression is just ``in<k>`` (a copy or a transposition), else None."""
        return self.index if isinstance(self, Input) else None

    def matches(self, *forms: "str | Expression", commutative: bool = False) -> bool:
        """This expression is one of ``forms`` up to spacing, parentheses and the spelling of numbers
        (``0`` / ``0.0``); ``commutative``: also up to the order of the operands of ``+`` and ``*``."""
        mine = self.canonical() if commutative else self
        for form in forms:
            other = parse(form) if isinstance(form, str) else form
            if mine == (other.canonical() if commutative else other):
                return True
        return False

    def canonical(self) -> "Expression":
        """The operands of every ``+`` and ``*`` in one order (by their source)."""
        node = self.rebuild(tuple(child.canonical() for child in self.children()))
        if isinstance(node, Binary) and node.op in ("+", "*"):
            left, right = sorted((node.left, node.right), key=lambda n: n.source())
            return Binary(node.op, left, right)
        return node

    def is_sum_of_inputs(self, count: int | None = None) -> bool:
        """Whether this is ``in0 + in1 + ... + in<count-1>`` (the derivation's sum of contributions);
        without ``count``: whether it only adds inputs (``in1 + in0``, ``in2``, ...), in any order."""
        if count is None:
            return all(isinstance(node, Input) or (isinstance(node, Binary) and node.op == "+") for node in self.walk())
        return count >= 1 and self == parse(" + ".join(f"in{k}" for k in range(count)))

    def scale_of(self, k: int = 0) -> "Expression | None":
        """c when this is ``in<k> * c``, ``c * in<k>`` or ``in<k> / c`` (then ``1 / c``) with c
        reading no input; else None."""
        if not isinstance(self, Binary) or self.op not in ("*", "/"):
            return None
        if self.left == Input(k) and not self.right.reads_input:
            return self.right if self.op == "*" else Binary("/", Constant(1), self.right)
        if self.op == "*" and self.right == Input(k) and not self.left.reads_input:
            return self.left
        return None

    def linear_factor(self, names: Mapping[str, float], functions: Mapping = FUNCTIONS) -> float | None:
        """For an expression of ``in0`` alone: f(1) when f(2) == 2 f(1) (to 1e-12 relative), else None."""
        one, two = (float(self.evaluate([x], names, functions)) for x in (1.0, 2.0))
        return None if abs(two - 2 * one) > 1e-12 * abs(one) else one

    def flop(self) -> int:
        """Arithmetic operations per element: every ``+ - * / **``, negation and call (other than
        ``FREE_FUNCTIONS``) that reads an input; comparisons and constant parts (``sqrt(P)``) count zero."""
        count = 0
        for node in self.walk():
            if not node.reads_input:
                continue
            if isinstance(node, Binary) or (isinstance(node, Unary) and node.op == "-") \
                    or (isinstance(node, Call) and node.function not in FREE_FUNCTIONS):
                count += 1
        return count

    # --- rewriting --------------------------------------------------------------------------

    def substitute(self, values: Mapping[int, "Expression"]) -> "Expression":
        """Each ``in<k>`` with k in ``values`` replaced by ``values[k]`` (all at once)."""
        if isinstance(self, Input):
            return values.get(self.index, self)
        return self.rebuild(tuple(child.substitute(values) for child in self.children()))

    def derivative(self, k: int) -> "Expression":
        """d(self)/d(in<k>), simplified (no ``+ 0``, ``* 1``, ``* 0``, double negation, ``a * (1 / b)``).

        maximum(a, b) sends the gradient to a where a > b and to b elsewhere (so ReLU, maximum(x, 0),
        gives ``x > 0``, as torch.relu); minimum(a, b) to a where a < b.  Comparisons and ``sign``
        (0 but at 0, where torch takes 0 too) count as constants."""
        return _derivative(self, k)

    # --- evaluation and printing ------------------------------------------------------------

    def evaluate(self, inputs: Sequence, names: Mapping, functions: Mapping = FUNCTIONS,
                 constant: Callable | None = None, compared: Callable | None = None):
        """The value with ``in<k>`` = ``inputs[k]``, scalar names from ``names``, calls through
        ``functions`` (NumPy's by default; torch's: ``harness.torch_eval.FUNCTIONS``) and numbers
        as written (or ``constant(number)``), with Python's operators, as ``eval`` of the text would;
        a comparison's value passed through ``compared(value, left, right)`` where given."""
        def value(node: Expression):
            if isinstance(node, Input):
                return inputs[node.index]
            if isinstance(node, Name):
                if node.id not in names:
                    raise ExpressionError(f"unknown name {node.id!r} in a map expression")
                return names[node.id]
            if isinstance(node, Constant):
                return node.value if constant is None else constant(node.value)
            if isinstance(node, Unary):
                operand = value(node.operand)
                return -operand if node.op == "-" else +operand
            if isinstance(node, (Binary, Compare)):
                left, right = value(node.left), value(node.right)
                result = _APPLY[node.op](left, right)
                return compared(result, left, right) if compared is not None and isinstance(node, Compare) else result
            return functions[node.function](*(value(arg) for arg in node.args))
        return value(self)

    def to_ast(self, inputs: Sequence[str] | Callable[[int], str] | None = None,
               names: Mapping[str, str] | Callable[[str], str] | None = None,
               functions: Mapping[str, str] | None = None, constant: Callable | None = None,
               expand_powers: bool = False) -> ast.expr:
        """A Python AST of the expression; see ``source`` for the arguments."""
        def text(table, key, default):
            if table is None:
                return default
            if isinstance(table, Mapping) and key not in table:
                raise ExpressionError(f"unknown name {key!r} in a map expression")
            return table(key) if callable(table) else table[key]

        def build(node: Expression) -> ast.expr:
            if isinstance(node, Input):
                return ast.Name(text(inputs, node.index, f"in{node.index}"), ast.Load())
            if isinstance(node, Name):
                return ast.Name(text(names, node.id, node.id), ast.Load())
            if isinstance(node, Constant):
                return ast.Constant(node.value if constant is None else constant(node.value))
            if isinstance(node, Unary):
                return ast.UnaryOp(_AST_UNARY[node.op](), build(node.operand))
            if isinstance(node, Compare):
                return ast.Compare(build(node.left), [_AST[node.op]()], [build(node.right)])
            if isinstance(node, Call):
                if functions is not None and node.function not in functions:
                    raise ExpressionError(f"unsupported function in a map expression: {node.function}")
                callee = ast.Name(text(functions, node.function, node.function), ast.Load())
                return ast.Call(callee, [build(arg) for arg in node.args], [])
            left, right = build(node.left), build(node.right)
            if node.op == "**" and expand_powers:  # small integer powers (tanh' = 1 - tanh**2) as products
                power = right.value if isinstance(right, ast.Constant) else None
                if not (isinstance(power, (int, float)) and float(power).is_integer() and 1 <= power <= 4):
                    raise ExpressionError(f"'**' only with a constant integer exponent 1..4, not {ast.unparse(right)}")
                product = left
                for _ in range(int(power) - 1):
                    product = ast.BinOp(product, ast.Mult(), left)
                return product
            return ast.BinOp(left, _AST[node.op](), right)
        return build(self)

    def source(self, inputs: Sequence[str] | Callable[[int], str] | None = None,
               names: Mapping[str, str] | Callable[[str], str] | None = None,
               functions: Mapping[str, str] | None = None, constant: Callable | None = None,
               expand_powers: bool = False) -> str:
        """The expression as Python source, as ``ast.unparse`` prints it (so ``parse(text).source()``
        is ``ast.unparse(ast.parse(text))``).  ``inputs``: the text of ``in<k>`` (a sequence or a
        function of k); ``names``: of a scalar name; ``functions``: of each callee (``"tl.exp"``; a
        function not in it is refused); ``constant``: maps every number (``float`` for Triton);
        ``expand_powers``: ``a ** n`` (n a constant integer 1..4) as ``a * a * ...``."""
        return ast.unparse(self.to_ast(inputs, names, functions, constant, expand_powers))


@dataclass(frozen=True, repr=False)
class Input(Expression):
    """``in<index>``: the primitive's input ``index``."""

    index: int


@dataclass(frozen=True, repr=False)
class Name(Expression):
    """A scalar name: a dim (``N``) or ``scale_<mask>``."""

    id: str


@dataclass(frozen=True, repr=False)
class Constant(Expression):
    """A number as written (int or float; ``Constant(0) == Constant(0.0)``)."""

    value: int | float


@dataclass(frozen=True, repr=False)
class _Operation(Expression):
    """An operator (``op``) applied to the node's other fields, its children."""

    op: str

    def children(self):
        return tuple(getattr(self, f.name) for f in fields(self)[1:])

    def rebuild(self, children):
        return type(self)(self.op, *children)


@dataclass(frozen=True, repr=False)
class Unary(_Operation):
    operand: Expression  # op: "-" or "+"


@dataclass(frozen=True, repr=False)
class Binary(_Operation):
    left: Expression  # op: "+", "-", "*", "/", "**"
    right: Expression


@dataclass(frozen=True, repr=False)
class Compare(_Operation):
    left: Expression  # op: ">", ">=", "<", "<=", "==", "!="
    right: Expression


@dataclass(frozen=True, repr=False)
class Call(Expression):
    function: str  # a key of FUNCTIONS
    args: tuple[Expression, ...]

    def children(self):
        return self.args

    def rebuild(self, children):
        return Call(self.function, tuple(children))


# --- parsing ------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def parse(text: str) -> Expression:
    """The tree of map expression ``text``; ``ExpressionError`` for anything outside the language."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise ExpressionError(f"map expression {text!r} is not an expression: {error.msg}") from None
    return from_ast(tree.body)


def from_ast(node: ast.expr) -> Expression:
    """The tree of a Python expression AST (the language of ``parse``)."""
    def refuse(what: str) -> ExpressionError:
        return ExpressionError(f"unsupported {what} in a map expression: {ast.unparse(node)!r}")

    if isinstance(node, ast.Name):
        if node.id.startswith("in") and node.id[2:].isdigit():
            if not _INPUT.fullmatch(node.id):
                raise refuse("input name")
            return Input(int(node.id[2:]))
        if node.id in FUNCTIONS:
            raise refuse("function without a call")
        return Name(node.id)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise refuse("constant")
        return Constant(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return Unary(_UNARY[type(node.op)], from_ast(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return Binary(_BINARY[type(node.op)], from_ast(node.left), from_ast(node.right))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        return Compare(_COMPARE[type(node.ops[0])], from_ast(node.left), from_ast(node.comparators[0]))
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise ExpressionError(f"unsupported function in a map expression: {ast.unparse(node.func)}")
        if node.keywords or len(node.args) != ARITY[node.func.id] \
                or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise refuse(f"call of {node.func.id} (it takes {ARITY[node.func.id]} positional arguments)")
        return Call(node.func.id, tuple(from_ast(arg) for arg in node.args))
    raise refuse("construct")


# --- derivatives --------------------------------------------------------------------------------

ZERO, ONE = Constant(0), Constant(1)


def _const(node: Expression, value: float) -> bool:
    return isinstance(node, Constant) and node.value == value


def add(a: Expression, b: Expression) -> Expression:
    """``a + b`` simplified as the derivatives are (no ``+ 0``)."""
    if _const(a, 0):
        return b
    if _const(b, 0):
        return a
    return Binary("+", a, b)


def _neg(a: Expression) -> Expression:
    if _const(a, 0):
        return a
    if isinstance(a, Unary) and a.op == "-":
        return a.operand
    return Unary("-", a)


def _sub(a: Expression, b: Expression) -> Expression:
    if _const(b, 0):
        return a
    if _const(a, 0):
        return _neg(b)
    return Binary("-", a, b)


def product(a: Expression, b: Expression) -> Expression:
    """``a * b`` simplified as the derivatives are (0, 1, -1 and ``a * (1 / c)`` -> ``a / c``)."""
    if _const(a, 0) or _const(b, 0):
        return ZERO
    if _const(a, 1):
        return b
    if _const(b, 1):
        return a
    if _const(b, -1):
        return _neg(a)
    if isinstance(b, Binary) and b.op == "/" and _const(b.left, 1):
        return Binary("/", a, b.right)
    return Binary("*", a, b)


def _div(a: Expression, b: Expression) -> Expression:
    if _const(a, 0) or _const(b, 1):
        return a
    return Binary("/", a, b)


def _derivative(node: Expression, k: int) -> Expression:
    d = lambda n: _derivative(n, k)  # noqa: E731
    if isinstance(node, Input):
        return ONE if node.index == k else ZERO
    if isinstance(node, (Name, Constant, Compare)):
        return ZERO
    if isinstance(node, Unary):
        inner = d(node.operand)
        return _neg(inner) if node.op == "-" else inner
    if isinstance(node, Binary):
        a, b = node.left, node.right
        if node.op == "+":
            return add(d(a), d(b))
        if node.op == "-":
            return _sub(d(a), d(b))
        if node.op == "*":
            return add(product(d(a), b), product(a, d(b)))
        if node.op == "/":
            return _sub(_div(d(a), b), _div(product(a, d(b)), Binary("*", b, b)))
        da, db = d(a), d(b)  # "**"
        power = product(product(b, Binary("**", a, _sub(b, ONE))), da)
        if _const(db, 0):
            return power
        return add(power, product(product(node, Call("log", (a,))), db))
    name, args = node.function, node.args
    if name == "exp":
        return product(node, d(args[0]))
    if name == "log":
        return _div(d(args[0]), args[0])
    if name == "sqrt":
        return _div(d(args[0]), product(Constant(2), node))
    if name == "tanh":
        return product(_sub(ONE, Binary("**", node, Constant(2))), d(args[0]))
    if name == "log1p":
        return _div(d(args[0]), add(ONE, args[0]))
    if name == "expm1":
        return product(Call("exp", (args[0],)), d(args[0]))
    if name == "abs":
        return product(Call("sign", (args[0],)), d(args[0]))
    if name == "sign":
        return ZERO
    if name in ("maximum", "minimum"):
        a, b = args
        first = Compare(">" if name == "maximum" else "<", a, b)
        second = Compare("<=" if name == "maximum" else ">=", a, b)
        return add(product(d(a), first), product(d(b), second))
    if name == "where":
        cond, a, b = args
        da, db = d(a), d(b)
        if _const(da, 0) and _const(db, 0):
            return ZERO
        return Call("where", (cond, da, db))
    raise ExpressionError(f"cannot differentiate {node.source()!r}: unsupported construct")
