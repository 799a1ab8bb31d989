"""The fused attention's one recogniser: einsum -> (scale, added constant) -> softmax -> (dropout)
-> einsum of a fused training graph, with its backward, as one flash-attention-style operator.

``attention_roles(fused)`` serves both users: the analysis (``attention_candidates``, listed
beside the fused plan by ``dataflow.pipeline``: every softmax it takes) and the selection, the
tuning and the runtime (``datamove.families.attention``: the first softmax, with the kernels'
head dims as ``takes_head_dim``).  It lives in the dataflow layer because the analysis calls it;
the kernels' own limits are passed in.  ``fused``: a ``dataflow.fusion.FusedGraph`` or a
``dataflow.snapshot.FusedTraining`` (the same graph and operators; their softmaxes are read alike
by ``_softmaxes``).

Checks, in order; the first that fails is the reason given (``AttentionRoles`` or None and why):

1. a softmax recognised in closed form ("no softmax");
2. the operator writing it is no contraction and runs in the forward;
3. besides a dropout mask and a constant added to the scores (``in0 + in1``, e.g. GPT-2's additive
   causal mask), it reads one tensor, written by a contraction (the scores);
4. exactly one forward contraction reads what it writes, and it and the scores' contraction are
   one einsum each;
5. that contraction sums over the softmax's keys (what it writes is the attention's output);
6. the scores reach the softmax through constant factors only (the scale);
7. the score contraction, the softmax operator and the output contraction run consecutively;
8. the scores keep their letter order up to the softmax;
9. the scores carry one head letter (two: grouped-query attention written over a group letter,
   not fused);
10. a constant added to the scores is over (query, key) positions (it becomes the causal mask,
    which ``datamove.families.attention.check_causal_constant`` checks it holds at run time), and
    where the front end knows its value (``np.triu``, ``np.where`` of positions), that value is the
    causal mask (not a sliding window);
11. (with ``takes_head_dim``) the kernels take both head dims;
12. the gradients of q, k, v and o exist; the backward operators on paths from d_o to d_q, d_k,
    d_v run consecutively; nothing outside reads what the forward or backward keeps inside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from datamove.dataflow.initial_values import CausalMask, holds_causal_mask
from datamove.dataflow.layer_inputs import batch_letters
from datamove.dataflow.operators import CONTRACTION, FORWARD, make_operator


@dataclass(frozen=True)
class AttentionRoles:
    """The fused attention's place in the graph: forward ``members`` (score contraction, softmax,
    output contraction) and ``backward`` operators, the tensors in each role and the letters."""

    members: tuple[str, ...]
    backward: tuple[str, ...]
    tensors: dict  # role -> tensor: q, k, v, o, mask, do, dq, dk, dv
    letters: dict  # batch, heads, rows, keys, features, value_features
    scale: float
    causal: str | None = None  # the constant (rows, keys) added to the scores that the causal mask stands in for


@dataclass(frozen=True)
class Softmax:
    """A softmax recognised in closed form: its input and output tensors and the letters it
    normalises over, in the input tensor's own naming."""

    input: str
    output: str
    reduced: str


def _softmaxes(fused) -> list[Softmax]:
    """The softmaxes of ``fused`` in recognition order: a ``FusedTraining``'s closed forms name the
    reduced letters in the input's own naming already, a ``FusedGraph``'s (``dataflow.closed_forms``)
    in their members' (renamed here axis by axis)."""
    if hasattr(fused, "closed_forms"):
        return [Softmax(f.input, f.output, f.reduced) for f in fused.closed_forms if f.kind == "softmax"]
    graph = fused.training.graph
    result = []
    for form in (f for f in fused.training.closed_forms if f.kind == "softmax"):
        read = next(o.letters for n in form.members for p in graph.primitives if p.name == n
                    for o in p.inputs if o.tensor == form.input)
        own = dict(zip(read, graph.tensors[form.input].letters))
        result.append(Softmax(form.input, form.output, "".join(own[x] for x in form.reduced)))
    return result


def own_letters(operand, graph) -> dict:
    """An operand's primitive letters -> the tensor's own letters (axis by axis)."""
    return dict(zip(operand.letters, graph.tensors[operand.tensor].letters))


def _scale(graph, prims, source: str, target: str) -> float | None:
    """The constant factor of the chain of one-input maps from ``source`` to ``target`` (None if not linear)."""
    producer = {p.output.tensor: p for p in prims}
    factor, tensor = 1.0, target
    scalars = graph.scalars()
    while tensor != source:
        prim = producer.get(tensor)
        if prim is None or prim.kind != "map" or len(prim.inputs) != 1:
            return None
        one = prim.expression.linear_factor(scalars)
        if one is None:
            return None
        factor, tensor = factor * one, prim.inputs[0].tensor
    return factor


def _added_constant(graph, middle, softmax_input: str) -> tuple | None:
    """(scores operand, constant operand) of the map ``in0 + in1`` writing the softmax's input when
    one side is a constant (role "constant": e.g. GPT-2's additive causal mask), else None."""
    prim = next((p for p in middle.primitives if p.output.tensor == softmax_input), None)
    if prim is None or prim.kind != "map" or len(prim.inputs) != 2 or not prim.expression.matches("in0 + in1", "in1 + in0"):
        return None
    constants = [o for o in prim.inputs if graph.tensors[o.tensor].role == "constant"]
    if len(constants) != 1:
        return None
    scores = next(o for o in prim.inputs if o is not constants[0])
    return (scores, constants[0]) if scores.letters == prim.output.letters else None


def attention_roles(fused, takes_head_dim: Callable[[int], bool] | None = None,
                    softmax: Softmax | None = None) -> tuple[AttentionRoles | None, str]:
    """The fused attention around ``softmax`` (default: the first softmax of ``fused``), or (None,
    why it does not apply): the module doc's checks, the head dims only with ``takes_head_dim``."""
    graph, ops = fused.graph, {op.name: op for op in fused.operators}
    producer_op = {t: op for op in fused.operators for t in op.outputs}
    softmax = softmax or next(iter(_softmaxes(fused)), None)
    if softmax is None:
        return None, "no softmax"
    middle = next(op for op in fused.operators if any(p.output.tensor == softmax.output for p in op.primitives))
    if middle.cls == CONTRACTION or middle.phase != FORWARD:
        return None, f"the softmax runs in {middle.name}, a {middle.phase} {middle.cls} operator"
    added = _added_constant(graph, middle, softmax.input)
    others = [t for t in middle.inputs
              if graph.tensors[t].role != "dropout" and (added is None or t != added[1].tensor)]
    masks = [t for t in middle.inputs if graph.tensors[t].role == "dropout"]
    if len(others) != 1 or producer_op.get(others[0]) is None or producer_op[others[0]].cls != "contraction":
        return None, f"the softmax operator {middle.name} reads {others}: only the scores (and a dropout mask) fuse"
    scores_op = producer_op[others[0]]
    sinks = [op for op in fused.operators if op.cls == "contraction" and op.phase == "forward"
             and set(op.inputs) & set(middle.outputs)]
    if len(sinks) != 1 or len(scores_op.primitives) != 1 or len(sinks[0].primitives) != 1:
        return None, "the softmax's producer and consumer are not single contractions"
    score, out = scores_op.primitives[0], sinks[0].primitives[0]
    alpha = next(o for o in out.inputs if o.tensor in middle.outputs)
    summed = dict(zip(graph.tensors[alpha.tensor].letters, alpha.letters))
    if not all(summed.get(x) in out.reduced for x in softmax.reduced):
        return None, f"{sinks[0].name} does not sum over the keys the softmax normalises"
    scale = _scale(graph, middle.primitives, score.output.tensor, added[0].tensor if added else softmax.input)
    if scale is None:
        return None, "the scores reach the softmax through more than a constant scale (and an added constant)"
    order = [op.name for op in fused.operators]
    members = (scores_op.name, middle.name, sinks[0].name)
    if [order.index(m) for m in members] != list(range(order.index(members[0]), order.index(members[0]) + 3)):
        return None, "the score contraction, softmax and output contraction are not consecutive"
    # letters from the score einsum "A,B->C": the feature is summed; the operand whose own position
    # letter is the softmax's reduced one holds the keys, the other the queries (rows)
    if graph.tensors[score.output.tensor].letters != graph.tensors[softmax.input].letters:
        return None, "the scores change letter order before the softmax"
    (a, b), c = [o.letters for o in score.inputs], score.output.letters
    feature = next(x for x in a if x in b and x not in c)
    keys_letter = c[graph.tensors[softmax.input].letters.index(softmax.reduced)]
    k_operand, q_operand = score.inputs if keys_letter in a else score.inputs[::-1]
    only_q = [x for x in q_operand.letters if x in c and x not in k_operand.letters]
    if len(only_q) != 1:  # a query-head group letter besides the position: q[b, k, g, s, e] against k[b, k, t, e]
        shared = [x for x in c if x in a and x in b]
        kv_heads = [x for x in shared if x not in batch_letters(graph)] or shared
        groups = [x for x in only_q if graph.size(x) != graph.size(keys_letter)] or only_q[:-1]
        return None, (f"the scores carry two head letters, {'/'.join(kv_heads)} and {'/'.join(groups)} "
                      f"(grouped-query attention: K and V shared by the query heads of a group): not fused yet")
    rows_letter = only_q[0]
    batch_like = [x for x in c if x in a and x in b]
    if len(batch_like) != 2:  # the fused kernels take (batch, heads) scores; single-head attention: no heads letter
        return None, (f"the scores carry {len(batch_like)} letter(s) besides the positions "
                      f"({', '.join(batch_like) or 'none'}), not a batch and a heads letter: not fused")
    batch = next((x for x in batch_like if x in batch_letters(graph)), batch_like[0])
    heads = next(x for x in batch_like if x != batch)
    v_operand = next(o for o in out.inputs if o is not alpha)
    value_feature = next(x for x in v_operand.letters if x not in alpha.letters)
    rename_q, rename_k = own_letters(q_operand, graph), own_letters(k_operand, graph)
    letters = {"batch": rename_q[batch], "heads": rename_q[heads], "rows": rename_q[rows_letter],
               "keys": rename_k[keys_letter], "features": rename_q[feature],
               "value_features": own_letters(v_operand, graph)[value_feature]}
    causal = None
    if added is not None:
        scores, constant = added  # positions in the scores: as in the score einsum's output ``c``
        if graph.tensors[scores.tensor].letters != graph.tensors[softmax.input].letters \
                or constant.letters != scores.letters[c.index(rows_letter)] + scores.letters[c.index(keys_letter)]:
            return None, f"the constant {constant.tensor} added to the scores is not over (query, key) positions"
        own = own_letters(constant, graph)
        mask = CausalMask(rows=own[constant.letters[0]], keys=own[constant.letters[1]])
        if getattr(graph.tensors[constant.tensor], "value", "") and not holds_causal_mask(graph, constant.tensor, mask):
            return None, (f"the constant {constant.tensor} added to the scores holds a mask that is not causal (a "
                          "sliding window, say): the fused attention applies only a causal mask")
        causal = constant.tensor
    head_dims = sorted({graph.size(letters[f]) for f in ("features", "value_features")})
    if takes_head_dim is not None and not all(map(takes_head_dim, head_dims)):
        return None, f"head dims {head_dims}: the fused attention takes powers of two in [16, 256]"
    tensors = {"q": q_operand.tensor, "k": k_operand.tensor, "v": v_operand.tensor, "o": out.output.tensor,
               "mask": masks[0] if masks else None}
    backward, why = _backward(fused, ops, members, tensors)
    if backward is None:
        return None, why
    roles = {**tensors, **{"d" + role: f"d_{tensors[role]}" for role in ("o", "q", "k", "v")}}
    return AttentionRoles(members, backward, roles, letters, scale, causal), ""


def _backward(fused, ops: dict, members: tuple, tensors: dict) -> tuple[tuple | None, str]:
    """The attention's backward operators (those on paths from d_o to d_q / d_k / d_v), or (None,
    why not): the gradients must exist, the operators run consecutively, and nothing outside the
    forward and backward read what they keep inside."""
    graph = fused.graph
    grads = {role: f"d_{tensors[role]}" for role in ("q", "k", "v", "o")}
    if any(g not in graph.tensors for g in grads.values()):
        return None, "gradients of the attention's tensors not found"
    readers: dict[str, list] = {}
    for op in fused.operators:
        for t in op.inputs:
            readers.setdefault(t, []).append(op)
    reach, frontier = set(), [grads["o"]]
    while frontier:
        for op in readers.get(frontier.pop(), []):
            if op.phase == "backward" and op.name not in reach:
                reach.add(op.name)
                frontier += list(op.outputs)
    wanted = {grads["q"], grads["k"], grads["v"]}
    order = [op.name for op in fused.operators]
    backward = [op.name for op in fused.operators if op.name in reach
                and (set(op.outputs) & wanted or _feeds(ops[op.name], wanted, ops, reach))]
    positions = [order.index(n) for n in backward]
    if not backward or positions != list(range(positions[0], positions[0] + len(positions))):
        return None, f"the attention's backward operators {backward} are not consecutive"
    inside = set(members) | set(backward)
    hidden = {t for m in members for t in ops[m].outputs if t != tensors["o"]}
    hidden |= {t for m in backward for t in ops[m].outputs if t not in wanted}
    for op in fused.operators:
        if op.name not in inside and set(op.inputs) & hidden:
            return None, f"{op.name} reads {sorted(set(op.inputs) & hidden)}, which the fused attention does not write"
    return tuple(backward), ""


def _feeds(op, wanted: set, ops: dict, reach: set) -> bool:
    """Whether ``op``'s outputs lead (within ``reach``) to a tensor in ``wanted``."""
    frontier, seen = list(op.outputs), set()
    while frontier:
        t = frontier.pop()
        if t in wanted:
            return True
        for other in ops.values():
            if other.name in reach and t in other.inputs and other.name not in seen:
                seen.add(other.name)
                frontier += list(other.outputs)
    return False


# --- the analysis's view ---------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionCandidate:
    """A fused attention as the analysis lists it beside the fused plan (forward).

    ``members``: the fused operators it replaces (contraction, softmax operator, contraction);
    ``outputs``: what the forward pass reads from it; ``saved``: what only the backward reads
    (the probabilities a flash-style kernel recomputes instead of storing); element counts of each.
    """

    name: str
    phase: str
    members: tuple[str, ...]
    primitives: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    saved: tuple[str, ...]
    input_elements: int
    output_elements: int
    saved_elements: int


def attention_candidates(fused) -> list[AttentionCandidate]:
    """Every softmax of ``fused`` that ``attention_roles`` takes (any head dims), as the analysis
    lists it."""
    graph = fused.graph
    phase_of = {p.name: op.phase for op in fused.operators for p in op.primitives}
    ops = {op.name: op for op in fused.operators}
    readers: dict[str, list] = {}
    for p in graph.primitives:
        for operand in p.inputs:
            readers.setdefault(operand.tensor, []).append(p)
    size = lambda ts: sum(graph.size(graph.tensors[t].letters) for t in ts)  # noqa: E731
    result = []
    for softmax in _softmaxes(fused):
        roles, _ = attention_roles(fused, softmax=softmax)
        if roles is None:
            continue
        prims = [p for m in roles.members for p in ops[m].primitives]
        op = make_operator(graph, prims, FORWARD)
        outputs = tuple(t for t in op.outputs if t in graph.outputs or any(
            r not in prims and phase_of.get(r.name) == FORWARD for r in readers.get(t, [])))
        saved = tuple(t for t in op.outputs if t not in outputs)
        result.append(AttentionCandidate(f"attention({','.join(roles.members)})", FORWARD, roles.members,
                                         tuple(p.name for p in prims), op.inputs, outputs, saved, size(op.inputs),
                                         size(outputs), size(saved)))
    return result
