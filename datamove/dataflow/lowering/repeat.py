"""``np.repeat(k, n, axis)`` / ``k.repeat(n, axis)`` (HF's ``repeat_kv`` for grouped-query attention):
one einsum ``"bkse,kh->bhse"`` with the 0/1 matrix ``[h // n == k]``, the written axis the dim of
INDEX that ``n`` times the read one is (H for ``H // KV``), so the attention reads K and V over the
query heads, materialised as HF's eager attention does (a spec written with a group letter,
``q[b, k, g, s, e]``, reads them once instead; the fused attention does not take it yet)."""
from __future__ import annotations

import ast

from datamove.dataflow.lowering.syntax import dim_symbol, load_name, make_call, np_attr
from datamove.dataflow.lowering.values import Arr


class Repeats:
    """Mixin of ``FunctionLowering``: ``np.repeat``."""

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
        total = dim_symbol(m.letters.dim(letter)) * count
        dim = m.dim_of_size(node, total, "the repeated axis")
        value, wanted = m.size_value(node, total), m.size_value(node, dim_symbol(dim))
        if value != wanted:  # KV * (H // KV) taken for H: only where KV divides H (NumPy's shapes then disagree)
            raise m.error(node, f"the repeated axis has {total} = {value} elements, {dim} = {wanted} at these dims",
                          f"give dims where it is {dim} (H a multiple of KV for H // KV)")
        written = m.letters.fresh(dim, set(array.stored) - {letter})
        value_expr = f"where(i1 // {m.size_source(node, count)} == i0, 1.0, 0.0)"
        matrix = m.constant((letter, written), value_expr, f"repeat_{letter}{written}")
        stored = "".join(array.stored)
        subscripts = f"{stored},{letter}{written}->{stored.replace(letter, written)}"
        expr = make_call(np_attr("einsum"), ast.Constant(subscripts), array.expr, load_name(matrix))
        return Arr(expr, tuple(written if x == letter else x for x in array.stored), array.visible)
