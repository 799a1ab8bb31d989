"""Arrays whose value the front end knows (``Const``): ``np.arange(T)``, ``np.ones`` / ``np.zeros`` /
``np.full((T, T), v)``, ``np.tril`` / ``np.triu``, comparisons, ``& | ~``, arithmetic and ``np.where``
of these, combined as expressions of their indices until they meet a computed array; there each
becomes a constant argument of the layer (``Tensor(letters, requires_grad=False)``, one per distinct
value) whose graph tensor carries its value (``TensorInfo.value``).  ``np.where(mask, x, -inf)`` (or
any number <= -1e4) with such a mask is ``x`` plus the additive constant (0 where kept) where the
mask keeps a position on every line (``keeps_every_line``): a causal mask so added to the scores
before the softmax is what ``dataflow.initial_values`` reads as the ``CausalMask`` and the fused
attention replaces."""
from __future__ import annotations

import ast
import copy
import math
from dataclasses import replace

import numpy as np
import sympy

from datamove.dataflow.expression import FUNCTIONS
from datamove.dataflow.initial_values import MASKED_SCORE
from datamove.dataflow.lowering.support import CONST_FUNCTIONS
from datamove.dataflow.lowering.syntax import (float32_of, index_name, int_source, load_name, make_call, np_attr,
                                               substitute)
from datamove.dataflow.lowering.values import Arr, Const, NeedsInline, Num, Part


class KnownConstants:
    """Mixin of ``FunctionLowering``: constants of known value, causal masks in ``np.where``."""

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
            return ast.parse(int_source(value.size), mode="eval").body
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
                names = {index_name(x): index_name(result[offset + p]) for p, x in enumerate(value.letters) if x}
                value = replace(value, expr=substitute(value.expr, names))
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
                if name in CONST_FUNCTIONS:
                    return call
                if name == "np.float32":
                    return call.args[0]
                if name.startswith("np.") and name[3:] in CONST_FUNCTIONS:
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
            raise NeedsInline
        expr = substitute(value.expr, {index_name(x): f"i{k}" for k, x in enumerate(real)})
        unknown = sorted({n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}
                         - {f"i{k}" for k in range(len(real))} - set(self.m.spec.dim_values) - CONST_FUNCTIONS - {"inf"})
        if unknown:
            raise self.m.error(node, f"the constant array's value uses {', '.join(unknown)}: only the dims of INDEX's "
                               "letters and numbers are known")
        name = self.m.constant(real, expr, value.hint or "mask")
        return Arr(load_name(name), real, tuple(None if x is None else real.index(x) for x in value.letters))

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
            rows, cols = (index_name(x) for x in value.letters[-2:])
            keep = f"{cols} <= {rows} + {int_source(k)}" if kind == "tril" else f"{cols} >= {rows} + {int_source(k)}"
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
            return Const(index_name(letter), (letter,))
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

    def keeps_every_line(self, cond: Const, kept: bool) -> bool:
        """Whether the known mask ``cond`` keeps a position (where it is ``kept``) on every line along
        each of its axes: a causal mask does, a strict one (key before the query) leaves the first
        query's row empty.  Only then is ``np.where(mask, x, -1e9)`` after a softmax over any axis the
        same as ``x`` plus the additive constant: over a row masked whole NumPy averages the fill
        uniformly, while ``x`` + constant gives softmax(x)."""
        real = [x for x in cond.letters if x is not None]
        sizes = [self.m.spec.dim_values[self.m.letters.dim(x)] for x in real]
        grids = {index_name(x): grid for x, grid in zip(real, np.indices(sizes))} if real else {}
        known = {**FUNCTIONS, "inf": math.inf, **self.m.spec.dim_values, **grids}
        value = eval(compile(ast.parse(cond.expr, mode="eval"), "<mask>", "eval"), {"__builtins__": {}}, known)
        keep = np.broadcast_to(np.asarray(value).astype(bool) == kept, sizes)
        return all(bool(keep.any(axis=axis).all()) for axis in range(len(sizes)))

    def where_known(self, node: ast.Call, cond: Const, x, y):
        """``np.where(mask, x, y)`` for a mask of known value (a causal mask from np.tril or np.arange):
        of constants, a constant; choosing between an array and a number of -1e4 or less (-inf), the
        array plus an additive constant (0 where the array is kept, that number elsewhere: the form
        the fused attention recognises; after a softmax the same); otherwise a map reading the mask
        as a constant of 0 and 1."""
        def choose(c, a, b):
            return make_call(np_attr("where"), c, a, b)
        if all(isinstance(v, Const) or (isinstance(v, Num) and self.const_term(v) is not None) for v in (x, y)):
            return self.const_elementwise(node, choose, [cond, x, y])
        zero = Num(float32_of(ast.Constant(0.0)), 0.0)
        for array, fill, kept in ((x, y, True), (y, x, False)):
            if isinstance(array, (Arr, Part)) and isinstance(fill, Num) and fill.value is not None \
                    and fill.value <= MASKED_SCORE and self.keeps_every_line(cond, kept):
                added = self.const_elementwise(node, choose, [cond, zero, fill] if kept else [cond, fill, zero])
                return self.arith(node, ast.Add(), array, replace(added, hint=cond.hint or "mask"))
        one = Num(float32_of(ast.Constant(1.0)), 1.0)
        mask = self.const_elementwise(node, choose, [cond, one, zero])
        half = Num(float32_of(ast.Constant(0.5)), 0.5)
        return self.elementwise(node,
                                lambda m, h, a, b: make_call(np_attr("where"), ast.Compare(m, [ast.Gt()], [h]), a, b),
                                [self.materialise(node, replace(mask, hint=cond.hint or "mask")), half, x, y])
