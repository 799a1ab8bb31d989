"""Element-wise operations by NumPy's rules: broadcasting (trailing alignment, size-1 axes, scalars),
each operand indexed explicitly with ``None`` for the axes it lacks (``b[None, None, :]``) and, where
its axes are permuted, relabelled through ``np.einsum("ts->st", x)``; arithmetic, unary functions,
``x ** n`` for a constant n (products, one division for negative n, ``np.sqrt`` for ``** 0.5`` /
``** -0.5``), ``np.where(a > b, c, d)`` (kept, explicitly broadcast: the reader makes it one map) and
``np.clip`` with number bounds (two ``np.where``, so that the bounds take torch.clamp's gradient).
Slices and constants of known value met here go to ``slices`` and ``masks``."""
from __future__ import annotations

import ast
import operator
from dataclasses import replace

from datamove.dataflow.lowering.syntax import float32_of, make_call, np_attr
from datamove.dataflow.lowering.values import Arr, Compare, Const, Num, Part, Static
from datamove.dataflow.spec import SpecError

# np.where's comparisons between two known numbers
_COMPARED = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
             ast.Eq: operator.eq, ast.NotEq: operator.ne}


class Elementwise:
    """Mixin of ``FunctionLowering``: element-wise operations and broadcasting."""

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
                    self.refuse_broadcast(node, pos - rank, [found[0], (letter, array)])
            letter = found[0][0] if found else None
            if letter is not None and letter in result:
                raise self.m.error(node, f"the result would have two axes with letter {letter} (an outer product "
                                   "of an axis with itself)", "write it with np.einsum and two letters, e.g. "
                                   "np.einsum('s,t->st', a, b)")
            result.append(letter)
        return tuple(result)

    def refuse_broadcast(self, node: ast.AST, axis: int, found: list[tuple[str, Arr]]):
        """Two letters of different dims on one axis (``found``: each with its operand): the ``SpecError``,
        which says why where one of them has size 1 (NumPy would broadcast it; the graph's axes are letters,
        each sized by its dim, which a call or ``--dims`` may set to another size)."""
        dims, sizes = self.m.letters, self.m.spec.dim_values
        named = [f"{x} ({dims.dim(x)}{' = 1' if sizes.get(dims.dim(x)) == 1 else ''})" for x, _ in found]
        problem = f"cannot broadcast: axis {axis} is {named[0]} in one operand and {named[1]} in another"
        single = [(x, array) for x, array in found if sizes.get(dims.dim(x)) == 1]
        if not single:
            raise self.m.error(node, problem, "check the operands' axes; align them with [:, None] or transpose one")
        letter, array = single[0]
        name = array.expr.id if isinstance(array.expr, ast.Name) else "the operand"
        kept = "".join(x for x in array.stored if x not in (None, letter))
        index = ", ".join("None" if x in (letter, None) else ":" for x in array.letters)
        raise self.m.error(node, f"{problem}; a letter of size 1 is an axis of its dim ({dims.dim(letter)} may take "
                           "another size), it does not broadcast", f"declare {name} without it, Tensor(\"{kept}\"), "
                           f"and index it with None where it broadcasts: {name}[{index}]")

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
            expr = make_call(np_attr("einsum"), ast.Constant(f"{stored}->{''.join(stored[i] for i in order)}"), expr)
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
            return self.elementwise(node, lambda a: make_call(np_attr(name), a), [value])
        self.number_or_array(node, value)
        if isinstance(value, Arr):
            return replace(value, expr=make_call(np_attr(name), value.expr))
        return Num(make_call(np_attr(name), value.expr))

    def power(self, node: ast.AST, base, exponent):
        m = self.m
        if not isinstance(exponent, Num) or exponent.value is None:
            raise m.error(node, "only constant exponents are supported",
                          "write np.exp(y * np.log(x)) for a variable exponent")
        p = exponent.value
        if not isinstance(base, (Part, Const)):
            self.number_or_array(node, base)
        one = Num(float32_of(ast.Constant(1)), 1.0)
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
        if all(isinstance(v, Num) for v in values):  # numbers only (np.clip(2.0, 0.0, 1.0)): no map to build
            if any(v.value is None for v in values):
                raise self.m.error(node, "np.where of numbers whose values are not known as the spec is read",
                                   "apply it to an array, or write the number it gives")
            a, b, x, y = values
            return x if _COMPARED[type(op)](a.value, b.value) else y

        def build(a, b, x, y):
            return make_call(np_attr("where"), ast.Compare(a, [op], [b]), x, y)
        return self.elementwise(node, build, values)

    def clip(self, node: ast.Call, value, positional: list[ast.expr], lower: tuple[str, ...], upper: tuple[str, ...],
             taken: tuple[str, ...] = ()):
        """``np.clip(x, lo, hi)`` / ``x.clip(lo, hi)``: the bounds ``positional`` or by a keyword of ``lower`` /
        ``upper`` (np.clip's a_min / min, a_max / max), either one None or absent, numbers known as the spec is
        read; as ``np.where(x < lo, lo, np.where(x > hi, hi, x))`` with x computed once: NumPy's value, and a
        gradient of 1 from lo to hi, both bounds included, 0 outside (torch.clamp's).  ``taken``: keywords the
        caller read (np.clip's ``a``, the array)."""
        m = self.m
        unknown = [k.arg for k in node.keywords if k.arg not in lower + upper + taken]
        if unknown or len(positional) > 2:
            problem = f"clip's keyword {unknown[0]}= is not supported" if unknown else "clip takes two bounds"
            raise m.error(node, problem, f"write np.clip(x, lo, hi) (or {'= / '.join(lower + upper)}=), a bound None "
                          "where there is none")
        bounds = []
        for k, names in enumerate((lower, upper)):
            given = positional[k:k + 1] + [kw.value for kw in node.keywords if kw.arg in names]
            if len(given) > 1:
                raise m.error(node, "np.clip's bound is given twice", "give each bound once")
            bound = self.expr(given[0]) if given else None
            if isinstance(bound, Static) and bound.value is None:
                bound = None
            if bound is not None and not (isinstance(bound, Num) and bound.value is not None):
                raise m.error(node, f"np.clip's bound {ast.unparse(given[0])} is not a number known as the spec is read",
                              "clip by numbers or module constants (LIMIT = 1 / 3), or write "
                              "np.minimum(np.maximum(x, lo), hi) for bounds the layer computes")
            bounds.append(bound)
        lo, hi = bounds
        if lo is None and hi is None:
            raise m.error(node, "np.clip without a bound", "give a lower or an upper bound, or drop the np.clip")
        if lo is not None and hi is not None and lo.value > hi.value:
            raise m.error(node, f"np.clip's lower bound {lo.value:g} is above its upper bound {hi.value:g} (NumPy "
                          "then gives the upper bound everywhere)", "swap the bounds")
        if isinstance(value, Num):  # a number clipped (np.clip(2.0, 0.0, 1.0)): no map to build
            if value.value is None:
                raise m.error(node, "np.clip of a number whose value is not known as the spec is read",
                              "clip an array, or write the number it gives")
            clipped = min(max(value.value, lo.value if lo else value.value), hi.value if hi else value.value)
            return Num(float32_of(ast.Constant(clipped)), clipped)
        if isinstance(value, Arr):
            value = self.temp("clip", value)
        result = value
        for bound, op in ((hi, ast.Gt()), (lo, ast.Lt())):
            if bound is not None:
                result = self.elementwise(node, lambda a, b, x, y, op=op: make_call(
                    np_attr("where"), ast.Compare(a, [op], [b]), x, y), [value, bound, bound, result])
        return result
