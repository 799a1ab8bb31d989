"""Shuffles: einsums of a tensor with a constant signed permutation along one axis, run as element-wise
operations.

The front end lowers ``np.concatenate`` of slices of one axis (rotate_half's ``(-x2, x1)``) to an
einsum ``"...a,ae->...e"`` with a constant matrix whose value (``TensorInfo.value``,
``dataflow.lowering.slices.place``) is a sum of pieces ``where((start <= i1) & (i1 < end) &
(i0 == i1 + shift), factor, 0.0)``: element e of the result, for start <= e < end, is ``factor``
times element ``e + shift`` of the array.  The executor, the autodiff and the torch backend keep
that einsum; the operator classification (``dataflow.operators``), fusion (``dataflow.fusion``), the
layout space (``layouts.space``) and the code generator (``kernels.codegen``) read it through
``shuffle_of`` as an element-wise operation reading the array at a moved index (the constant is
never read); so do the sweep's references (``harness.torch_eval``: the constant at its value, the
shuffle unscaled) and its eager baseline (``harness.eager``: ``index_select``).  The autodiff's einsum with the same constant transposed (``"...e,ae->...a"``, the
gradient) is a shuffle too, with the pieces moved back.

Plain Python: the pieces' bounds are the value's own text over the dim names (``E // 2``), so the
generated kernel computes them from its runtime sizes.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from datamove.dataflow.graph import Operand


@dataclass(frozen=True)
class Piece:
    """Result elements ``start <= e < end`` are ``factor`` times source element ``e + shift``;
    bounds and shift are Python text over dim names."""

    start: str
    end: str
    shift: str
    factor: float

    def values(self, dims: Mapping[str, int]) -> tuple[int, int, int]:
        """(start, end, shift) at the dim values ``dims``."""
        return tuple(int(eval(compile(text, "<piece>", "eval"), {"__builtins__": {}}, dict(dims)))  # noqa: S307
                     for text in (self.start, self.end, self.shift))

    def transposed(self) -> "Piece":
        """The piece of the transposed matrix: result elements ``start + shift <= a < end + shift``
        are ``factor`` times source element ``a - shift``."""
        return Piece(_text(f"({self.start}) + ({self.shift})"), _text(f"({self.end}) + ({self.shift})"),
                     _text(f"-({self.shift})"), self.factor)


def _text(source: str) -> str:
    return ast.unparse(ast.parse(source, mode="eval"))


def source(text: str, names: Mapping[str, str]) -> str:
    """``text`` (a piece's bound or shift) with each dim name replaced by ``names[name]``."""
    tree = ast.parse(text, mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            node.id = names[node.id]
    return ast.unparse(tree)


@dataclass(frozen=True)
class Shuffle:
    """An einsum primitive read as ``out[..., e] = factor(e) * x[..., e + shift(e)]``.

    ``source``: the index of the input operand ``x``; ``constant``: the matrix tensor (not read);
    ``letter``: the primitive's letter of the output axis the elements move along; ``read``: ``x``'s
    letter for that axis (the einsum's contraction letter); ``pieces``: in ``letter``'s terms."""

    source: int
    constant: str
    letter: str
    read: str
    pieces: tuple[Piece, ...]

    def view(self, prim) -> Operand:
        """``x`` read under the output's letters (its moved axis named as the output's): the
        element-wise view of what ``prim`` reads."""
        x = prim.inputs[self.source]
        return Operand(x.tensor, x.letters.replace(self.read, self.letter))

    def gather(self, dims: Mapping[str, int]) -> tuple[list[int], list[float]]:
        """(the source element of each result element, its factor) along the moved axis at ``dims``."""
        extent = sum(end - start for start, end, _ in (p.values(dims) for p in self.pieces))
        index, factor = [0] * extent, [0.0] * extent
        for piece in self.pieces:
            start, end, shift = piece.values(dims)
            for e in range(start, end):
                index[e], factor[e] = e + shift, piece.factor
        return index, factor


@lru_cache(maxsize=None)
def permutation_pieces(value: str) -> tuple[Piece, ...] | None:
    """The pieces of a constant's value over (i0 read, i1 written) when it is a sum of
    ``where((start <= i1) & (i1 < end) & (i0 == i1 + shift), factor, 0.0)``; else None."""
    try:
        tree = ast.parse(value, mode="eval").body
    except SyntaxError:
        return None
    pieces = []
    for term in _operands(tree, ast.Add):
        piece = _piece(term)
        if piece is None:
            return None
        pieces.append(piece)
    return tuple(pieces)


def _operands(tree, kind) -> list:
    """The operands of a left-nested chain of binary operators ``kind`` (``a + b + c``), in order."""
    terms = []
    while isinstance(tree, ast.BinOp) and isinstance(tree.op, kind):
        terms.append(tree.right)
        tree = tree.left
    terms.append(tree)
    return terms[::-1]


def _name(node, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _piece(node) -> Piece | None:
    if not (isinstance(node, ast.Call) and _name(node.func, "where") and len(node.args) == 3 and not node.keywords):
        return None
    cond, factor, zero = node.args
    try:
        factor, zero = ast.literal_eval(factor), ast.literal_eval(zero)
    except ValueError:
        return None
    if not isinstance(factor, (int, float)) or zero != 0:
        return None
    parts = _operands(cond, ast.BitAnd)[::-1]
    if len(parts) != 3 or not all(isinstance(p, ast.Compare) and len(p.ops) == 1 for p in parts):
        return None
    moved, upper, lower = parts  # (start <= i1) & (i1 < end) & (i0 == i1 + shift), reversed
    if not (isinstance(lower.ops[0], ast.LtE) and _name(lower.comparators[0], "i1")
            and isinstance(upper.ops[0], ast.Lt) and _name(upper.left, "i1")
            and isinstance(moved.ops[0], ast.Eq) and _name(moved.left, "i0")):
        return None
    index = moved.comparators[0]
    if not (isinstance(index, ast.BinOp) and isinstance(index.op, ast.Add) and _name(index.left, "i1")):
        return None
    texts = [lower.left, upper.comparators[0], index.right]
    if any(_name(n, "i0") or _name(n, "i1") for text in texts for n in ast.walk(text)):
        return None
    return Piece(*(ast.unparse(t) for t in texts), float(factor))


def is_permutation(pieces: tuple[Piece, ...], dims: Mapping[str, int], extent: int) -> bool:
    """Whether ``pieces`` at ``dims`` write each of ``extent`` elements once from a distinct one."""
    return _permutes(pieces, tuple(sorted(dims.items())), extent)


@lru_cache(maxsize=None)
def _permutes(pieces: tuple[Piece, ...], dims: tuple, extent: int) -> bool:
    written, read = set(), set()
    try:
        values = [piece.values(dict(dims)) for piece in pieces]
    except (NameError, ArithmeticError, TypeError, ValueError):
        return False
    for start, end, shift in values:
        for e in range(start, end):
            if e in written or e + shift in read or not (0 <= e < extent and 0 <= e + shift < extent):
                return False
            written.add(e)
            read.add(e + shift)
    return len(written) == extent


def element_inputs(graph, prim) -> tuple[Operand, ...]:
    """What ``prim`` reads as values, element-wise: a shuffle its array under its output's letters
    (``Shuffle.view``; never its constant), any other primitive its inputs."""
    shuffle = shuffle_of(graph, prim)
    return prim.inputs if shuffle is None else (shuffle.view(prim),)


def shuffle_of(graph, prim) -> Shuffle | None:
    """``prim`` as a shuffle (module doc), or None: an einsum of one array and a constant over
    (read letter, written letter) whose value is a signed permutation at the graph's dims, the
    output the array's letters with the read letter replaced by the written one."""
    if prim.kind != "einsum" or len(prim.inputs) != 2:
        return None
    for k, matrix in enumerate(prim.inputs):
        info = graph.tensors[matrix.tensor]
        if info.role != "constant" or not info.value or len(matrix.letters) != 2 or len(set(matrix.letters)) != 2:
            continue
        pieces = permutation_pieces(info.value)
        if pieces is None:
            continue
        x = prim.inputs[1 - k]
        out = prim.output.letters
        for read, letter, moved in ((matrix.letters[0], matrix.letters[1], pieces),
                                    (matrix.letters[1], matrix.letters[0], tuple(p.transposed() for p in pieces))):
            if x.letters.count(read) != 1 or letter in x.letters or out != x.letters.replace(read, letter):
                continue
            dim = graph.letter_dims.get(letter)
            if dim is None or graph.letter_dims.get(read) != dim \
                    or not is_permutation(moved, graph.dim_values, graph.dim_values[dim]):
                continue
            return Shuffle(1 - k, matrix.tensor, letter, read, moved)
    return None
