"""The candidates of every operator of a fused training graph, with their times, and the plan.

``plan_layer`` gathers, per operator of the fused graph (``dataflow.snapshot.FusedTraining``):

- generated element-wise / normalization kernels: one candidate per tensor-layout combination of
  ``layouts.space.configurations`` (pruned space), its knobs the fastest measured (else the
  representative's, predicted);
- contractions: each BLAS-mappable operand-layout combination (one batch dim at most; a stacked
  operand keeps its stack letter outermost: its members are views of one buffer), cuBLAS or the
  fastest measured Triton configuration, timed as the ``harness.contraction_variants.pick_layouts``
  plan that makes the same BLAS call (``same_call_layouts``: the same sizes and strides);
- a GEMM with each kernel family of ``datamove.families.GEMM_FAMILIES`` whose pattern it has
  (the residual add, the forward epilogue, the gradient epilogue): the family's candidates;
- a layernorm backward joined with the column sums beside it (``layouts.space.column_sum_joins``:
  its parameter gradients, a bias gradient of what it writes): one generated kernel, its
  candidates as a generated operator's, in place of the members';
- the fused attention (``attention_roles``): forward and backward, in every layout the producer of
  its inputs can write, in place of the score contraction, softmax and output contraction (and
  their backward operators); with its causal mask where the softmax reads the scores plus a
  constant over (query, key) positions (GPT-2's additive mask, which ``datamove.module`` checks);
  with grouped-query attention (``attention_repeats``: K and V repeated over the query heads by
  np.repeat's matrix, Llama's) also grouped, reading K and V before the repeat and writing their
  gradients, in place of the repeats and their backward too;

times from ``Timings`` (the tuning database's records of one device and dtype) or the cost model
(``layouts.cost_model``, marked predicted); then ``layouts.select`` chooses.  Layout changes are
priced by ``Timings`` (``op="layout:<letters>"``) or the cost model.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, replace

import numpy as np

from datamove.dataflow.graph import is_expression
from datamove.dataflow.layer_inputs import batch_letters
from datamove.kernels.attention import KERNEL_ID as ATTENTION_ID, supported_head_dim
from datamove.harness.attention_variants import AttentionCase
from datamove.kernels.contraction import parse
from datamove.kernels.gemm import TEMPLATE_ID
from datamove.kernels.layout_change import KERNEL_ID as LAYOUT_CHANGE_ID
from datamove.families import GEMM_FAMILIES
from datamove.families.base import GemmSite, PlainLayout, gemm_config_of
from datamove.harness.contraction_variants import STACK_LETTERS, same_call_layouts, training_gemms
from datamove.harness.sweep_variants import moved_bytes, op_signature
from datamove.harness.tuning_db import canonical_json
from datamove.layouts.cost_model import DeviceFigures, predict_ms
from datamove.layouts.plan import (ATTENTION_BACKWARD, ATTENTION_FORWARD, GEMM, GENERATED, ITEMSIZE, MEASURED,
                                   PREDICTED, Plan)
from datamove.layouts.select import Candidate, best_sum, select, to_plan
from datamove.layouts.step_config import AttentionConfig, ContractionConfig, GeneratedConfig
from datamove.layouts.space import (column_sum_joins, configurations, default_configuration, join_members, masks_grouped,
                                    parts, representatives)

# candidates kept per operator run (fastest; ties: spec order first): bounds the search.  48: with
# cuBLASLt's other algorithms timed, BERT-large's 1024-wide GEMMs have 8 layouts within 0.3 us of each
# other, and at 16 the H100 plan lost the layouts shared by the three GEMMs reading the attention's
# output projection weight and paid a 9.5 us change (0.7776 ms against 0.7683 at 48; search 2 s)
KEEP_PER_OPERATOR = 48
COMPOSED_PER_PART = 3  # a multi-part operator's fastest measured layouts per part that ``composed`` combines


def _stale(key) -> bool:
    """Whether a tuning-database key times another version of its kernel's source than this one:
    a Triton GEMM configuration (knob ``template``, ``kernels.gemm.TEMPLATE_ID``), the fused
    attention or a layout change (knob ``kernel``: ``kernels.attention.KERNEL_ID``,
    ``kernels.layout_change.KERNEL_ID``).  Generated kernels carry their generator's version in
    their key instead (``harness.sweep_variants``)."""
    knobs = key.knobs
    if knobs.get("backend") == "triton":
        return knobs.get("template") != TEMPLATE_ID
    if key.op.startswith("attention:") and knobs.get("impl") == "fused":
        return knobs.get("kernel") != ATTENTION_ID
    if key.op.startswith("layout:"):
        return knobs.get("kernel") != LAYOUT_CHANGE_ID
    return False


class Timings:
    """Measured times by key, from tuning-database records of exactly one device and dtype.

    A record of another device or dtype is refused (``ValueError`` naming both), never used; one
    of another version of the kernel's source (``_stale``) is left out.  A kernel whose every
    record failed or was wrong (``broken``) is not offered at a predicted time."""

    def __init__(self, records, device: str, dtype: str):
        self.device, self.dtype = device, dtype
        self.times: dict[tuple, list[tuple[float, dict]]] = {}  # fastest first
        self._broken: set[tuple] = set()  # keys with failed / wrong records and none ok
        for r in records:
            if r.key.device != device or r.key.dtype != dtype:
                raise ValueError(f"timing of {r.key.op} is from {r.key.device} / {r.key.dtype}; this selection is for "
                                 f"{device} / {dtype}: query the tuning database for this device and dtype only")
            if _stale(r.key):
                continue  # another version of the kernel was timed (the tuning measures this one again)
            key = _timing_key(r.key.op, r.key.dims, r.key.layout)
            if r.status in ("failed", "wrong"):
                self._broken.add(key)
            if r.status != "ok" or r.median_ms is None:
                continue
            self.times.setdefault(key, []).append((r.median_ms, r.key.knobs))
        self._broken -= self.times.keys()
        for found in self.times.values():
            found.sort(key=lambda pair: pair[0])
        self.changes_by_size: dict[int, list[float]] = {}  # elements -> each measured layout change's time, ascending
        for (op, dims, _), found in self.times.items():
            if op.startswith("layout:"):
                self.changes_by_size.setdefault(math.prod(json.loads(dims).values()), []).append(found[0][0])
        for times in self.changes_by_size.values():
            times.sort()

    def lookup(self, op: str, dims: dict, layout, accept=lambda knobs: True) -> tuple[float, dict] | None:
        """The fastest (ms, knobs) of ``op`` at ``dims`` in ``layout`` whose knobs ``accept`` allows."""
        found = self.times.get(_timing_key(op, dims, layout), [])
        return next((pair for pair in found if accept(pair[1])), None)

    def exact(self, op: str, dims: dict, config) -> tuple[float, dict] | None:
        """``lookup`` of ``config`` itself (a ``layouts.space.Configuration``): its layouts, its knobs."""
        knobs = canonical_json(config.knobs)
        return self.lookup(op, dims, config.layouts, lambda found: canonical_json(found) == knobs)

    def broken(self, op: str, dims: dict, layout) -> bool:
        """Whether ``op`` at ``dims`` in ``layout`` failed (build, launch, time limit) or was wrong on
        this device at every setting tried, and never ran correctly: no candidate then, not a
        cost-model guess at a kernel known not to run."""
        return _timing_key(op, dims, layout) in self._broken

    def fastest(self, op: str, dims: dict) -> float | None:
        """The fastest time of ``op`` at ``dims`` in any layout (PyTorch's baselines: one layout each)."""
        dims_key = canonical_json(dims)
        times = [found[0][0] for (name, d, _), found in self.times.items() if name == op and d == dims_key]
        return min(times) if times else None


def _timing_key(op: str, dims: dict, layout) -> tuple:
    """What ``Timings`` keeps its records by: the operator at its sizes in one layout (any knobs)."""
    return op, canonical_json(dims), canonical_json(layout)


NO_TIMINGS = Timings([], "", "")


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


def _rename(operand, graph) -> dict:
    """An operand's primitive letters -> the tensor's own letters (axis by axis)."""
    return dict(zip(operand.letters, graph.tensors[operand.tensor].letters))


def _scale(graph, prims, source: str, target: str) -> float | None:
    """The constant factor of the chain of one-input maps from ``source`` to ``target`` (None if not linear)."""
    producer = {p.output.tensor: p for p in prims}
    factor, tensor = 1.0, target
    namespace = graph.scalars()
    namespace["sqrt"] = math.sqrt
    while tensor != source:
        prim = producer.get(tensor)
        if prim is None or prim.kind != "map" or len(prim.inputs) != 1:
            return None
        one, two = (eval(prim.expr, {"__builtins__": {}}, {**namespace, "in0": x}) for x in (1.0, 2.0))  # noqa: S307
        if abs(two - 2 * one) > 1e-12 * abs(one):
            return None
        factor, tensor = factor * one, prim.inputs[0].tensor
    return factor


def attention_roles(fused) -> tuple[AttentionRoles | None, str]:
    """The fused attention's roles, or (None, why it does not apply)."""
    graph, ops = fused.graph, {op.name: op for op in fused.operators}
    producer_op = {t: op for op in fused.operators for t in op.outputs}
    softmax = next((f for f in fused.closed_forms if f.kind == "softmax"), None)
    if softmax is None:
        return None, "no softmax"
    middle = next(op for op in fused.operators if any(p.output.tensor == softmax.output for p in op.primitives))
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
    batch = next((x for x in batch_like if x in batch_letters(graph)), batch_like[0])
    heads = next(x for x in batch_like if x != batch)
    alpha = next(o for o in out.inputs if o.tensor in middle.outputs)
    v_operand = next(o for o in out.inputs if o is not alpha)
    value_feature = next(x for x in v_operand.letters if x not in alpha.letters)
    rename_q, rename_k = _rename(q_operand, graph), _rename(k_operand, graph)
    letters = {"batch": rename_q[batch], "heads": rename_q[heads], "rows": rename_q[rows_letter],
               "keys": rename_k[keys_letter], "features": rename_q[feature],
               "value_features": _rename(v_operand, graph)[value_feature]}
    causal = None
    if added is not None:
        scores, constant = added  # positions in the scores: as in the score einsum's output ``c``
        if graph.tensors[scores.tensor].letters != graph.tensors[softmax.input].letters \
                or constant.letters != scores.letters[c.index(rows_letter)] + scores.letters[c.index(keys_letter)]:
            return None, f"the constant {constant.tensor} added to the scores is not over (query, key) positions"
        causal = constant.tensor
    head_dims = sorted({graph.size(letters[f]) for f in ("features", "value_features")})
    if not all(map(supported_head_dim, head_dims)):
        return None, f"head dims {head_dims}: the fused attention takes powers of two in [16, 256]"
    tensors = {"q": q_operand.tensor, "k": k_operand.tensor, "v": v_operand.tensor, "o": out.output.tensor,
               "mask": masks[0] if masks else None}
    grads = {role: f"d_{tensors[role]}" for role in ("q", "k", "v", "o")}
    if any(g not in graph.tensors for g in grads.values()):
        return None, "gradients of the attention's tensors not found"
    # the backward: operators on paths from d_o to d_q / d_k / d_v
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
    roles = {**tensors, "do": grads["o"], "dq": grads["q"], "dk": grads["k"], "dv": grads["v"]}
    return AttentionRoles(members, tuple(backward), roles, letters, scale, causal), ""


def _added_constant(graph, middle, softmax_input: str) -> tuple | None:
    """(scores operand, constant operand) of the map ``in0 + in1`` writing the softmax's input when
    one side is a constant (role "constant": e.g. GPT-2's additive causal mask, which the fused
    attention's causal mask stands in for: ``datamove.module`` checks the constant holds it), else None."""
    prim = next((p for p in middle.primitives if p.output.tensor == softmax_input), None)
    if prim is None or prim.kind != "map" or len(prim.inputs) != 2 \
            or not is_expression(prim.expr, "in0 + in1", "in1 + in0"):
        return None
    constants = [o for o in prim.inputs if graph.tensors[o.tensor].role == "constant"]
    if len(constants) != 1:
        return None
    scores = next(o for o in prim.inputs if o is not constants[0])
    return (scores, constants[0]) if scores.letters == prim.output.letters else None


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
        if role is None or prim.kind != "map" or len(prim.inputs) != 2 or not is_expression(prim.expr, "in0 + in1", "in1 + in0"):
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
    from datamove.dataflow.executor import known_value

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


def attention_repeats(fused, roles: AttentionRoles) -> AttentionRepeats | None:
    """Grouped-query attention: where the attention's k and v are each written by an einsum from a
    tensor over K/V heads with a 0/1 constant the front end made that is np.repeat's matrix over
    the heads (``configs/llama.py``'s ``np.repeat(k, H // KV, axis=1)``, lowered by
    ``dataflow.numpy_lowering`` to ``"bkse,kh->bhse"``: query head h takes K/V head h // G), and
    their backward is the transposed einsum (dk, dv summed over each group), the grouped attention
    reads the K/V tensors in place and writes their gradients (``kernels.attention``'s grouped-query
    attention): ``AttentionRepeats``.  None where anything differs: the repeat's operators must do
    nothing else, only the attention may read its outputs and only the group sums the attention's
    dk / dv, K and V must share the K/V heads' letter and G, the K/V gradients must be over the K/V
    tensors' letters, and the repeats and their backward must run right before the attention's
    forward and right after its backward in the execution order."""
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
        own_out, own_in = _rename(prim.output, graph), _rename(x, graph)
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
        back_out, back_in = _rename(back.output, graph), _rename(matched_back[0], graph)
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
    order = execution_order(fused)
    position = {name: n for n, name in enumerate(order)}
    forward = sorted(set(forward), key=position.get)
    backward = sorted(set(backward), key=position.get)
    for run in (forward + list(roles.members), list(roles.backward) + backward):
        at = sorted(position[name] for name in run)
        if at != list(range(at[0], at[0] + len(at))):
            return None
    return AttentionRepeats(letter, groups, found, tuple(forward), tuple(backward), tuple(sorted(constants)))


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


class CandidateBuilder:
    """Candidates of one fused graph for one dtype, timed by ``timings`` or ``figures``."""

    def __init__(self, fused, spec: str, dtype: str, figures: DeviceFigures, timings: Timings):
        self.fused, self.spec, self.dtype, self.figures, self.timings = fused, spec, dtype, figures, timings
        self.graph = fused.graph
        self.itemsize = ITEMSIZE[dtype]
        self._changes: dict[tuple, tuple[float, str]] = {}
        self.order = execution_order(fused)  # the operators as the plan runs them

    def generated(self, op) -> list[Candidate]:
        graph = self.graph
        masks = {t for t in op.inputs if graph.tensors[t].role == "dropout"}
        groups: dict[str, list] = {}
        for config in configurations(graph, op):
            layouts = canonical_json({t: l for t, l in config.layouts.items() if t not in masks})
            groups.setdefault(layouts, []).append(config)
        flop = sum(graph.size(p.output.letters) for p in op.primitives if p.kind != "einsum")
        result = []
        grouped = masks_grouped(graph, op)
        for configs in groups.values():
            default = representatives(configs, grouped)[0]
            found = None
            for config in configs:
                hit = self.timings.exact(op_signature(self.spec, op), dict(graph.dim_values), config)
                if hit is not None and (found is None or hit[0] < found[0][0]):
                    found = (hit, config)
            if found is None and self.timings.broken(op_signature(self.spec, op), dict(graph.dim_values), default.layouts):
                continue
            ms, source, _ = self.time(found[0] if found else None, "generated", flop,
                                       moved_bytes(graph, op, self.itemsize))
            config = found[1] if found else default
            reads = {t: config.layouts[t] for t in op.inputs if t not in masks}
            writes = {t: config.layouts[t] for t in op.outputs}
            result.append(Candidate(op.name, op.phase, GENERATED, (op.name,), reads, writes,
                                    GeneratedConfig(config.knobs, {t: config.layouts[t] for t in masks}), ms, source))
        return result

    def composed(self, op, written: dict[str, set]) -> list[Candidate]:
        """An operator of several parts (``layouts.space.parts``) with each part at its own best.

        Its space holds the all-default configuration and each part varied with the others at their
        defaults (rule 5 of ``layouts.space``), so no measured configuration has two parts away from
        their defaults, and a stacked producer's layouts (GPT-2's Q/K/V gradients, all h-outermost)
        match none: the plan paid layout changes to reach one.  Per part, the layouts of its
        ``COMPOSED_PER_PART`` fastest variations and, per combination of layouts that ``written``
        says some candidate writes its inputs in ({tensor: layouts}), the fastest reading them so,
        each with its fastest knobs; every combination of two or more parts away from their
        defaults, priced as the measured all-default time plus each part's measured difference to
        it (parts run in disjoint programs), no faster than the cost model, marked ``composed`` (so
        kept beside measurements, and measured once a plan takes it, then tuned part by part:
        ``datamove.tuning.chosen_patterns``).  Once measured, the fastest measured setting of its
        layouts; none where it only failed.  None without a measured all-default configuration."""
        split = parts(op)
        if len(split) < 2:
            return []
        graph, dims, signature = self.graph, dict(self.graph.dim_values), op_signature(self.spec, op)
        base = default_configuration(graph, op)
        base_found = self.timings.exact(signature, dims, base)
        if base_found is None:
            return []
        base_ms = base_found[0]
        masks = {t for t in op.inputs if graph.tensors[t].role == "dropout"}
        tensors = [[t for t in base.layouts if t in (*part.inputs, *part.outputs)] for part in split]

        def own(config, k) -> str:
            return canonical_json([{t: config.layouts[t] for t in tensors[k]}, config.knobs["parts"][k]])

        options: list[dict] = [{} for _ in split]  # per part: its layouts -> (fastest ms, that configuration)
        for config in configurations(graph, op):
            away = [k for k in range(len(split)) if own(config, k) != own(base, k)]
            if len(away) != 1:
                continue
            found = self.timings.exact(signature, dims, config)
            k = away[0]
            layouts = canonical_json({t: config.layouts[t] for t in tensors[k]})
            if found is not None and (layouts not in options[k] or found[0] < options[k][layouts][0]):
                options[k][layouts] = (found[0], config)
        chosen = []
        for k, part in enumerate(split):
            default = canonical_json({t: base.layouts[t] for t in tensors[k]})
            ranked = sorted(options[k].items(), key=lambda item: item[1][0])
            matching: dict[str, str] = {}  # the layouts of its written inputs -> the fastest option reading them so
            for layouts, (_, config) in ranked:
                read = {t: config.layouts[t] for t in part.inputs if t in written}
                if all(layout in written[t] for t, layout in read.items()):
                    matching.setdefault(canonical_json(read), layouts)
            keep = {layouts for layouts, _ in ranked[:COMPOSED_PER_PART]} | set(matching.values())
            chosen.append([(None, base_ms, base)] + [(layouts, *options[k][layouts]) for layouts in sorted(keep)
                                                    if layouts != default])
        flop = sum(graph.size(p.output.letters) for p in op.primitives if p.kind != "einsum")
        floor, _, _ = self.time(None, "generated", flop, moved_bytes(graph, op, self.itemsize))
        result = []
        for combination in itertools.product(*chosen):
            if sum(layouts is not None for layouts, _, _ in combination) < 2:
                continue  # the base, or one part varied: measured as it is
            layouts = {t: config.layouts[t] for k, (_, _, config) in enumerate(combination) for t in tensors[k]}
            own_knobs = tuple(config.knobs["parts"][k] for k, (_, _, config) in enumerate(combination))
            slowest = max(combination, key=lambda option: option[1])[2]
            warps = sorted({config.knobs["num_warps"] for _, _, config in combination})
            knobs = {"parts": own_knobs, "num_warps": slowest.knobs["num_warps"], "dropout": base.knobs["dropout"]}
            found = self.timings.lookup(signature, dims, layouts,
                                        lambda k, w=canonical_json(own_knobs): canonical_json(k.get("parts")) == w)
            if found is not None:  # measured: its fastest setting of these layouts (the main job tunes around it)
                (ms, knobs), source = self.timings.lookup(signature, dims, layouts), MEASURED
            elif self.timings.broken(signature, dims, layouts):
                continue
            else:
                ms, source = max(floor, base_ms + sum(option_ms - base_ms for _, option_ms, _ in combination)), PREDICTED
            reads = {t: layouts[t] for t in op.inputs if t not in masks}
            writes = {t: layouts[t] for t in op.outputs}
            result.append(Candidate(op.name, op.phase, GENERATED, (op.name,), reads, writes,
                                    GeneratedConfig(knobs, {t: layouts[t] for t in masks}, tuple(warps)), ms, source))
        return result

    def time(self, found, family: str, flop: float, bytes_moved: float, **extra) -> tuple[float, str, dict | None]:
        """(ms, source, knobs): ``found``'s (a tuning-database hit), else the cost model's prediction."""
        if found is not None:
            return found[0], MEASURED, found[1]
        return predict_ms(self.figures, family, flop=flop, bytes_moved=bytes_moved, dtype=self.dtype, **extra), PREDICTED, None

    def gemms(self) -> dict[str, list[Candidate]]:
        """Per training GEMM, its plain candidates (run ``<gemm>``) and those of each family of
        ``GEMM_FAMILIES`` whose pattern it has, where the pattern's consumer runs right after it
        (run ``<gemm>+<family>``)."""
        graph, ops = self.graph, {op.name: op for op in self.fused.operators}
        result: dict[str, list[Candidate]] = {}
        for g in training_gemms(self.fused):
            op = ops[g.name]
            einsums = [p for p in op.primitives if p.kind == "einsum"]
            c = parse(g.spec)
            stack = next((x for x in STACK_LETTERS if x in g.spec and x not in einsums[0].expr), None)
            members = {}
            for key, index in (("a", 0), ("b", 1)):
                tensors = [e.inputs[index].tensor for e in einsums]
                members[key] = tensors if len(set(tensors)) > 1 else tensors[:1]
            stacked_out = len(einsums) > 1 and (len(members["a"]) == 1 or len(members["b"]) == 1)
            members["out"] = [e.output.tensor for e in einsums] if stacked_out else list(op.outputs)
            # a member's own letters for the einsum's letters, axis by axis (every member has the
            # first's axes; the summed output, the first einsum's output's)
            first = {"a": einsums[0].inputs[0].letters, "b": einsums[0].inputs[1].letters, "out": einsums[0].output.letters}
            renames = {t: dict(zip(first[key], graph.tensors[t].letters)) for key, tensors in members.items() for t in tensors}
            candidates, plain = [], []
            for plan_layouts, timed_as in same_call_layouts(g).items():
                layouts = dict(zip(("a", "b", "out"), plan_layouts))
                if any(len(members[k]) > 1 and layouts[k][0] != stack for k in layouts):
                    continue  # a stacked operand's members are views of one buffer, stack letter outermost
                reads = {t: "".join(renames[t][x] for x in layouts[k] if x != stack) for k in ("a", "b") for t in members[k]}
                writes = {t: "".join(renames[t][x] for x in layouts["out"] if x != stack) for t in members["out"]}
                found = self.timings.lookup(g.op, g.sizes, dict(zip(("a", "b", "out"), timed_as)))
                if found is None and self.timings.broken(g.op, g.sizes, dict(zip(("a", "b", "out"), timed_as))):
                    continue
                ms, source, knobs = self.time(found, "gemm", g.flop, self.itemsize * sum(
                    math.prod(g.sizes[x] for x in letters) for letters in (c.a, c.b, c.out)))
                backend = (knobs or {}).get("backend", "cublas")
                gemm_config = gemm_config_of(knobs) if backend == "triton" else None
                algorithm = (knobs or {}).get("algorithm", 0) if backend == "cublas" else 0
                candidates.append(Candidate(g.name, op.phase, GEMM, (g.name,), reads, writes,
                                            ContractionConfig(g.spec, backend, members, gemm_config, algorithm), ms, source))
                plain.append(PlainLayout(reads, writes, timed_as, found is not None))
            result[g.name] = candidates
            site = GemmSite(g, op, members, renames, plain)
            for family in GEMM_FAMILIES:
                pattern = family.match(self.fused, g)
                if pattern is not None and self._follows(g, family.consumer(pattern)):
                    found = family.candidates(self, site, pattern)
                    if found:
                        result[f"{g.name}+{family.name}"] = found
        return result

    def _follows(self, g, consumer: str) -> bool:
        """Whether ``consumer`` runs right after ``g`` in ``execution_order`` (which moves it there
        where nothing between writes what it reads): a candidate covering both runs a contiguous
        run of operators (``layouts.select``)."""
        return self.order.index(consumer) == self.order.index(g.name) + 1

    def attention(self, roles: AttentionRoles, q_layouts: set[str], bias: dict | None = None,
                  repeats: AttentionRepeats | None = None) -> list[Candidate]:
        """The fused attention's forward and backward in each storage order of ``q_layouts``; with
        ``bias`` (``attention_bias``) also with that bias add folded in: a forward covering the bias
        operator too and a backward, both reading the tensors before the add and the biases; one of
        those not measured is priced no faster than the measured one without the bias add.  With
        ``repeats`` (``attention_repeats``: grouped-query attention) also the grouped attention: a
        forward covering the repeat of K and V too, reading the K/V tensors before it, and a
        backward covering the repeat's backward (the sums of dK, dV over each group), reading those
        and writing their gradients (K/V in q's storage order, their heads letter for q's); one not
        measured is priced no faster than the measured one without groups."""
        graph, letters, t = self.graph, roles.letters, roles.tensors
        kernel = {letters["batch"]: "b", letters["heads"]: "h", letters["rows"]: "j", letters["features"]: "p"}
        size = {role: graph.size(letters[role]) for role in letters}
        p = graph.tensors[t["mask"]].p if t["mask"] else 0.0
        case = AttentionCase(size["batch"], size["heads"], size["rows"], size["features"], p,
                             causal=roles.causal is not None)
        lse = f"lse({roles.members[1]})"
        lse_layout = letters["batch"] + letters["heads"] + letters["rows"]  # the kernels' (b, h, j) float32
        result = []
        for q_layout in sorted(q_layouts):
            order = "".join(kernel[x] for x in q_layout)  # the kernels' (b, h, j, p) storage order
            like = {role: "".join({"b": letters["batch"], "h": letters["heads"],
                                   "j": letters["keys" if role in ("k", "v") else "rows"],
                                   "p": letters["value_features" if role in ("v", "o") else "features"]}[x] for x in order)
                    for role in ("q", "k", "v", "o")}
            layout_key = {**{r: order.replace("j", "k") if r in ("k", "v") else order for r in ("q", "k", "v", "o")},
                          "do": order}
            plain_ms: dict[str, float] = {}  # direction -> the measured time without the bias add folded in
            variants = [(None, None)] + ([(bias, None)] if bias else []) + ([(None, repeats)] if repeats else [])
            for folded, grouped in variants:
                timed = replace(case, bias=True) if folded else case
                inputs = {r: folded[r][0] if folded else t[r] for r in ("q", "k", "v")}
                bias_of = {r: {folded[r][1]: graph.tensors[folded[r][1]].letters} if folded else {} for r in ("q", "k", "v")}
                kv_like, grads, groups = like, {r: t[r] for r in ("dq", "dk", "dv")}, None
                if grouped:  # K, V (and dK, dV) over the K/V heads, in their tensors' naming
                    timed = replace(case, KV=graph.size(grouped.letter))
                    inputs.update(k=grouped.tensors["k"], v=grouped.tensors["v"])
                    kv_like = {**like, **{r: "".join(grouped.letter if x == letters["heads"] else x for x in like[r])
                                          for r in ("k", "v")}}
                    grads.update(dk=grouped.tensors["dk"], dv=grouped.tensors["dv"])
                    groups = {"letter": grouped.letter, "size": grouped.size,
                              "repeated": {r: t[r] for r in ("k", "v", "dk", "dv")}}
                for direction, kind, members in (("forward", ATTENTION_FORWARD, roles.members),
                                                 ("backward", ATTENTION_BACKWARD, roles.backward)):
                    found = self.timings.lookup(timed.op(direction), timed.dims, layout_key,
                                                lambda k: k.get("impl") == "fused" and k.get("dropout_mask", "regenerate") == "regenerate"
                                                and (k.get("backward") or {}).get("dropout_mask", "regenerate") == "regenerate")
                    if found is None and self.timings.broken(timed.op(direction), timed.dims, layout_key):
                        continue
                    ms, source, knobs = self.time(found, "attention", timed.flop(direction), timed.bytes(direction))
                    if (folded or grouped) and source == PREDICTED and plain_ms.get(direction) is not None:
                        ms = max(ms, plain_ms[direction])  # the same kernel plus bias loads: not faster than measured without
                    if not (folded or grouped) and source == MEASURED:
                        plain_ms[direction] = ms
                    if direction == "forward":  # with the bias add: its operands (bk too: a parameter the kernels
                        # need not load), and the biased q out for the backward (``kernels.attention``: biases)
                        reads = {**{inputs[r]: kv_like[r] for r in ("q", "k", "v")}, **bias_of["q"], **bias_of["k"],
                                 **bias_of["v"]}
                        if roles.causal:  # not loaded: the causal mask stands in for it (``datamove.module`` checks)
                            reads[roles.causal] = graph.tensors[roles.causal].letters
                        for constant in grouped.constants if grouped else ():  # not loaded either: the kernels' groups
                            reads[constant] = graph.tensors[constant].letters
                        writes = {t["o"]: like["o"], lse: lse_layout, **({t["q"]: like["q"]} if folded else {})}
                        knob = (knobs or {}).get("forward") or {}
                        operators, name = ((folded["op"], *members), f"{folded['op']}+attention_forward") if folded \
                            else (members, "attention_forward")
                        if grouped:  # the repeats of K and V run right before (``attention_repeats``)
                            operators, name = (*grouped.forward, *members), "+".join(grouped.forward) + "+attention_forward"
                    else:
                        reads = {t["q"]: like["q"], inputs["k"]: kv_like["k"], inputs["v"]: kv_like["v"], **bias_of["v"],
                                 t["o"]: like["o"], t["do"]: like["o"], lse: lse_layout}
                        writes = {grads["dq"]: like["q"], grads["dk"]: kv_like["k"], grads["dv"]: kv_like["v"]}
                        knob = {k: v for k, v in ((knobs or {}).get("backward") or {}).items() if k != "dropout_mask"}
                        operators, name = members, "attention_backward"
                        if grouped:  # the group sums of dK and dV run right after
                            operators, name = (*members, *grouped.backward), "+".join(("attention_backward",
                                                                                       *grouped.backward))
                    config = AttentionConfig(knob, {**t, **({**inputs, **grads} if grouped else {}), "lse": lse},
                                             letters, roles.scale,
                                             roles.causal is not None, roles.causal,
                                             {r: list(folded[r]) for r in ("q", "k", "v")} if folded else None, groups)
                    result.append(Candidate(name, graph_phase(direction), kind, operators, reads, writes, config, ms,
                                            source))
        return result

    def layout_change(self, tensor: str, source: str, target: str) -> tuple[float, str]:
        """(ms, source) of copying ``tensor`` from layout ``source`` to ``target`` (asked for once per
        edge of the search: kept per triple)."""
        key = (tensor, source, target)
        if key not in self._changes:
            self._changes[key] = self._layout_change(tensor, source, target)
        return self._changes[key]

    def _layout_change(self, tensor: str, source: str, target: str) -> tuple[float, str]:
        """Measured, else predicted: the cost model's copy time, or the median of the changes measured
        on tensors of this size where that is slower (a tiled transpose runs near one speed whatever
        the permutation; the model's bandwidth is a ceiling it does not reach)."""
        letters = self.graph.tensors[tensor].letters
        elements = self.graph.size(letters)
        found = self.timings.lookup(f"layout:{letters}", {x: self.graph.size(x) for x in letters},
                                    {"from": source, "to": target})
        ms, source_kind, _ = self.time(found, "copy", 0.0, 2 * elements * self.itemsize)
        measured = self.timings.changes_by_size.get(elements) if found is None else None
        if measured:
            ms = max(ms, measured[len(measured) // 2])
        return ms, source_kind


def graph_phase(direction: str) -> str:
    return "forward" if direction == "forward" else "backward"


def _keep(candidates: list[Candidate], spec_letters: dict) -> list[Candidate]:
    """The ``KEEP_PER_OPERATOR`` fastest, measured ones only where any was measured (a prediction
    must not beat a measurement by optimism); among equal times, those closest to spec order first."""
    return _ranked(candidates, spec_letters)[:KEEP_PER_OPERATOR]


def _ranked(candidates: list[Candidate], spec_letters: dict) -> list[Candidate]:
    """``_keep``'s order: measured ones only where any was measured, fastest first, then closest to spec order."""
    def distance(c: Candidate) -> int:
        return sum(layout != spec_letters.get(t, layout) for t, layout in {**c.reads, **c.writes}.items())
    measured = [c for c in candidates if c.source == MEASURED or (c.kind == GENERATED and c.config.composed)]
    return sorted(measured or candidates, key=lambda c: (round(c.time_ms, 6), distance(c)))


def _kept_runs(runs: dict[str, list[Candidate]], order: list[str], spec_letters: dict) -> list[Candidate]:
    """The candidates the search gets: per operator run, ``_keep``'s; for every kept candidate
    before it that writes what it reads, the fastest one reading all of that in the layouts written;
    then, for every kept candidate after it that reads what it writes, the fastest one writing that
    in the layouts read.

    Without the second rule, an operator with hundreds of layout variants within a few percent of
    each other (an element-wise one) can lose every variant matching its producer's layouts to faster
    ones that each need a layout change costing far more than the difference (BERT-large at B=96
    L=128: the Q/K/V bias add's variant in the stacked GEMM's layouts ranked below the 16 kept, and
    the plan paid 0.10 ms of changes to save 0.001 ms).  The third is the same for a producer: on
    an H100 the output projection's GEMM wrote ``ibj`` in its kept variants (17.8 us, 32 of them
    within 0.5 us), and the plan paid a 9.3 us change to the ``bji`` its LayerNorm reads."""
    position = {name: n for n, name in enumerate(order)}
    ordered = sorted((cs for cs in runs.values() if cs), key=lambda cs: position[cs[0].operators[0]])
    ranked_by_run = [_ranked(cs, spec_letters) for cs in ordered]
    kept_by_run: list[list[Candidate]] = []
    for ranked in ranked_by_run:
        kept = ranked[:KEEP_PER_OPERATOR]
        _add_matches(kept, ranked, [c for run in kept_by_run for c in run], "reads", "writes")
        kept_by_run.append(kept)
    for n, ranked in enumerate(ranked_by_run):
        written: dict[str, set] = {}  # what the kept candidates before this run write
        for c in (c for run in kept_by_run[:n] for c in run):
            for t, layout in c.writes.items():
                written.setdefault(t, set()).add(layout)
        # among those writing a consumer's layouts, first those reading what is written before them
        preferred = sorted(ranked, key=lambda c: not all(layout in written[t]
                                                         for t, layout in c.reads.items() if t in written))
        _add_matches(kept_by_run[n], preferred, [c for run in kept_by_run[n + 1:] for c in run], "writes", "reads")
    return [c for run in kept_by_run for c in run]


def _add_matches(kept: list[Candidate], ranked: list[Candidate], others: list[Candidate], mine: str, theirs: str) -> None:
    """Append to ``kept`` the first of ``ranked`` whose ``mine`` ("reads" / "writes") layouts equal
    the ``theirs`` layouts of each of ``others`` on the tensors both name, where one does."""
    names = {t for c in ranked for t in getattr(c, mine)}
    for other in others:
        shared = {t: layout for t, layout in getattr(other, theirs).items() if t in names}
        match = next((c for c in ranked if shared and all(getattr(c, mine).get(t) == l for t, l in shared.items())), None)
        if match is not None and match not in kept:
            kept.append(match)


def execution_order(fused) -> list[str]:
    """The fused graph's operators in order, but the consumer of a GEMM family that moves it
    (``GemmFamily.moves_consumer``: the gradient epilogue, the residual add) right after its GEMM
    where no operator between writes what it reads (GPT-2's ``d_bfc`` after ``d_gelu``, before
    ``d_wout``), so that one candidate can run both (the selection takes contiguous runs)."""
    order = [op.name for op in fused.operators]
    ops = {op.name: op for op in fused.operators}
    for g in training_gemms(fused):
        found = next((f.consumer(p) for f in GEMM_FAMILIES if f.moves_consumer for p in (f.match(fused, g),)
                      if p is not None), None)
        if found is None:
            continue
        start, at = order.index(g.name), order.index(found)
        between = {t for name in order[start + 1:at] for t in ops[name].outputs}
        if at > start + 1 and not between & set(ops[found].inputs):
            order.insert(start + 1, order.pop(at))
    return order


def plan_layer(fused, spec: str, *, dtype: str, figures: DeviceFigures, timings: Timings = NO_TIMINGS,
               boundary: dict | None = None, device: str | None = None) -> Plan:
    """Select the plan of ``fused`` (see the module doc).  ``boundary``: {tensor -> layout} fixed
    from outside (the layer's activations, outputs and their gradients in PyTorch's order)."""
    graph = fused.graph
    builder = CandidateBuilder(fused, spec, dtype, figures, timings)
    spec_letters = {t: info.letters for t, info in graph.tensors.items()}
    runs: dict[str, list[Candidate]] = {}
    for op in fused.operators:
        if op.cls != "contraction":
            runs[op.name] = builder.generated(op)
    for join in column_sum_joins(graph, fused.operators):  # run as one kernel: the members' names
        members = join_members(join, fused.operators)
        runs[join.name] = [replace(c, operators=members) for c in builder.generated(join)]
    runs.update(builder.gemms())
    roles, why = attention_roles(fused)
    repeats = None
    if roles is not None:
        producers = [c for cs in runs.values() for c in cs if roles.tensors["q"] in c.writes]
        bias = attention_bias(fused, roles)
        repeats = attention_repeats(fused, roles)
        q_layouts = {c.writes[roles.tensors["q"]] for c in _keep(producers, spec_letters)}
        if bias:  # the folded forward reads what the bias operator reads: its producers' layouts too
            q_layouts |= {c.writes[bias["q"][0]] for cs in runs.values() for c in _keep(cs, spec_letters) if bias["q"][0] in c.writes}
        for c in builder.attention(roles, q_layouts, bias, repeats):
            runs.setdefault(c.name + ("+bias" if c.config.bias else ""), []).append(c)
    written: dict[str, set] = {}
    for c in (c for cs in runs.values() for c in cs):
        for t, layout in c.writes.items():
            written.setdefault(t, set()).add(layout)
    for op in fused.operators:
        if op.cls != "contraction":
            runs[op.name] += builder.composed(op, written)
    order = builder.order
    candidates = _kept_runs(runs, order, spec_letters)
    missing = [op.name for op in fused.operators if not any(op.name in c.operators for c in candidates)]
    if missing:
        raise ValueError(f"operators without a candidate that runs: {', '.join(missing)}")
    boundary = dict(boundary or {})
    outputs = tuple(t for t, info in graph.tensors.items() if info.role in ("output", "gradient"))
    produced = {t for op in fused.operators for t in op.outputs} | {t for c in candidates for t in c.writes}
    steps, facts = select(order, candidates, produced=produced, boundary=boundary, change_cost=builder.layout_change,
                          outputs=outputs)
    facts["attention"] = "fused candidate" if roles is not None else f"none: {why}"
    if repeats is not None:
        facts["attention"] += (f" (and grouped-query: K/V over {repeats.letter}, {repeats.size} query heads each, "
                               f"read in place of {roles.tensors['k']} / {roles.tensors['v']})")
    return to_plan(steps, facts, spec=spec, dims=dict(graph.dim_values), dtype=dtype,
                   device=device or f"cost model: {figures.name}", layouts_of_inputs=boundary,
                   total_best=best_sum(order, candidates))
