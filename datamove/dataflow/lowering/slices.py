"""Slices of one axis and ``np.concatenate``.  ``x[..., a:b]`` (one axis, contiguous; the bounds
sizes: dims, ``x.shape[k]``, integers and ``+ - * //`` of these) is a ``Part``: element-wise
operations on parts cut the same way (and on arrays broadcast along that axis) are computed on the
whole axis and cut again; ``np.concatenate`` of parts that put an axis of one dim back together is,
per array sliced, one einsum ``"...a,ae->...e"`` with a constant matrix placing each part (0, 1, or
its factor: rotate_half's ``-x2`` is -1 there, no negation map); parts put back in their places are
the array itself.  New letters for the halves would need dims derived from others (``E // 2``),
which the graph cannot keep consistent when a dim changes, and views with offsets, which no later
stage reads; the matrix (E x E) keeps the executor, the autodiff and the torch backend as they are,
and the later stages run such an einsum element-wise (``dataflow.shuffle``: a load at the moved
index, no GEMM).  Any other use of a slice is refused (``PART_HINT``)."""
from __future__ import annotations

import ast

import sympy

from datamove.dataflow.lowering.support import PART_HINT
from datamove.dataflow.lowering.syntax import (axes_text, dim_symbol, float32_of, int_source, load_name, make_call,
                                               np_attr, same_size)
from datamove.dataflow.lowering.values import Arr, Const, Num, Part


class Slices:
    """Mixin of ``FunctionLowering``: slices of one axis, element-wise operations on them,
    ``np.concatenate``."""

    def cut(self, node: ast.AST, array: Arr, axis: int, item: ast.Slice):
        """``array[..., lo:hi, ...]`` along visible ``axis``: a ``Part`` (``array`` itself if whole)."""
        letter = array.letters[axis]
        if letter is None:
            raise self.m.error(node, "slicing an axis of size 1 is not supported")
        dim = self.m.letters.dim(letter)
        whole = dim_symbol(dim)

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
        if same_size(lo, 0) and same_size(hi, whole):
            return array
        return Part(array, axis, sympy.simplify(lo), sympy.simplify(hi - lo))

    def part_elementwise(self, node: ast.AST, build, values: list) -> Part:
        """Element-wise operations on slices cut the same way: computed on their whole arrays, cut again."""
        parts = [v for v in values if isinstance(v, Part)]
        first = parts[0]
        right = len(first.base.visible) - first.axis  # the cut axis, counted from the right
        where = f"axis {first.base.letters[first.axis]} [{first.lo}:{first.lo + first.length}]"
        for part in parts[1:]:
            if len(part.base.visible) - part.axis != right or not same_size(part.lo, first.lo) \
                    or not same_size(part.length, first.length):
                raise self.m.error(node, f"element-wise operation on different slices ({where} and axis "
                                   f"{part.base.letters[part.axis]} [{part.lo}:{part.lo + part.length}])", PART_HINT)
        whole = []
        for value in values:
            if isinstance(value, Const):
                value = self.materialise(node, value)
            if isinstance(value, Part):
                base = value.base
                if value.scale != 1:
                    base = self.arith(node, ast.Mult(), base, Num(float32_of(ast.Constant(value.scale)), value.scale))
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
                pieces.append((item, sympy.Integer(0), dim_symbol(m.letters.dim(letter)), 1.0))
        dims = [[m.letters.dim(x) for x in p[0].letters] for p in pieces]
        if any(d != dims[0] for d in dims):
            raise m.error(node, "np.concatenate of parts of different axes: "
                          + " and ".join(axes_text(d) for d in dict.fromkeys(tuple(x or "1" for x in d) for d in dims)),
                          "concatenate parts of arrays with the same axes")
        dim = dims[0][axis]
        total = sympy.simplify(sum(p[2] for p in pieces))
        if not same_size(total, dim_symbol(dim)):
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
            if len(groups) == 1 and all(same_size(lo, at) and factor == 1 for lo, at, _, factor in placed):
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
            terms.append(f"where(({int_source(at)} <= i1) & (i1 < {int_source(end)}) & "
                         f"(i0 == i1 + {int_source(shift)}), {float(factor)!r}, 0.0)")
        matrix = self.m.constant((read, letter), " + ".join(terms), f"concat_{letter}")
        stored = "".join(base.stored)
        expr = make_call(np_attr("einsum"), ast.Constant(f"{stored.replace(letter, read)},{read}{letter}->{stored}"),
                         base.expr, load_name(matrix))
        return Arr(expr, base.stored, base.visible)
