"""The abstract values a spec's expressions lower to: arrays with their letters and views (``Arr``),
numbers and sizes (``Num``), slices (``Part``), arrays of known value (``Const``), Python values known
while lowering (``Static``), comparisons awaiting ``np.where`` (``Compare``); ``NeedsInline``, raised
when a helper must be inlined into its caller."""
from __future__ import annotations

import ast
from dataclasses import dataclass

from datamove.dataflow.spec import SpecError


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


class NeedsInline(Exception):
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


def as_int(num: Num) -> int:
    if num.value is None or not float(num.value).is_integer():
        raise SpecError("expected an integer")
    return int(num.value)
