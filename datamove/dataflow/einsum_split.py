"""Every einsum of a forward graph made a GEMM: two operands, each letter in two of (A, B, output).

``np.einsum`` takes forms that are no GEMM; the later stages (autodiff's derivative of an einsum,
``kernels.contraction``'s mapping onto a GEMM, the candidates) take an einsum ``"a,b->c"`` whose
letters each lie in two of its three terms, and some of M (A and C), N (B and C) and K (A and B).
``split_einsums`` rewrites the others, each into primitives computing the same values in float64:

- a letter only one operand has and the output lacks (``"btd,de->bt"``: e) is summed out of that
  operand first, a reduce ``"de" -> "d"``, then ``"btd,d->bt"``;
- three operands or more (``"bd,de,ef->bf"``) are contracted left to right, each partial result
  over the letters a later operand or the output still has (``"bd,de->be"``, ``"be,ef->bf"``);
- a two-operand einsum with fewer than two of M, N, K (no GEMM: an operand or the output holding
  batch letters only) is a product, a map ``in0 * in1``: over the output's letters where nothing is
  summed (``"bd,d->bd"``), else over the output's and then the summed letters, and a reduce (sum)
  to the output's (``"bhse,bhse->bsh"``, a batched dot product);
- one operand whose letters, once summed, are the output's in another order: a map ``in0`` writing
  them in the output's order.

New tensors are intermediates named after what they hold (``w_sum_e``, ``x_w1``,
``x_times_g``); the einsum's own output keeps its name and is written by the last primitive.
"""
from __future__ import annotations

from dataclasses import replace

from datamove.dataflow.graph import Operand, Primitive, PrimitiveGraph, TensorInfo


def is_gemm(terms: list[str], out: str) -> bool:
    """Whether einsum ``terms`` (letters per operand) ``-> out`` is a GEMM: two operands, every
    letter in exactly two of the three terms or in all three (batch), and two of M, N, K or more."""
    if len(terms) != 2:
        return False
    a, b = terms
    if any((x in a) + (x in b) + (x in out) < 2 for x in set(a + b + out)):
        return False
    groups = (set(a) - set(b), set(b) - set(a), (set(a) & set(b)) - set(out))  # M, N, K
    return sum(bool(group) for group in groups) >= 2


def split_einsums(graph: PrimitiveGraph) -> PrimitiveGraph:
    """``graph`` with every einsum that is no GEMM (``is_gemm``) rewritten as the module docstring
    says; the same object when every einsum is one."""
    if all(p.kind != "einsum" or is_gemm([op.letters for op in p.inputs], p.output.letters) for p in graph.primitives):
        return graph
    tensors = dict(graph.tensors)
    primitives: list[Primitive] = []

    def emit(kind: str, inputs: list[Operand], letters: str, expr: str, name: str | None = None,
             base: str = "") -> Operand:
        """A primitive writing ``name`` (an intermediate named from ``base`` where None) over ``letters``."""
        if name is None:
            name, n = base, 1
            while name in tensors:
                name, n = f"{base}_{n}", n + 1
            tensors[name] = TensorInfo(name, letters, "intermediate")
        output = Operand(name, letters)
        primitives.append(Primitive(f"{kind}:{name}", kind, tuple(inputs), output, expr))
        return output

    for prim in graph.primitives:
        if prim.kind != "einsum" or is_gemm([op.letters for op in prim.inputs], prim.output.letters):
            primitives.append(prim)
            continue
        target = prim.output
        operands = list(prim.inputs)
        for k, operand in enumerate(operands):  # letters no other term has: summed out of their operand
            others = "".join(op.letters for j, op in enumerate(operands) if j != k) + target.letters
            kept = "".join(x for x in operand.letters if x in others)
            if kept != operand.letters:
                summed = "".join(x for x in operand.letters if x not in others)
                name = target.tensor if len(operands) == 1 and kept == target.letters else None
                operands[k] = emit("reduce", [operand], kept, "sum", name, f"{operand.tensor}_sum_{summed}")
        while len(operands) > 2:  # left to right: the first two contracted over the letters still needed
            a, b, rest = operands[0], operands[1], operands[2:]
            later = "".join(op.letters for op in rest) + target.letters
            letters = "".join(dict.fromkeys(x for x in a.letters + b.letters if x in later))
            operands = [_two(emit, a, b, letters, f"{a.tensor}_{b.tensor}"), *rest]
        if len(operands) == 2:
            _two(emit, *operands, target.letters, target.tensor, name=target.tensor)
        elif operands[0].tensor != target.tensor:  # one operand, its letters the output's in another order
            emit("map", operands, target.letters, "in0", target.tensor)
    return replace(graph, tensors=tensors, primitives=primitives)


def _two(emit, a: Operand, b: Operand, out: str, base: str, name: str | None = None) -> Operand:
    """``a`` and ``b`` contracted onto letters ``out`` (each of their letters in ``out`` or in both):
    one einsum where it is a GEMM, else their product (a map) and, where letters are summed, a reduce."""
    if is_gemm([a.letters, b.letters], out):
        return emit("einsum", [a, b], out, f"{a.letters},{b.letters}->{out}", name, base)
    summed = "".join(x for x in a.letters if x in b.letters and x not in out)
    if not summed:
        return emit("map", [a, b], out, "in0 * in1", name, base)
    product = emit("map", [a, b], out + summed, "in0 * in1", None, f"{a.tensor}_times_{b.tensor}")
    return emit("reduce", [product], out, "sum", name, base)
