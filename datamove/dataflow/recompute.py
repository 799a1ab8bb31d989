"""Rematerialization: cheap element-wise forward intermediates recomputed in the backward instead of
stored for it.

A forward tensor X that some backward primitive reads is recomputed in the backward when:

- X is produced by a chain of forward ``map`` primitives (no reduction, no einsum) whose leaf
  inputs are tensors some backward primitive reads anyway, each tensor between X and the leaves
  read by nothing in the backward (SwiGLU's ``silu(gate) = gate * sigmoid(gate)``: the chain
  ``-gate``, ``exp``, ``1 + .``, ``1 / .``, ``gate * .`` from ``gate``, which the backward's
  ``d_gate`` map reads; RMSNorm's ``x / rms`` from x and rms, which its backward reads);
- every tensor of the chain has X's dims (a normalization's statistics, over fewer, stay stored:
  their copies would be an operator of their own), no map of the chain writes over letters that
  none of its inputs covers (no broadcast making X larger than its sources), and none reads a
  dropout mask or its keep factor (``scale_<mask>``): a mask is random, read where it is drawn;
- every reader of X is a map over the letters it reads X with (no einsum, reduction or
  broadcast), and each backward one lies in an operator (``TrainingGraph.operators``) over X's
  dims: fusion then puts the copies in with the backward readers, and the forward operator
  computing X holds it for its forward readers; X is no output of the layer.

Then the chain is copied into the backward (fresh tensors ``<name>_recomputed`` over X's letters,
primitives ``map:<tensor>`` with the originals' expressions, phase "backward"), placed before the
first backward reader of X, and every backward reader of X reads the copy of X instead.  X stays
in the forward, computed for its forward readers as before; as nothing outside its forward
operator reads it any more, fusion no longer makes it an output of that operator
(``operators.make_operator``'s outputs are the tensors read outside).  ``derived``, ``grads`` and
``seeds`` are unchanged (a copy derives from no forward primitive).  Forward tensors are taken
last first: a later X's chain stops at an earlier X the backward reads, whose copy then replaces it
there too, so no chain is copied twice.

What it pays: the forward's write of X, and the backward's read of X against a read of its leaves
and arithmetic on them.  SwiGLU: silu(gate), as large as the MLP's hidden activation, is written
and read no more; the backward operator reading it reads gate anyway.  RMSNorm: x / rms is written
no more; the weight gradient's operator reads x and the rms of each row in its place (as much).
The copies are the same expressions on the same inputs, so the float64 executor and
every backend evaluate them as any other map.
"""
from __future__ import annotations

from datamove.dataflow.autodiff import TrainingGraph
from datamove.dataflow.graph import SCALE_PREFIX, Operand, Primitive, PrimitiveGraph, TensorInfo
from datamove.dataflow.operators import BACKWARD, FORWARD

SUFFIX = "_recomputed"


def recompute_elementwise(training: TrainingGraph) -> TrainingGraph:
    """``training`` with every qualifying forward tensor recomputed in the backward (see the module
    docstring); the same object when none qualifies."""
    for x in reversed([p.output.tensor for p in training.primitives(FORWARD)]):
        chain = _qualifies(training, x)
        if chain is not None:
            training = _rewrite(training, x, chain)
    return training


def _qualifies(training: TrainingGraph, x: str) -> list[Primitive] | None:
    """The chain recomputing forward tensor ``x`` in program order, when ``x`` qualifies."""
    graph = training.graph
    read_back = {op.tensor for p in training.primitives(BACKWARD) for op in p.inputs}
    readers = graph.consumers()[x]
    if x not in read_back or x in graph.outputs or not all(_elementwise_on(r, x) for r in readers):
        return None
    operator = {p.name: op for op in training.operators() if op.phase == BACKWARD for p in op.primitives}
    if any(_dims(graph, operator[r.name].letters) != _dims(graph, graph.tensors[x].letters)
           for r in readers if training.phases[r.name] == BACKWARD):
        return None
    return _chain(training, x, read_back, graph.producer())


def _dims(graph: PrimitiveGraph, letters: str) -> list[str]:
    """The dim names of ``letters``, sorted (a space up to the naming and order of its letters)."""
    return sorted(graph.letter_dims[letter] for letter in letters)


def _elementwise_on(reader: Primitive, tensor: str) -> bool:
    """``reader`` is a map over the letters under which it reads ``tensor`` (each time it does)."""
    return reader.kind == "map" and all(set(op.letters) == set(reader.output.letters)
                                        for op in reader.inputs if op.tensor == tensor)


def _chain(training: TrainingGraph, x: str, read_back: set[str], producer: dict[str, Primitive]
           ) -> list[Primitive] | None:
    """The forward maps leading to ``x`` from tensors the backward reads (``read_back``), in
    program order; None when a path leaves the rule (see the module docstring)."""
    graph = training.graph
    space = _dims(graph, graph.tensors[x].letters)
    chain, pending = {x}, [x]
    while pending:
        tensor = pending.pop()
        prim = producer.get(tensor)
        if prim is None or training.phases[prim.name] != FORWARD or prim.kind != "map" \
                or _dims(graph, graph.tensors[tensor].letters) != space \
                or any(name.startswith(SCALE_PREFIX) for name in prim.expression.names) \
                or not any(set(prim.output.letters) <= set(op.letters) for op in prim.inputs):
            return None
        for op in prim.inputs:
            if graph.tensors[op.tensor].role == "dropout":
                return None
            if op.tensor not in read_back and op.tensor not in chain:
                chain.add(op.tensor)
                pending.append(op.tensor)
    return [p for p in graph.primitives if p.output.tensor in chain]


def _rewrite(training: TrainingGraph, x: str, chain: list[Primitive]) -> TrainingGraph:
    """Copy ``chain`` into the backward before X's first backward reader; X's backward readers read
    the copy."""
    graph = training.graph
    tensors = dict(graph.tensors)
    copy: dict[str, str] = {}
    for prim in chain:
        name, base, n = prim.output.tensor + SUFFIX, prim.output.tensor + SUFFIX, 1
        while name in tensors:
            name, n = f"{base}_{n}", n + 1
        tensors[name] = TensorInfo(name, graph.tensors[prim.output.tensor].letters, "intermediate")
        copy[prim.output.tensor] = name

    def renamed(op: Operand) -> Operand:
        return Operand(copy.get(op.tensor, op.tensor), op.letters)

    copies = [Primitive(f"map:{copy[p.output.tensor]}", "map", tuple(map(renamed, p.inputs)), renamed(p.output), p.expr)
              for p in chain]
    primitives, phases, placed = [], dict(training.phases), False
    for prim in graph.primitives:
        if training.phases[prim.name] == BACKWARD and any(op.tensor == x for op in prim.inputs):
            if not placed:
                primitives += copies
                phases.update({p.name: BACKWARD for p in copies})
                placed = True
            prim = Primitive(prim.name, prim.kind, tuple(Operand(copy[x], op.letters) if op.tensor == x else op
                                                         for op in prim.inputs), prim.output, prim.expr)
        primitives.append(prim)
    return TrainingGraph(PrimitiveGraph(tensors, primitives, graph.letter_dims, graph.dim_values, list(graph.outputs)),
                         phases, dict(training.grads), dict(training.seeds), dict(training.derived),
                         list(training.closed_forms))
