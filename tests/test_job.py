"""The main job on a CPU machine (``optimize-layer SPEC``, cost model) and its report.

The job must finish without a GPU, say that nothing was measured, and leave the plan, the artifact
and the report (HTML without any external reference, Markdown, PNG, JSON that regenerates them).
Where Chromium is installed, the HTML is rendered headless and the screenshot checked for content.
"""
import json
import re
import shutil
import subprocess

import pytest

from datamove.cli import main
from datamove.report import KernelRow, ReportData, achieved_bandwidth, markdown, mue, write_report

SMALL = "B=2,L=64,N=64,H=2,P=32,U=128"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("job") / "bert"
    assert main(["configs/bert.py", "--dims", SMALL, "--out", str(out)]) == 0
    return out


def test_the_job_writes_plan_artifact_and_report(job, capsys):
    for name in ("plan.json", "graph.json", "manifest.json", "report.html", "report.md", "roofline.png", "report.json"):
        assert (job / name).is_file(), name
    assert list((job / "kernels").glob("*.py"))
    plan = json.loads((job / "plan.json").read_text())
    assert plan["timing"] == "predicted" and plan["device"].startswith("cost model")
    report = json.loads((job / "report.json").read_text())
    assert report["meta"]["measured"] is False
    assert "predicted" in (job / "report.md").read_text() and "nothing was measured" in (job / "report.html").read_text()
    assert (job / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_html_has_no_external_reference(job):
    page = (job / "report.html").read_text()
    assert "http://" not in page and "https://" not in page and "<link" not in page and "@import" not in page
    for attribute in re.findall(r'(?:src|href)=["\']([^"\']*)', page):
        assert attribute.startswith("data:"), attribute
    assert "url(" not in page


def test_the_report_regenerates_from_its_json(job, tmp_path):
    data = ReportData.from_json(json.loads((job / "report.json").read_text()))
    paths = write_report(data, tmp_path)
    assert paths["markdown"].read_text() == (job / "report.md").read_text()
    assert paths["html"].read_text() == (job / "report.html").read_text()


def test_mue_and_class_totals_by_hand():
    row = KernelRow("op", "elementwise", "forward", 0, 10**6, 10**6, 4 * 10**6, 8 * 10**6, 0.001, "measured", "k")
    # B = D / t = 8e6 B / 1e-6 s = 8e12 B/s; MUE = Q/D * B/B_peak * 100 = 0.5 * 8e12 / 1.6e13 * 100 = 25
    assert mue(row, 1.6e13) == pytest.approx(25.0)
    assert achieved_bandwidth(row) == pytest.approx(8e12)
    other = KernelRow("op2", "elementwise", "backward", 2 ** 30, 5 * 10**5, 5 * 10**5, 2 * 10**6, 2 * 10**6, 0.002,
                      "predicted", "k")
    data = ReportData({"spec": "s", "dims": {}, "dtype": "bfloat16", "device": "d", "measured": True, "versions": {},
                       "date": "today"}, {"bandwidth": 1.6e13, "flops": 1e15, "source": "test"}, [row, other], [],
                      {"unfused": {}, "fused": {}, "reduction_percent": {}}, {"total_ms": 0.003, "best_sum_ms": 0.003})
    text = markdown(data)
    assert "| elementwise | 2 | 1.000 | 3.00 | 0.0030 |" in text  # class total: kernels, Gflop, 1e6 elements, ms
    assert "| 0.0010 | measured | 0.0 | 8.00 | 50 | 25.0 | k |" in text  # B TB/s and % of B_peak beside MUE


def test_compute_ceiling_is_never_below_a_measured_kernel():
    """A GEMM measured at a higher clock than the ceiling's 8192^3 GEMM raises the roof (an H200 run
    showed 105% of peak); predicted times do not; without measurements the cost model's figures."""
    from types import SimpleNamespace

    from datamove.report import peak_percent
    from datamove.report_data import ceilings_of
    from datamove.layouts.cost_model import device_figures

    measured = SimpleNamespace(device="NVIDIA H200", copy_bytes_per_s=4.25e12, gemm_flop_per_s=6.8e14)
    fast = KernelRow("gemm", "contraction", "forward", 7.2e10, 1, 1, 1, 1, 0.1, "measured", "cuBLAS")
    optimistic = KernelRow("pred", "contraction", "forward", 9.0e10, 1, 1, 1, 1, 0.1, "predicted", "cuBLAS")
    limits = ceilings_of(measured, device_figures("H200"), "bfloat16", [fast, optimistic])
    assert limits["flops"] == pytest.approx(7.2e14) and peak_percent(fast, limits["flops"]) == pytest.approx(100.0)
    assert "fastest kernel measured" in limits["source"]
    slow = KernelRow("gemm", "contraction", "forward", 3.4e10, 1, 1, 1, 1, 0.1, "measured", "cuBLAS")
    assert ceilings_of(measured, device_figures("H200"), "bfloat16", [slow])["flops"] == 6.8e14
    model = ceilings_of(None, device_figures("H200"), "bfloat16", [fast])
    assert model["flops"] == device_figures("H200").peak("bfloat16") and "cost-model" in model["source"]


def _chromium():
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "headless_shell")
                 if shutil.which(n)), None)


@pytest.mark.skipif(_chromium() is None, reason="no Chromium installed here: the report is not rendered")
def test_the_report_renders_in_headless_chromium(job, tmp_path):
    shot = tmp_path / "report.png"
    subprocess.run([_chromium(), "--headless", "--disable-gpu", "--no-sandbox", f"--screenshot={shot}",
                    "--window-size=1400,2400", (job / "report.html").as_uri()], check=True, timeout=120,
                   capture_output=True)
    image = shot.read_bytes()
    assert image[:8] == b"\x89PNG\r\n\x1a\n" and len(image) > 50_000  # tables and the plot, not a blank page
    dom = subprocess.run([_chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom",
                          (job / "report.html").as_uri()], check=True, timeout=120, capture_output=True, text=True).stdout
    assert "<table>" in dom and "data:image/png;base64," in dom


def test_selection_rounds_measure_what_the_plan_chose_until_nothing_is_new(capsys):
    """On a GPU the job measures the knobs of the layouts its plan chose and the layout changes it
    inserts unmeasured, selects again, and stops when a round measured nothing new or after
    ``SELECTION_ROUNDS``; the layout changes are measured past the budget too."""
    from types import SimpleNamespace

    from datamove.job import SELECTION_ROUNDS, refine_plan
    from datamove.layouts.step_config import LayoutChangeConfig

    def plan(*changes):
        return SimpleNamespace(steps=[SimpleNamespace(kind="layout_change", source=source,
                                                      config=LayoutChangeConfig(t, "ab", "ba"))
                                      for t, source in changes])

    plans = iter([plan(("v", "measured")), plan()])
    calls = []
    chosen = refine_plan(plan(("v", "predicted")), lambda: next(plans),
                         lambda p: calls.append(("knobs", len(p.steps))) or (5 if len(calls) == 1 else 0),
                         lambda wanted: calls.append(("changes", sorted(wanted))))
    assert calls == [("knobs", 1), ("changes", [("v", "ab", "ba")]), ("knobs", 1)]  # round 2: nothing new, done
    assert chosen.steps[0].source == "measured" and "5 variant(s) of the chosen layouts" in capsys.readouterr().out

    calls.clear()  # the budget spent: the knobs are not tuned (measure_chosen measures nothing), the changes are
    plans = iter([plan(("v", "measured")), plan(("v", "measured"))])
    stopped = refine_plan(plan(("v", "predicted")), lambda: next(plans), lambda p: 0, calls.append)
    assert calls == [{("v", "ab", "ba")}] and stopped.steps[0].source == "measured"

    rounds = []
    refine_plan(plan(), lambda: plan(), lambda p: rounds.append(p) or 1, calls.append)
    assert len(rounds) == SELECTION_ROUNDS


def test_the_tuning_measures_the_attention_with_its_bias_add_folded_in():
    from datamove.dataflow.snapshot import stored_fused
    from datamove.job import attention_setups

    (bert,) = attention_setups(stored_fused()["bert"], "bfloat16")
    assert bert == dict(B=8, H=16, L=512, P=64, dropout_p=0.1, layout="phbj", bias=True, causal=False)  # q's order
    # GPT-2: its additive causal mask taken by the causal kernels; measured in the spec's order of q
    # and in the one its stacked projection writes (h, e outermost: "hebs")
    gpt2 = dict(B=4, H=12, L=1024, P=64, dropout_p=0.1, bias=True, causal=True)
    assert attention_setups(stored_fused()["gpt2"], "bfloat16") == [dict(gpt2, layout="bhjp"), dict(gpt2, layout="hpbj")]


def _recorded_tuning(monkeypatch, ms, **options):
    """``tuning.tune`` of BERT's training graph (no fused operators, no attention) with a tuner that
    records the sweeps it is given and the variants their rules pruned, the database replaced by
    made-up times ``ms(variant)``, four cuBLASLt algorithms per call."""
    from datamove import tuning
    from datamove.dataflow.snapshot import stored_fused
    from datamove.harness import contraction_variants

    monkeypatch.setattr(contraction_variants, "cublas_algorithms", lambda *args, **kwargs: 4)

    class Ranker:
        def ranked(self, variants):
            return sorted(variants, key=ms)

    class Recorder:
        ranker, report = Ranker(), tuning.TuningReport()
        sweeps: list = []
        pruned = 0

        def measure(self, variants, pruned=0, **timing):
            self.sweeps.append(list(variants))
            self.pruned += pruned

    tuner = Recorder()
    tuning.tune(tuner, stored_fused()["bert"], [], spec="bert", dtype="bfloat16", attention=[], **options)
    return tuner


def test_cublas_other_algorithms_are_timed_on_each_gemms_fastest_layouts(monkeypatch):
    """``tune``: every layout of a GEMM with cuBLAS's first algorithm, then cuBLASLt's other
    algorithms on the ``ALGORITHM_LAYOUTS`` layouts where the first was fastest (replayed here with
    made-up times on BERT's training GEMMs, four algorithms per call)."""
    import zlib

    from datamove import tuning
    from datamove.dataflow.snapshot import stored_fused
    from datamove.harness import contraction_variants
    from datamove.harness.tuning_db import canonical_json

    ms = lambda v: zlib.crc32((v.op + canonical_json(v.layout) + str(v.algorithm)).encode()) % 1000  # noqa: E731
    tuner = _recorded_tuning(monkeypatch, ms)
    fused = stored_fused()["bert"]
    cublas = [v for sweep in tuner.sweeps for v in sweep
              if isinstance(v, contraction_variants.GemmVariant) and v.config is None and not v.residual]
    last = [sweep for sweep in tuner.sweeps if sweep][-1]  # the other algorithms come last (no attention, no spaces)
    assert all(isinstance(v, contraction_variants.GemmVariant) and v.algorithm > 0 for v in last)
    for g in contraction_variants.training_gemms(fused):
        mine = [v for v in cublas if v.op == g.op and v.dims == dict(g.sizes)]
        layouts = {canonical_json(v.layout) for v in mine}
        first_algorithm = sorted((v for v in mine if v.algorithm == 0), key=ms)
        fastest = list(dict.fromkeys(canonical_json(v.layout) for v in first_algorithm))[:tuning.ALGORITHM_LAYOUTS]
        first_layout = canonical_json(mine[0].layout)  # its every algorithm timed in the first sweep
        others = {canonical_json(v.layout) for v in mine if v.algorithm > 0}
        assert others == set(fastest) | {first_layout} or len(layouts) <= tuning.ALGORITHM_LAYOUTS, g.name
        assert {v.algorithm for v in mine} == {0, 1, 2, 3}


def test_a_gemm_read_through_a_layout_change_is_timed_without_it(monkeypatch):
    """``tuning.change_free_algorithms``: a plain GEMM step reading a tensor through a layout change
    gets every cuBLASLt algorithm timed on the layouts reading that tensor as written (its other
    tensors as the step has them), so the selection can drop the change (Llama-8B's d_w_down)."""
    from dataclasses import replace

    import torch

    from datamove import tuning
    from datamove.candidates import gemm_layouts
    from datamove.dataflow.snapshot import stored_fused
    from datamove.harness import contraction_variants
    from datamove.layouts.plan import LAYOUT_CHANGE, Step
    from datamove.layouts.step_config import LayoutChangeConfig
    from plans import spec_order_plan

    monkeypatch.setattr(contraction_variants, "cublas_algorithms", lambda *args, **kwargs: 4)
    fused = stored_fused()["bert"]
    plan = spec_order_plan(fused, "bert")
    steps = []
    for step in plan.steps:  # the FFN's GEMMs read x1 (ibj) as bji through one change
        steps.append(replace(step, reads={**step.reads, "x1": "bji"}) if step.name in ("w1_x1", "d_w1") else step)
        if step.name == "x1":
            steps.append(Step("layout(x1:ibj->bji)#0", "forward", LAYOUT_CHANGE, (), {"x1": "ibj"}, {},
                              LayoutChangeConfig("x1", "ibj", "bji"), 0.0, "predicted"))
    plan = replace(plan, steps=steps)
    variants = tuning.change_free_algorithms(fused, plan, torch.bfloat16)
    gemms = {g.name: g for g in contraction_variants.training_gemms(fused)}
    ops = {op.name: op for op in fused.operators}
    found = {}
    for v in variants:
        name = next(n for n, g in gemms.items() if g.op == v.op and g.sizes == v.dims and n in ("w1_x1", "d_w1"))
        step = next(s for s in plan.steps if s.name == name)
        reads = [r for r, w, timed in gemm_layouts(fused.graph, ops[name], gemms[name])[2]
                 if dict(zip(("a", "b", "out"), timed)) == v.layout and w == step.writes]
        assert {**step.reads, "x1": "ibj"} in reads, (name, v.layout)
        assert v.config is None  # cuBLAS
        found.setdefault(name, set()).add(v.algorithm)
    assert found == {"w1_x1": {0, 1, 2, 3}, "d_w1": {0, 1, 2, 3}}
    assert tuning.change_free_algorithms(fused, spec_order_plan(fused, "bert"), torch.bfloat16) == []  # no change


def test_the_triton_template_is_timed_on_the_layouts_a_plan_runs_where_it_competes(monkeypatch):
    """``tuning.chosen_layout_configs``: where the Triton template came within ``COMPETITIVE`` of
    cuBLAS on a GEMM's first layout, its fastest ``CHOSEN_LAYOUT_CONFIGS`` configurations there are
    timed on the layouts the plan's step runs; nothing for a GEMM where it did not compete, nor for
    a step on the first layout (replayed with made-up times)."""
    import zlib
    from dataclasses import replace

    import torch

    from datamove import tuning
    from datamove.dataflow.snapshot import stored_fused
    from datamove.harness.tuning_db import canonical_json
    from plans import spec_order_plan

    def ms(v):
        if v.config is None:
            return 1.0
        slower = 0.5 if v.op == "gemm:ubj,ibj->ui" else 0.0  # the FFN's weight gradient: no competition
        return 0.95 + slower + zlib.crc32(canonical_json(v.knobs).encode()) % 100 / 1000

    class Ranker:
        def ranked(self, variants):
            return sorted(variants, key=ms)

        def time_ms(self, variant):
            return ms(variant)

    fused = stored_fused()["bert"]
    plan = spec_order_plan(fused, "bert")
    steps = {s.name: s for s in plan.steps}
    moved = {"w1_x1": {**steps["w1_x1"].reads, "x1": "bji"}, "d_w1": {**steps["d_w1"].reads, "x1": "bji"}}
    plan = replace(plan, steps=[replace(s, reads=moved[s.name]) if s.name in moved else s for s in plan.steps])
    variants = tuning.chosen_layout_configs(Ranker(), fused, plan, torch.bfloat16)
    gemms = {g.name: g for g in tuning.training_gemms(fused)}
    assert {v.op for v in variants} == {gemms["w1_x1"].op}, sorted({v.op for v in variants})
    first = [v for v in tuning.gemm_variants(gemms["w1_x1"], "cuda", dtype=torch.bfloat16, layouts=1,
                                             first_configs=tuning.first_gemm_configs(torch.bfloat16, 8)) if v.config]
    fastest = {canonical_json(v.knobs) for v in sorted(first, key=ms)[:tuning.CHOSEN_LAYOUT_CONFIGS]}
    assert variants and all(v.config is not None and canonical_json(v.knobs) in fastest for v in variants)
    assert all(v.layout != first[0].layout for v in variants)


def test_the_exhaustive_tuning_measures_what_the_rules_prune(monkeypatch):
    """``tune(..., exhaustive=True)`` (the reference of ``benchmarks/tuning_cost.py``): cuBLASLt's
    other algorithms on every layout of every GEMM, the Triton template's fastest
    ``CHOSEN_LAYOUT_CONFIGS`` configurations of the first layout on every other, and nothing
    reported pruned (made-up times, four algorithms per call)."""
    import zlib

    from datamove import tuning
    from datamove.dataflow.snapshot import stored_fused
    from datamove.harness import contraction_variants
    from datamove.harness.tuning_db import canonical_json

    ms = lambda v: zlib.crc32((v.op + canonical_json(v.layout) + canonical_json(v.knobs)).encode()) % 1000  # noqa: E731
    tuner = _recorded_tuning(monkeypatch, ms, exhaustive=True)
    fused = stored_fused()["bert"]
    assert tuner.pruned == 0
    measured = [v for sweep in tuner.sweeps for v in sweep
                if isinstance(v, contraction_variants.GemmVariant) and not v.residual]
    for g in contraction_variants.training_gemms(fused):
        mine = [v for v in measured if v.op == g.op and v.dims == dict(g.sizes)]
        layouts = {canonical_json(v.layout) for v in mine}
        for layout in layouts:
            assert {v.algorithm for v in mine if v.config is None and canonical_json(v.layout) == layout} == {0, 1, 2, 3}
        first = canonical_json(mine[0].layout)
        triton_first = sorted((v for v in mine if v.config is not None and canonical_json(v.layout) == first), key=ms)
        fastest = {canonical_json(v.knobs) for v in triton_first[:tuning.CHOSEN_LAYOUT_CONFIGS]}
        for layout in layouts - {first}:
            others = {canonical_json(v.knobs) for v in mine if v.config is not None and canonical_json(v.layout) == layout}
            assert others <= fastest, (g.name, layout)
        assert any(v.config is not None and canonical_json(v.layout) != first for v in mine) or len(layouts) == 1 \
            or not triton_first, g.name
