"""The fused attention's pattern in a fused training graph: what ``dataflow.attention``'s recogniser
finds (``attention_roles``, here with the kernels' head dims), and around it what the kernels can
take in as well: the bias add before it (``attention_bias``) and, with grouped-query attention,
the repeat of K and V over the query heads (``attention_repeats``); the layout the Q projection
writes as a plain GEMM (``projection_layout``, where the tuning also measures the attention).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datamove.dataflow.attention import AttentionRoles, attention_roles as recognise, own_letters
from datamove.dataflow.executor import known_value
from datamove.dataflow.layer_inputs import batch_letters
from datamove.kernels.attention import supported_head_dim


def attention_roles(fused) -> tuple[AttentionRoles | None, str]:
    """The fused attention of ``fused``'s first softmax (``dataflow.attention.attention_roles``)
    where the kernels take its head dims, or (None, why not)."""
    return recognise(fused, takes_head_dim=supported_head_dim)


def projection_layout(fused, roles: AttentionRoles, bias: dict | None) -> str | None:
    """The storage order (in q's letters) in which the contraction producing the attention's q
    (before its bias add, ``attention_bias``) writes it as one plain GEMM output with its rows
    along the weight: the weight's letters, then the activation's (BERT: "phbj", the spec's; GPT-2:
    "hebs", where the spec says "bhse").  The stacked Q/K/V projection can write this order with
    the stack letter outermost, so the tuning measures the attention there too.  None where q's
    producer is no contraction of one weight and one activation."""
    graph = fused.graph
    source = bias["q"][0] if bias else roles.tensors["q"]
    op = next((o for o in fused.operators if any(p.output.tensor == source for p in o.primitives)), None)
    if op is None or op.cls != "contraction":
        return None
    prim = next(p for p in op.primitives if p.output.tensor == source)
    batch = set(batch_letters(graph))
    weights = [o for o in prim.inputs if not set(graph.tensors[o.tensor].letters) & batch]
    activations = [o for o in prim.inputs if o not in weights]
    if len(weights) != 1 or len(activations) != 1:
        return None
    own = dict(zip(prim.output.letters, graph.tensors[source].letters))
    order = [x for operand in (weights[0], activations[0]) for x in operand.letters if x in prim.output.letters]
    return "".join(own[x] for x in order) if len(order) == len(own) else None


def attention_bias(fused, roles: AttentionRoles) -> dict | None:
    """The operator right before the fused attention's forward if all it does is add a bias to
    each of q, k and v (BERT's ``stack(q,k,v)``): ``{"op": its name, "q": (tensor before the add,
    bias), "k": ..., "v": ...}``, the biases over the heads and feature letters; the attention can
    then add them as it loads q, k, v (``kernels.attention``'s ``bias``).  None where it does more,
    or where anything but the attention reads q, k or v."""
    graph, t, letters = fused.graph, roles.tensors, roles.letters
    order = [op.name for op in fused.operators]
    op = next((o for o in fused.operators if t["q"] in o.outputs), None)
    if op is None or op.cls == "contraction" or set(op.outputs) != {t["q"], t["k"], t["v"]} \
            or order.index(op.name) + 1 != order.index(roles.members[0]):
        return None
    feature = {"q": letters["features"], "k": letters["features"], "v": letters["value_features"]}
    found = {"op": op.name}
    for prim in op.primitives:
        role = next((r for r in "qkv" if t[r] == prim.output.tensor), None)
        if role is None or prim.kind != "map" or len(prim.inputs) != 2 \
                or not prim.expression.matches("in0 + in1", "in1 + in0"):
            return None
        pre, bias = sorted(prim.inputs, key=lambda x: -len(x.letters))
        if graph.tensors[pre.tensor].letters != graph.tensors[t[role]].letters or pre.letters != prim.output.letters \
                or sorted(graph.tensors[bias.tensor].letters) != sorted(letters["heads"] + feature[role]):
            return None
        found[role] = (pre.tensor, bias.tensor)
    inside = set(roles.members) | set(roles.backward)
    if len(found) != 4 or any(o.name not in inside and set(o.inputs) & {t["q"], t["k"], t["v"]} for o in fused.operators):
        return None
    return found


@dataclass(frozen=True)
class AttentionRepeats:
    """Grouped-query attention in the graph (``attention_repeats``): the attention's k and v each the
    repeat over the query heads of a tensor over fewer (K/V) heads, ``size`` query heads per K/V head.

    ``tensors``: "k", "v" -> the K/V tensors before the repeat; "dk", "dv" -> what the repeat's
    backward writes from the attention's dk / dv (their sums over each group: the K/V tensors'
    gradients, or their share of them).  ``letter``: the K/V heads' letter in those tensors' naming
    (every other letter is the attention's).  ``forward`` / ``backward``: the repeat's operators and
    its backward's, which the grouped attention's forward / backward cover; ``constants``: the
    repeat matrices they read (the kernels need none: the grouped forward names them among its
    reads, unloaded, as it does a causal mask, so that the layer keeps them as its constants)."""

    letter: str
    size: int
    tensors: dict
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    constants: tuple[str, ...] = ()


def _group_matrix(graph, prim) -> tuple | None:
    """(the operand, its letter the constant maps, the output letter it maps to, G) where ``prim``
    is an einsum ``X, C -> Y`` whose constant C (made by the front end, ``TensorInfo.value``) maps
    one letter of X to one of Y as np.repeat's matrix does, in either direction: a repeat (X over
    KV heads, Y over H = G KV, Y[.., h, ..] = X[.., h // G, ..]) or its transpose, the sum over each
    group of G (X over H, Y over KV); every other letter of X kept in Y, in the same place.  None
    otherwise."""
    if prim.kind != "einsum" or len(prim.inputs) != 2:
        return None
    constants = [o for o in prim.inputs if graph.tensors[o.tensor].role == "constant" and graph.tensors[o.tensor].value]
    if len(constants) != 1 or len(constants[0].letters) != 2:
        return None
    constant = constants[0]
    x = next(o for o in prim.inputs if o is not constant)
    out = prim.output.letters
    inner = [c for c in constant.letters if c in x.letters and c not in out]
    outer = [c for c in constant.letters if c in out and c not in x.letters]
    if len(inner) != 1 or len(outer) != 1 or out != x.letters.replace(inner[0], outer[0]):
        return None
    value = known_value(graph, constant.tensor)
    if constant.letters.index(inner[0]) != 0:
        value = value.T  # [inner, outer]
    n_in, n_out = value.shape
    narrow, wide = min(n_in, n_out), max(n_in, n_out)
    if narrow == wide or wide % narrow:
        return None
    groups = wide // narrow
    repeat = (np.arange(wide)[None, :] // groups == np.arange(narrow)[:, None]).astype(np.float64)  # [kv, h]
    if not np.array_equal(value, repeat if n_in == narrow else repeat.T):
        return None
    return x, inner[0], outer[0], groups


def attention_repeats(fused, roles: AttentionRoles, order: list[str]) -> AttentionRepeats | None:
    """Grouped-query attention: where the attention's k and v are each written by an einsum from a
    tensor over K/V heads with a 0/1 constant the front end made that is np.repeat's matrix over
    the heads (``configs/llama.py``'s ``np.repeat(k, H // KV, axis=1)``, lowered by
    ``dataflow.lowering`` to ``"bkse,kh->bhse"``: query head h takes K/V head h // G), and
    their backward is the transposed einsum (dk, dv summed over each group), the grouped attention
    reads the K/V tensors in place and writes their gradients (``kernels.attention``'s grouped-query
    attention): ``AttentionRepeats``.  None where anything differs: the repeat's operators must do
    nothing else, only the attention may read its outputs and only the group sums the attention's
    dk / dv, K and V must share the K/V heads' letter and G, the K/V gradients must be over the K/V
    tensors' letters, and the repeats and their backward must run right before the attention's
    forward and right after its backward in ``order`` (the plan's execution order,
    ``families.base.execution_order``)."""
    graph, t, letters = fused.graph, roles.tensors, roles.letters
    ops = {op.name: op for op in fused.operators}
    writer = {p.output.tensor: (op, p) for op in fused.operators for p in op.primitives}
    readers: dict[str, list] = {}
    for op in fused.operators:
        for x in op.inputs:
            readers.setdefault(x, []).append(op.name)
    inside = set(roles.members) | set(roles.backward)
    found, forward, backward, kv, constants = {}, [], [], set(), set()
    for role in ("k", "v"):
        op, prim = writer.get(t[role], (None, None))
        matched = _group_matrix(graph, prim) if prim is not None and op.cls == "contraction" else None
        if matched is None:
            return None
        x, inner, outer, groups = matched
        own_out, own_in = own_letters(prim.output, graph), own_letters(x, graph)
        if own_out[outer] != letters["heads"] or any(own_out[c] != own_in[c] for c in prim.output.letters if c != outer) \
                or not set(readers.get(t[role], [])) <= inside or not set(op.outputs) <= {t["k"], t["v"]}:
            return None
        sums = readers.get(t["d" + role], [])
        if len(sums) != 1 or ops[sums[0]].cls != "contraction" or len(ops[sums[0]].primitives) != 1:
            return None
        back = ops[sums[0]].primitives[0]
        matched_back = _group_matrix(graph, back)
        if matched_back is None or matched_back[0].tensor != t["d" + role] or matched_back[3] != groups:
            return None
        grad = back.output.tensor
        back_out, back_in = own_letters(back.output, graph), own_letters(matched_back[0], graph)
        if graph.tensors[grad].letters != graph.tensors[x.tensor].letters or back_out[matched_back[2]] != own_in[inner] \
                or any(back_out[c] != back_in[c] for c in back.output.letters if c != matched_back[2]):
            return None
        kv.add((own_in[inner], groups))
        constants.update(o.tensor for p in (prim, back) for o in p.inputs if o is not x and o is not matched_back[0])
        found[role], found["d" + role] = x.tensor, grad
        forward.append(op.name)
        backward.append(sums[0])
    if len(kv) != 1:
        return None
    (letter, groups), = kv
    position = {name: n for n, name in enumerate(order)}
    forward = sorted(set(forward), key=position.get)
    backward = sorted(set(backward), key=position.get)
    for run in (forward + list(roles.members), list(roles.backward) + backward):
        at = sorted(position[name] for name in run)
        if at != list(range(at[0], at[0] + len(at))):
            return None
    return AttentionRepeats(letter, groups, found, tuple(forward), tuple(backward), tuple(sorted(constants)))


@dataclass(frozen=True)
class AttentionPattern:
    """The fused attention found in a graph (``AttentionFamily.match``): its ``roles``, the bias
    add it can take in (``attention_bias``) and its grouped-query repeats (``attention_repeats``)."""

    roles: AttentionRoles
    bias: dict | None
    repeats: AttentionRepeats | None
