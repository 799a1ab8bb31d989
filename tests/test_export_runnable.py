"""Every plan that exports runs (issue 47): before an artifact is written, each plan's program is
built and run forward and backward dry, on the meta device (``datamove.runtime.runnable``), and a
plan that cannot run is refused in one line naming its step, with nothing written.

The plans: the cost model's as recorded in ``tests/golden/plans.json`` (BERT-large and GPT-2 at
their real sizes, BERT at two shapes; ``tests/test_plans_unchanged.py`` holds them to what the job
selects now), the main job's Llama plan (``llama_artifact``), and BERT-large's plan broken as past
selection bugs broke plans that exported and then failed in the runtime: a stacked operand
overlapping another stack group, a GEMM reading an operand whose contracted letters are not
adjacent, a GEMM epilogue writing its output with the N letters apart, the members of a stack
group in different layouts.  And a plan the runtime could not run before: an attention backward
reading a saved dropout mask where its forward saves none.
"""
import json
import re
from dataclasses import replace

import pytest
import torch

from datamove.cli import main
from datamove.dataflow.snapshot import load as load_graph
from datamove.dataflow.snapshot import stored_fused
from datamove.kernels.launch import GRID_LIMITS, SizeLimitError, dry_launches, through_jit
from datamove.kernels.layout_change import permute_copy
from datamove.layouts.plan import Plan, PlanNotRunnable
from datamove.runtime.layer import tensor_interface
from datamove.runtime.runnable import check_runnable
from golden_plans import GOLDEN
from plans import spec_module

RECORDED = json.loads(GOLDEN.read_text())


def recorded(case: str) -> tuple[list[Plan], object]:
    """The recorded plans of a golden case (``plan.json`` first) and the fused graph of its spec at
    the first plan's dims."""
    plans = RECORDED[case]["plans"]
    ordered = [Plan.from_json(plans["plan.json"])] + [Plan.from_json(plans[p]) for p in sorted(plans) if p != "plan.json"]
    return ordered, stored_fused()[ordered[0].spec].with_dims(ordered[0].dims)


def check(plans: list[Plan], fused) -> list:
    """``check_runnable`` of ``plans`` over ``fused`` (a ``FusedTraining``) with their spec's interface:
    the launches checked."""
    module = spec_module(plans[0].spec)
    interface = tensor_interface(fused.graph, getattr(module, "TORCH_ORDER", {}), getattr(module, "INPUTS", None))
    return check_runnable(plans, fused.graph, fused.operators, interface)


@pytest.mark.parametrize("case", ["bert", "bert-two-shapes", "gpt2"])
def test_the_selected_plans_run_dry(case):
    plans, fused = recorded(case)
    launches = check(plans, fused)
    names = {name for name, _ in launches}
    assert "_attn_fwd_kernel" in names and "_attn_bwd_dkdv_kernel" in names and "_permute_kernel" in names
    assert all(0 <= n <= limit for _, grid in launches for n, limit in zip(grid, GRID_LIMITS))


def test_the_llama_plan_runs_dry(llama_artifact):
    manifest = json.loads((llama_artifact / "manifest.json").read_text())
    plan = Plan.from_json(json.loads((llama_artifact / "plan.json").read_text()))
    graph, operators = load_graph(json.loads((llama_artifact / "graph.json").read_text()))
    interface = tensor_interface(graph, manifest["torch_order"], manifest["inputs"])
    names = {name for name, _ in check_runnable([plan], graph, operators, interface)}
    assert "_attn_fwd_kernel" in names


def test_a_backward_reading_a_saved_mask_runs_where_the_forward_saves_none():
    """A plan whose attention backward reads the dropout mask its forward saves (knob "saved", as
    the tuning may choose) runs where the forward has none to save, in evaluation mode here: the
    backward draws the mask again (before, the forward stored None and the backward failed)."""
    (plan,), fused = recorded("bert")
    saved = _edited(plan, "attention_backward",
                    lambda s: replace(s, config=replace(s.config, knobs={**s.config.knobs, "dropout_mask": "saved"})))
    assert check([saved], fused)


def _edited(plan: Plan, step: str, change, layouts: dict | None = None) -> Plan:
    """``plan`` with ``change(step)`` in place of step ``step`` and ``layouts`` over its layouts."""
    assert step in [s.name for s in plan.steps]
    return replace(plan, steps=[change(s) if s.name == step else s for s in plan.steps],
                   layouts={**plan.layouts, **(layouts or {})})


def _operands(step, **operands):
    return replace(step, config=replace(step.config, operands={**step.config.operands, **operands}))


def _writes(step, **layouts):
    return replace(step, writes={**step.writes, **layouts})


BROKEN = {  # name: (the break of BERT-large's plan, the step named, what the reason says)
    "stack-overlap": (lambda p: _edited(p, "stack(d_wv,d_wk,d_wq)", lambda s: _operands(s, a=["d_v", "d_k"], out=["d_wv", "d_wk"])),
                      "stack(d_wv,d_wk,d_wq)", "stacked operand ['d_v', 'd_k'] overlaps another stack group"),
    "k-apart": (lambda p: _edited(p, "stack(q,k,v)+attention_forward", lambda s: _writes(s, gamma="wbjh"), {"gamma": "wbjh"}),
                "wo_gamma", "K letters 'wh' not adjacent in B layout 'wbjh'"),
    "n-apart": (lambda p: _edited(p, "w1_x1+hidden", lambda s: _writes(s, hidden="buj"), {"hidden": "buj"}),
                "w1_x1+hidden", "N letters 'bj' not adjacent in output layout 'buj'"),
    "stack-layouts": (lambda p: _edited(p, "attention_backward", lambda s: _writes(s, d_k="hpbk"), {"d_k": "hpbk"}),
                      "attention_backward", "d_k is written in layout hpbk, but its stack group"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_plan_that_cannot_run_is_refused_naming_its_step(case):
    (plan,), fused = recorded("bert")
    breaks, step, reason = BROKEN[case]
    with pytest.raises(PlanNotRunnable) as refused:
        check([breaks(plan)], fused)
    assert refused.value.step == step and reason in refused.value.reason
    assert str(refused.value).startswith(f"the plan at B=8, L=512 cannot run: step {step}: ValueError: ")
    assert str(refused.value).endswith("this is a bug in datamove's selection: please report it; no artifact was written")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the job tunes before it selects: minutes")
def test_the_job_refuses_a_plan_that_cannot_run_and_writes_nothing(tmp_path, capsys, monkeypatch):
    (plan,), _ = recorded("bert")
    breaks, step, reason = BROKEN["k-apart"]
    monkeypatch.setattr("datamove.candidates.plan_layer", lambda *args, **kwargs: breaks(plan))
    out = tmp_path / "out"
    assert main(["configs/bert.py", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert error.startswith(f"optimize-layer: error: the plan at B=8, L=512 cannot run: step {step}: ") and reason in error
    assert "this is a bug in datamove's selection: please report it" in error
    assert list(tmp_path.iterdir()) == []  # no artifact folder, no temporary folder beside it


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the job tunes before it selects: minutes")
def test_dims_past_the_kernels_limits_are_refused_as_such_in_one_line(tmp_path, capsys):
    """B = 2**30 (under the 2**31 - 1 a dim may be) puts B*H attention programs on a grid axis
    past CUDA's: refused naming the limit and the dims, not as 'a bug in datamove's selection'."""
    out = tmp_path / "out"
    assert main(["configs/bert.py", "--dims", f"B={2**30},L=23,N=32,H=2,P=16,U=70", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error and "bug" not in error, error
    assert error.startswith(f"optimize-layer: error: the plan at B={2**30}, L=23 cannot run: step "), error
    assert re.search(r"SizeLimitError: kernel _attn_fwd_kernel: grid \(\d+, 2147483648, 1\) is outside CUDA's limits",
                     error), error
    assert error.endswith("these dims are past its kernels' limits (CUDA's grid, int32 offsets): give smaller dims "
                          "(--dims); no artifact was written\n"), error
    assert list(tmp_path.iterdir()) == []


def test_dry_launches_refuse_a_grid_beyond_cudas_and_arguments_that_do_not_fit():
    side = 2**22  # a 2**22 x 2**22 copy takes 2**32 tiles of 64 x 64: one more than a grid holds
    src = torch.empty(side, side, device="meta")
    with dry_launches() as dry, pytest.raises(SizeLimitError, match=r"kernel _permute_kernel: grid \(4294967296, 1, 1\) "
                                                                r"is outside CUDA's limits"):
        permute_copy(src, src.t().contiguous().t())
    assert dry.launches == []
    from datamove.kernels.gemm import _sum_partials_kernel
    with dry_launches(), pytest.raises(TypeError, match="kernel _sum_partials_kernel: its arguments do not fit"):
        through_jit(_sum_partials_kernel, (1,))(src, src, 1)


SPEC_HEAD = '''import numpy as np
from datamove.dataflow.spec import Tensor, dims

B, T, D = dims(B=3, T=5, D=7)
INDEX = {"b": B, "t": T, "s": T, "d": D}
INPUTS = ("x",)

'''


@pytest.mark.parametrize("body", [
    # np.abs: its gradient's sign() had no Triton form ("a bug in datamove's selection")
    "def f(x: Tensor('btd'), g: Tensor('d')):\n    return x / (1.0 + np.abs(g)) + np.abs(x) * g\n",
    # single-head causal attention (no heads letter): the attention match failed with StopIteration
    "def f(x: Tensor('btd'), g: Tensor('d')):\n"
    "    s = np.einsum('btd,bsd->bts', x * g, x)\n"
    "    s = np.where(np.triu(np.ones((T, T)), k=1) == 1, -np.inf, s)\n"
    "    p = np.exp(s - s.max(-1, keepdims=True))\n"
    "    return np.einsum('bts,bsd->btd', p / p.sum(-1, keepdims=True), x)\n",
    # a strict mask (keys before the query) leaves the first row masked whole: NumPy averages the fill
    # there; taken as the scores plus an additive mask, the layer gave softmax(scores) instead
    "def f(x: Tensor('btd'), g: Tensor('d')):\n"
    "    s = np.einsum('btd,bsd->bts', x * g, x)\n"
    "    s = np.where(np.arange(T)[None, :] < np.arange(T)[:, None], s, -1e9)\n"
    "    p = np.exp(s - s.max(-1, keepdims=True))\n"
    "    return np.einsum('bts,bsd->btd', p / p.sum(-1, keepdims=True), x)\n",
], ids=["abs", "single-head-attention", "strict-mask"])
def test_a_plain_spec_exports_and_computes_as_numpy(tmp_path, body):
    """Specs a user writes (found by probing the front end against NumPy): exported, and the layer's
    forward (float64, CPU) is NumPy's running the spec itself."""
    import importlib.util
    import warnings

    import numpy as np

    from datamove.export import load_layer

    spec = tmp_path / "spec.py"
    spec.write_text(SPEC_HEAD + body)
    assert main([str(spec), "--out", str(tmp_path / "out")]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(tmp_path / "out", device="cpu", dtype=torch.float64, allow_mismatch=True).eval()
    gen = np.random.default_rng(3)
    x, g = gen.standard_normal((3, 5, 7)), gen.standard_normal(7)
    with torch.no_grad():
        layer.spec_view("g").copy_(torch.from_numpy(g))
    y = layer(torch.from_numpy(x))
    loaded = importlib.util.spec_from_file_location("plain_spec", spec)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    module.B, module.T, module.D = x.shape  # the dims as numbers (the spec declares them as symbols)
    expected = module.f(x, g)
    assert np.abs(y.detach().numpy() - expected).max() < 1e-12 * np.abs(expected).max()
