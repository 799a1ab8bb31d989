"""The layout selection (``layouts.select``) against brute force, and the plans of both specs.

Brute force: every way of covering the operator order with candidates, each priced by walking it
(a tensor read in a layout it is neither stored in nor was copied to pays a change, once; a parameter takes its first
reader's layout; a tensor nobody wrote yet cannot be read; an output leaves in its boundary
layout), the cheapest kept.  Synthetic graphs small enough to enumerate: one where a layout change
pays, one where a residual constrains the choice, one where a forward choice costs the backward,
one where a fused forward needs its own backward.
"""
import time
from dataclasses import replace

import pytest

from datamove.dataflow.snapshot import stored_fused
from datamove.candidates import Timings, plan_layer
from datamove.harness.tuning_db import Key, Record
from datamove.kernels.attention import KERNEL_ID as ATTENTION_ID
from datamove.kernels.layout_change import KERNEL_ID as LAYOUT_CHANGE_ID
from datamove.layouts.cost_model import device_figures
from datamove.layouts.plan import LAYOUT_CHANGE
from datamove.layouts.select import Candidate, NoPlan, select
from datamove.layouts.step_config import GeneratedConfig

CHANGE_MS = 1.0


def change_cost(tensor, source, target):
    return CHANGE_MS, "predicted"


def cand(name, ops, reads, writes, ms, phase="forward"):
    return Candidate(name, phase, "generated", tuple(ops), dict(reads), dict(writes), GeneratedConfig({}), ms, "predicted")


def brute_force(order, candidates, produced, boundary, outputs=()):
    best = float("inf")
    by_start = {}
    for c in candidates:
        by_start.setdefault(order.index(c.operators[0]), []).append(c)

    def covers(index):
        if index == len(order):
            yield []
            return
        for c in by_start.get(index, []):
            for rest in covers(index + len(c.operators)):
                yield [c] + rest

    for chain in covers(0):
        stored, cost, valid = {t: {layout} for t, layout in boundary.items()}, 0.0, True
        for c in chain:
            cost += c.time_ms
            for t, layout in c.reads.items():
                if t not in stored:
                    if t in produced:
                        valid = False
                        break
                    stored[t] = {layout}
                if layout not in stored[t]:  # a copy, kept for later readers
                    cost += CHANGE_MS
                    stored[t].add(layout)
            for t, layout in c.writes.items():
                stored[t] = {layout}
                if t in outputs and t in boundary and boundary[t] != layout:
                    cost += CHANGE_MS
            if not valid:
                break
        if valid:
            best = min(best, cost)
    return best


def searched(order, candidates, produced, boundary, outputs=()):
    steps, facts = select(order, candidates, produced=produced, boundary=boundary, change_cost=change_cost,
                          outputs=outputs)
    assert [op for c, _ in steps for op in c.operators] == order
    return sum(c.time_ms + sum(ch[3] for ch in changes) for c, changes in steps)


GRAPHS = {
    # A writes t fast in "xy", B reads it fast only in "yx": paying the change (1.0) beats both slow options
    "change_pays": (["A", "B"], [
        cand("A1", ["A"], {"p": "ab"}, {"t": "xy"}, 1.0), cand("A2", ["A"], {"p": "ab"}, {"t": "yx"}, 3.5),
        cand("B1", ["B"], {"t": "yx"}, {"u": "xy"}, 1.0), cand("B2", ["B"], {"t": "xy"}, {"u": "xy"}, 3.5)],
        {"t", "u"}, {}, ()),
    # the residual r written by A is read again by C: C's fast layout for r forces A's choice
    "residual": (["A", "B", "C"], [
        cand("A1", ["A"], {"x": "ab"}, {"r": "ab"}, 1.0), cand("A2", ["A"], {"x": "ab"}, {"r": "ba"}, 1.2),
        cand("B1", ["B"], {"r": "ab"}, {"h": "ab"}, 1.0), cand("B2", ["B"], {"r": "ba"}, {"h": "ab"}, 1.1),
        cand("C1", ["C"], {"h": "ab", "r": "ba"}, {"y": "ab"}, 1.0), cand("C2", ["C"], {"h": "ab", "r": "ab"}, {"y": "ab"}, 2.5)],
        {"r", "h", "y"}, {"x": "ab", "y": "ab"}, ("y",)),
    # the forward's cheap layout for a saved activation costs the backward more
    "forward_costs_backward": (["F", "G", "H"], [
        cand("F1", ["F"], {"x": "ab"}, {"s": "ab"}, 1.0), cand("F2", ["F"], {"x": "ab"}, {"s": "ba"}, 1.4),
        cand("G1", ["G"], {"s": "ab"}, {"y": "ab"}, 1.0), cand("G2", ["G"], {"s": "ba"}, {"y": "ab"}, 1.0),
        cand("H1", ["H"], {"s": "ba", "y": "ab"}, {"d": "ab"}, 1.0, "backward"),
        cand("H2", ["H"], {"s": "ab", "y": "ab"}, {"d": "ab"}, 2.9, "backward")],
        {"s", "y", "d"}, {"x": "ab"}, ("d",)),
    # t is read twice in "yx" (the second time by the backward): one change serves both readers
    "copy_serves_later_readers": (["A", "B", "C", "D"], [
        cand("A1", ["A"], {"x": "ab"}, {"t": "xy"}, 1.0), cand("A2", ["A"], {"x": "ab"}, {"t": "yx"}, 2.5),
        cand("B1", ["B"], {"t": "yx"}, {"u": "xy"}, 1.0), cand("C1", ["C"], {"t": "xy", "u": "xy"}, {"v": "xy"}, 1.0),
        cand("D1", ["D"], {"t": "yx", "v": "xy"}, {"d": "xy"}, 1.0, "backward")],
        {"t", "u", "v", "d"}, {"x": "ab"}, ("d",)),
    # a fused forward writes statistics only its backward reads; the unfused backward needs probabilities
    "fused_pair": (["S", "P", "O", "dO", "dP"], [
        cand("S", ["S"], {"q": "ab"}, {"s": "ab"}, 1.0), cand("P", ["P"], {"s": "ab"}, {"p": "ab"}, 1.0),
        cand("O", ["O"], {"p": "ab"}, {"o": "ab"}, 1.0), cand("fused", ["S", "P", "O"], {"q": "ab"}, {"o": "ab", "lse": "a"}, 1.5),
        cand("dO", ["dO"], {"o": "ab", "p": "ab"}, {"dp": "ab"}, 1.0, "backward"),
        cand("dP", ["dP"], {"dp": "ab"}, {"dq": "ab"}, 1.0, "backward"),
        cand("fused_bwd", ["dO", "dP"], {"o": "ab", "lse": "a", "q": "ab"}, {"dq": "ab"}, 3.0, "backward")],
        {"s", "p", "o", "lse", "dp", "dq"}, {"q": "ab"}, ("dq",)),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_search_finds_the_brute_force_optimum(name):
    order, candidates, produced, boundary, outputs = GRAPHS[name]
    assert searched(order, candidates, produced, boundary, outputs) == pytest.approx(
        brute_force(order, candidates, produced, boundary, outputs))


def test_random_graphs_match_brute_force():
    import random

    rng = random.Random(7)
    for trial in range(30):
        order = [f"op{n}" for n in range(5)]
        tensors = [f"t{n}" for n in range(5)]
        candidates = []
        for n, op in enumerate(order):
            for k in range(rng.randint(1, 3)):
                reads = {t: rng.choice(("ab", "ba")) for t in rng.sample(tensors[:n] + ["w"], k=min(2, n + 1))}
                candidates.append(cand(f"{op}_{k}", [op], reads, {tensors[n]: rng.choice(("ab", "ba"))},
                                       round(rng.uniform(0.5, 3.0), 3)))
        produced = set(tensors)
        assert searched(order, candidates, produced, {}) == pytest.approx(brute_force(order, candidates, produced, {}))


def test_unreachable_plan_names_the_operator():
    order = ["A", "B"]
    candidates = [cand("A", ["A"], {}, {"t": "ab"}, 1.0), cand("B", ["B"], {"u": "ab"}, {"v": "ab"}, 1.0)]
    with pytest.raises(NoPlan, match="before operator 'B'.*B reads u, which no chosen kernel before it writes"):
        select(order, candidates, produced={"t", "u", "v"}, boundary={}, change_cost=change_cost)


def _consistent(plan, graph):
    """Every tensor one stored layout; every read in it or through an earlier layout change."""
    copies = set()
    for step in plan.steps:
        if step.kind == LAYOUT_CHANGE:
            copies.add((step.config.tensor, step.config.target))
            continue
        for t, layout in step.reads.items():
            assert layout == plan.layouts[t] or (t, layout) in copies, (step.name, t, layout, plan.layouts[t])
        for t, layout in step.writes.items():
            assert plan.layouts[t] == layout, (step.name, t)


@pytest.mark.parametrize("spec", ["bert", "gpt2"])
def test_both_specs_select_a_complete_plan_with_the_cost_model(spec):
    fused = stored_fused()[spec]
    boundary = {"x": "bji", "y": "bji", "d_x": "bji", "d_y": "bji"} if spec == "bert" else {}
    started = time.monotonic()
    plan = plan_layer(fused, spec, dtype="bfloat16", figures=device_figures("H100"), boundary=boundary)
    assert time.monotonic() - started < 30
    covered = [op for s in plan.steps for op in s.operators]
    assert sorted(covered) == sorted(op.name for op in fused.operators)
    _consistent(plan, fused.graph)
    assert plan.timing == "predicted" and plan.device.startswith("cost model")
    assert plan.best_sum_ms <= plan.total_ms
    kinds = {s.kind for s in plan.steps}
    assert {"attention_forward", "attention_backward"} <= kinds  # GPT-2's: causal, for its additive mask
    assert {s.config.causal for s in plan.steps if s.kind.startswith("attention")} == {spec == "gpt2"}
    for step in plan.steps:  # stacked operands: every member stored in the same order of its axes
        for members in [m for m in (getattr(step.config, "operands", None) or {}).values() if len(m) > 1]:
            orders = {tuple(fused.graph.tensors[t].letters.index(x) for x in plan.layouts[t]) for t in members}
            assert len(orders) == 1, (step.name, members)


def test_timings_of_another_device_or_dtype_are_refused():
    key = Key("NVIDIA H200", {}, "gemm:ui,ibj->ubj", {}, "bfloat16", {}, {"backend": "cublas"})
    with pytest.raises(ValueError, match="from NVIDIA H200 / bfloat16; this selection is for NVIDIA H100 80GB HBM3 / bfloat16"):
        Timings([Record(key, "ok", 0.05)], "NVIDIA H100 80GB HBM3", "bfloat16")
    with pytest.raises(ValueError, match="/ float16"):
        Timings([Record(key, "ok", 0.05)], "NVIDIA H200", "float16")


def test_unmeasured_layout_change_priced_like_measured_ones_of_its_size():
    """A change not measured yet costs at least the median of the changes measured on tensors of
    its size (a transposing copy runs near one speed whatever the permutation), so the selection
    does not chase the cost model's optimism round after round; a measured change keeps its time."""
    from datamove.candidates import CandidateBuilder

    fused = stored_fused()["bert"]
    graph = fused.graph
    sizes = {x: graph.size(x) for x in "phbjk"}
    device = "NVIDIA H200"

    def change(letters, source, target, ms, kernel=LAYOUT_CHANGE_ID):
        key = Key(device, {}, f"layout:{letters}", {x: sizes[x] for x in letters}, "bfloat16",
                  {"from": source, "to": target}, {"impl": "triton-tiles", "kernel": kernel})
        return Record(key, "ok", ms)

    older = change("phbj", "phbj", "bpjh", 0.001, kernel="an-older-one")  # another version's timing: left out
    timings = Timings([change("phbj", "phbj", "bjph", 0.026), change("phbj", "bjph", "phbj", 0.027),
                       change("phbj", "phbj", "bpjh", 0.025), older], device, "bfloat16")
    builder = CandidateBuilder(fused, "bert", "bfloat16", device_figures("H200"), timings)
    unmeasured = CandidateBuilder(fused, "bert", "bfloat16", device_figures("H200"), Timings([], device, "bfloat16"))
    model_ms, source = unmeasured.layout_change("k", "phbk", "bkph")
    assert source == "predicted" and model_ms < 0.026
    assert builder.layout_change("k", "phbk", "bkph") == (0.026, "predicted")  # wk's size: the median
    assert builder.layout_change("q", "phbj", "bpjh") == (0.025, "measured")
    assert builder.layout_change("pre_act", "bju", "ubj") == unmeasured.layout_change("pre_act", "bju", "ubj")  # 4x more


def test_operator_without_candidate_is_named(monkeypatch):
    import datamove.candidates as candidates

    fused = stored_fused()["bert"]
    monkeypatch.setattr(candidates.CandidateBuilder, "generated", lambda self, op: [])
    # (the Q/K/V bias add still runs inside the attention, which folds it in)
    with pytest.raises(ValueError, match="operators without a candidate that runs: x1, y, d_ln2_gamma"):
        plan_layer(fused, "bert", dtype="bfloat16", figures=device_figures("H100"))



def test_states_per_position_bound_the_search(monkeypatch):
    """With the bound reached the search still returns a complete plan, no cheaper than the optimum,
    and says how many nodes it dropped; the GPT-2 layer at test sizes (32k states unbounded) is
    selected in seconds."""
    import random

    import datamove.layouts.select as search

    rng = random.Random(11)
    order = [f"op{n}" for n in range(6)]
    tensors = [f"t{n}" for n in range(6)]
    candidates = [cand(f"{op}_{k}", [op], {t: rng.choice(("ab", "ba")) for t in (tensors[:n] or ["w"])[-3:]},
                       {tensors[n]: ("ab", "ba")[k % 2]}, round(rng.uniform(0.5, 3.0), 3))
                  for n, op in enumerate(order) for k in range(4)]
    optimum = brute_force(order, candidates, set(tensors), {})
    monkeypatch.setattr(search, "STATES_PER_POSITION", 1)
    steps, facts = select(order, candidates, produced=set(tensors), boundary={}, change_cost=change_cost)
    assert [op for c, _ in steps for op in c.operators] == order
    assert facts["dropped"] > 0
    assert sum(c.time_ms + sum(ch[3] for ch in changes) for c, changes in steps) >= optimum - 1e-9
    monkeypatch.undo()
    fused = stored_fused()["gpt2"].with_dims(dict(B=2, T=21, D=32, H=2, E=16, F=72))
    started = time.monotonic()
    plan = plan_layer(fused, "gpt2", dtype="float32", figures=device_figures("H100"))
    assert time.monotonic() - started < 20
    _consistent(plan, fused.graph)


def test_a_consumer_keeps_its_variant_in_the_producers_layouts():
    """An element-wise operator with more near-equal layout variants than are kept per operator keeps
    the one reading its producer's layouts too (B=96 L=128 on the H200: the Q/K/V bias add's variant
    in the stacked GEMM's layouts ranked 17th, and the plan paid two layout changes of 0.025 ms to
    save 0.001 ms), so the search can choose it."""
    from datamove.candidates import KEEP_PER_OPERATOR, _kept_runs

    producer = cand("gemm", ["gemm"], {"w": "ab"}, {"t": "abc", "u": "abc"}, 1.0)
    layouts = ["acb", "bac", "bca", "cab", "cba"]
    others = [cand("add", ["add"], {"t": layouts[n % 5], "u": layouts[(n // 5) % 5]}, {"v": "abc"}, 0.100 + n * 1e-4)
              for n in range(KEEP_PER_OPERATOR + 4)]
    matching = cand("add", ["add"], {"t": "abc", "u": "abc"}, {"v": "abc"}, 0.101 + KEEP_PER_OPERATOR * 1e-4)  # past all
    runs = {"gemm": [producer], "add": others + [matching]}
    kept = _kept_runs(runs, ["gemm", "add"], {"t": "abc", "u": "abc", "v": "abc"})
    assert matching in kept and len([c for c in kept if c.name == "add"]) == KEEP_PER_OPERATOR + 1
    steps, _ = select(["gemm", "add"], kept, produced={"t", "u", "v"}, boundary={}, change_cost=change_cost)
    assert [c for c, _ in steps] == [producer, matching] and all(not changes for _, changes in steps)


def test_a_producer_keeps_its_variant_writing_what_its_consumer_reads():
    """A GEMM with more near-equal layout variants than are kept per operator keeps the one writing
    the layout its consumer's kept variants read, among those the one reading what its own producer
    writes (an H100's BERT-large plan: the output projection's variants writing ``bji`` for its
    LayerNorm ranked past the kept ones, and the plan paid a 9.3 us change for 0.4 us), so the
    search can choose it."""
    from datamove.candidates import KEEP_PER_OPERATOR, _kept_runs

    source = cand("attention", ["attention"], {}, {"g": "ab"}, 1.0)
    layouts = ["ab", "ba"]
    gemms = [cand("gemm", ["gemm"], {"g": layouts[n % 2]}, {"t": "cab"}, 0.100 + n * 1e-4)
             for n in range(KEEP_PER_OPERATOR + 4)]
    past = 0.101 + KEEP_PER_OPERATOR * 1e-4  # slower than every one of gemms
    elsewhere = cand("gemm", ["gemm"], {"g": "ba"}, {"t": "abc"}, past)  # the consumer's layout, reading g as no one writes it
    matching = cand("gemm", ["gemm"], {"g": "ab"}, {"t": "abc"}, past + 1e-4)
    consumer = cand("norm", ["norm"], {"t": "abc"}, {"v": "abc"}, 0.05)
    runs = {"attention": [source], "gemm": gemms + [elsewhere, matching], "norm": [consumer]}
    kept = _kept_runs(runs, ["attention", "gemm", "norm"], {"g": "ab", "t": "abc", "v": "abc"})
    assert matching in kept and elsewhere not in kept
    assert len([c for c in kept if c.name == "gemm"]) == KEEP_PER_OPERATOR + 1
    steps, _ = select(["attention", "gemm", "norm"], kept, produced={"g", "t", "v"}, boundary={}, change_cost=change_cost)
    assert [c for c, _ in steps] == [source, matching, consumer] and all(not changes for _, changes in steps)


def test_a_kernel_that_never_ran_is_not_offered_and_a_folded_one_is_not_cheaper():
    """A variant whose every record failed or was wrong (and none ran) gets no candidate: the cost
    model is not asked to guess at a kernel known not to run here (the H200 run of 2026-11-25: every
    biased attention backward failed to compile, and the plan took one at a predicted 0.063 ms where
    the plain backward measured 0.117).  The attention with the bias add folded in, not measured, is
    priced no faster than the measured one without it (the same kernel plus bias loads)."""
    from datamove.candidates import CandidateBuilder
    from datamove.families.attention import attention_bias, attention_roles
    from datamove.families.attention.variants import AttentionCase

    fused = stored_fused()["bert"]
    device = "NVIDIA H200"
    roles, _ = attention_roles(fused)
    bias = attention_bias(fused, roles)
    case = AttentionCase(*(fused.graph.size(roles.letters[r]) for r in ("batch", "heads", "rows", "features")),
                         fused.graph.tensors[roles.tensors["mask"]].p)
    layout = {"q": "phbj", "k": "phbk", "v": "phbk", "o": "phbj", "do": "phbj"}

    def record(direction, status, ms=None, folded=False, kernel=ATTENTION_ID):
        timed = replace(case, bias=folded)
        return Record(Key(device, {}, timed.op(direction), timed.dims, "bfloat16", layout,
                          {"impl": "fused", "kernel": kernel}), status, ms)

    plain = {"forward": 5.0, "backward": 7.0}  # slower than the model's guesses
    older = record("forward", "ok", 0.001, kernel="an-older-one")  # another version of the kernels: left out
    timings = Timings([record(d, "ok", ms) for d, ms in plain.items()] + [record("backward", "failed", folded=True),
                       record("backward", "wrong", folded=True), older], device, "bfloat16")
    assert timings.broken(replace(case, bias=True).op("backward"), case.dims, layout)
    assert not timings.broken(case.op("backward"), case.dims, layout)
    builder = CandidateBuilder(fused, "bert", "bfloat16", device_figures("H200"), timings)
    found = {(c.name, c.config.bias is not None): c for c in builder.attention(roles, {"phbj"}, bias)}
    assert set(found) == {("attention_forward", False), ("attention_backward", False),
                          (f"{bias['op']}+attention_forward", True)}
    assert found[("attention_forward", False)].time_ms == plain["forward"]
    assert found[(f"{bias['op']}+attention_forward", True)].time_ms == plain["forward"]
    assert found[(f"{bias['op']}+attention_forward", True)].source == "predicted"


def test_an_operator_of_parts_is_offered_each_part_at_its_best():
    """An operator of several parts is measured with one part away from its defaults at a time
    (``layouts.space`` rule 5), so no measurement has every part where its producer writes it
    (GPT-2's Q/K/V bias gradients on the H100: each member summed along strided rows, 47 us, plus
    two layout changes of 8.8 us).  ``composed`` offers each part at its own measured best,
    priced as the all-default time plus each part's measured difference, kept beside the
    measurements; once measured, its measurement; a combination that only failed is not offered."""
    from datamove.candidates import CandidateBuilder, _keep
    from datamove.harness.sweep_variants import op_signature
    from datamove.layouts.space import configurations, default_configuration, parts

    fused = stored_fused()["gpt2"]
    graph, device = fused.graph, "NVIDIA H100 80GB HBM3"
    op = next(o for o in fused.operators if o.name == "stack(d_bv,d_bk,d_bq)")
    base = default_configuration(graph, op)
    wanted = {"d_v": "hebt", "d_k": "hebt", "d_q": "hebs"}

    def record(config, ms, status="ok"):
        key = Key(device, {}, op_signature("gpt2", op), dict(graph.dim_values), "bfloat16", config.layouts, config.knobs)
        return Record(key, status, ms)

    records, varied = [record(base, 0.050)], {}
    for config in configurations(graph, op):
        away = [k for k, part in enumerate(parts(op)) if any(config.layouts[t] != base.layouts[t] for t in part.inputs)]
        if len(away) == 1 and all(config.layouts[t] in (base.layouts[t], wanted[t]) for t in wanted):
            varied.setdefault(away[0], config)
            records.append(record(config, 0.048 if varied[away[0]] is config else 0.049))
    assert sorted(varied) == [0, 1, 2]
    written = {t: {layout} for t, layout in wanted.items()}

    def offered(extra=()):
        builder = CandidateBuilder(fused, "gpt2", "bfloat16", device_figures("H100"),
                                   Timings(records + list(extra), device, "bfloat16"))
        return {tuple(sorted(c.reads.items())): c for c in builder.composed(op, written)}

    composite = offered()[tuple(sorted(wanted.items()))]
    assert composite.source == "predicted" and composite.time_ms == pytest.approx(0.050 - 3 * 0.002)
    assert composite.config.knobs["parts"] == tuple(varied[k].knobs["parts"][k] for k in range(3))
    assert set(composite.config.composed) >= {composite.config.knobs["num_warps"]}
    assert composite in _keep([composite] + [replace(composite, source="measured", time_ms=0.047, config={})], {})
    from datamove.layouts.space import Configuration
    layouts = {**composite.reads, **composite.writes, **composite.config.masks}
    run = Configuration(layouts, {**composite.config.knobs, "num_warps": 8})
    measured = offered([record(run, 0.009)])[tuple(sorted(wanted.items()))]
    assert (measured.source, measured.time_ms, measured.config.knobs["num_warps"]) == ("measured", 0.009, 8)
    assert measured.config.composed  # the main job tunes its parts together next
    retuned = Configuration(layouts, {**run.knobs, "num_warps": 2, "parts": ({**run.knobs["parts"][0], "block_row": 2},
                                                                          *run.knobs["parts"][1:])})
    best = offered([record(run, 0.009), record(retuned, 0.007)])[tuple(sorted(wanted.items()))]
    assert (best.time_ms, best.config.knobs) == (0.007, retuned.knobs)  # the fastest setting of these layouts
    assert tuple(sorted(wanted.items())) not in offered([record(run, None, "failed")])
    assert CandidateBuilder(fused, "gpt2", "bfloat16", device_figures("H100"),
                            Timings(records[1:], device, "bfloat16")).composed(op, written) == []  # no base measured


def test_fused_epilogue_candidates_read_the_layouts_it_was_timed_in():
    """The FFN's GEMM with its bias + ReLU + dropout fused: a candidate per A/B layout pair the
    template was measured reading (x1 as its LayerNorm writes it among them), each at its own
    time; without measurements, spec order only (the cost model's)."""
    from datamove.candidates import CandidateBuilder
    from datamove.families.forward_epilogue import epilogue_of, epilogue_op
    from datamove.harness.contraction_variants import training_gemms
    from datamove.kernels.gemm import TEMPLATE_ID

    fused = stored_fused()["bert"]
    device = "NVIDIA H100 80GB HBM3"
    linear1 = next(g for g in training_gemms(fused) if g.name == "w1_x1")
    op = epilogue_op(linear1, epilogue_of(fused, linear1))
    knobs = {"backend": "triton", "block_m": 128, "block_n": 256, "block_k": 64, "group_m": 8, "num_stages": 3,
             "num_warps": 8, "tma": True, "store_tma": True, "persistent": True, "epilogue_split": 2,
             "template": TEMPLATE_ID}

    def record(a, b, ms, knobs=knobs):
        return Record(Key(device, {}, op, linear1.sizes, "bfloat16", {"a": a, "b": b, "out": "ubj"}, knobs), "ok", ms)

    stale = record("ui", "bji", 0.001, {**knobs, "template": "an-older-one"})  # another template's timing: left out
    timings = Timings([record("ui", "ibj", 0.063), record("ui", "bji", 0.062), stale], device, "bfloat16")
    found = CandidateBuilder(fused, "bert", "bfloat16", device_figures("H100"), timings).gemms()["w1_x1+epilogue"]
    assert {(c.reads["w1"], c.reads["x1"], c.time_ms, c.source) for c in found} == {
        ("ui", "ibj", 0.063, "measured"), ("ui", "bji", 0.062, "measured")}
    assert all(c.writes == {"hidden": "ubj"} and c.config.gemm["store_tma"] and "template" not in c.config.gemm
               for c in found)
    model = CandidateBuilder(fused, "bert", "bfloat16", device_figures("H100"), Timings([], device, "bfloat16"))
    assert [(c.reads["x1"], c.source) for c in model.gemms()["w1_x1+epilogue"]] == [("ibj", "predicted")]


@pytest.mark.parametrize("fastest", [0, 3])
def test_a_gemm_takes_the_cublas_algorithm_measured_fastest(fastest):
    """cuBLAS records of one call with other algorithms of cuBLASLt's heuristic
    (``harness.contraction_variants.cublas_knobs``): the candidate of that layout takes the fastest's
    time and names its algorithm (none: the first, PyTorch's call)."""
    from datamove.candidates import CandidateBuilder
    from datamove.harness.contraction_variants import cublas_knobs, same_call_layouts, training_gemms

    fused = stored_fused()["bert"]
    gemm = next(g for g in training_gemms(fused) if g.name == "w2_hidden")
    layouts = next(iter(same_call_layouts(gemm).values()))
    device = "NVIDIA H100 80GB HBM3"
    records = [Record(Key(device, {}, gemm.op, gemm.sizes, "bfloat16", dict(zip(("a", "b", "out"), layouts)),
                          cublas_knobs(n)), "ok", 0.040 if n == fastest else 0.045 + n / 1000) for n in range(5)]
    builder = CandidateBuilder(fused, "bert", "bfloat16", device_figures("H100"), Timings(records, device, "bfloat16"))
    timed = [c for c in builder.gemms()["w2_hidden"] if c.source == "measured"]
    assert timed and all(c.time_ms == 0.040 and c.config.backend == "cublas" for c in timed)
    assert all(c.config.algorithm == (fastest or 0) for c in timed)


def test_a_layout_change_serves_every_later_reader():
    """One copy of t into "yx" for B and the backward's D (A1 + the change, 2.0, beats A2's 2.5
    only because the copy is made once)."""
    order, candidates, produced, boundary, outputs = GRAPHS["copy_serves_later_readers"]
    steps, _ = select(order, candidates, produced=produced, boundary=boundary, change_cost=change_cost, outputs=outputs)
    assert [c.name for c, _ in steps] == ["A1", "B1", "C1", "D1"]
    assert [change[:3] for _, changes in steps for change in changes] == [("t", "xy", "yx")]
