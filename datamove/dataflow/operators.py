"""Operators: the paper's unit of analysis, grouped from primitives by their iteration spaces.

Classes (Ivanov et al., Sec. III-B), decided from iteration spaces, not from names:
- contraction: an einsum (it has contraction letters read by two operands), except a shuffle
  (``dataflow.shuffle``: an einsum with a constant signed permutation, rotate_half's), which is
  element-wise: it reads its array at a moved index and never reads the constant;
- normalization: a reduction over letters R of a tensor over letters D, together with the maps
  that compute its statistics (over D minus R), the maps that apply them back over D, the maps
  that lead from one such reduction to the next over the same D (softmax's exp, layernorm's
  square), and a trailing per-feature affine transform (maps whose other operand is a layer
  input over letters inside R: layernorm's gamma and beta); a map that applies two reductions
  over other letter sets (np.max over axis 1 and np.min over axis 0 of one x, added) joins the
  first of them only, one (D, R) per operator;
- element-wise: everything else, one operator per map, except that a chain of maps reading one
  tensor only (plus constants), such as GELU written out, is one operator.
"""
from __future__ import annotations

from dataclasses import dataclass

from datamove.dataflow.graph import Primitive, PrimitiveGraph
from datamove.dataflow.shuffle import element_inputs, shuffle_of

CONTRACTION, NORMALIZATION, ELEMENTWISE = "contraction", "normalization", "elementwise"
FORWARD, BACKWARD = "forward", "backward"  # the phases of a training graph (``dataflow.autodiff``)


@dataclass(frozen=True)
class Operator:
    """A group of primitives analysed (and later fused) as one unit.

    ``inputs``: tensors it reads that something else produced (or layer inputs); ``outputs``:
    tensors it produces that are read outside it or are layer outputs.
    """

    name: str
    cls: str
    phase: str
    primitives: tuple[Primitive, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def letters(self) -> str:
        seen: dict[str, None] = {}
        for prim in self.primitives:
            seen.update(dict.fromkeys(prim.letters))
        return "".join(seen)

    @property
    def reduced(self) -> str:
        """The reduce primitives' reduced letters (and a contraction's einsums': a shuffle reduces none)."""
        seen: dict[str, None] = {}
        kinds = ("reduce", "einsum") if self.cls == CONTRACTION else ("reduce",)
        for prim in self.primitives:
            if prim.kind in kinds:
                seen.update(dict.fromkeys(prim.reduced))
        return "".join(seen)


class _Groups:
    """Union-find over primitive names."""

    def __init__(self, names):
        self.parent = {name: name for name in names}

    def find(self, name: str) -> str:
        while self.parent[name] != name:
            self.parent[name] = self.parent[self.parent[name]]
            name = self.parent[name]
        return self.parent[name]

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra

    def members(self, name: str, order: list[str]) -> list[str]:
        root = self.find(name)
        return [n for n in order if self.find(n) == root]


def _group_normalizations(graph: PrimitiveGraph, groups: _Groups) -> set[str]:
    """Union each reduction with its statistics, apply, bridge and affine maps; returns their names."""
    producer, consumers = graph.producer(), graph.consumers()
    outer = _outer_maps(graph)
    member: set[str] = set()
    spaces: dict[str, tuple[frozenset, frozenset]] = {}  # group root -> (D, R)
    for prim in graph.primitives:
        if prim.kind != "reduce":
            continue
        space = frozenset(prim.inputs[0].letters)
        reduced = frozenset(prim.reduced)
        stats = space - reduced
        group = [prim.name]
        frontier = [prim.output.tensor]
        while frontier:  # statistics chain and apply maps
            tensor = frontier.pop()
            for user in consumers[tensor]:
                if user.kind != "map" or user.name in group:
                    continue
                if user.name in member and spaces[groups.find(user.name)] != (space, reduced):
                    continue  # it applies another reduction, over other letters: one (D, R) per group
                out = frozenset(user.output.letters)
                if out <= stats:
                    group.append(user.name)
                    frontier.append(user.output.tensor)
                elif out == space:
                    group.append(user.name)
        chain, tensor = [], prim.inputs[0].tensor  # bridge back to an earlier reduction over the same space
        while tensor in producer:
            source = producer[tensor]
            if source.name in member and spaces.get(groups.find(source.name)) == (space, reduced):
                for name in chain + group:
                    groups.union(source.name, name)
                break
            if source.kind != "map" or frozenset(source.output.letters) != space:
                break
            chain.append(source.name)
            nonconstant = list(dict.fromkeys(op.tensor for op in source.inputs
                                             if op.tensor in producer and op.tensor not in outer))
            if len(nonconstant) != 1:
                break
            tensor = nonconstant[0]
        for name in group:
            groups.union(prim.name, name)
        member.update(groups.members(prim.name, [p.name for p in graph.primitives]))
        spaces[groups.find(prim.name)] = (space, reduced)
    # trailing per-feature affine maps (gamma, beta), each the only reader of the group's result
    changed = True
    while changed:
        changed = False
        for prim in graph.primitives:
            if prim.kind != "map" or prim.name in member:
                continue
            for operand in prim.inputs:
                source = producer.get(operand.tensor)
                if source is None or source.name not in member:
                    continue
                space, reduced = spaces[groups.find(source.name)]
                others = [op for op in prim.inputs if op is not operand]
                if (frozenset(prim.output.letters) == space and others
                        and all(op.tensor not in producer and graph.tensors[op.tensor].role in ("input", "constant")
                                and set(op.letters) <= reduced for op in others)
                        and len(consumers[source.output.tensor]) == 1):
                    groups.union(source.name, prim.name)
                    member.add(prim.name)
                    changed = True
                    break
    return member


def _outer_maps(graph: PrimitiveGraph) -> set[str]:
    """Tensors that maps compute from the graph's inputs alone: in a backward subgraph, forward
    values recomputed there (``dataflow.recompute``), which a bridge between two reductions reads
    as it reads the forward tensors themselves, as constants of its chain."""
    producer, outer = graph.producer(), set()
    for prim in graph.primitives:
        if prim.kind == "map" and all(op.tensor not in producer or op.tensor in outer for op in prim.inputs):
            outer.add(prim.output.tensor)
    return outer


def _group_elementwise_chains(graph: PrimitiveGraph, groups: _Groups, taken: set[str]) -> None:
    """Merge chains of maps that together read a single tensor (plus constants), e.g. GELU."""
    producer, consumers = graph.producer(), graph.consumers()
    order = [p.name for p in graph.primitives]
    by_name = {p.name: p for p in graph.primitives}

    def external_inputs(names: list[str]) -> set[str]:
        produced = {by_name[n].output.tensor for n in names}
        return {op.tensor for n in names for op in by_name[n].inputs if op.tensor not in produced}

    for prim in graph.primitives:
        if prim.kind != "map" or prim.name in taken:
            continue
        merged = [prim.name]
        for operand in prim.inputs:
            source = producer.get(operand.tensor)
            if (source is not None and source.kind == "map" and source.name not in taken
                    and set(source.output.letters) == set(prim.output.letters)
                    and consumers[operand.tensor] == [prim]):
                merged += groups.members(source.name, order)
        if len(merged) > 1 and len(external_inputs(merged)) == 1:
            for name in merged[1:]:
                groups.union(prim.name, name)


def group_operators(graph: PrimitiveGraph, phase: str = FORWARD) -> list[Operator]:
    """Group the primitives of ``graph`` into classified operators, in topological order."""
    order = [p.name for p in graph.primitives]
    groups = _Groups(order)
    normalized = _group_normalizations(graph, groups)
    _group_elementwise_chains(graph, groups, normalized)
    seen, operators = set(), []
    for name in order:
        root = groups.find(name)
        if root in seen:
            continue
        seen.add(root)
        operators.append(make_operator(graph, [p for p in graph.primitives if groups.find(p.name) == root], phase))
    return operators


def make_operator(graph: PrimitiveGraph, prims: list[Primitive], phase: str, name: str | None = None,
                  cls: str | None = None) -> Operator:
    """An operator over ``prims`` with its external inputs and outputs worked out from ``graph`` (a
    shuffle's constant is no input: nothing reads it)."""
    consumers = graph.consumers()
    produced = [p.output.tensor for p in prims]
    inside = {p.name for p in prims}
    inputs = list(dict.fromkeys(op.tensor for p in prims for op in element_inputs(graph, p) if op.tensor not in produced))
    outputs = [t for t in produced
               if t in graph.outputs or any(c.name not in inside for c in consumers.get(t, []))]
    if cls is None:
        cls = classify(graph, prims)
    return Operator(name or (outputs[-1] if outputs else produced[-1]), cls, phase, tuple(prims),
                    tuple(inputs), tuple(outputs))


def classify(graph: PrimitiveGraph, prims) -> str:
    """The class of an operator of ``prims``: contraction with an einsum other than a shuffle, else
    normalization with a reduction, else element-wise."""
    kinds = {p.kind for p in prims}
    if any(p.kind == "einsum" and shuffle_of(graph, p) is None for p in prims):
        return CONTRACTION
    return NORMALIZATION if "reduce" in kinds else ELEMENTWISE


# --- counting ----------------------------------------------------------------------------------

def primitive_flop(graph: PrimitiveGraph, prim: Primitive) -> int:
    """flop of one primitive: 2 per multiply-add of an einsum (a shuffle: one per element, its
    factor), one per element reduced, the map's ops (``Expression.flop``: comparisons, selections and
    constant parts count zero)."""
    if prim.kind == "einsum" and shuffle_of(graph, prim) is not None:
        return graph.size(prim.output.letters)
    if prim.kind == "einsum":
        return 2 * graph.size(prim.letters)
    if prim.kind == "reduce":
        return graph.size(prim.inputs[0].letters) - graph.size(prim.output.letters)
    return prim.expression.flop() * graph.size(prim.output.letters)


def operator_counts(graph: PrimitiveGraph, op: Operator) -> dict[str, int]:
    """flop and distinct input/output elements of ``op`` (each element of each tensor once)."""
    return {
        "flop": sum(primitive_flop(graph, p) for p in op.primitives),
        "input_elements": sum(graph.size(graph.tensors[t].letters) for t in op.inputs),
        "output_elements": sum(graph.size(graph.tensors[t].letters) for t in op.outputs),
    }
