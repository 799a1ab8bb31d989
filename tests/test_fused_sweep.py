"""The fused-operator sweep (harness.sweep_variants, harness.eager, harness.torch_eval) at small odd dims.

On the CPU the generated kernels run through the Triton interpreter in float32 (its fp32 -> bf16
casts truncate); the eager baseline and the torch evaluator run in float64 against the reference
executor.  Graphs come from the stored snapshots, checked against the live front end where DaCe
is installed.
"""
import time

import numpy as np
import pytest
import torch

from datamove.dataflow.dropout_mask import keep_mask
from datamove.dataflow.executor import execute
from datamove.harness import sweep_variants as sv
from datamove.harness.bench import Sweep
from datamove.harness.eager import EagerRun, eager_plan
from datamove.harness.torch_eval import evaluate, graph_inputs, keep_mask_torch
from datamove.harness.tuning_db import TuningDB
from datamove.layouts.space import Configuration, access_pattern, configurations, default_configuration
from datamove.layouts.step_config import GeneratedConfig
from datamove.dataflow import snapshot

SMALL = {"bert": dict(B=2, L=5, N=12, H=3, P=4, U=7), "gpt2": dict(B=2, T=5, D=12, H=3, E=4, F=7)}
STORED = snapshot.stored_fused()


def _training(spec):
    return STORED[spec].with_dims(SMALL[spec])


def test_snapshot_matches_front_end():
    pytest.importorskip("dace")
    assert snapshot.live_fused() == __import__("json").loads(snapshot.FUSED_PATH.read_text())


# --- the torch evaluator -------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["bert", "gpt2"])
def test_torch_evaluator_matches_reference_executor(spec):
    """Every tensor of the fused training graph, float64, torch vs dataflow.executor on the same inputs."""
    training = _training(spec)
    graph = training.graph
    prims = [p for op in training.operators for p in op.primitives]
    inputs = graph_inputs(graph, prims, seed=3, device="cpu")
    ours = evaluate(graph, prims, inputs)
    theirs = execute(graph, {t: v.numpy() for t, v in inputs.items()}, schedule=training.operators)
    for prim in prims:
        t = prim.output.tensor
        np.testing.assert_allclose(ours[t].numpy(), theirs[t], rtol=1e-10, atol=1e-10, err_msg=t)


def test_masks_follow_the_dropout_convention():
    shape, p = (3, 5, 7), 0.3
    expected = keep_mask(11, 1000, shape, p)
    assert torch.equal(keep_mask_torch(11, 1000, shape, p, "cpu"), torch.from_numpy(expected))
    from datamove.kernels.philox import keep_threshold
    from datamove.harness.torch_eval import _keep_kernel  # the GPU path, here through the interpreter
    out = torch.empty(105, dtype=torch.int8)
    _keep_kernel[(2,)](out, 105, 11, 1000, keep_threshold(p), BLOCK=64, INDEX64=False)
    assert torch.equal(out.view(shape).bool(), torch.from_numpy(expected))


# --- the eager baseline --------------------------------------------------------------------------

EAGER_CASES = [  # (spec, fused operator, the PyTorch kernels its plan must use)
    ("bert", "alpha", {"softmax", "dropout"}),
    ("bert", "x1", {"layernorm", "dropout"}),
    ("bert", "d_k_q", {"softmax_backward", "dropout"}),
    ("bert", "d_ffn", {"layernorm_backward", "dropout"}),
    ("gpt2", "h1", {"layernorm"}),
    ("gpt2", "d_x", {"layernorm_backward"}),
]


@pytest.mark.parametrize("spec,name,kinds", EAGER_CASES)
def test_eager_baseline_computes_the_reference(spec, name, kinds):
    """softmax / layernorm forward and backward through PyTorch's kernels, float64, against the
    float64 values of the training graph (its inputs are the graph's own intermediate values)."""
    training = _training(spec)
    op = next(o for o in training.operators if o.name == name)
    steps = eager_plan(training, op)
    assert kinds <= {s.kind for s in steps}, steps
    if "layernorm" in kinds:
        assert next(s for s in steps if s.kind == "layernorm").affine is not None  # gamma, beta folded in
    ws = sv.Workspace(training, "cpu", torch.float64)
    masks = {t: ws.keep(t) for t in op.inputs if training.graph.tensors[t].role == "dropout"}
    results = EagerRun(training, op, ws.values, masks, torch.float64)()
    compared = [t for t in op.outputs if t in results]
    assert compared
    for t in compared:
        torch.testing.assert_close(results[t], ws.values[t], rtol=1e-9, atol=1e-9, msg=t)


# --- the sweep ----------------------------------------------------------------------------------

def _variants(limit_configs=1):
    variants = []
    for spec in ("bert", "gpt2"):
        spaces, notes = sv.sweep_variants(spec, _training(spec), "cpu", dtype=torch.float32, limit_configs=limit_configs)
        assert not notes, notes
        variants += [v for space in spaces for v in space.variants()]
    return variants


def test_sweep_checks_every_operator_records_failures_and_resumes(tmp_path, monkeypatch):
    variants = _variants()
    ops = {v.op_obj.name for v in variants}
    assert {"alpha", "x1", "d_ffn", "d_k_q", "h1", "d_x"} <= ops
    fused = [v for v in variants if isinstance(v, sv.FusedVariant)]
    eager = [v for v in variants if isinstance(v, sv.EagerVariant)]
    assert len(eager) == len(sv.fused_operators(_training("bert"))) + len(sv.fused_operators(_training("gpt2")))
    joins = {v.op for v in fused if "+" in v.op_obj.name}  # layouts.space.column_sum_joins: no eager sequence
    assert {v.op.removesuffix("#eager") for v in eager} == {v.op for v in fused} - joins
    assert {v.op_obj.name for v in fused if v.op in joins} == {
        "d_ln2_gamma+d_ffn+d_b2", "d_ln1_gamma+d_attn+d_bo", "d_ln2_gain+d_expr_plus_bproj_slice+d_bproj", "d_ln1_gain+d_x"}
    # one configuration that cannot compile: the harness records it as failed and goes on
    x1 = next(v for v in fused if v.op_obj.name == "x1")
    base = default_configuration(x1.ws.graph, x1.op_obj)
    broken = sv.FusedVariant(x1.ws, "bert", x1.op_obj, Configuration(base.layouts, {**base.knobs, "order": "zz"}))
    variants.append(broken)

    db = TuningDB(tmp_path / "tuning.db")
    report = Sweep(db, variants, progress=False).run()
    assert not report.measured and report.stopped is None
    assert report.counts["wrong"] == 0
    assert report.counts["failed"] == 1
    assert report.counts["checked"] == len(variants) - 1
    record = db.lookup(Sweep(db, [], progress=False).key(broken))
    assert record.status == "failed" and record.detail.startswith("build: ValueError")
    for v in variants[:-1]:
        rec = db.lookup(Sweep(db, [], progress=False).key(v))
        assert rec.status == "checked" and rec.rel_error is not None, (v.op, rec.detail)

    # resume: a fresh list of the same variants is answered from the DB; nothing is built or evaluated
    fresh = _variants()
    again = fresh + [sv.FusedVariant(x1.ws, "bert", x1.op_obj, broken.config)]
    for cls in (sv.FusedVariant, sv.EagerVariant):
        monkeypatch.setattr(cls, "build", lambda self: pytest.fail(f"{self.op} rebuilt"))
    started = time.monotonic()
    report = Sweep(db, again, progress=False).run()
    assert report.counts["skipped"] == len(again)
    assert time.monotonic() - started < 5
    assert all(v.ws.token not in sv._VALUES and "_values" not in v.ws.__dict__ for v in fresh)  # never evaluated


def test_bytes_moved_skip_regenerated_masks():
    training = _training("bert")
    op = next(o for o in training.operators if o.name == "alpha")  # reads k_q, mask; writes probs, alpha
    hbjk = 3 * 2 * 5 * 5
    assert sv.moved_bytes(training.graph, op) == 2 * 3 * hbjk


def test_judge_treats_a_cancelled_reference_by_scale():
    """A reference that is zero up to float64 rounding (the key-bias gradient) is judged by the
    unit scale of the workspace, not by its own rounding noise."""
    reference = torch.full((64,), 1e-17, dtype=torch.float64)
    close = sv.judge(torch.full((64,), 1e-7), torch.full((64,), 2e-7), reference)
    assert close.passed and close.error < 1e-3
    far = sv.judge(torch.full((64,), 1e-2), torch.full((64,), 1e-7), reference)
    assert not far.passed


def test_two_stage_search_covers_every_layout_then_tunes_the_best():
    """First stage: one variant per access pattern (every layout); second: every configuration of
    the patterns ranked first."""
    spaces, _ = sv.sweep_variants("bert", _training("bert"), "cpu", dtype=torch.float32)
    space = next(s for s in spaces if s.op.name == "stack(q,k,v)")
    configs = configurations(space.ws.graph, space.op)
    first = space.first_stage()
    assert first[0] is space.eager
    assert [access_pattern(v.config) for v in first[1:]] == list(dict.fromkeys(access_pattern(c) for c in configs))
    assert len(space.variants()) == len(configs) + 1 and len(first) < len(configs)
    ranked = list(reversed(first[1:]))  # pretend the last pattern measured fastest
    second = space.fastest_patterns(ranked, top=2)
    patterns = [access_pattern(v.config) for v in ranked[:2]]
    assert [access_pattern(group[0].config) for group in second] == patterns
    assert all(v is first[1:][::-1][n] for n, v in enumerate(group[0] for group in second))
    assert all(access_pattern(v.config) == patterns[n] for n, group in enumerate(second) for v in group)
    assert sum(map(len, second)) == sum(access_pattern(c) in patterns for c in configs)


def test_first_stage_draws_dropout_masks_in_groups_where_a_tile_can():
    """A layout's first-stage variant draws every regenerated mask sixteen decisions per Philox call
    where any plain configuration of that layout does: BERT-large's bias + ReLU + dropout over ubj
    (the mask's trailing letter j along the columns) with a column block of 128, not 32 (per-element
    draws measured 0.20 ms against 0.06 for bju on the H200, so ubj was never tuned further)."""
    from datamove.layouts.space import grouped_masks, masks_grouped, operator_letters, representatives, tile_axes

    fused = snapshot.stored_fused()["bert"].with_dims(dict(B=96, L=128))
    graph = fused.graph
    op = next(o for o in fused.operators if o.name == "hidden")
    letters = operator_letters(graph, op)
    chosen = {c.layouts["hidden"]: c for c in representatives(configurations(graph, op), masks_grouped(graph, op))}
    for layout in ("ubj", "bju"):
        knobs = chosen[layout].knobs
        _, rows, cols = tile_axes(letters, knobs)
        grouped = grouped_masks(graph, letters, cols, ("drop_act",), knobs["block_col"]) \
            + grouped_masks(graph, letters, rows, ("drop_act",), knobs["block_row"])
        assert grouped == ("drop_act",), (layout, knobs)
    ungrouped = {c.layouts["hidden"]: c for c in representatives(configurations(graph, op))}["ubj"].knobs
    assert ungrouped["block_col"] % 64  # without the operator: the middle plain configuration, per-element draws


def test_elementwise_tiles_of_64_rows_draw_a_mask_along_rows_in_groups():
    """BERT-large's bias + ReLU + dropout stored bju (vector u) has its mask's counters along j, the
    tile's rows: the second stage offers tiles of 64 rows (64 x 64, 64 x 128), which draw it sixteen
    decisions per Philox call, besides 128 x 32 (H200: 22.0 us at 64 x 128 on 4 warps, 25.6 at 128 x 32)."""
    from datamove.layouts.space import grouped_masks, operator_letters, tile_axes

    fused = snapshot.stored_fused()["bert"].with_dims(dict(B=8, L=512))
    graph = fused.graph
    op = next(o for o in fused.operators if o.name == "hidden")
    letters = operator_letters(graph, op)
    tiles = set()
    for config in configurations(graph, op):
        knobs = config.knobs
        if config.layouts["hidden"] == "bju" and knobs["vector"] == "u":
            _, rows, _ = tile_axes(letters, knobs)
            if grouped_masks(graph, letters, rows, ("drop_act",), knobs["block_row"]):
                tiles.add((knobs["block_row"], knobs["block_col"], knobs["num_warps"]))
    assert {(64, 64, 2), (64, 128, 4), (128, 32, 1)} <= tiles


def test_the_main_job_tunes_the_layouts_its_plan_chose():
    """After a selection the main job sweeps every knob setting of the layouts the plan's generated
    steps run (``datamove.tuning.chosen_patterns``): the first stage measured one setting per
    layout and the second only each operator's fastest layout, so a layout chosen for the changes
    it saves would otherwise stay at one setting (BERT-large's bias + ReLU + dropout over ubj)."""
    from datamove.candidates import plan_layer
    from datamove.tuning import chosen_patterns
    from datamove.layouts.cost_model import device_figures
    from datamove.layouts.plan import GENERATED

    fused = _training("bert")
    spaces, _ = sv.sweep_variants("bert", fused, "cpu", dtype=torch.float32)
    plan = plan_layer(fused, "bert", dtype="float32", figures=device_figures("H100"))
    groups, composed = chosen_patterns(spaces, plan)
    variants = [v for group in groups for v in group] + composed
    assert all(len({access_pattern(v.config) for v in group}) == 1 for group in groups)
    steps = {s.name: s for s in plan.steps if s.kind == GENERATED}
    assert {v.op_obj.name for v in variants} == set(steps)
    for space in (s for s in spaces if s.op.name in steps):  # the others run in the attention or a GEMM epilogue
        step = steps[space.op.name]
        layouts = {**step.reads, **step.writes, **step.config.masks}
        mine = [v for v in variants if v.op_obj is space.op]
        assert len({access_pattern(v.config) for v in mine}) == 1
        assert mine == space.patterns[access_pattern(mine[0].config)]
        assert any(v.config.layouts == layouts and v.config.knobs == step.config.knobs for v in mine)
    assert len(variants) > len(steps)  # whole patterns, not the chosen settings alone



def test_an_operator_of_parts_measures_its_defaults_first_and_a_composed_choice_once_chosen():
    """The first stage of an operator of several parts measures its all-default configuration (what
    ``candidates.CandidateBuilder.composed`` prices each part against); a plan step combining its
    parts' own configurations, in no access pattern of the space, is measured after the selection
    at each warp count its parts were measured with, and with each part's other knob settings of
    its layouts, the other parts as chosen."""
    from types import SimpleNamespace

    from datamove.layouts.plan import GENERATED, Step
    from datamove.layouts.space import combine_parts, parts
    from datamove.tuning import chosen_patterns

    fused = _training("gpt2")
    spaces, _ = sv.sweep_variants("gpt2", fused, "cpu", dtype=torch.float32)
    space = next(s for s in spaces if s.op.name == "stack(d_bv,d_bk,d_bq)")
    graph = space.eager.ws.graph
    base = default_configuration(graph, space.op)
    assert any(v.config.key() == base.key() for v in space.first_stage()[1:])
    mine = [next(c for c in configurations(graph, part) if c.knobs["vector"] in "ts" and c.knobs["mode"] == "row"
                 and c.layouts[part.inputs[0]].startswith("he")) for part in parts(space.op)]
    config = combine_parts(mine, 2, "regenerate")
    assert not any(access_pattern(config) in s.patterns for s in spaces)
    step = Step(space.op.name, "backward", GENERATED, (space.op.name,),
                {t: config.layouts[t] for t in space.op.inputs}, {t: config.layouts[t] for t in space.op.outputs},
                GeneratedConfig(config.knobs, {}, (2, 4)), 0.01, "predicted")
    groups, composed = chosen_patterns(spaces, SimpleNamespace(steps=[step]))
    assert groups == []
    variants = [v for v in composed if v.op_obj is space.op]
    assert [(v.config.layouts, v.config.knobs) for v in variants[:2]] == \
        [(config.layouts, {**config.knobs, "num_warps": w}) for w in (2, 4)]
    assert isinstance(variants[0].config, Configuration)
    assert len({v.config.key() for v in variants}) == len(variants)
    for v in variants[2:]:  # one part's other knob settings, the others as chosen
        assert v.config.layouts == config.layouts and v.config.knobs["num_warps"] == 2
        moved = [k for k, own in enumerate(config.knobs["parts"]) if v.config.knobs["parts"][k] != own]
        assert len(moved) == 1 and v.config.knobs["parts"][moved[0]]["order"] == config.knobs["parts"][moved[0]]["order"]
    assert {k for v in variants[2:] for k, own in enumerate(config.knobs["parts"]) if v.config.knobs["parts"][k] != own} \
        == {0, 1, 2}

@pytest.mark.gpu
def test_compiling_ahead_in_workers_leaves_only_loading(tmp_path):
    """At full size: kernels compiled by ``Sweep(compile_workers=2)``'s spawned processes are only
    loaded by the sweep's own builds (Triton's disk cache), and every variant is timed."""
    import concurrent.futures
    import multiprocessing

    training = snapshot.stored_fused()["bert"]
    spaces, _ = sv.sweep_variants("bert", training, "cuda")
    space = next(s for s in spaces if s.op.name == "alpha")
    fresh = [v for v in space.variants()[1:] if v.knobs["num_warps"] == 2][:3]
    assert len(fresh) == 3
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        fn, args = fresh[0].compile_task()
        pool.submit(fn, *args).result()
    fresh[0].ws.values  # the float64 workspace (evaluated on first use), not part of what is timed
    started = time.monotonic()
    fresh[0].build()
    loaded_s = time.monotonic() - started
    print(f"build after a worker compiled it: {loaded_s:.3f} s")
    assert loaded_s < 0.5
    with TuningDB(tmp_path / "t.db") as db:
        report = Sweep(db, fresh[1:], compile_workers=2, progress=False).run()
    assert report.counts["ok"] == 2, report.summary()


def test_a_workspace_let_go_frees_its_values_and_masks():
    """A measuring process drops each sweep's copy of a workspace: nothing outside it (a cache on
    its methods) may keep it, or its float64 values, alive (Llama-1B's: tens of GB a sweep, out of
    GPU memory after a few sweeps on an H200)."""
    import gc
    import pickle
    import weakref

    training = _training("bert")
    ws = pickle.loads(pickle.dumps(sv.Workspace(training, "cpu", torch.float32)))
    mask = next(t for t, info in training.graph.tensors.items() if info.role == "dropout")
    assert ws.keep(mask) is ws.keep(mask)
    gone = weakref.ref(ws)
    del ws
    gc.collect()
    assert gone() is None
