"""Contraction and attention variants through ``harness.bench.Sweep`` into the tuning DB, at small odd sizes.

On the CPU (Triton interpreter) nothing is timed: every variant is built, checked against float64
and recorded 'checked'.  GEMMs run in bf16 (the template corrects the interpreter's bf16 faults);
attention in float32 (the interpreter's bf16 dots and casts are wrong, see tests/test_attention.py).
"""
import time

import torch

from datamove.dataflow import snapshot
from datamove.families.attention import variants as av
from datamove.families import forward_epilogue as fe, residual_add as ra
from datamove.harness import contraction_variants as cv
from datamove.harness.bench import Sweep
from datamove.kernels.gemm import GemmConfig, valid_configs
from datamove.harness.tuning_db import TuningDB

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(B=2, L=5, N=7, H=3, P=3, U=9)


def _training():
    return snapshot.stored_fused()["bert"].with_dims(SMALL)


def test_gemms_come_from_the_training_graph():
    gemms = {g.name: g for g in cv.training_gemms(snapshot.stored_fused()["bert"])}
    assert len(gemms) == 18
    assert gemms["stack(wq_x,wk_x,wv_x)"].spec == "sphi,ibj->sphbj"
    assert gemms["stack(d_wv,d_wk,d_wq)"].spec == "swhbk,ibk->swhi"
    assert gemms["stack(d_x_via_wv_x,d_x_via_wk_x,d_x_via_wq_x)"].spec == "swhi,swhbk->ibk"
    linear1 = gemms["w1_x1"]
    assert linear1.spec == "ui,ibj->ubj" and linear1.flop == 2 * 4096 * 1024 * 8 * 512
    epilogue = fe.epilogue_of(snapshot.stored_fused()["bert"], linear1)
    assert (epilogue.bias, epilogue.bias_letters, epilogue.activation, epilogue.mask, epilogue.save) == \
        ("b1", "u", "relu", "drop_act", None)  # the backward reads hidden, not the pre-activation
    assert [g.name for g in gemms.values() if fe.epilogue_of(snapshot.stored_fused()["bert"], g)] == ["w1_x1"]
    residual = {g.name: ra.residual_add_of(snapshot.stored_fused()["bert"], g) for g in gemms.values()}
    assert {name: r for name, r in residual.items() if r} == {"stack(d_x_via_wv_x,d_x_via_wk_x,d_x_via_wq_x)": ra.ResidualAdd(
        "d_x", "d_x_stacked", "d_resid1", "d_x")}  # the input gradient: the residual branch's plus the GEMM's


def test_sweep_records_checked_failed_and_resumes(tmp_path):
    training = _training()
    gemms = {g.name: g for g in cv.training_gemms(training)}
    configs = valid_configs()[:2]
    broken = GemmConfig(16, 32, 24, 1, 1, 4)  # BLOCK_K not a power of two: tl.arange refuses it
    variants = []
    for name in ("stack(wq_x,wk_x,wv_x)", "k_q", "stack(d_x_via_wv_x,d_x_via_wk_x,d_x_via_wq_x)"):
        variants += cv.gemm_variants(gemms[name], DEVICE, layouts=2, first_configs=configs, other_configs=configs[:1])
    variants += cv.gemm_variants(gemms["d_w1"], DEVICE, layouts=1, first_configs=[broken])
    # D = A B + C through cuBLASLt (CUDA only): checked against float64 with the residual added
    added = ra.residual_variants(gemms["stack(d_x_via_wv_x,d_x_via_wk_x,d_x_via_wq_x)"], DEVICE, layouts=1)
    assert bool(added) == (DEVICE == "cuda")
    variants += added
    linear1 = gemms["w1_x1"]
    epilogue = fe.epilogue_of(training, linear1)
    consumers = fe.consumer_configurations(training, epilogue)
    assert consumers and all(c.layouts[t] == training.graph.tensors[t].letters for _, _, c in consumers for t in c.layouts)
    variants += fe.epilogue_variants(cv.Operands(linear1, DEVICE), epilogue, configs[:1], consumers[:2])
    ws = av.Workspace(av.AttentionCase(2, 3, 21, 16, 0.2, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32), DEVICE)
    variants += av.config_variants(ws)[:1] + [av.FusedVariant(ws, "backward"), av.FusedVariant(ws, "fwd+bwd", launch="python")]
    variants += av.baseline_variants(ws, directions=("fwd+bwd",), launches=("python",), backends=("default", "math"))

    with TuningDB(tmp_path / "tuning.db") as db:
        sweep = Sweep(db, variants, progress=False)
        report = sweep.run()
        done = "ok" if report.measured else "checked"
        assert report.counts["wrong"] == 0
        assert report.counts["failed"] == 1 and report.counts[done] == len(variants) - 1
        failed = db.query(status="failed")
        assert len(failed) == 1 and failed[0].key.knobs["block_k"] == 24 and failed[0].detail.startswith("build:")
        eager = db.query(op=ws.case.op("fwd+bwd"), knobs={"impl": "eager", "launch": "python"})[0]
        assert "native_dropout" in eager.detail and eager.flop == 14 * 2 * 3 * 21 * 21 * 16
        gemm = db.query(op=linear1.op + "+bias[u]+relu+dropout(0.1)", knobs={"backend": "cublas+eager"})
        assert gemm and gemm[0].status == done and "pre_activation" not in gemm[0].detail  # nothing saved
        generated = db.query(op=linear1.op + "+bias[u]+relu+dropout(0.1)")
        generated = [r for r in generated if r.key.knobs["backend"] == "cublas+fused"]
        assert len(generated) == 2 and all(r.status == done and "out" in r.detail for r in generated)
        ranked = sweep.ranked([v for v in variants if v.op == gemms["k_q"].op])
        assert len(ranked) == 2 + 1 + 1 + 1  # both layouts' cuBLAS, their Triton configs

        started = time.monotonic()
        again = Sweep(db, variants, progress=False).run()
        assert again.counts["skipped"] == len(variants)
        assert time.monotonic() - started < 5


def test_triton_gemms_compile_ahead_in_a_compile_worker(tmp_path):
    """A Triton configuration's compile task builds it in a compile worker (cuBLAS has none), as a
    fused epilogue's (its Triton kernel, or its consumer's generated one; not cuBLAS + eager);
    one that cannot compile is recorded failed there, never built by a measuring process."""
    training = _training()
    gemms = {g.name: g for g in cv.training_gemms(training)}
    broken = GemmConfig(16, 32, 24, 1, 1, 4)  # BLOCK_K not a power of two
    variants = cv.gemm_variants(gemms["k_q"], DEVICE, layouts=1, first_configs=[valid_configs()[0], broken])
    assert [v.compile_task() is None for v in variants] == [v.config is None for v in variants]
    epilogue = fe.epilogue_of(training, gemms["w1_x1"])
    consumers = fe.consumer_configurations(training, epilogue)[:1]
    fused = fe.epilogue_variants(cv.Operands(gemms["w1_x1"], DEVICE), epilogue, valid_configs()[:1], consumers)
    assert [v.compile_task() is None for v in fused] == [v.config is None and v.consumer is None for v in fused]
    variants += fused
    with TuningDB(tmp_path / "tuning.db") as db:
        report = Sweep(db, variants, progress=False, compile_workers=1).run()
        failed = db.query(status="failed")
        assert report.compiling.tasks == 2 + len(fused) - 1 and report.counts["failed"] == 1
        assert failed[0].key.knobs["block_k"] == 24 and failed[0].detail.startswith("compile: ")
        assert len(db.query(status="ok" if report.measured else "checked")) == len(variants) - 1


def test_attention_with_biases_is_checked_against_biased_inputs(tmp_path):
    """A biased attention case (``AttentionCase(bias=True)``: q + bq, k + bk, v + bv inside the
    kernels) has its own keys and passes the float64 check on the biased reference; a variant that
    ignored the biases would not (its O is checked against the biased chain); baselines refuse biases."""
    import pytest

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    ws = av.Workspace(av.AttentionCase(2, 3, 21, 16, 0.2, dtype=dtype, bias=True), DEVICE)
    variants = [av.FusedVariant(ws, "forward"), av.FusedVariant(ws, "backward")]
    with TuningDB(tmp_path / "tuning.db") as db:
        report = Sweep(db, variants, progress=False).run()
        assert report.counts["wrong"] == 0 and report.counts["failed"] == 0
        assert {r.key.op for r in db.query()} == {"attention:forward:dropout=0.2:bias", "attention:backward:dropout=0.2:bias"}
        configs = av.config_variants(av.Workspace(av.AttentionCase(2, 3, 21, 16, 0.2, dtype=dtype), DEVICE))
        plain = [v for v in configs if v.direction == "forward"][:2] + [v for v in configs if v.direction == "backward"][:2]
        sweep = Sweep(db, plain, progress=False)
        sweep.run()
        again = av.biased_variants(sweep.ranked(plain), per_direction=1)  # the main job's second look, with biases
        assert [(v.direction, v.ws.case.bias) for v in again] == [("forward", True), ("backward", True)]
        assert (again[0].forward, again[1].backward) == (sweep.ranked(plain)[0].forward, plain[2].backward)
        assert Sweep(db, again, progress=False).run().counts["wrong"] == 0
    plain = av.Workspace(av.AttentionCase(2, 3, 21, 16, 0.2, dtype=dtype), DEVICE)
    unbiased = av.FusedVariant(plain, "forward")
    unbiased.build()
    assert not ws.verdict(unbiased.run()).passed  # the same inputs without the biases: far from the biased reference
    with pytest.raises(ValueError, match="bias"):
        av.EagerVariant(ws, "forward")
    with pytest.raises(ValueError, match="bias"):
        av.FusedVariant(ws, "fwd+bwd")


def test_fused_epilogues_with_dropout_are_also_timed_on_the_whole_tile_and_in_halves():
    from datamove.families.base import EPILOGUE_CONFIGS, epilogue_configs

    ranked = [GemmConfig(128, 256, 64, 8, 3, 8, tma=True), GemmConfig(128, 128, 64, 8, 4, 4),
              GemmConfig(64, 64, 64, 8, 4, 4, epilogue_split=1), GemmConfig(256, 128, 64, 8, 3, 8)]
    fastest = ranked[:EPILOGUE_CONFIGS]
    assert epilogue_configs(ranked, slices=False) == fastest
    with_dropout = epilogue_configs(ranked, slices=True)
    assert with_dropout[:EPILOGUE_CONFIGS] == fastest
    assert with_dropout[EPILOGUE_CONFIGS:] == [GemmConfig(128, 256, 64, 8, 3, 8, tma=True, epilogue_split=1),
                                               GemmConfig(128, 256, 64, 8, 3, 8, tma=True, epilogue_split=2),
                                               GemmConfig(128, 128, 64, 8, 4, 4, epilogue_split=1),
                                               GemmConfig(128, 128, 64, 8, 4, 4, epilogue_split=2)]


def test_fused_epilogue_is_timed_reading_each_input_layout(tmp_path):
    """The fused GEMM + epilogue reads A and B in every layout pair whose plan writes the output in
    spec order (BERT's x1 as its LayerNorm writes it, bji, among them), each checked against float64."""
    training = _training()
    linear1 = next(g for g in cv.training_gemms(training) if g.name == "w1_x1")
    epilogue = fe.epilogue_of(training, linear1)
    inputs = cv.epilogue_inputs(linear1)
    assert inputs[0] == ("ui", "ibj") and ("ui", "bji") in inputs and len(set(inputs)) == len(inputs) == 4
    variants = fe.epilogue_variants(cv.Operands(linear1, DEVICE), epilogue, valid_configs()[:1], inputs=inputs)
    with TuningDB(tmp_path / "tuning.db") as db:
        report = Sweep(db, variants, progress=False).run()
        assert report.counts["wrong"] == 0 and report.counts["failed"] == 0
        records = [r for r in db.query(op=linear1.op + "+bias[u]+relu+dropout(0.1)") if r.key.knobs["backend"] == "triton"]
        assert sorted((r.key.layout["a"], r.key.layout["b"]) for r in records) == sorted(inputs)
        assert {r.key.layout["out"] for r in records} == {"ubj"}


def test_gelu_epilogue_found_in_the_spec_and_checked(tmp_path):
    """GPT-2's FFN consumer (bias add, then tanh-GELU spelled as nine maps, the bias-added value
    kept for the backward) is the template's GELU epilogue with the pre-activation saved; the
    fused kernel and both baselines pass the float64 check at small sizes.  A chain one constant
    off GELU is no activation."""
    from datamove.dataflow.graph import Operand, Primitive

    training = snapshot.stored_fused()["gpt2"].with_dims(dict(B=2, T=5, D=8, H=2, E=4, F=12))
    wfc = next(g for g in cv.training_gemms(training) if g.name == "h2_wfc")
    epilogue = fe.epilogue_of(training, wfc)
    assert (epilogue.consumer, epilogue.bias, epilogue.activation, epilogue.mask, epilogue.save, epilogue.saved) == \
        ("gelu", "bfc", "gelu", None, "pre_activation", "up")
    variants = fe.epilogue_variants(cv.Operands(wfc, DEVICE), epilogue, valid_configs()[:1],
                                    fe.consumer_configurations(training, epilogue)[:1])
    with TuningDB(tmp_path / "tuning.db") as db:
        report = Sweep(db, variants, progress=False).run()
        assert report.counts["wrong"] == 0 and report.counts["failed"] == 0 and len(variants) == 3

    def chain(*exprs):
        prims, source = [], "x"
        for n, expr in enumerate(exprs):
            prims.append(Primitive(f"p{n}", "map", (Operand(source, "a"),), Operand(f"t{n}", "a"), expr))
            source = f"t{n}"
        return prims

    gelu = "0.5 * in0 * (1 + tanh(0.7978845608028654 * (in0 + 0.044715 * in0 * in0 * in0)))"
    assert fe._activation(chain("in0 + 0", gelu), 0, "x", {}) == ("gelu", 1)
    assert fe._activation(chain(gelu.replace("0.044715", "0.045")), 0, "x", {}) is None
    assert fe._activation(chain("maximum(in0, 0.0)"), 0, "x", {}) == ("relu", 0)
    assert fe._activation(chain("maximum(in0, 0.01 * in0)"), 0, "x", {}) is None  # leaky


def test_an_epilogue_that_saves_gets_the_stages_that_fit(monkeypatch):
    """A saved pre-activation takes a second slice of the tile in shared memory (sm_90): a
    configuration that fits without it runs one stage fewer, or two, or is dropped."""
    from datamove.kernels import gemm
    from datamove.families.base import epilogue_configs

    monkeypatch.setattr(gemm, "interpreted", lambda: False)
    halves = GemmConfig(128, 256, 64, 8, 4, 8, tma=True, epilogue_split=2, persistent=True, store_tma=True)
    whole = GemmConfig(128, 256, 64, 8, 3, 8, tma=True, persistent=True, store_tma=True)
    assert gemm.fitted(halves, torch.bfloat16, saves=False) == halves
    assert gemm.fitted(halves, torch.bfloat16, saves=True).num_stages == 3
    assert gemm.fitted(whole, torch.bfloat16, saves=True).num_stages == 2
    assert gemm.fitted(GemmConfig(256, 256, 64, 8, 2, 8, tma=True, store_tma=True), torch.bfloat16, saves=True) is None
    assert epilogue_configs([halves, whole], slices=False, saves=True) == [gemm.replace(halves, num_stages=3),
                                                                           gemm.replace(whole, num_stages=2)]


def test_attention_without_dropout_times_each_configuration_once():
    """The dropout-mask option changes no kernel without dropout: a case with dropout_p 0 gets each
    forward and backward configuration once (with the option's first value), one with dropout
    each configuration per option its key blocks take."""
    from datamove.harness.tuning_db import canonical_json
    from datamove.kernels.attention import DROPOUT_MASK_OPTIONS

    def option(v) -> str:  # a forward's among its knobs, a backward's in its configuration
        return v.knobs.get("dropout_mask") or v.knobs["backward"]["dropout_mask"]

    def configuration(v) -> str:
        knobs = {k: x for k, x in v.knobs.items() if k != "dropout_mask"}
        if "backward" in knobs:
            knobs["backward"] = {k: x for k, x in knobs["backward"].items() if k != "dropout_mask"}
        return canonical_json(knobs)

    with_dropout = av.config_variants(av.Workspace(av.AttentionCase(2, 3, 21, 16, 0.2), "cpu"))
    without = av.config_variants(av.Workspace(av.AttentionCase(2, 3, 21, 16, 0.0), "cpu"))
    assert {option(v) for v in with_dropout} == set(DROPOUT_MASK_OPTIONS)
    assert {option(v) for v in without} == {DROPOUT_MASK_OPTIONS[0]}
    assert len({configuration(v) for v in without}) == len(without)  # no two apart only in the option
    assert {configuration(v) for v in without} == {configuration(v) for v in with_dropout}
    assert len(without) < len(with_dropout)


def test_the_tuning_times_only_attention_variants_a_plan_can_run():
    """The job's attention stage measures the fused kernels regenerating the dropout mask (what a
    plan runs, ``candidates._plannable``), not those saving it (half the stage, never chosen)."""
    from types import SimpleNamespace

    from datamove.families.attention import tuning as attention_tuning
    from datamove.families.attention.candidates import _plannable

    swept = []
    tuner = SimpleNamespace(measure=lambda variants, **_: swept.extend(variants),
                            ranker=SimpleNamespace(ranked=lambda variants: list(variants)))
    attention_tuning.measure(tuner, [dict(B=2, H=3, L=21, P=16, dropout_p=0.2, layout="bjhp")], torch.float32)
    fused = [v for v in swept if v.knobs.get("impl") == "fused"]
    assert fused and all(_plannable(v.knobs) for v in fused)
    assert {v.direction for v in fused} == {"forward", "backward"}
