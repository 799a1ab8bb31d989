"""Which layer arguments are data (the inputs the layer is called with) and which are its weights.

A spec may say so itself (``INPUTS = ("x", "memory")``, checked by ``dataflow.spec``).  Without
it, ``data_inputs`` reads the forward graph:

- the anchor is the layer function's first argument with a gradient (as PyTorch's
  ``forward(x, ...)``);
- the batch letters are the anchor's letters that an output has and that no forward primitive
  sums, maxes or contracts over: batch and sequence positions, along which every output element
  depends on the data at its own position only (an LN + Linear block, x "btd" -> y "btf": b and t;
  d is normalised and contracted; an MLP ending in a softmax, "na" -> "nd": n);
- data are the arguments with a gradient that hold a batch letter (the anchor always: a
  cross-attention's memory "bsd" holds the queries' b); weights are the others, which hold feature
  letters only (one value shared by every batch and sequence position).

Arguments without a gradient (``Tensor(..., requires_grad=False)``, e.g. a causal mask) are
constants either way.  The rule cannot tell a feature letter from a batch letter in a layer that
reduces over no feature letter (``x * g + b`` alone) or over its batch letters (batch
statistics); such a spec declares ``INPUTS``.
"""
from __future__ import annotations

from datamove.dataflow.graph import Primitive, PrimitiveGraph

INPUT = "input"  # TensorInfo.role of an argument with a gradient


def forward_primitives(graph: PrimitiveGraph) -> list[Primitive]:
    """The primitives the layer outputs (role "output") depend on: the forward part of a training graph."""
    producer = graph.producer()
    pending = [t for t in graph.outputs if graph.tensors[t].role == "output"]
    needed: set[str] = set()
    while pending:
        prim = producer.get(pending.pop())
        if prim is not None and prim.name not in needed:
            needed.add(prim.name)
            pending.extend(operand.tensor for operand in prim.inputs)
    return [prim for prim in graph.primitives if prim.name in needed]


def batch_letters(graph: PrimitiveGraph) -> str:
    """The anchor's letters that an output has and no forward primitive reduces (see the module doc)."""
    arguments = [t for t, info in graph.tensors.items() if info.role == INPUT]
    if not arguments:
        return ""
    outputs = {letter for t, info in graph.tensors.items() if info.role == "output" for letter in info.letters}
    reduced = {letter for prim in forward_primitives(graph) for letter in prim.reduced}
    return "".join(x for x in graph.tensors[arguments[0]].letters if x in outputs and x not in reduced)


def data_inputs(graph: PrimitiveGraph) -> tuple[str, ...]:
    """The arguments with a gradient that are data by the default rule, in argument order."""
    arguments = [t for t, info in graph.tensors.items() if info.role == INPUT]
    batch = set(batch_letters(graph))
    return tuple(t for n, t in enumerate(arguments) if n == 0 or batch & set(graph.tensors[t].letters))
