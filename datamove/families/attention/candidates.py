"""The fused attention's selection candidates: its forward and backward, in every layout the
producer of its inputs can write, in place of the score contraction, softmax and output
contraction (and their backward operators); with its causal mask where the softmax reads the
scores plus a constant over (query, key) positions (GPT-2's additive mask,
``launch.check_causal_constant``); with the bias add before it folded in (``attention_bias``);
with grouped-query attention (``attention_repeats``: Llama's K and V repeated over the query heads
by np.repeat's matrix) also grouped, reading K and V before the repeat and writing their
gradients, in place of the repeats and their backward too.  Timed by the selection's
``datamove.candidates.CandidateBuilder`` (the tuning database's records, else the cost model):
each pass at each layout is its fastest plannable record (``_plannable``), the generated kernels'
or cuDNN's (``kernels.attention.library``, measured where it takes the case), whose knobs the
step carries (``_step_knobs``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from datamove.dataflow.attention import AttentionRoles
from datamove.families.attention.pattern import AttentionPattern, AttentionRepeats
from datamove.families.attention.variants import AttentionCase
from datamove.layouts.plan import ATTENTION_BACKWARD, ATTENTION_FORWARD, MEASURED, PREDICTED
from datamove.layouts.select import Candidate
from datamove.layouts.step_config import AttentionConfig


def q_layouts(pattern: AttentionPattern, runs: dict, kept) -> set[str]:
    """The storage orders of q to offer the attention in: those the kept candidates writing q write
    it in (``runs``: {run: [Candidate]}; ``kept(candidates)``: those the search keeps of a run);
    with a bias add folded in (the forward then reads what the bias operator reads) those its
    producers write too."""
    q = pattern.roles.tensors["q"]
    layouts = {c.writes[q] for c in kept([c for cs in runs.values() for c in cs if q in c.writes])}
    if pattern.bias:
        before = pattern.bias["q"][0]
        layouts |= {c.writes[before] for cs in runs.values() for c in kept(cs) if before in c.writes}
    return layouts


@dataclass(frozen=True)
class _Variant:
    """One way the attention is offered at one storage order: plain, with the bias add folded in
    (``folded``: ``attention_bias``) or grouped (``grouped``: ``attention_repeats``).  ``timed``: its
    tuning case; ``inputs`` / ``grads``: role -> the tensor read / written; ``bias_of``: role ->
    {bias: letters} read; ``kv_like``: role -> layout, K and V over the K/V heads where grouped."""

    timed: AttentionCase
    inputs: dict
    grads: dict
    bias_of: dict
    kv_like: dict
    groups: dict | None
    folded: dict | None = None
    grouped: AttentionRepeats | None = None


def _variants(graph, roles: AttentionRoles, case: AttentionCase, like: dict, bias: dict | None,
              repeats: AttentionRepeats | None) -> list[_Variant]:
    t, heads = roles.tensors, roles.letters["heads"]
    plain = _Variant(case, {r: t[r] for r in "qkv"}, {r: t[r] for r in ("dq", "dk", "dv")}, {r: {} for r in "qkv"},
                     like, None)
    result = [plain]
    if bias:
        result.append(replace(plain, timed=replace(case, bias=True), inputs={r: bias[r][0] for r in "qkv"},
                              bias_of={r: {bias[r][1]: graph.tensors[bias[r][1]].letters} for r in "qkv"}, folded=bias))
    if repeats:  # K, V (and dK, dV) over the K/V heads, in their tensors' naming
        kv_like = {**like, **{r: "".join(repeats.letter if x == heads else x for x in like[r]) for r in ("k", "v")}}
        result.append(replace(plain, timed=replace(case, KV=graph.size(repeats.letter)),
                              inputs={**plain.inputs, "k": repeats.tensors["k"], "v": repeats.tensors["v"]},
                              grads={**plain.grads, "dk": repeats.tensors["dk"], "dv": repeats.tensors["dv"]},
                              kv_like=kv_like, grouped=repeats,
                              groups={"letter": repeats.letter, "size": repeats.size,
                                      "repeated": {r: t[r] for r in ("k", "v", "dk", "dv")}}))
    return result


PLANNED_MASK_OPTIONS = ("regenerate",)  # the dropout-mask options a plan runs (``kernels.attention``'s module doc)


def _plannable(knobs: dict) -> bool:
    """A timing the plan can run: the fused kernels regenerating the dropout mask in the backward
    (nothing saved: ``PLANNED_MASK_OPTIONS``), or cuDNN's attention (measured only without dropout)."""
    if knobs.get("impl") == "cudnn":
        return True
    return knobs.get("impl") == "fused" and knobs.get("dropout_mask", "regenerate") in PLANNED_MASK_OPTIONS \
        and (knobs.get("backward") or {}).get("dropout_mask", "regenerate") in PLANNED_MASK_OPTIONS


def _step_knobs(knobs: dict | None, direction: str) -> dict:
    """The plan step's knobs from a timing's: cuDNN's ``{"impl": "cudnn"}``; the fused kernels'
    configuration of ``direction`` (empty: the default)."""
    if (knobs or {}).get("impl") == "cudnn":
        return {"impl": "cudnn"}
    return (knobs or {}).get(direction) or {}


def _forward(graph, roles: AttentionRoles, v: _Variant, like: dict, lse: tuple, knobs: dict | None) -> tuple:
    """(reads, writes, knobs, operators, name) of the forward: with the bias add, its operands (bk
    too: a parameter the kernels need not load) and the biased q out for the backward
    (``kernels.attention``: biases)."""
    t = roles.tensors
    reads = {**{v.inputs[r]: v.kv_like[r] for r in "qkv"}, **v.bias_of["q"], **v.bias_of["k"], **v.bias_of["v"]}
    if roles.causal:  # not loaded: the causal mask stands in for it (``launch.check_causal_constant``)
        reads[roles.causal] = graph.tensors[roles.causal].letters
    for constant in v.grouped.constants if v.grouped else ():  # not loaded either: the kernels' groups
        reads[constant] = graph.tensors[constant].letters
    writes = {t["o"]: like["o"], lse[0]: lse[1], **({t["q"]: like["q"]} if v.folded else {})}
    members = roles.members
    operators, name = ((v.folded["op"], *members), f"{v.folded['op']}+attention_forward") if v.folded \
        else (members, "attention_forward")
    if v.grouped:  # the repeats of K and V run right before (``attention_repeats``)
        operators, name = (*v.grouped.forward, *members), "+".join(v.grouped.forward) + "+attention_forward"
    return reads, writes, _step_knobs(knobs, "forward"), operators, name


def _backward(roles: AttentionRoles, v: _Variant, like: dict, lse: tuple, knobs: dict | None) -> tuple:
    """(reads, writes, knobs, operators, name) of the backward; grouped, the group sums of dK and
    dV run right after."""
    t = roles.tensors
    reads = {t["q"]: like["q"], v.inputs["k"]: v.kv_like["k"], v.inputs["v"]: v.kv_like["v"], **v.bias_of["v"],
             t["o"]: like["o"], t["do"]: like["o"], lse[0]: lse[1]}
    writes = {v.grads["dq"]: like["q"], v.grads["dk"]: v.kv_like["k"], v.grads["dv"]: v.kv_like["v"]}
    knob = {k: x for k, x in _step_knobs(knobs, "backward").items() if k != "dropout_mask"}
    operators, name = roles.backward, "attention_backward"
    if v.grouped:
        operators, name = (*roles.backward, *v.grouped.backward), "+".join(("attention_backward", *v.grouped.backward))
    return reads, writes, knob, operators, name


def attention_candidates(builder, roles: AttentionRoles, q_layouts: set[str], bias: dict | None = None,
                         repeats: AttentionRepeats | None = None) -> list[Candidate]:
    """The fused attention's forward and backward in each storage order of ``q_layouts``; with
    ``bias`` (``attention_bias``) also with that bias add folded in: a forward covering the bias
    operator too and a backward, both reading the tensors before the add and the biases; one of
    those not measured is priced no faster than the measured one without the bias add.  With
    ``repeats`` (``attention_repeats``: grouped-query attention) also the grouped attention: a
    forward covering the repeat of K and V too, reading the K/V tensors before it, and a
    backward covering the repeat's backward (the sums of dK, dV over each group), reading those
    and writing their gradients (K/V in q's storage order, their heads letter for q's); one not
    measured is priced no faster than the measured one without groups.  ``builder``: a
    ``datamove.candidates.CandidateBuilder`` (``graph``, ``timings``, ``time``)."""
    graph, letters, t = builder.graph, roles.letters, roles.tensors
    kernel = {letters["batch"]: "b", letters["heads"]: "h", letters["rows"]: "j", letters["features"]: "p"}
    size = {role: graph.size(letters[role]) for role in letters}
    p = graph.tensors[t["mask"]].p if t["mask"] else 0.0
    case = AttentionCase(size["batch"], size["heads"], size["rows"], size["features"], p, causal=roles.causal is not None)
    lse = (f"lse({roles.members[1]})", letters["batch"] + letters["heads"] + letters["rows"])  # the kernels' (b, h, j) float32
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
        for v in _variants(graph, roles, case, like, bias, repeats):
            for direction, kind in (("forward", ATTENTION_FORWARD), ("backward", ATTENTION_BACKWARD)):
                timed = v.timed
                found = builder.timings.lookup(timed.op(direction), timed.dims, layout_key, _plannable)
                if found is None and builder.timings.broken(timed.op(direction), timed.dims, layout_key):
                    continue
                ms, source, knobs = builder.time(found, "attention", timed.flop(direction), timed.bytes(direction))
                if (v.folded or v.grouped) and source == PREDICTED and plain_ms.get(direction) is not None:
                    ms = max(ms, plain_ms[direction])  # the same kernel plus bias loads: not faster than measured without
                if not (v.folded or v.grouped) and source == MEASURED:
                    plain_ms[direction] = ms
                reads, writes, knob, operators, name = _forward(graph, roles, v, like, lse, knobs) \
                    if direction == "forward" else _backward(roles, v, like, lse, knobs)
                config = AttentionConfig(knob, {**t, **({**v.inputs, **v.grads} if v.grouped else {}), "lse": lse[0]},
                                         letters, roles.scale, roles.causal is not None, roles.causal,
                                         {r: list(v.folded[r]) for r in "qkv"} if v.folded else None, v.groups)
                result.append(Candidate(name, direction, kind, operators, reads, writes, config, ms, source))
    return result
