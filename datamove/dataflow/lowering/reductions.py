"""Reductions: ``np.sum`` / ``np.max`` / ``np.min`` / ``np.mean`` / ``np.var`` / ``np.std``,
``np.amax`` / ``np.amin``, ``np.add.reduce`` / ``np.maximum.reduce`` / ``np.minimum.reduce`` and the
methods ``x.sum()`` ..., with negative or tuple axes and ``keepdims=True``: ``np.sum`` / ``np.max``
over explicit axes (min as ``-np.max(-x)``), the mean divided by ``np.float32(D)``, the variance as
the mean of the centred square, the standard deviation its ``np.sqrt``; a keepdims result is stored
without its size-1 axes and re-broadcast where it is used, so the normalization grouping sees sums."""
from __future__ import annotations

import ast
from dataclasses import replace

from datamove.dataflow.lowering.syntax import as_tuple, float32_of, int_node, make_call, np_attr
from datamove.dataflow.lowering.values import Arr


class Reductions:
    """Mixin of ``FunctionLowering``: reductions."""

    def reduce(self, node: ast.Call, kind: str, array: Arr, axis_node):
        m = self.m
        rank = len(array.visible)
        axis = None if axis_node is None else self.static(axis_node)
        axes = list(range(rank)) if axis is None else [self.axis(node, a, rank) for a in as_tuple(axis)]
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
            return make_call(np_attr(what), value.expr, axis=int_node([value.visible[a] for a in axes]))

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
            count = float32_of(ast.BinOp(count.args[0], ast.Sub(), ast.Constant(ddof)))
        expr = ast.BinOp(total(square, "sum"), ast.Div(), count)
        return reduced(square, make_call(np_attr("sqrt"), expr) if kind == "std" else expr, keepdims)
