"""The operator graph's primitives: tensors with named dims and the computations between them.

A ``PrimitiveGraph`` holds tensors (letters in storage order, a role) and ``Primitive``s of kind
``"map"`` (an element-wise expression), ``"reduce"`` or ``"einsum"``.  Each primitive reads its
operands through index letters of its own iteration space, so dims keep their letters from the
spec onwards.  ``dataflow.sdfg_reader`` builds one from a spec's SDFG; grouping primitives into
the paper's operators is ``dataflow.operators``' job.  Plain Python: no DaCe needed to use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from datamove.dataflow.dropout_mask import dropout_scale
from datamove.dataflow.expression import Expression, parse

SCALE_PREFIX = "scale_"  # ``scale_<mask>`` in a map expression: the keep factor of dropout tensor <mask>


def is_expression(expr: str, *forms: str) -> bool:
    """``expr`` is one of ``forms`` up to spacing and the spelling of constants (``0`` / ``0.0``):
    ``parse(expr).matches(*forms)`` (a primitive's own tree: ``Primitive.expression.matches``)."""
    return parse(expr).matches(*forms)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor: ``letters`` name its dims in storage order; ``role`` says where it comes from.

    role: "input" (layer argument with a gradient), "constant" (argument without one), "dropout"
    (a dropout mask argument, drop probability ``p``), "intermediate", "output".

    ``value``: for a constant the front end made itself (``dataflow.lowering``: the matrix of an
    ``np.concatenate`` or ``np.repeat``, a mask from ``np.tril`` / ``np.arange``), its value as an
    expression over the index variables ``i0, i1, ...`` of its axes (in its letter order), the dim
    names, ``inf`` and the map functions (``dataflow.executor.known_value`` evaluates it); "" for
    every other tensor.
    """

    name: str
    letters: str
    role: str
    p: float = 0.0
    value: str = ""


@dataclass(frozen=True)
class Operand:
    """A tensor read or written by a primitive; ``letters`` are the primitive's letters for its axes."""

    tensor: str
    letters: str


@dataclass(frozen=True)
class Primitive:
    """One computation of the graph.

    kind "einsum": ``expr`` is the subscripts, e.g. ``"phi,ibj->phbj"``, inputs in that order.
    kind "map": ``expr`` is an element-wise Python expression over ``in0, in1, ...`` (the inputs),
    dim names (e.g. ``N``), ``scale_<mask>`` (the factor ``dataflow.dropout_mask.dropout_scale(p)``
    of a kept element of dropout tensor ``<mask>``, at the graph's current ``p``: see
    ``PrimitiveGraph.scalars``) and the functions of ``dataflow.expression.FUNCTIONS`` (exp, log,
    sqrt, tanh, log1p, expm1, abs, sign, maximum, minimum, where); ``expression`` is its tree
    (``dataflow.expression``), parsed once.
    kind "reduce": ``expr`` is "sum" or "max", over the input letters missing from the output.
    """

    name: str
    kind: str
    inputs: tuple[Operand, ...]
    output: Operand
    expr: str

    @cached_property
    def expression(self) -> Expression:
        """A map's ``expr`` as a tree (``dataflow.expression.parse``), parsed on first use."""
        if self.kind != "map":
            raise ValueError(f"{self.name}: a {self.kind} primitive has no map expression")
        return parse(self.expr)

    @property
    def letters(self) -> str:
        """The iteration space: every letter the primitive loops over."""
        seen = dict.fromkeys(self.output.letters)
        for operand in self.inputs:
            seen.update(dict.fromkeys(operand.letters))
        return "".join(seen)

    @property
    def reduced(self) -> str:
        """Letters summed or maxed over (contraction letters of an einsum)."""
        return "".join(letter for letter in self.letters if letter not in self.output.letters)


@dataclass
class PrimitiveGraph:
    """Tensors and primitives in topological order, with each letter's dim name and the dim values."""

    tensors: dict[str, TensorInfo]
    primitives: list[Primitive]
    letter_dims: dict[str, str]
    dim_values: dict[str, int]
    outputs: list[str] = field(default_factory=list)

    def size(self, letters: str) -> int:
        """Number of elements of a tensor (or iteration space) over ``letters``."""
        total = 1
        for letter in letters:
            total *= self.dim_values[self.letter_dims[letter]]
        return total

    def scalars(self) -> dict[str, float]:
        """Every name a map expression may use besides its operands and functions: each dim name's
        value, and ``scale_<mask>`` for each dropout tensor (1 when its ``p`` is 0, so a graph whose
        probabilities are set to 0, as evaluation mode does, scales by 1)."""
        values = {name: float(value) for name, value in self.dim_values.items()}
        values.update({SCALE_PREFIX + name: dropout_scale(info.p) for name, info in self.tensors.items()
                       if info.role == "dropout"})
        return values

    def producer(self) -> dict[str, Primitive]:
        return {prim.output.tensor: prim for prim in self.primitives}

    def consumers(self) -> dict[str, list[Primitive]]:
        result: dict[str, list[Primitive]] = {name: [] for name in self.tensors}
        for prim in self.primitives:
            for operand in prim.inputs:
                if prim not in result[operand.tensor]:
                    result[operand.tensor].append(prim)
        return result

    def with_dims(self, dim_values: dict[str, int]) -> "PrimitiveGraph":
        """The same graph evaluated at other dim values (sizes are symbolic until counted)."""
        return replace(self, dim_values=dict(dim_values))
