"""Plain NumPy in a layer spec, lowered to the dialect the DaCe front end reads.

People write ``h @ w + c``, ``x.mean(axis=-1, keepdims=True)``, ``0.5 * z * (1.0 + np.tanh(...))``;
``dataflow.sdfg`` / ``dataflow.sdfg_reader`` read explicit ``np.einsum``, ``np.sum`` / ``np.max`` with
integer axes, explicit ``None`` broadcasts and ``np.float32`` constants.  ``lower_spec`` rewrites the
layer function, and each helper it calls (one copy per distinct argument shapes), at the source
level before DaCe sees it.  It interprets the function's AST abstractly: every array value carries
its letters (from the arguments' annotations), so NumPy's shape rules can be applied by name.

What is lowered to what:

- ``a @ b``, ``np.matmul``, ``np.dot``, ``np.tensordot`` and ``np.einsum`` without ``->``: one explicit
  ``np.einsum`` over the operands' letters (the batch dims of ``@`` broadcast as NumPy's; a free
  letter that would repeat, as in ``q @ k.T``, gets another letter of the same dim, INDEX's first);
- NumPy broadcasting (trailing alignment, size-1 axes, scalars): each operand indexed explicitly
  with ``None`` for the axes it lacks (``b[None, None, :]``);
- ``np.sum`` / ``np.max`` / ``np.min`` / ``np.mean`` / ``np.var`` / ``np.std``, ``np.amax`` / ``np.amin``,
  ``np.add.reduce`` / ``np.maximum.reduce`` / ``np.minimum.reduce`` and the methods ``x.sum()`` ...,
  with negative or tuple axes and ``keepdims=True``: ``np.sum`` / ``np.max`` over explicit axes (min as
  ``-np.max(-x)``), the mean divided by ``np.float32(D)``, the variance as the mean of the centred
  square, the standard deviation its ``np.sqrt``; a keepdims result is stored without its size-1
  axes and re-broadcast where it is used, so the normalization grouping sees sums;
- ``x ** n`` for integer n: products (negative n: one division), ``** 0.5`` / ``** -0.5``:
  ``np.sqrt``; ``np.square``, ``np.reciprocal``, ``np.negative``, ``np.add`` ...: the operators;
- ``np.where(a > b, c, d)``: kept, explicitly broadcast (the reader makes it one map);
- ``x.T``, ``np.transpose``, ``np.swapaxes``, ``x.transpose``, ``x.swapaxes``: relabelled letters, no
  copy: an einsum reads the stored operand with permuted letters, an element-wise operation
  through ``np.einsum("ts->st", x)``, which the reader turns into permuted operand letters;
- Python numbers, module-level float constants and dims (``D``, ``x.shape[-1]``) in arithmetic:
  ``np.float32(...)``, the spec's dtype; sizes (dims, ``x.shape[k]``, integers and ``+ - * //`` of
  these, ``H // KV`` at module level) stay symbolic where they bound a slice or count a repeat;
- helpers: an array passed as an expression is assigned to a name first; a helper that contracts
  (once DaCe inlines two calls, their einsums' results would share one name), or makes or returns a
  constant or slice below, is inlined (its statements before the caller's, names made unique);
  other helpers stay functions DaCe inlines, as before.

Constructs the primitive graph has no kind for (it has einsums, maps and reductions over named
dims, no offsets, no index-dependent values) are lowered onto einsums with constants whose value
the front end knows.  Each becomes a constant argument of the layer (appended to the spec's,
``Tensor(letters, requires_grad=False)``) whose graph tensor carries its value as an expression of
its indices and the dims (``TensorInfo.value``, evaluated by ``dataflow.executor.known_value``, read
by ``dataflow.initial_values`` as a ``KnownValue``), so autodiff (no gradient to a constant), the
executor, fusion and the kernels treat it as any constant, and it follows the dims (``with_dims``):

- ``x[..., a:b]`` (one axis, contiguous; bounds sizes as above) is a ``Part``: element-wise
  operations on parts cut the same way (and on arrays broadcast along that axis) are computed on the
  whole axis and cut again; ``np.concatenate`` of parts that put an axis of one dim back together
  is, per array sliced, one einsum ``"...a,ae->...e"`` with a constant matrix placing each part
  (0, 1, or its factor: rotate_half's ``-x2`` is -1 there, no negation map); parts put back in their
  places are the array itself.  New letters for the halves would need dims derived from others
  (``E // 2``), which the graph cannot keep consistent when a dim changes, and views with offsets,
  which no later stage reads; the matrix (E x E, a tiny GEMM) keeps every stage as it is.  Any
  other use of a slice is refused (``PART_HINT``);
- ``np.repeat(k, n, axis)`` / ``k.repeat(n, axis)`` (HF's ``repeat_kv`` for grouped-query
  attention): one einsum ``"bkse,kh->bhse"`` with the 0/1 matrix ``[h // n == k]``, the written axis
  the dim of INDEX that ``n`` times the read one is (H for ``H // KV``), so the attention reads K
  and V over the query heads, materialised as HF's eager attention does (a spec written with a group
  letter, ``q[b, k, g, s, e]``, reads them once instead; the fused attention does not take it yet);
- ``np.arange(T)``, ``np.ones`` / ``np.zeros`` / ``np.full((T, T), v)``, ``np.tril`` / ``np.triu``,
  comparisons, ``& | ~``, arithmetic and ``np.where`` of these are ``Const``s, combined until they
  meet a computed array; ``np.where(mask, x, -inf)`` (or any number <= -1e4) with such a mask is
  ``x`` plus the additive constant (0 where kept): a causal mask so added to the scores before the
  softmax is what ``initial_values`` reads as the ``CausalMask`` and the fused attention replaces.

Anything else is refused with ``file:line``, the construct as written and what to write instead.
A spec that needs none of this (``configs/bert.py``) is returned unchanged, function and all.
"""
from __future__ import annotations

import ast
import copy
import inspect
import itertools
import linecache
import math
import sys
import types
from dataclasses import dataclass, replace

import dace
import numpy
import sympy

from datamove.dataflow.initial_values import MASKED_SCORE
from datamove.dataflow.spec import Argument, LayerSpec, SpecError

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_UNARY = {"exp": "exp", "log": "log", "sqrt": "sqrt", "tanh": "tanh", "abs": "abs", "absolute": "abs"}
_BINARY = {"add": ast.Add, "subtract": ast.Sub, "multiply": ast.Mult, "divide": ast.Div, "true_divide": ast.Div}
_REDUCERS = {"sum": "sum", "max": "max", "min": "min", "amax": "max", "amin": "min", "mean": "mean",
             "var": "var", "std": "std", "add.reduce": "sum", "maximum.reduce": "max", "minimum.reduce": "min"}
_HINTS = {  # refused NumPy functions and methods -> what to write instead
    "reshape": "name every axis with its own letter instead, e.g. a per-head weight as Tensor(\"hde\") and "
               "x[:, None] @ w for its batch of heads",
    "stack": "declare the pieces as separate Tensor arguments",
    "split": "slice the axis into its parts instead: x[..., :h], x[..., h:]",
    "astype": "drop it: the spec computes in its own dtype",
    "softmax": "write the softmax out with np.max, np.exp and np.sum",
    "erf": "write GELU in its tanh form: 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))",
    "random": "declare a Dropout(letters, p) argument and multiply by it",
    "float64": "write np.float32(...) or a plain Python number (taken in the spec's dtype)",
}
SUPPORTED = ("@, np.einsum, np.matmul, np.dot, np.tensordot, np.sum/max/min/mean/var/std, np.exp, np.log, "
              "np.sqrt, np.tanh, np.abs, np.square, np.reciprocal, np.maximum, np.minimum, np.where, "
              "np.transpose, np.swapaxes, x[..., a:b] with np.concatenate, np.repeat, np.arange, np.ones, "
              "np.zeros, np.full, np.tril, np.triu, arithmetic and ** with a constant exponent")
PART_HINT = ("a slice x[..., a:b] is supported element-wise (with arrays that broadcast along that axis, or are "
             "sliced the same way) and put back together with np.concatenate along the axis it was cut from, "
             "as rotate_half does; for anything else declare the part as its own Tensor argument")
_CONST_FUNCTIONS = {"where", "exp", "log", "sqrt", "tanh", "abs", "maximum", "minimum"}


@dataclass(frozen=True)
class Arr:
    """An array value: ``expr`` computes its stored array, whose axes have the letters ``stored``
    (None: a size-1 axis the array has); NumPy sees the axes ``visible``: each the index of a stored
    axis, or None for a size-1 axis added by a view (``x[:, None]``, keepdims).  A view is lazy: the
    stored array is indexed (``[:, None]``) or relabelled only where the value is used."""

    expr: ast.expr
    stored: tuple[str | None, ...]
    visible: tuple[int | None, ...]

    @staticmethod
    def of(expr: ast.expr, letters) -> "Arr":
        return Arr(expr, tuple(letters), tuple(range(len(letters))))

    @property
    def letters(self) -> tuple[str | None, ...]:
        """The letters NumPy sees, None for size-1 axes."""
        return tuple(None if e is None else self.stored[e] for e in self.visible)

    @property
    def plain(self) -> bool:
        return self.visible == tuple(range(len(self.stored)))


@dataclass(frozen=True)
class Num:
    """A scalar in the spec's dtype; ``value`` when it is a known Python number; ``size`` (a sympy
    integer expression over the dims) when it is a size: a dim, ``x.shape[k]``, an integer, and
    ``+ - * //`` of these (slice bounds, ``np.repeat`` counts, shapes)."""

    expr: ast.expr
    value: float | None = None
    size: object = None


@dataclass(frozen=True)
class Part:
    """``x[..., lo:lo + length]``: ``base`` (a whole array) cut along its visible axis ``axis`` (``lo``,
    ``length``: sympy sizes), times ``scale`` (a negation or a known factor, folded into the matrix of
    the ``np.concatenate`` that puts the parts back together).  Element-wise operations on parts are
    computed on their bases (the whole axis) and cut the same way."""

    base: Arr
    axis: int
    lo: object
    length: object
    scale: float = 1.0


@dataclass(frozen=True)
class Const:
    """An array the front end knows the value of (``np.arange``, ``np.ones`` / ``np.zeros`` /
    ``np.full``, ``np.tril`` / ``np.triu``, comparisons, arithmetic and ``np.where`` of these): ``expr``
    over ``_i_<letter>`` (the index along each axis), the dim names and numbers; ``letters``: its
    axes (None: size 1).  Where it meets computed arrays it becomes a constant argument of the layer
    whose value the graph carries (``TensorInfo.value``); ``hint`` names it."""

    expr: str
    letters: tuple[str | None, ...]
    hint: str = ""


class _NeedsInline(Exception):
    """A helper whose lowering must be inlined into its caller (it contracts, or makes or returns a
    constant or a slice): raised while lowering it on its own."""


@dataclass(frozen=True)
class Static:
    """A Python value known while lowering (an axis, a tuple of axes, a string, a module)."""

    value: object


@dataclass(frozen=True)
class Compare:
    """An element-wise comparison, only valid as np.where's condition."""

    node: ast.Compare
    operands: tuple


def _load(name: str) -> ast.Name:
    return ast.Name(name, ast.Load())


def _np(attr: str) -> ast.expr:
    return ast.Attribute(_load("np"), attr, ast.Load())


def _call(func: ast.expr, *args: ast.expr, **keywords: ast.expr) -> ast.Call:
    return ast.Call(func, list(args), [ast.keyword(k, v) for k, v in keywords.items()])


def _float32(value: ast.expr) -> ast.Call:
    return _call(_np("float32"), value)


def _int_node(values: list[int]) -> ast.expr:
    if len(values) == 1:
        return ast.Constant(values[0])
    return ast.Tuple([ast.Constant(v) for v in values], ast.Load())


def _symbol(dim: str) -> sympy.Symbol:
    return sympy.Symbol(dim, integer=True, positive=True)


def _sympy_size(value) -> sympy.Expr:
    """A dim symbol (``dace.symbol``), an expression of them (``H // KV``) or an int as a sympy size over
    ``_symbol``s."""
    if isinstance(value, (int, numpy.integer)) and not isinstance(value, bool):
        return sympy.Integer(int(value))
    expr = sympy.sympify(value)
    return expr.subs({s: _symbol(str(s)) for s in expr.free_symbols})


def _same(a, b) -> bool:
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def _int_source(expr) -> str:
    """A sympy size as Python integer arithmetic over the dim names (``floor(E/2)`` -> ``(E // 2)``)."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return expr.name
    if isinstance(expr, sympy.floor):
        num, den = sympy.fraction(sympy.together(expr.args[0]))
        return f"({_int_source(num)} // {_int_source(den)})"
    if expr.is_Add:
        terms = sorted(expr.args, key=lambda a: (a.could_extract_minus_sign(), a.is_Number, str(a)))
        text = _int_source(terms[0])
        for term in terms[1:]:
            text += f" - {_int_source(-term)}" if term.could_extract_minus_sign() else f" + {_int_source(term)}"
        return f"({text})"
    if expr.is_Mul and all(a.is_Integer or not a.is_Rational for a in expr.args):
        if expr.could_extract_minus_sign():
            return f"(-{_int_source(-expr)})"
        return "(" + " * ".join(_int_source(a) for a in expr.args) + ")"
    raise SpecError(f"size {expr} is not an integer expression of the dims")


def _substitute(expr: str, names: dict[str, str]) -> str:
    """``expr`` with the names in ``names`` replaced, all at once."""
    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name):
            return ast.copy_location(ast.Name(names.get(node.id, node.id), ast.Load()), node)
    return ast.unparse(Rename().visit(ast.parse(expr, mode="eval")))


def _variable(letter: str) -> str:
    return f"_i_{letter}"


class _Letters:
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


def _segment(source: str, node: ast.AST) -> str:
    text = ast.get_source_segment(source, node) or ast.unparse(node)
    text = " ".join(text.split())
    return text if len(text) <= 90 else text[:87] + "..."


class _Module:
    """Lowering state of one spec module: letters, helper specialisations, the error format."""

    def __init__(self, spec: LayerSpec, source: str, tree: ast.Module, module_dict: dict):
        self.spec, self.source, self.globals = spec, source, module_dict
        self.functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        reserved = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and self.callee(node.func) == "np.einsum" and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                reserved.update(c for c in node.args[0].value if c.isalpha())
        self.letters = _Letters(spec, reserved)
        self.specialised: dict[str, list[tuple[tuple, str, ast.FunctionDef, object]]] = {}  # name -> versions
        self.dim_names: dict[str, str] = {}
        self.constants: dict[tuple[str, str], Argument] = {}  # (letters, value) -> the constant argument made
        self.names = set(module_dict) | {arg.name for arg in spec.arguments}  # what a constant argument must not
        # be named (nor what the layer function has assigned so far: ``constant``)
        self.root: _Function | None = None  # the layer function's lowering

    # --- sizes and constants of known value ------------------------------------------------------

    def size_value(self, node: ast.AST, size) -> int:
        """``size`` at the spec's dims (a dim no letter has: its default)."""
        values = {dim: getattr(value, "default", None) for dim, value in self.globals.items()
                  if isinstance(value, dace.symbol)}
        values.update(self.spec.dim_values)
        result = sympy.sympify(size).subs({_symbol(d): v for d, v in values.items() if v is not None})
        if not result.is_Integer:
            raise self.error(node, f"size {size} is not an integer at the spec's dims")
        return int(result)

    def size_source(self, node: ast.AST, size) -> str:
        """``size`` as Python over the graph's dims (those of INDEX's letters)."""
        unknown = sorted(str(s) for s in sympy.sympify(size).free_symbols
                         if str(s) not in self.spec.dim_values)
        if unknown:
            raise self.error(node, f"size {size} uses {', '.join(unknown)}, which no letter of INDEX has",
                             "write it with the dims of INDEX")
        return _int_source(size)

    def dim_of_size(self, node: ast.AST, size, what: str) -> str:
        """The dim (of INDEX's letters) that ``size`` is: equal as an expression, else the one of its
        value that ``size`` names (``KV * (H // KV)``: H), else the only one of its value."""
        dims = list(dict.fromkeys(self.spec.letter_dims.values()))
        for dim in dims:
            if _same(size, _symbol(dim)):
                return dim
        value = self.size_value(node, size)
        equal = [dim for dim in dims if self.spec.dim_values[dim] == value]
        named = [dim for dim in equal if _symbol(dim) in sympy.sympify(size).free_symbols]
        if len(named) == 1 or len(equal) == 1:
            return (named or equal)[0]
        raise self.error(node, f"{what} has {size} = {value} elements: "
                         + (f"that is {' and '.join(equal)} at these dims, which one is meant is unclear" if equal
                            else "no dim of INDEX has that size"),
                         "write its size with the dim it is, e.g. np.repeat(k, H // KV, axis=1) for H heads")

    def constant(self, letters: tuple[str, ...], value: str, hint: str) -> str:
        """The name of the constant argument over ``letters`` of known ``value`` (made on first use)."""
        key = ("".join(letters), value)
        if key not in self.constants:
            taken = self.names | {a.name for a in self.constants.values()}
            if self.root is not None:
                taken |= self.root.written
            name, n = hint, 1
            while name in taken:
                n += 1
                name = f"{hint}_{n}"
            self.constants[key] = Argument(name, "".join(letters), "tensor", False, value=value)
        return self.constants[key].name

    def generated(self) -> set[str]:
        return {arg.name for arg in self.constants.values()}

    def error(self, node: ast.AST, problem: str, hint: str = "") -> SpecError:
        line = getattr(node, "lineno", None)
        where = f"{self.spec.path}:{line}" if line else str(self.spec.path)
        text = f"{where}: {_segment(self.source, node)}: {problem}"
        return SpecError(text + (f"; {hint}" if hint else ""))

    def callee(self, func: ast.expr) -> str | None:
        """``np.maximum.reduce`` -> "np.maximum.reduce" when ``np`` is NumPy in the module, "math.x" for math."""
        chain = []
        while isinstance(func, ast.Attribute):
            chain.append(func.attr)
            func = func.value
        if not isinstance(func, ast.Name) or not chain:
            return None
        value = self.globals.get(func.id)
        prefix = "np" if value is numpy else "math" if value is math else None
        return f"{prefix}.{'.'.join(reversed(chain))}" if prefix else None

    def dim_name(self, dim: str) -> str:
        """A global name bound to the dim's symbol in the lowered module."""
        if dim not in self.dim_names:
            value = self.globals.get(dim)
            name = dim if isinstance(value, dace.symbol) and str(value) == dim else f"_dim_{dim}"
            self.dim_names[dim] = name
        return self.dim_names[dim]

    def dims_of(self, letters) -> ast.expr:
        """``np.float32(D)`` or ``np.float32(D * H)`` for the product of the letters' dims."""
        expr = None
        for letter in letters:
            name = _load(self.dim_name(self.letters.dim(letter)))
            expr = name if expr is None else ast.BinOp(expr, ast.Mult(), name)
        return _float32(expr)

    def specialise(self, caller: "_Function", call: ast.Call, name: str, args: list) -> object:
        """Lower helper ``name`` for these argument values; returns the value of the call.  An array
        passed as an expression is assigned to a name first (DaCe's inlining loses an einsum passed
        straight into a call).  A helper that contracts (its einsums' results would share names
        between calls once DaCe inlines them), or makes or returns a constant or a slice, or is given
        one, is inlined: its statements go before the caller's, its names made unique."""
        node = self.functions[name]
        function = self.globals[name]
        try:
            bound = inspect.signature(function).bind(*args[0], **args[1])
        except TypeError as err:
            raise self.error(call, f"cannot call {name}: {err}") from None
        bound.apply_defaults()
        values = {}
        for param, value in bound.arguments.items():
            if not isinstance(value, (Arr, Num, Static, Part, Const)):
                value = _static_value(value)
            if isinstance(value, Arr) and not isinstance(value.expr, ast.Name):
                value = caller.temp(param, value)
            elif isinstance(value, Part) and not isinstance(value.base.expr, ast.Name):
                value = replace(value, base=caller.temp(param, value.base))
            values[param] = value
        if any(isinstance(v, (Part, Const)) for v in values.values()):
            return self.inline(caller, call, node, values)
        key = tuple((p, _signature(v)) for p, v in values.items())
        versions = self.specialised.setdefault(name, [])
        for known_key, known_name, lowered, returned in versions:
            if known_key == key:
                if lowered is None:
                    return self.inline(caller, call, node, values)
                return self.call_value(call, known_name, values, returned)
        lowering = _Function(self, node, {p: _as_param(p, v) for p, v in values.items()})
        try:
            lowered = _with_body(node, lowering.lower_body(node.body))
            if any(isinstance(n, ast.Call) and ast.unparse(n.func) == "np.einsum" for n in ast.walk(lowered)):
                raise _NeedsInline
        except _NeedsInline:
            versions.append((key, name, None, None))
            return self.inline(caller, call, node, values)
        versions = [v for v in versions if v[2] is not None]
        same = next((n for _, n, f, _ in versions if ast.dump(_with_body(f, f.body, name)) == ast.dump(lowered)), None)
        lowered.name = same or (name if not versions else f"{name}_{len(versions) + 1}")
        self.specialised[name].append((key, lowered.name, lowered, lowering.returned))
        return self.call_value(call, lowered.name, values, lowering.returned)

    def inline(self, caller: "_Function", call: ast.Call, node: ast.FunctionDef, values: dict) -> object:
        """Helper ``node``'s statements for these argument values, before the caller's current one;
        returns its value."""
        lowering = _Function(self, node, values, parent=caller)
        caller.prelude.extend(lowering.lower_body(node.body))
        if lowering.returned is None:
            raise self.error(call, f"{node.name} returns nothing", "return its result")
        return lowering.returned

    def call_value(self, call: ast.Call, name: str, values: dict, returned) -> object:
        args = [value.expr if isinstance(value, (Arr, Num)) else _static_node(value.value) for value in values.values()]
        expr = _call(_load(name), *args)
        ast.copy_location(expr, call)
        if isinstance(returned, Arr):
            return Arr(expr, returned.stored, returned.visible)
        if isinstance(returned, Num):
            return Num(expr, returned.value)
        raise self.error(call, "a helper must return one array or number",
                         "return a tuple from the layer function only")


def _signature(value) -> tuple:
    if isinstance(value, Arr):
        return ("array", value.stored, value.visible)
    if isinstance(value, Num):
        return ("number", value.value, str(value.size))
    return ("static", repr(value.value))


def _as_param(name: str, value):
    if isinstance(value, Arr):
        return Arr(_load(name), value.stored, value.visible)
    if isinstance(value, Num):
        return Num(_load(name), value.value, value.size)
    return value


def _static_value(value):
    if isinstance(value, bool) or value is None or isinstance(value, (str, tuple, list, types.ModuleType)):
        return Static(value)
    if isinstance(value, (int, float, numpy.floating, numpy.integer)):
        number = value.item() if hasattr(value, "item") else value
        return Num(_float32(ast.Constant(number)), number)
    return Static(value)


def _static_node(value) -> ast.expr:
    return ast.parse(repr(value), mode="eval").body


class _Function:
    """Lowers one function body for given argument values (abstract interpretation, statement by statement)."""

    def __init__(self, module: _Module, node: ast.FunctionDef, params: dict, parent: "_Function | None" = None):
        """``parent``: inline into that function (its names, its statements; ``params`` are its values)."""
        self.m = module
        self.env: dict[str, object] = dict(params)
        self.returned = None
        self.prelude: list[ast.stmt] = []
        self.target = "t"
        self.inline = parent is not None
        self.top: _Function = self if parent is None else parent.top  # the function the statements land in
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | set(params) | set(module.globals)
        if parent is None:
            self.taken = names
            self.written = set(params)  # array names assigned so far
            self.named: dict[str, str] = {}  # ast.dump of an assigned computation -> its name
        else:
            self.taken, self.written, self.named = parent.taken, parent.written, parent.named
            self.taken |= names
            self.target = parent.target

    # --- statements -------------------------------------------------------------------------

    def lower_body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out, saved = [], self.prelude
        for stmt in body:
            self.prelude = []
            lowered = self.statement(stmt)
            out += [new if getattr(new, "lineno", None) else ast.copy_location(new, stmt)  # inlined: the helper's line
                    for new in self.prelude + lowered]
        self.prelude = saved
        return out

    def statement(self, stmt: ast.stmt) -> list[ast.stmt]:
        m = self.m
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return [stmt]  # docstring
        if isinstance(stmt, ast.Pass):
            return [stmt]
        if isinstance(stmt, ast.AugAssign):
            target = ast.Name(stmt.target.id, ast.Load()) if isinstance(stmt.target, ast.Name) else None
            if target is None:
                raise m.error(stmt, "augmented assignment to a part of an array is not supported",
                              "assign a new name instead")
            value = ast.copy_location(ast.BinOp(target, stmt.op, stmt.value), stmt)
            stmt = ast.copy_location(ast.Assign([ast.Name(stmt.target.id, ast.Store())], value), stmt)
        if isinstance(stmt, ast.Assign):
            target = stmt.targets[0]
            pairs = [(target, stmt.value)]
            if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple) \
                    and len(target.elts) == len(stmt.value.elts):
                pairs = list(zip(target.elts, stmt.value.elts))  # q, k, v = a, b, c
            if len(stmt.targets) != 1 or not all(isinstance(t, ast.Name) for t, _ in pairs):
                raise m.error(stmt, "only assignments to names are supported",
                              "assign each result to its own name (no slices, no unpacking of arrays)")
            values = []
            for name, value in pairs:
                self.target = name.id
                values.append(self.expr(value))
            return [new for (name, value), v in zip(pairs, values) for new in self.assign(stmt, name.id, value, v)]
        if isinstance(stmt, ast.Return):
            if stmt.value is None:
                raise m.error(stmt, "the function returns nothing", "return its outputs")
            items = stmt.value.elts if isinstance(stmt.value, ast.Tuple) else [stmt.value]
            if self.inline:
                if len(items) != 1:
                    raise m.error(stmt, "a helper must return one array or number",
                                  "return a tuple from the layer function only")
                self.returned = self.expr(items[0])
                return []
            values = []
            for item in items:
                self.target = item.id if isinstance(item, ast.Name) else "out"
                value = self.expr(item)
                if isinstance(value, (Part, Const)):
                    if self.top is not m.root:
                        raise _NeedsInline
                    if isinstance(value, Part):
                        raise m.error(item, "returns a slice", PART_HINT)
                    value = self.materialise(item, value)
                if isinstance(value, Arr) and not value.plain:
                    raise m.error(item, f"returns a view with axes {_axes(value.letters)} of an array stored as "
                                  f"{_axes(value.stored)}", "return an array computed in the order of its "
                                  "axes (a transposed or keepdims view has no storage of its own)")
                values.append(value)
            if len(values) == 1:
                self.returned = values[0]
                return [ast.Return(self.render_value(values[0]))]
            self.returned = tuple(values)
            return [ast.Return(ast.Tuple([self.render_value(v) for v in values], ast.Load()))]
        if isinstance(stmt, ast.If):
            try:
                taken = bool(eval(compile(ast.Expression(stmt.test), "<test>", "eval"), dict(m.globals),  # noqa: S307
                                  {k: v.value for k, v in self.env.items() if isinstance(v, Static)}))
            except Exception:
                raise m.error(stmt.test, "a condition on array values is not supported",
                              "branch on module constants only (OPTIONS); for element-wise choices use "
                              "np.where(cond, a, b)") from None
            body, orelse = (stmt.body, stmt.orelse) if taken else (stmt.orelse, stmt.body)
            lowered = self.lower_body(body)
            if self.inline:
                return lowered  # the branch taken only
            saved = dict(self.env), dict(self.named)
            try:
                other = self.lower_body(orelse)
            except SpecError:
                other = orelse
            self.env, self.named = saved
            if not taken:
                lowered, other = other, lowered
            return [ast.If(stmt.test, lowered or [ast.copy_location(ast.Pass(), stmt)], other)]
        kind = type(stmt).__name__
        raise m.error(stmt, f"{kind} statements are not supported in a layer spec",
                      "write whole-array assignments and one return")

    def assign(self, stmt: ast.stmt, name: str, node: ast.expr, value) -> list[ast.stmt]:
        """Bind ``name``; a name assigned again (``p = p / s``) gets a new array (``p_2``), so views of
        its old value stay valid and DaCe sees no copies."""
        if isinstance(value, Static) or (isinstance(value, Num) and isinstance(node, ast.Constant)):
            self.env[name] = value
            return []
        if isinstance(value, Compare):
            raise self.m.error(node, "comparisons are only supported as np.where's condition",
                               "write np.where(a > b, x, y), or np.maximum for ReLU")
        if isinstance(value, Const):
            self.env[name] = replace(value, hint=value.hint or name)
            return []
        if isinstance(value, Part):
            if not isinstance(value.base.expr, ast.Name):
                value = replace(value, base=self.temp("whole", value.base))
            self.env[name] = value
            return []
        if isinstance(value, Num) and value.size is not None and not isinstance(value.expr, ast.Name):
            self.env[name] = value  # a size (half = E // 2): kept as computed, so slices see it
            return []
        value = self.known(value)
        hoisted = self.prelude[-1] if self.prelude else None
        if isinstance(value.expr, ast.Name) and hoisted is not None and hoisted.targets[0].id == value.expr.id:
            self.prelude.pop()  # ``mu = x.mean(...)``: the mean hoisted for this statement takes its name
            self.named = {k: v for k, v in self.named.items() if v != value.expr.id}
            value = replace(value, expr=hoisted.value)
        if isinstance(value.expr, ast.Name):
            self.env[name] = value  # a view or alias of another value, or the same computation again: no copy
            return []
        array = self.new_name(name) if name in self.written or name in self.m.generated() else name
        self.written.add(array)
        self.named[ast.dump(value.expr)] = array
        self.env[name] = replace(value, expr=_load(array))
        return [ast.Assign([ast.Name(array, ast.Store())], value.expr)]

    def known(self, value):
        """The same computation assigned before (``x.var`` recomputing the user's ``x.mean``) is reused
        by name, so that the graph computes it once (names are never reassigned, see ``assign``)."""
        if isinstance(value, (Arr, Num)) and not isinstance(value.expr, ast.Name):
            name = self.named.get(ast.dump(value.expr))
            if name is not None:
                return replace(value, expr=_load(name))
        return value

    def new_name(self, base: str) -> str:
        name, n = base, 1
        while name in self.taken or name in self.m.generated():
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        return name

    def temp(self, base: str, value: Arr) -> Arr:
        """Hoist ``value`` into a new name before the current statement (it is used twice)."""
        value = self.known(value)
        if isinstance(value.expr, ast.Name):
            return value
        name = self.new_name(f"{self.target}_{base}")
        self.written.add(name)
        self.named[ast.dump(value.expr)] = name
        self.prelude.append(ast.Assign([ast.Name(name, ast.Store())], value.expr))
        return Arr(_load(name), value.stored, value.visible)

    # --- expressions ------------------------------------------------------------------------

    def expr(self, node: ast.expr):
        method = getattr(self, f"e_{type(node).__name__}", None)
        if method is None:
            raise self.m.error(node, f"{type(node).__name__} expressions are not supported",
                               "write it with " + SUPPORTED)
        return self.known(method(node))

    def e_Name(self, node: ast.Name):
        if node.id in self.env:
            return self.env[node.id]
        if node.id not in self.m.globals:
            raise self.m.error(node, f"unknown name {node.id}")
        value = self.m.globals[node.id]
        if isinstance(value, dace.symbol):
            return Num(_float32(_load(self.m.dim_name(str(value)))), size=_symbol(str(value)))
        if isinstance(value, (int, float, numpy.integer, numpy.floating)) and not isinstance(value, bool):
            number = value.item() if hasattr(value, "item") else value
            return Num(_float32(ast.Constant(number)), number, _sympy_size(number) if isinstance(number, int) else None)
        if isinstance(value, sympy.Expr) and value.free_symbols \
                and all(isinstance(self.m.globals.get(str(x)), dace.symbol) for x in value.free_symbols):
            return self.size_num(node, _sympy_size(value))  # G = H // KV at module level
        if isinstance(value, numpy.ndarray):
            raise self.m.error(node, "module-level arrays are not supported",
                               "declare it as a Tensor argument of the layer")
        return Static(value)

    def e_Constant(self, node: ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Num(_float32(node), node.value, _sympy_size(node.value) if isinstance(node.value, int) else None)
        return Static(node.value)

    def size_num(self, node: ast.AST, size) -> Num:
        """A size as a number of the spec's dtype (``np.float32(E // 2)``)."""
        size = sympy.sympify(size)
        if size.is_Integer:
            return Num(_float32(ast.Constant(int(size))), int(size), size)
        source = _int_source(size)
        names = {str(x): self.m.dim_name(str(x)) for x in size.free_symbols}
        return Num(_float32(ast.parse(_substitute(source, names), mode="eval").body), None, size)

    def size_of(self, node: ast.expr):
        """The sympy size an expression is (a slice bound, a count)."""
        value = self.expr(node)
        if isinstance(value, Static) and isinstance(value.value, int) and not isinstance(value.value, bool):
            return sympy.Integer(value.value)
        if not isinstance(value, Num) or value.size is None:
            raise self.m.error(node, "expected a size here: an integer, a dim, x.shape[k] or + - * // of these")
        return value.size

    def e_Tuple(self, node: ast.Tuple):
        items = [self.expr(e) for e in node.elts]
        if not all(isinstance(i, (Static, Num)) for i in items):
            raise self.m.error(node, "tuples of arrays are only supported as the layer's return value")
        return Static(tuple(i.value if isinstance(i, Static) else _as_int(i) for i in items))

    e_List = e_Tuple

    def e_UnaryOp(self, node: ast.UnaryOp):
        value = self.expr(node.operand)
        if isinstance(node.op, ast.UAdd):
            return value
        if isinstance(value, Part) and isinstance(node.op, ast.USub):
            return replace(value, scale=-value.scale)
        if isinstance(value, Const) and isinstance(node.op, (ast.USub, ast.Invert, ast.Not)):
            return self.const_elementwise(node, lambda a: ast.UnaryOp(ast.USub(), a) if isinstance(node.op, ast.USub)
                                          else ast.Compare(a, [ast.Eq()], [ast.Constant(0)]), [value])
        if not isinstance(node.op, ast.USub):
            raise self.m.error(node, "only unary minus is supported on arrays")
        if isinstance(value, Num) and value.value is not None \
                and isinstance(node.operand, (ast.Constant, ast.Name, ast.Attribute)):
            return Num(_float32(ast.Constant(-value.value)), -value.value, None if value.size is None else -value.size)
        if isinstance(value, Static) and isinstance(value.value, int):
            return Static(-value.value)
        if isinstance(value, Arr):
            return replace(value, expr=ast.UnaryOp(ast.USub(), value.expr))
        if isinstance(value, Num):
            return Num(ast.UnaryOp(ast.USub(), value.expr))
        raise self.m.error(node, "unary minus of a non-number")

    def e_BinOp(self, node: ast.BinOp):
        if isinstance(node.op, ast.MatMult):
            return self.matmul(node, self.array(node.left), self.array(node.right))
        left, right = self.expr(node.left), self.expr(node.right)
        if isinstance(node.op, ast.Pow):
            return self.power(node, left, right)
        sizes = isinstance(left, Num) and isinstance(right, Num) and left.size is not None and right.size is not None
        if sizes and isinstance(node.op, ast.FloorDiv):
            return self.size_num(node, sympy.floor(left.size / right.size))
        if isinstance(node.op, (ast.BitAnd, ast.BitOr)) and any(isinstance(v, Const) for v in (left, right)):
            return self.const_elementwise(node, lambda a, b: ast.BinOp(a, node.op, b), [left, right])
        if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            raise self.m.error(node, f"operator {type(node.op).__name__} is not supported",
                               "use +, -, *, /, ** or @ (// of sizes, & and | of constant masks)")
        result = self.arith(node, node.op, left, right)
        if sizes and not isinstance(node.op, ast.Div):  # a size still: E - E // 2
            combine = {ast.Add: sympy.Add, ast.Sub: lambda a, b: a - b, ast.Mult: sympy.Mul}[type(node.op)]
            result = replace(result, size=combine(left.size, right.size))
        return result

    def e_Compare(self, node: ast.Compare):
        if len(node.ops) != 1:
            raise self.m.error(node, "chained comparisons are not supported", "compare two values")
        left, right = self.expr(node.left), self.expr(node.comparators[0])
        if any(isinstance(v, Const) for v in (left, right)) and all(isinstance(v, (Const, Num)) for v in (left, right)):
            return self.const_elementwise(node, lambda a, b: ast.Compare(a, [node.ops[0]], [b]), [left, right])
        return Compare(node, (left, right))

    def e_Subscript(self, node: ast.Subscript):
        if isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            value = self.expr(node.value.value)
            letters = value.base.letters if isinstance(value, Part) else value.letters if isinstance(value, Const) \
                else self.as_array(node.value.value, value).letters
            axis = self.static_int(node.slice)
            if not -len(letters) <= axis < len(letters):
                raise self.m.error(node, f"axis {axis} is out of range for an array with {len(letters)} axes")
            if isinstance(value, Part) and axis % len(letters) == value.axis:
                return self.size_num(node, value.length)
            letter = letters[axis]
            if letter is None:
                return Num(_float32(ast.Constant(1)), 1.0, sympy.Integer(1))
            return Num(self.m.dims_of([letter]), None, _symbol(self.m.letters.dim(letter)))
        value = self.expr(node.value)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        kinds: list = []
        cut = None  # the slice a:b, as its position in kinds
        for item in items:
            if isinstance(item, ast.Slice) and item.lower is item.upper is item.step is None:
                kinds.append(":")
            elif (isinstance(item, ast.Constant) and item.value is None) or self.m.callee(item) == "np.newaxis":
                kinds.append(None)
            elif isinstance(item, ast.Constant) and item.value is Ellipsis:
                kinds.append("...")
            elif isinstance(item, ast.Slice) and item.step is None and cut is None:
                cut = item
                kinds.append(item)
            elif isinstance(item, ast.Slice):
                raise self.m.error(node, "a slice with a step, or slices of more than one axis, are not supported",
                                   "slice one axis into contiguous parts (x[..., :h], x[..., h:])")
            else:
                raise self.m.error(node, "indexing with a number or an array is not supported (slices a:b of one "
                                   "axis, None / np.newaxis and ... are)",
                                   "declare the part you need as its own Tensor argument")
        if isinstance(value, Part):
            raise self.m.error(node, "indexing a slice is not supported", PART_HINT)
        if isinstance(value, Const) and cut is not None:
            raise self.m.error(node, "slicing a constant array is not supported",
                               "build it at the size you need (np.ones((T, T)), np.arange(T))")
        rank = len(value.letters) if isinstance(value, Const) else len(self.as_array(node.value, value).visible)
        if kinds.count("...") > 1:
            raise self.m.error(node, "more than one ... in an index")
        used = sum(k is not None and k != "..." for k in kinds)
        if used > rank:
            raise self.m.error(node, f"too many indices for an array with {rank} axes")
        if "..." in kinds:
            at = kinds.index("...")
            kinds[at:at + 1] = [":"] * (rank - used)
        else:
            kinds += [":"] * (rank - used)
        if isinstance(value, Const):
            axes = iter(value.letters)
            return replace(value, letters=tuple(None if k is None else next(axes) for k in kinds))
        array = self.as_array(node.value, value)
        axes = iter(array.visible)
        viewed = Arr(array.expr, array.stored, tuple(None if k is None else next(axes) for k in kinds))
        if cut is None:
            return viewed
        return self.cut(node, viewed, kinds.index(cut), cut)

    def cut(self, node: ast.AST, array: Arr, axis: int, item: ast.Slice):
        """``array[..., lo:hi, ...]`` along visible ``axis``: a ``Part`` (``array`` itself if whole)."""
        letter = array.letters[axis]
        if letter is None:
            raise self.m.error(node, "slicing an axis of size 1 is not supported")
        dim = self.m.letters.dim(letter)
        whole = _symbol(dim)

        def bound(bound_node, default):
            if bound_node is None:
                return default
            size = self.size_of(bound_node)
            return whole + size if self.m.size_value(bound_node, size) < 0 else size  # x[..., -2:]
        lo, hi = bound(item.lower, sympy.Integer(0)), bound(item.upper, whole)
        lo_value, hi_value, whole_value = (self.m.size_value(node, x) for x in (lo, hi, whole))
        if not 0 <= lo_value < hi_value <= whole_value:
            raise self.m.error(node, f"the slice {lo}:{hi} of axis {letter} ({dim} = {whole_value}) is empty or out "
                               f"of range at the spec's dims ({lo_value}:{hi_value})")
        if _same(lo, 0) and _same(hi, whole):
            return array
        return Part(array, axis, sympy.simplify(lo), sympy.simplify(hi - lo))

    def e_Attribute(self, node: ast.Attribute):
        name = self.m.callee(node)
        if name in ("np.pi", "np.e", "math.pi", "math.e", "np.inf", "math.inf"):
            return Num(_float32(ast.Constant(getattr(math, node.attr))), getattr(math, node.attr))
        if isinstance(node.value, ast.Call) and self.m.callee(node.value.func) == "np.finfo" \
                and node.attr in ("min", "max", "eps", "tiny"):  # np.finfo(np.float32).min: HF's masked score
            number = float(getattr(numpy.finfo(numpy.float32), node.attr))
            return Num(_float32(ast.Constant(number)), number)
        if name is not None:
            raise self.m.error(node, f"{name} is not supported here", "write it with " + SUPPORTED)
        if node.attr == "T":
            array = self.array(node.value)
            return replace(array, visible=tuple(reversed(array.visible)))
        if node.attr == "ndim":
            return Static(len(self.array(node.value).visible))
        raise self.m.error(node, f"attribute .{node.attr} is not supported", _HINTS.get(node.attr, ""))

    def e_IfExp(self, node: ast.IfExp):
        raise self.m.error(node, "conditional expressions are not supported",
                           "for an element-wise choice write np.where(cond, a, b)")

    def e_Call(self, node: ast.Call):
        m = self.m
        name = m.callee(node.func)
        if name is None and isinstance(node.func, ast.Name):
            if node.func.id in m.functions and isinstance(m.globals.get(node.func.id), types.FunctionType):
                args = [self.expr(a) for a in node.args]
                keywords = {k.arg: self.expr(k.value) for k in node.keywords}
                return m.specialise(self, node, node.func.id, (args, keywords))
            if node.func.id in ("abs", "float", "int"):
                value = self.expr(node.args[0])
                if node.func.id == "abs":
                    return self.unary(node, "abs", value)
                if node.func.id == "float" and isinstance(value, Static) and isinstance(value.value, str):
                    try:
                        number = float(value.value)  # float("-inf")
                    except ValueError:
                        raise m.error(node, f"float({value.value!r}) is not a number") from None
                    return Num(_float32(ast.Constant(number)), number)
                return value
            raise m.error(node, f"call of {node.func.id} is not supported",
                          "call NumPy functions or helper functions defined in the spec")
        if name is None and isinstance(node.func, ast.Attribute):
            return self.method(node, node.func.attr, self.expr(node.func.value))
        if name is None:
            raise m.error(node, "this call is not supported", "write it with " + SUPPORTED)
        short = name.split(".", 1)[1]
        if name == "np.float32":
            value = self.expr(node.args[0])
            return value if isinstance(value, (Arr, Part, Const)) else Num(node, value.value if isinstance(value, Num) else None)
        if name == "np.concatenate":
            return self.concatenate(node)
        if short == "repeat":
            return self.repeat(node, self.expr(node.args[0]), node.args[1:])
        if short in ("arange", "ones", "zeros", "full", "tril", "triu"):
            return self.constant_array(node, short)
        if short in _HINTS or short.split(".")[0] in _HINTS:
            raise m.error(node, f"{name} is not supported", _HINTS.get(short, _HINTS.get(short.split(".")[0])))
        if name == "np.einsum":
            return self.einsum(node)
        if short in ("matmul", "dot", "tensordot", "inner"):
            args = [self.array(a) for a in node.args[:2]]
            if short == "matmul":
                return self.matmul(node, *args)
            if short == "dot":
                return self.dot(node, *args)
            if short == "tensordot":
                axes = node.args[2] if len(node.args) > 2 else self.keyword(node, "axes")
                return self.tensordot(node, *args, 2 if axes is None else self.static(axes))
        if short in _REDUCERS:
            array = self.array(node.args[0])
            axis = node.args[1] if len(node.args) > 1 else self.keyword(node, "axis")
            return self.reduce(node, _REDUCERS[short], array, axis)
        if short in ("transpose", "swapaxes"):
            return self.method(node, short, self.expr(node.args[0]), node.args[1:])
        if short in _UNARY or name in ("math.sqrt", "math.exp", "math.log", "math.tanh"):
            return self.unary(node, _UNARY.get(short, short), self.expr(node.args[0]))
        if short in ("maximum", "minimum"):
            left, right = (self.expr(a) for a in node.args)
            return self.elementwise(node, lambda a, b: _call(_np(short), a, b), [left, right])
        if short in _BINARY:
            return self.arith(node, _BINARY[short](), *(self.expr(a) for a in node.args))
        if short == "power":
            return self.power(node, *(self.expr(a) for a in node.args))
        if short == "square":
            return self.power(node, self.expr(node.args[0]), Num(ast.Constant(2), 2.0))
        if short == "reciprocal":
            return self.arith(node, ast.Div(), Num(_float32(ast.Constant(1)), 1.0), self.expr(node.args[0]))
        if short == "negative":
            return self.arith(node, ast.Mult(), Num(_float32(ast.Constant(-1)), -1.0), self.expr(node.args[0]))
        if short == "where":
            return self.where(node)
        raise m.error(node, f"{name} is not supported", "write it with " + SUPPORTED)

    def method(self, node: ast.Call, name: str, value, args=None):
        args = node.args if args is None else args
        m = self.m
        if isinstance(value, Const) and name == "astype":
            return value if not args or ast.unparse(args[0]) not in ("bool", "np.bool_") else \
                self.const_elementwise(node, lambda a: ast.Compare(a, [ast.NotEq()], [ast.Constant(0)]), [value])
        if name in _HINTS:
            raise m.error(node, f".{name}() is not supported", _HINTS[name])
        if name == "repeat":
            return self.repeat(node, value, args)
        if isinstance(value, Part):
            raise m.error(node, f".{name}() of a slice is not supported", PART_HINT)
        if isinstance(value, Const):
            value = self.materialise(node, value)
        if not isinstance(value, Arr):
            raise m.error(node, f".{name}() of a non-array is not supported")
        if name in _REDUCERS and args is node.args:
            axis = args[0] if args else self.keyword(node, "axis")
            return self.reduce(node, _REDUCERS[name], value, axis)
        if name == "transpose":
            axes_node = args[0] if len(args) == 1 else (ast.Tuple(list(args), ast.Load()) if args else
                                                         self.keyword(node, "axes"))
            if axes_node is None:
                return replace(value, visible=tuple(reversed(value.visible)))
            axes = [self.axis(node, a, len(value.visible)) for a in _as_tuple(self.static(axes_node))]
            if sorted(axes) != list(range(len(value.visible))):
                raise m.error(node, f"axes {tuple(axes)} are not a permutation of the {len(value.visible)} axes")
            return replace(value, visible=tuple(value.visible[a] for a in axes))
        if name == "swapaxes":
            a, b = (self.axis(node, self.static(x), len(value.visible)) for x in args[:2])
            visible = list(value.visible)
            visible[a], visible[b] = visible[b], visible[a]
            return replace(value, visible=tuple(visible))
        raise m.error(node, f".{name}() is not supported", "write it with " + SUPPORTED)

    # --- helpers for values -------------------------------------------------------------------

    def array(self, node: ast.expr) -> Arr:
        return self.as_array(node, self.expr(node))

    def as_array(self, node: ast.expr, value) -> Arr:
        """``value`` as an array of the graph: a constant of known value becomes a constant argument."""
        if isinstance(value, Const):
            return self.materialise(node, value)
        if isinstance(value, Part):
            raise self.m.error(node, "a slice used here is not supported", PART_HINT)
        if not isinstance(value, Arr):
            raise self.m.error(node, "expected an array here")
        return value

    def static(self, node: ast.expr):
        value = self.expr(node)
        if isinstance(value, Num) and value.value is not None and float(value.value).is_integer():
            return int(value.value)
        if not isinstance(value, Static):
            raise self.m.error(node, "expected a constant here (an axis, a tuple of axes)")
        return value.value

    def static_int(self, node: ast.expr) -> int:
        value = self.static(node)
        if not isinstance(value, int):
            raise self.m.error(node, "expected an integer here")
        return value

    def keyword(self, node: ast.Call, name: str):
        for keyword in node.keywords:
            if keyword.arg == name:
                return keyword.value
        return None

    def axis(self, node: ast.AST, axis, rank: int) -> int:
        if not isinstance(axis, int) or not -rank <= axis < rank:
            raise self.m.error(node, f"axis {axis} is out of range for an array with {rank} axes")
        return axis % rank

    def render_value(self, value) -> ast.expr:
        return value.expr if isinstance(value, (Arr, Num)) else _static_node(value.value)

    # --- element-wise -----------------------------------------------------------------------

    def broadcast(self, node: ast.AST, arrays: list[Arr]) -> tuple[str | None, ...]:
        """The result's axes by NumPy's rules (trailing alignment, size-1 axes); letters of the first
        operand that has one at each position."""
        rank = max(len(a.visible) for a in arrays)
        result: list[str | None] = []
        dims = self.m.letters
        for pos in range(rank):
            found: list[tuple[str, Arr]] = []
            for array in arrays:
                offset = rank - len(array.visible)
                if pos >= offset and array.letters[pos - offset] is not None:
                    found.append((array.letters[pos - offset], array))
            for letter, array in found[1:]:
                if dims.dim(letter) != dims.dim(found[0][0]):
                    raise self.m.error(node, f"cannot broadcast: axis {pos - rank} is {found[0][0]} "
                                       f"({dims.dim(found[0][0])}) in one operand and {letter} ({dims.dim(letter)}) "
                                       "in another", "check the operands' axes; align them with [:, None] or "
                                       "transpose one")
            letter = found[0][0] if found else None
            if letter is not None and letter in result:
                raise self.m.error(node, f"the result would have two axes with letter {letter} (an outer product "
                                   "of an axis with itself)", "write it with np.einsum and two letters, e.g. "
                                   "np.einsum('s,t->st', a, b)")
            result.append(letter)
        return tuple(result)

    def render(self, array: Arr) -> ast.expr:
        """``array``'s stored array indexed (``[:, None, :]``) and, if its axes are permuted, relabelled
        (``np.einsum("ts->st", x)``), so that DaCe sees the axes NumPy sees."""
        order = [e for e in array.visible if e is not None]
        index = [":" if e is not None else None for e in array.visible]
        expr = array.expr
        if order != sorted(order):
            if None in array.stored:
                raise SpecError("a transposed view of an array with size-1 axes")
            stored = "".join(array.stored)
            expr = _call(_np("einsum"), ast.Constant(f"{stored}->{''.join(stored[i] for i in order)}"), expr)
        if None not in index:
            return expr
        items = [ast.Slice() if i == ":" else ast.Constant(None) for i in index]
        return ast.Subscript(expr, items[0] if len(items) == 1 else ast.Tuple(items, ast.Load()), ast.Load())

    def elementwise(self, node: ast.AST, build, values: list) -> Arr | Num:
        """NumPy's element-wise broadcasting: computed over every axis of the result (as NumPy does),
        each operand aligned on the trailing axes and indexed with None where it has size 1.  Slices
        (``Part``) are computed on their whole arrays and cut again; constants of known value combine
        into one (``Const``) until they meet a computed array, where they become constant arguments."""
        if any(isinstance(v, Part) for v in values):
            return self.part_elementwise(node, build, values)
        if any(isinstance(v, Const) for v in values):
            if all(isinstance(v, Const) or (isinstance(v, Num) and self.const_term(v) is not None) for v in values):
                return self.const_elementwise(node, build, values)
            values = [self.materialise(node, v) if isinstance(v, Const) else v for v in values]
        arrays = [v for v in values if isinstance(v, Arr)]
        for value in values:
            self.number_or_array(node, value)
        if not arrays:
            return Num(build(*(v.expr for v in values)))
        result = self.broadcast(node, arrays)
        exprs = [self.render(v) if isinstance(v, Arr) else v.expr for v in values]
        return self.known(Arr.of(build(*exprs), result))

    def arith(self, node: ast.AST, op: ast.operator, left, right):
        for part, other in ((left, right), (right, left)):  # -x2, 0.5 * x1: a factor of the part
            if isinstance(part, Part) and isinstance(other, Num) and other.value not in (None, 0) \
                    and (isinstance(op, ast.Mult) or (isinstance(op, ast.Div) and part is left)):
                factor = other.value if isinstance(op, ast.Mult) else 1.0 / other.value
                return replace(part, scale=part.scale * factor)
        return self.elementwise(node, lambda a, b: ast.BinOp(a, op, b), [left, right])

    def number_or_array(self, node: ast.AST, value) -> None:
        if isinstance(value, Compare):
            raise self.m.error(node, "comparisons are only supported as np.where's condition",
                               "write np.where(a > b, x, y), or np.maximum for ReLU")
        if not isinstance(value, (Arr, Num)):
            raise self.m.error(node, "expected arrays or numbers here")

    def unary(self, node: ast.AST, name: str, value):
        if isinstance(value, (Part, Const)):
            return self.elementwise(node, lambda a: _call(_np(name), a), [value])
        self.number_or_array(node, value)
        if isinstance(value, Arr):
            return replace(value, expr=_call(_np(name), value.expr))
        return Num(_call(_np(name), value.expr))

    def power(self, node: ast.AST, base, exponent):
        m = self.m
        if not isinstance(exponent, Num) or exponent.value is None:
            raise m.error(node, "only constant exponents are supported",
                          "write np.exp(y * np.log(x)) for a variable exponent")
        p = exponent.value
        if not isinstance(base, (Part, Const)):
            self.number_or_array(node, base)
        one = Num(_float32(ast.Constant(1)), 1.0)
        if p in (0.5, -0.5):
            root = self.unary(node, "sqrt", base)
            return root if p > 0 else self.arith(node, ast.Div(), one, root)
        if not float(p).is_integer() or not 1 <= abs(p) <= 8:
            raise m.error(node, f"exponent {p:g} is not supported", "use integer exponents, 0.5 or -0.5 "
                          "(np.sqrt), or np.exp(y * np.log(x))")
        if isinstance(base, Arr) and abs(p) > 1:
            base = self.temp("base", base)
        product = base
        for _ in range(int(abs(p)) - 1):
            product = self.arith(node, ast.Mult(), product, base)
        return product if p > 0 else self.arith(node, ast.Div(), one, product)

    def where(self, node: ast.Call):
        if len(node.args) != 3:
            raise self.m.error(node, "np.where needs a condition and two values", "write np.where(a > b, x, y)")
        cond = self.expr(node.args[0])
        if isinstance(cond, Const):
            return self.where_known(node, cond, self.expr(node.args[1]), self.expr(node.args[2]))
        if not isinstance(cond, Compare):
            raise self.m.error(node.args[0], "np.where's condition must be a comparison",
                               "write np.where(a > b, x, y) with the comparison inside")
        values = [*cond.operands, self.expr(node.args[1]), self.expr(node.args[2])]
        op = cond.node.ops[0]

        def build(a, b, x, y):
            return _call(_np("where"), ast.Compare(a, [op], [b]), x, y)
        return self.elementwise(node, build, values)

    def where_known(self, node: ast.Call, cond: Const, x, y):
        """``np.where(mask, x, y)`` for a mask of known value (a causal mask from np.tril or np.arange):
        of constants, a constant; choosing between an array and a number of -1e4 or less (-inf), the
        array plus an additive constant (0 where the array is kept, that number elsewhere: the form
        the fused attention recognises; after a softmax the same); otherwise a map reading the mask
        as a constant of 0 and 1."""
        def choose(c, a, b):
            return _call(_np("where"), c, a, b)
        if all(isinstance(v, Const) or (isinstance(v, Num) and self.const_term(v) is not None) for v in (x, y)):
            return self.const_elementwise(node, choose, [cond, x, y])
        zero = Num(_float32(ast.Constant(0.0)), 0.0)
        for array, fill, kept in ((x, y, True), (y, x, False)):
            if isinstance(array, (Arr, Part)) and isinstance(fill, Num) and fill.value is not None \
                    and fill.value <= MASKED_SCORE:
                added = self.const_elementwise(node, choose, [cond, zero, fill] if kept else [cond, fill, zero])
                return self.arith(node, ast.Add(), array, replace(added, hint=cond.hint or "mask"))
        one = Num(_float32(ast.Constant(1.0)), 1.0)
        mask = self.const_elementwise(node, choose, [cond, one, zero])
        half = Num(_float32(ast.Constant(0.5)), 0.5)
        return self.elementwise(node, lambda m, h, a, b: _call(_np("where"), ast.Compare(m, [ast.Gt()], [h]), a, b),
                                [self.materialise(node, replace(mask, hint=cond.hint or "mask")), half, x, y])

    # --- constants of known value and slices ------------------------------------------------------

    def const_term(self, value) -> ast.expr | None:
        """A constant's or known number's expression (None for a number computed at run time)."""
        if isinstance(value, Const):
            return ast.parse(value.expr, mode="eval").body
        if value.value is not None:
            if math.isinf(value.value):
                inf = ast.Name("inf", ast.Load())
                return inf if value.value > 0 else ast.UnaryOp(ast.USub(), inf)
            return ast.Constant(float(value.value))
        if value.size is not None:
            return ast.parse(_int_source(value.size), mode="eval").body
        return None

    def const_elementwise(self, node: ast.AST, build, values: list) -> Const:
        """Constants (and known numbers) combined by NumPy's broadcasting; an axis's letter is the first
        operand's there, another letter of its dim where that one is taken (np.arange(T)[:, None] >=
        np.arange(T)[None, :] is over (s, t))."""
        consts = [v for v in values if isinstance(v, Const)]
        rank = max(len(c.letters) for c in consts)
        result: list[str | None] = []
        letters = self.m.letters
        for pos in range(rank):
            found = [c.letters[pos - rank + len(c.letters)] for c in consts if pos >= rank - len(c.letters)]
            found = [x for x in found if x is not None]
            for other in found[1:]:
                if letters.dim(other) != letters.dim(found[0]):
                    raise self.m.error(node, f"cannot broadcast: axis {pos - rank} is {letters.dim(found[0])} in one "
                                       f"operand and {letters.dim(other)} in another")
            letter = found[0] if found else None
            if letter is not None and letter in result:
                letter = letters.fresh(letters.dim(letter), set(result) | {x for c in consts for x in c.letters if x})
            result.append(letter)
        terms = []
        for value in values:
            if isinstance(value, Const):
                offset = rank - len(value.letters)
                names = {_variable(x): _variable(result[offset + p]) for p, x in enumerate(value.letters) if x}
                value = replace(value, expr=_substitute(value.expr, names))
            terms.append(self.const_term(value))
        return Const(self.const_source(node, build(*terms)), tuple(result))

    def const_source(self, node: ast.AST, tree: ast.expr) -> str:
        """A built expression as the value of a constant: ``np.f(...)`` as the map function ``f``,
        ``np.float32(x)`` as ``x``, dims by their names."""
        dims = {alias: dim for dim, alias in self.m.dim_names.items()}
        m = self.m

        class Clean(ast.NodeTransformer):
            def visit_Call(self, call: ast.Call):
                self.generic_visit(call)
                name = ast.unparse(call.func)
                if name in _CONST_FUNCTIONS:
                    return call
                if name == "np.float32":
                    return call.args[0]
                if name.startswith("np.") and name[3:] in _CONST_FUNCTIONS:
                    return ast.Call(ast.Name(name[3:], ast.Load()), call.args, [])
                raise m.error(node, f"{name} of a constant array is not supported")

            def visit_Name(self, name: ast.Name):
                return ast.Name(dims.get(name.id, name.id), ast.Load())
        return ast.unparse(Clean().visit(copy.deepcopy(tree)))

    def materialise(self, node: ast.AST, value: Const) -> Arr:
        """A constant of known value as an array of the graph: a constant argument of the layer (one
        per distinct value), its value carried by the graph (``TensorInfo.value``)."""
        real = tuple(x for x in value.letters if x is not None)
        if not real:
            raise self.m.error(node, "a constant array without axes is not supported", "write a number")
        if self.top is not self.m.root:
            raise _NeedsInline
        expr = _substitute(value.expr, {_variable(x): f"i{k}" for k, x in enumerate(real)})
        unknown = sorted({n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}
                         - {f"i{k}" for k in range(len(real))} - set(self.m.spec.dim_values) - _CONST_FUNCTIONS - {"inf"})
        if unknown:
            raise self.m.error(node, f"the constant array's value uses {', '.join(unknown)}: only the dims of INDEX's "
                               "letters and numbers are known")
        name = self.m.constant(real, expr, value.hint or "mask")
        return Arr(_load(name), real, tuple(None if x is None else real.index(x) for x in value.letters))

    def constant_array(self, node: ast.Call, kind: str) -> Const:
        """np.arange(n), np.ones / np.zeros / np.full(shape[, fill]), np.tril / np.triu(m, k) of constants."""
        m = self.m
        for keyword in node.keywords:
            if keyword.arg not in ("dtype", "k", "fill_value"):
                raise m.error(node, f"keyword {keyword.arg}= is not supported here")
        if kind in ("tril", "triu"):
            value = self.expr(node.args[0])
            if not isinstance(value, Const):
                raise m.error(node, f"np.{kind} of a computed array is not supported",
                              f"build the mask from constants, e.g. np.{kind}(np.ones((T, T))), and combine it "
                              "with the array by + or np.where")
            k_node = node.args[1] if len(node.args) > 1 else self.keyword(node, "k")
            k = sympy.Integer(0) if k_node is None else self.size_of(k_node)
            if len(value.letters) < 2 or None in value.letters[-2:]:
                raise m.error(node, f"np.{kind} needs two axes")
            rows, cols = (_variable(x) for x in value.letters[-2:])
            keep = f"{cols} <= {rows} + {_int_source(k)}" if kind == "tril" else f"{cols} >= {rows} + {_int_source(k)}"
            return replace(value, expr=f"where({keep}, {value.expr}, 0.0)", hint="")

        def dims_of(shape_node) -> list[str | None]:
            items = shape_node.elts if isinstance(shape_node, (ast.Tuple, ast.List)) else [shape_node]
            result = []
            for item in items:
                size = self.size_of(item)
                if size == 1:
                    result.append(None)
                elif size.is_Symbol and str(size) in m.spec.dim_values:
                    result.append(str(size))
                else:
                    raise m.error(item, f"a constant array of size {size} along an axis: only dims of INDEX's letters "
                                  "(or 1) are supported")
            return result
        if kind == "arange":
            if len(node.args) != 1:
                raise m.error(node, "np.arange with a start or step is not supported", "write np.arange(T)")
            dims = dims_of(node.args[0])
            if dims == [None]:
                raise m.error(node, "np.arange(1) is not supported")
            letter = m.letters.fresh(dims[0], set())
            return Const(_variable(letter), (letter,))
        if not node.args:
            raise m.error(node, f"np.{kind} needs a shape")
        dims = dims_of(node.args[0])
        letters: list[str | None] = []
        for dim in dims:
            letters.append(None if dim is None else m.letters.fresh(dim, {x for x in letters if x}))
        if kind == "full":
            fill_node = node.args[1] if len(node.args) > 1 else self.keyword(node, "fill_value")
            fill = self.expr(fill_node) if fill_node is not None else None
            if not isinstance(fill, Num) or self.const_term(fill) is None:
                raise m.error(node, "np.full needs a known number to fill with")
            return Const(ast.unparse(self.const_term(fill)), tuple(letters))
        return Const("1.0" if kind == "ones" else "0.0", tuple(letters))

    def part_elementwise(self, node: ast.AST, build, values: list) -> Part:
        """Element-wise operations on slices cut the same way: computed on their whole arrays, cut again."""
        parts = [v for v in values if isinstance(v, Part)]
        first = parts[0]
        right = len(first.base.visible) - first.axis  # the cut axis, counted from the right
        where = f"axis {first.base.letters[first.axis]} [{first.lo}:{first.lo + first.length}]"
        for part in parts[1:]:
            if len(part.base.visible) - part.axis != right or not _same(part.lo, first.lo) \
                    or not _same(part.length, first.length):
                raise self.m.error(node, f"element-wise operation on different slices ({where} and axis "
                                   f"{part.base.letters[part.axis]} [{part.lo}:{part.lo + part.length}])", PART_HINT)
        whole = []
        for value in values:
            if isinstance(value, Const):
                value = self.materialise(node, value)
            if isinstance(value, Part):
                base = value.base
                if value.scale != 1:
                    base = self.arith(node, ast.Mult(), base, Num(_float32(ast.Constant(value.scale)), value.scale))
                value = base
            elif isinstance(value, Arr):
                at = len(value.visible) - right
                if at >= 0 and value.letters[at] is not None:
                    raise self.m.error(node, f"a slice ({where}) meets an array with the whole axis "
                                       f"{value.letters[at]} there", "slice that array the same way")
            whole.append(value)
        result = self.elementwise(node, build, whole)
        return Part(result, len(result.visible) - right, first.lo, first.length)

    def concatenate(self, node: ast.Call) -> Arr:
        """``np.concatenate((a, b, ...), axis)`` of slices that put an axis back together (and whole arrays):
        per array sliced, one einsum with a constant matrix over (the axis read, the axis written)
        placing its parts (0, 1 or the part's factor, e.g. -1 in rotate_half); these are added."""
        m = self.m
        if not node.args or not isinstance(node.args[0], (ast.Tuple, ast.List)):
            raise m.error(node, "np.concatenate needs a tuple or list of arrays written out",
                          "write np.concatenate((a, b), axis=-1)")
        axis_node = node.args[1] if len(node.args) > 1 else self.keyword(node, "axis")
        axis = 0 if axis_node is None else self.static(axis_node)
        items = []
        for item_node in node.args[0].elts:
            item = self.expr(item_node)
            if isinstance(item, Const):
                item = self.materialise(item_node, item)
            if not isinstance(item, (Arr, Part)):
                raise m.error(item_node, "np.concatenate of a non-array")
            items.append(item)
        ranks = {len(i.base.visible if isinstance(i, Part) else i.visible) for i in items}
        if len(ranks) != 1:
            raise m.error(node, "np.concatenate of arrays with different numbers of axes")
        rank = ranks.pop()
        axis = self.axis(node, axis, rank)
        pieces = []  # (whole array, first element, length, factor)
        for item in items:
            if isinstance(item, Part):
                if item.axis != axis:
                    raise m.error(node, f"np.concatenate along axis {axis} of a slice of axis {item.axis}", PART_HINT)
                pieces.append((item.base, item.lo, item.length, item.scale))
            else:
                letter = item.letters[axis]
                if letter is None:
                    raise m.error(node, "np.concatenate along an axis of size 1 is not supported")
                pieces.append((item, sympy.Integer(0), _symbol(m.letters.dim(letter)), 1.0))
        dims = [[m.letters.dim(x) for x in p[0].letters] for p in pieces]
        if any(d != dims[0] for d in dims):
            raise m.error(node, "np.concatenate of parts of different axes: "
                          + " and ".join(_axes(d) for d in dict.fromkeys(tuple(x or "1" for x in d) for d in dims)),
                          "concatenate parts of arrays with the same axes")
        dim = dims[0][axis]
        total = sympy.simplify(sum(p[2] for p in pieces))
        if not _same(total, _symbol(dim)):
            raise m.error(node, f"np.concatenate makes an axis of {total} elements from parts of {dim}: only parts "
                          f"that put an axis back together (of {dim} elements) are supported",
                          "concatenate slices x[..., :h], x[..., h:] of one axis (as rotate_half), or declare the "
                          "result as its own Tensor argument")
        groups: dict[str, tuple[Arr, list]] = {}
        start = sympy.Integer(0)
        for base, lo, length, factor in pieces:
            if not isinstance(base.expr, ast.Name):
                base = self.temp("whole", base)
            groups.setdefault(ast.dump(base.expr) + repr((base.stored, base.visible)), (base, []))[1].append(
                (lo, start, length, factor))
            start = start + length
        result = None
        for base, placed in groups.values():
            if len(groups) == 1 and all(_same(lo, at) and factor == 1 for lo, at, _, factor in placed):
                part = base  # the parts in their places: the array itself
            else:
                part = self.place(node, base, axis, placed)
            result = part if result is None else self.arith(node, ast.Add(), result, part)
        return result

    def place(self, node: ast.AST, base: Arr, axis: int, placed: list) -> Arr:
        """``base`` with the parts ``placed`` ((first element, where it goes, length, factor)) of its
        visible ``axis`` moved: one einsum with a constant matrix over (axis read, axis written)."""
        if None in base.stored:
            raise self.m.error(node, "a slice of an array with a size-1 axis of its own is not supported")
        letter = base.stored[base.visible[axis]]
        read = self.m.letters.fresh(self.m.letters.dim(letter), set(base.stored))
        terms = []
        for lo, at, length, factor in placed:
            end = sympy.simplify(at + length)
            shift = sympy.simplify(lo - at)
            terms.append(f"where(({_int_source(at)} <= i1) & (i1 < {_int_source(end)}) & "
                         f"(i0 == i1 + {_int_source(shift)}), {float(factor)!r}, 0.0)")
        matrix = self.m.constant((read, letter), " + ".join(terms), f"concat_{letter}")
        stored = "".join(base.stored)
        expr = _call(_np("einsum"), ast.Constant(f"{stored.replace(letter, read)},{read}{letter}->{stored}"),
                     base.expr, _load(matrix))
        return Arr(expr, base.stored, base.visible)

    def repeat(self, node: ast.Call, value, args: list) -> Arr:
        """``np.repeat(x, n, axis)``: each element of the axis n times (K/V heads over the query groups of
        grouped-query attention): one einsum with a constant matrix over (axis read, axis written), 1
        where the written index // n is the read one.  The written axis is a dim of INDEX (n * the read
        dim, e.g. H for np.repeat(k, H // KV, axis=1))."""
        m = self.m
        array = self.as_array(node, value)
        count_node = args[0] if args else self.keyword(node, "repeats")
        axis_node = args[1] if len(args) > 1 else self.keyword(node, "axis")
        if count_node is None or axis_node is None:
            raise m.error(node, "np.repeat needs a count and an axis", "write np.repeat(k, H // KV, axis=1)")
        count = self.size_of(count_node)
        axis = self.axis(node, self.static(axis_node), len(array.visible))
        if None in array.stored or array.letters[axis] is None:
            raise m.error(node, "np.repeat of an axis of size 1 (or of an array with one) is not supported",
                          "broadcast it instead (NumPy's size-1 axes)")
        letter = array.letters[axis]
        total = _symbol(m.letters.dim(letter)) * count
        dim = m.dim_of_size(node, total, "the repeated axis")
        written = m.letters.fresh(dim, set(array.stored) - {letter})
        value_expr = f"where(i1 // {m.size_source(node, count)} == i0, 1.0, 0.0)"
        matrix = m.constant((letter, written), value_expr, f"repeat_{letter}{written}")
        stored = "".join(array.stored)
        expr = _call(_np("einsum"), ast.Constant(f"{stored},{letter}{written}->{stored.replace(letter, written)}"),
                     array.expr, _load(matrix))
        return Arr(expr, tuple(written if x == letter else x for x in array.stored), array.visible)

    # --- reductions -------------------------------------------------------------------------

    def reduce(self, node: ast.Call, kind: str, array: Arr, axis_node):
        m = self.m
        rank = len(array.visible)
        axis = None if axis_node is None else self.static(axis_node)
        axes = list(range(rank)) if axis is None else [self.axis(node, a, rank) for a in _as_tuple(axis)]
        keepdims_node = self.keyword(node, "keepdims")
        keepdims = bool(self.static(keepdims_node)) if keepdims_node is not None else False
        ddof_node = self.keyword(node, "ddof")
        ddof = self.static(ddof_node) if ddof_node is not None else 0
        for keyword in node.keywords:
            if keyword.arg not in ("axis", "keepdims", "ddof", "axes"):
                raise m.error(node, f"keyword {keyword.arg}= is not supported here",
                              "give axis= and keepdims= only")
        removed = sorted({array.visible[a] for a in axes if array.visible[a] is not None})
        letters = [array.stored[i] for i in removed]
        if None in letters:
            raise m.error(node, "a reduction over a size-1 axis the array has", "drop that axis from axis=")
        if len(letters) == len(array.stored):
            raise m.error(node, "a reduction over every axis is not supported",
                          "reduce over the axes you need with axis=; a layer keeps at least one axis")
        if not letters:  # only size-1 axes: nothing to compute
            return replace(array, visible=tuple(None if p in axes else e for p, e in enumerate(array.visible)
                                                if keepdims or p not in axes))

        def reduced(value: Arr, expr: ast.expr, keep: bool) -> Arr:
            """``value`` without the reduced axes (as size-1 axes with ``keep``), computed by ``expr``."""
            gone = [value.visible[a] for a in axes]
            stored = tuple(l for i, l in enumerate(value.stored) if i not in gone)
            visible = tuple(None if p in axes else e - sum(g < e for g in gone)
                            for p, e in enumerate(value.visible) if keep or p not in axes)
            return self.known(Arr(expr, stored, visible))

        def total(value: Arr, what: str) -> ast.expr:
            return _call(_np(what), value.expr, axis=_int_node([value.visible[a] for a in axes]))

        count = m.dims_of(letters)
        if kind in ("sum", "max"):
            return reduced(array, total(array, kind), keepdims)
        if kind == "min":
            negated = replace(array, expr=ast.UnaryOp(ast.USub(), array.expr))
            return reduced(array, ast.UnaryOp(ast.USub(), total(negated, "max")), keepdims)
        # a mean is named where it is computed, so that a variance of the same axes reuses it
        x = self.temp("x", array) if kind in ("var", "std") else array
        mean = self.temp("mean", reduced(x, ast.BinOp(total(x, "sum"), ast.Div(), count), True))
        if kind == "mean":
            return replace(mean, visible=reduced(x, mean.expr, keepdims).visible)
        # var, std: the mean of the centred square
        centred = self.temp("centred", self.arith(node, ast.Sub(), x, mean))
        square = self.arith(node, ast.Mult(), centred, centred)
        if ddof:
            count = _float32(ast.BinOp(count.args[0], ast.Sub(), ast.Constant(ddof)))
        expr = ast.BinOp(total(square, "sum"), ast.Div(), count)
        return reduced(square, _call(_np("sqrt"), expr) if kind == "std" else expr, keepdims)

    # --- contractions -----------------------------------------------------------------------

    def contract(self, node: ast.AST, operands: list[Arr], positions: list[list], output: list) -> Arr:
        """One explicit einsum.  ``positions[k][p]``: the index id of operand k's visible axis p (None:
        a size-1 axis); ``output``: the result's index ids (None: a size-1 axis it keeps).  Each
        index gets the letter of the first operand axis it is bound to, another letter of the same
        dim if that one is taken."""
        letters = self.m.letters
        bound: dict[object, list[str]] = {}
        for operand, ids in zip(operands, positions):
            if None in operand.stored:
                raise self.m.error(node, "a contraction operand with a size-1 axis of its own is not supported",
                                   "contract the array before adding the axis")
            for letter, index in zip(operand.letters, ids):
                if letter is not None and index is not None:
                    bound.setdefault(index, []).append(letter)
        names: dict[object, str] = {}
        for index, found in bound.items():
            for letter in found[1:]:
                if letters.dim(letter) != letters.dim(found[0]):
                    raise self.m.error(node, f"the contraction pairs axis {found[0]} ({letters.dim(found[0])}) "
                                       f"with axis {letter} ({letters.dim(letter)})",
                                       "check the operands' axes (transpose one with .T or np.swapaxes)")
            letter = found[0]
            if letter in names.values():
                letter = letters.fresh(letters.dim(letter), set(names.values()) | set(found))
            names[index] = letter
        terms = []
        for operand, ids in zip(operands, positions):
            terms.append("".join(names[ids[operand.visible.index(i)]] for i in range(len(operand.stored))))
        out = "".join(names[index] for index in output if index is not None)
        expr = _call(_np("einsum"), ast.Constant(f"{','.join(terms)}->{out}"), *(o.expr for o in operands))
        visible = iter(range(len(out)))
        return Arr(expr, tuple(out), tuple(None if index is None else next(visible) for index in output))

    def matmul(self, node: ast.AST, a: Arr, b: Arr) -> Arr:
        na, nb = len(a.visible), len(b.visible)
        if na == 0 or nb == 0:
            raise self.m.error(node, "@ of a scalar", "use *")
        ids_a: list = [None] * na
        ids_b: list = [None] * nb
        ids_a[-1] = "k"
        ids_b[-2 if nb > 1 else -1] = "k"
        output: list = []
        if na > 1 and nb > 1:
            batch = max(na, nb) - 2
            for pos in range(batch):
                pa, pb = pos - (batch - (na - 2)), pos - (batch - (nb - 2))
                for ids, p, arr in ((ids_a, pa, a), (ids_b, pb, b)):
                    if p >= 0:
                        ids[p] = ("batch", pos)
                output.append(("batch", pos))
            ids_a[-2], ids_b[-1] = "m", "n"
            output += ["m", "n"]
        elif na > 1:
            for p in range(na - 1):
                ids_a[p] = ("a", p)
            output = list(ids_a[:-1])
        elif nb > 1:
            for p in range(nb):
                if p != nb - 2:
                    ids_b[p] = ("b", p)
            output = [ids_b[p] for p in range(nb) if p != nb - 2]
        self.check_pairs(node, [(a, ids_a), (b, ids_b)])
        return self.contract(node, [a, b], [ids_a, ids_b], self.kept(output, [(a, ids_a), (b, ids_b)]))

    def kept(self, output: list, operands: list) -> list:
        """Output ids that no operand binds to a letter are size-1 axes (None)."""
        bound = {i for arr, ids in operands for letter, i in zip(arr.letters, ids) if letter is not None}
        return [i if i in bound else None for i in output]

    def check_pairs(self, node: ast.AST, operands: list) -> None:
        """A contracted pair of a real axis and a size-1 axis is NumPy's error, not a broadcast."""
        seen: dict[object, list] = {}
        for arr, ids in operands:
            for letter, index in zip(arr.letters, ids):
                seen.setdefault(index, []).append(letter)
        for index, letters in seen.items():
            if index == "k" and None in letters and any(l is not None for l in letters):
                raise self.m.error(node, "the contracted axes do not match (a size-1 axis against "
                                   f"{next(l for l in letters if l)})", "check the operands' axes")

    def dot(self, node: ast.AST, a: Arr, b: Arr) -> Arr:
        na, nb = len(a.visible), len(b.visible)
        if na <= 2 and nb <= 2 or na == 1 or nb == 1:
            return self.matmul(node, a, b)
        ids_a = [("a", p) for p in range(na - 1)] + ["k"]
        ids_b = [("b", p) for p in range(nb)]
        ids_b[-2] = "k"
        output = ids_a[:-1] + [i for p, i in enumerate(ids_b) if p != nb - 2]
        self.check_pairs(node, [(a, ids_a), (b, ids_b)])
        return self.contract(node, [a, b], [ids_a, ids_b], self.kept(output, [(a, ids_a), (b, ids_b)]))

    def tensordot(self, node: ast.AST, a: Arr, b: Arr, axes) -> Arr:
        na, nb = len(a.visible), len(b.visible)
        if isinstance(axes, int):
            pairs = [(na - axes + i, i) for i in range(axes)]
        else:
            left, right = (_as_tuple(x) for x in axes)
            if len(left) != len(right):
                raise self.m.error(node, "np.tensordot's axes lists differ in length")
            pairs = [(self.axis(node, x, na), self.axis(node, y, nb)) for x, y in zip(left, right)]
        ids_a = [("a", p) for p in range(na)]
        ids_b = [("b", p) for p in range(nb)]
        for n, (x, y) in enumerate(pairs):
            ids_a[x] = ids_b[y] = ("k", n)
        contracted = {("k", n) for n in range(len(pairs))}
        output = [i for i in ids_a + ids_b if i not in contracted]
        return self.contract(node, [a, b], [ids_a, ids_b], self.kept(output, [(a, ids_a), (b, ids_b)]))

    def einsum(self, node: ast.Call) -> Arr:
        m = self.m
        if not node.args or not isinstance(node.args[0], ast.Constant) or not isinstance(node.args[0].value, str):
            raise m.error(node, "np.einsum needs its subscripts as a string literal first",
                          "write np.einsum('ij,jk->ik', a, b)")
        subscripts = node.args[0].value.replace(" ", "")
        operands = [self.array(a) for a in node.args[1:]]
        if "." in subscripts:
            raise m.error(node, "np.einsum with ... is not supported", "name every axis with a letter")
        inputs, arrow, output = subscripts.partition("->")
        terms = inputs.split(",")
        if len(terms) != len(operands):
            raise m.error(node, f"np.einsum has {len(terms)} terms for {len(operands)} operands")
        for term, operand in zip(terms, operands):
            if len(term) != len(operand.visible):
                raise m.error(node, f"term {term!r} has {len(term)} letters for an operand with "
                              f"{len(operand.visible)} axes {_axes(operand.letters)}")
            if None in operand.letters:
                raise m.error(node, "an np.einsum operand with a size-1 (None) axis is not supported",
                              "pass the array without the added axis")
        if arrow:
            result = self.explicit_einsum(node, terms, output, operands)
        for term in terms:
            if len(set(term)) != len(term):
                raise m.error(node, f"term {term!r} repeats a letter (a diagonal)",
                              "give every axis of an operand its own letter")
        if arrow:
            return result
        counts = {c: inputs.count(c) for c in inputs if c != ","}
        out = sorted(c for c, n in counts.items() if n == 1)
        positions = [[c for c in term] for term in terms]
        return self.contract(node, operands, positions, out)

    def explicit_einsum(self, node: ast.Call, terms: list[str], output: str, operands: list[Arr]) -> Arr:
        """Kept as written (its letters are the user's); operands that are views get their terms
        permuted onto their stored axes; its letters must agree with INDEX and each other."""
        letters = self.m.letters
        for term, operand in zip(terms, operands):
            for letter, own in zip(term, operand.letters):
                dim = letters.dim(own)
                known = letters.dims.setdefault(letter, dim)
                if known != dim:
                    raise self.m.error(node, f"contradictory dims: letter {letter} is {known} but this np.einsum "
                                       f"uses it for an axis of size {dim}",
                                       "use another letter for that axis (INDEX maps each letter to one dim)")
        if all(o.plain for o in operands):
            expr = _call(node.func, node.args[0], *(o.expr for o in operands))
            expr.keywords = node.keywords
        else:
            new_terms = ["".join(term[o.visible.index(i)] for i in range(len(o.stored))) for term, o in zip(terms, operands)]
            expr = _call(_np("einsum"), ast.Constant(f"{','.join(new_terms)}->{output}"), *(o.expr for o in operands))
        return Arr.of(expr, output)


def _as_int(num: Num) -> int:
    if num.value is None or not float(num.value).is_integer():
        raise SpecError("expected an integer")
    return int(num.value)


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _axes(visible) -> str:
    return "(" + ", ".join("1" if l is None else l for l in visible) + ")"


# --- the lowered module ---------------------------------------------------------------------------

_LINES: dict[str, tuple[str, dict[int, int]]] = {}  # lowered source file -> (spec path, its line -> spec line)


def _with_body(node: ast.FunctionDef, body: list[ast.stmt], name: str | None = None) -> ast.FunctionDef:
    new = copy.copy(node)
    new.body, new.decorator_list, new.name = body, [], name or node.name
    return new


def _compile(module: _Module, functions: list[ast.FunctionDef]) -> types.ModuleType:
    """The lowered functions in a new module (a copy of the spec's globals).  DaCe reads a function's
    source with ``inspect``, so each lowered function gets a source file of its own in ``linecache``."""
    name = f"{module.spec.function.__module__}_lowered"
    lowered = types.ModuleType(name)
    lowered.__dict__.update(module.globals)
    lowered.__dict__.update(__name__=name, np=numpy)
    for dim, alias in module.dim_names.items():
        if alias != dim:
            lowered.__dict__[alias] = dace.symbol(dim)
    sys.modules[name] = lowered  # dace's parser looks functions' globals up through their module
    for function in functions:
        text = ast.unparse(function) + "\n"
        filename = f"<lowered {module.spec.path}:{function.name}>"
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        exec(compile(text, filename, "exec", dont_inherit=True), lowered.__dict__)  # noqa: S102
        ours = [n for n in ast.walk(function) if isinstance(n, ast.stmt)]
        theirs = [n for n in ast.walk(ast.parse(text).body[0]) if isinstance(n, ast.stmt)]
        _LINES[filename] = (str(module.spec.path), {new.lineno: getattr(old, "lineno", None)
                                                    for new, old in zip(theirs, ours)})
    return lowered


def spec_line(filename: str, line: int) -> tuple[str, int] | None:
    """The spec file and line behind a line of a lowered function's source (for DaCe's messages)."""
    path, lines = _LINES.get(filename, (None, {}))
    return (path, lines[line]) if lines.get(line) else None


def lower_spec(spec: LayerSpec) -> LayerSpec:
    """``spec`` (as ``dataflow.spec.load_spec`` reads it) with its layer function (and the helpers
    it calls) lowered to the dialect DaCe reads; ``spec`` itself if nothing needed lowering."""
    source = spec.path.read_text()
    module = _Module(spec, source, ast.parse(source, filename=str(spec.path)), spec.function.__globals__)
    node = module.functions.get(spec.function.__name__)
    if node is None:
        raise SpecError(f"{spec.path}: cannot find the source of {spec.function.__name__}")
    params = {arg.name: Arr.of(_load(arg.name), arg.letters) for arg in spec.arguments}
    module.root = _Function(module, node, params)
    layer = _with_body(node, module.root.lower_body(node.body))
    made = list(module.constants.values())  # constants of known value: arguments after the spec's
    if made:
        layer.args = copy.copy(node.args)
        layer.args.args = list(node.args.args) + [ast.arg(arg.name) for arg in made]
    functions = [f for versions in module.specialised.values() for _, _, f, _ in versions if f is not None]
    functions = list({f.name: f for f in functions}.values()) + [layer]
    if all(f.name in module.functions and ast.dump(f) == ast.dump(_with_body(module.functions[f.name],
                                                                             module.functions[f.name].body))
           for f in functions):
        return spec
    lowered = _compile(module, functions)
    letter_dims = dict(spec.letter_dims)
    letter_dims.update({x: module.letters.dims[x] for arg in made for x in arg.letters})
    return replace(spec, function=lowered.__dict__[node.name], arguments=list(spec.arguments) + made,
                   letter_dims=letter_dims)
