"""What a layer's parameters and constants start as, read from the graph's structure (never from names).

- a parameter an einsum of the forward reads (a weight): ``WEIGHT``, drawn N(0, 0.02^2);
- any other parameter: ``ONE`` where it scales what its map computes (a norm's gain: set to 0,
  the map's result no longer depends on its other operands), else ``ZERO`` (a bias, a norm's shift);
- a constant added to attention scores over (query, key) positions of one length, whose sum a
  max over the keys reads (a softmax's first step, directly or through maps of that sum alone):
  a ``CausalMask`` (0 where the key is at or before the query, ``MASKED_SCORE`` after);
- a constant the front end made with a value it knows (``TensorInfo.value``: the matrix of an
  ``np.concatenate`` or ``np.repeat``, a mask from ``np.tril`` / ``np.arange``): a ``KnownValue``
  (``.array(graph, name)``: its values at the graph's dims), or the ``CausalMask`` above where it is
  one by structure and its value is a causal mask (0 at or before the query, ``MASKED_SCORE`` or less
  after);
- any other constant: unknown (absent from the result); the layer refuses to run until it is set.

Graphs are duck-typed ``dataflow.graph.PrimitiveGraph``s (live or from ``dataflow.snapshot``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from datamove.dataflow.executor import known_value

WEIGHT, ONE, ZERO = "weight", "one", "zero"
MASKED_SCORE = -1e4  # a causal mask's value where the key comes after the query: exp underflows to 0 as for -inf
PROBES = 3  # random points at which a map is evaluated to tell a scale from a shift


@dataclass(frozen=True)
class CausalMask:
    """An additive causal mask over the constant's letters: ``rows`` (queries) and ``keys``."""

    rows: str
    keys: str

    def array(self, graph, name: str) -> np.ndarray:
        """Its float64 values over the letters of ``name``: 0 where the key is at or before the query,
        ``MASKED_SCORE`` after."""
        letters = graph.tensors[name].letters
        rows, keys = np.indices([graph.size(x) for x in letters])[[letters.index(self.rows), letters.index(self.keys)]]
        return np.where(keys > rows, MASKED_SCORE, 0.0)


@dataclass(frozen=True)
class KnownValue:
    """A constant the front end made, of known value: ``expr`` over the index variables ``i0, i1, ...``
    of its axes (its letter order), the dims, ``inf`` and the map functions (``TensorInfo.value``)."""

    expr: str

    def array(self, graph, name: str) -> np.ndarray:
        """Its float64 values over its letters at ``graph``'s dims."""
        return known_value(graph, name)


def initial_values(graph, parameters, constants) -> dict:
    """{tensor -> ``WEIGHT`` | ``ONE`` | ``ZERO`` | ``CausalMask`` | ``KnownValue``} for ``parameters``
    and the ``constants`` whose value is known (see the module doc)."""
    forward = forward_primitives(graph)
    result = {}
    for name in parameters:
        readers = [p for p in forward if any(o.tensor == name for o in p.inputs)]
        if any(p.kind == "einsum" for p in readers):
            result[name] = WEIGHT
        else:
            result[name] = ONE if any(p.kind == "map" and _scales(graph, p, name) for p in readers) else ZERO
    for name in constants:
        mask = _causal_mask(graph, forward, name)
        known = getattr(graph.tensors[name], "value", "")
        if mask is not None and (not known or holds_causal_mask(graph, name, mask)):
            result[name] = mask
        elif known:
            result[name] = KnownValue(known)
    return result


def holds_causal_mask(graph, name: str, mask: CausalMask) -> bool:
    """Whether the known value of ``name`` is the causal mask ``mask``: 0 where the key is at or before the
    query, ``MASKED_SCORE`` or less after."""
    after = mask.array(graph, name) < 0
    value = known_value(graph, name)
    return bool(np.where(after, value <= MASKED_SCORE, value == 0).all())


def forward_primitives(graph) -> list:
    """The primitives before the first one that reads an output's gradient (autodiff appends the backward)."""
    grads = {f"d_{t}" for t in graph.outputs}
    primitives = []
    for prim in graph.primitives:
        if any(o.tensor in grads for o in prim.inputs):
            break
        primitives.append(prim)
    return primitives


def _scales(graph, prim, name: str) -> bool:
    """Whether map ``prim`` with ``name``'s operand at 0 gives one value whatever its other operands hold."""
    if len(prim.inputs) < 2:
        return False
    scalars = graph.scalars()
    rng = random.Random(0)
    values = set()
    for _ in range(PROBES):
        point = [0.0 if operand.tensor == name else rng.uniform(0.5, 2.0) for operand in prim.inputs]
        try:
            values.add(round(float(prim.expression.evaluate(point, scalars)), 12))
        except (ArithmeticError, ValueError):
            return False
    return len(values) == 1


def _causal_mask(graph, forward, name: str) -> CausalMask | None:
    """The mask ``name`` is (see the module doc), or None."""
    letters = graph.tensors[name].letters
    if len(letters) != 2 or graph.letter_dims[letters[0]] != graph.letter_dims[letters[1]]:
        return None
    consumers: dict[str, list] = {}
    for prim in forward:
        for operand in prim.inputs:
            consumers.setdefault(operand.tensor, []).append(prim)
    for add in consumers.get(name, []):
        if add.kind != "map" or len(add.inputs) != 2 or not add.expression.matches("in0 + in1", "in1 + in0"):
            continue
        const = next(o for o in add.inputs if o.tensor == name)
        if len(set(const.letters)) != 2 or not set(const.letters) <= set(add.output.letters):
            continue
        axes = [add.output.letters.index(x) for x in const.letters]  # the sum's axes that are the constant's
        tensor = add.output.tensor
        while True:
            readers = consumers.get(tensor, [])
            for reader in readers:
                if reader.kind == "reduce" and reader.expr == "max":
                    operand = reader.inputs[0]
                    reduced = [a for a in axes if operand.letters[a] not in reader.output.letters]
                    if len(reduced) == 1:
                        keys = letters[axes.index(reduced[0])]
                        return CausalMask(rows=next(x for x in letters if x != keys), keys=keys)
            if len(readers) != 1 or readers[0].kind != "map" or len(readers[0].inputs) != 1 \
                    or readers[0].output.letters != readers[0].inputs[0].letters:
                break
            tensor = readers[0].output.tensor
    return None
