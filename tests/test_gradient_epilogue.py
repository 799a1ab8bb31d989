"""The GEMM template's gradient epilogue (an activation's derivative times the product, the bias
gradient's sums) and its place in the pipeline: found in BERT's and GPT-2's backward graphs,
swept and checked against float64 (Triton interpreter on the CPU, small odd sizes; the ``gpu``
test at BERT-large and GPT-2 sizes), offered to the selection, run by the exported layer."""
import math

import pytest
import torch

from datamove.candidates import execution_order, plan_layer
from datamove.dataflow import snapshot
from datamove.dataflow.activations import derivative
from datamove.harness import contraction_variants as cv
from datamove.families import gradient_epilogue as ge
from datamove.harness.bench import Sweep
from datamove.harness.tuning_db import TuningDB
from datamove.kernels.contraction import Epilogue, contract, empty_in_layout, parse
from datamove.kernels.gemm import valid_configs
from datamove.layouts.cost_model import device_figures
from datamove.layouts.step_config import GradientEpilogueConfig
from datamove.layouts.space import rest_part
from tests.bias_join import with_joined_bias_gradients

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {"bert": dict(B=2, L=5, N=7, H=3, P=3, U=9), "gpt2": dict(B=2, T=5, D=24, H=2, E=12, F=40)}


def _gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    c = math.sqrt(2 / math.pi)
    t = torch.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


@pytest.mark.parametrize("spec,sizes,sum_letters", [("iu,ibj->ubj", dict(i=40, u=48, b=3, j=8), "u"),
                                                    ("bsd,fd->bsf", dict(b=3, s=5, d=24, f=40), "f")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_template_multiplies_by_the_derivative_and_sums(spec, sizes, sum_letters, dtype):
    """Every config (TMA, persistent, epilogue slices; strides of 16 bytes), the output and factor in
    spec order and rotated (unit stride along m or n; reversed where that is a GEMM), the sums along
    m (BERT's u) or n (GPT-2's f), partial tiles along both: against float64, within the rule's
    tolerance from PyTorch's own error."""
    c = parse(spec)
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn([sizes[x] for x in letters], generator=gen).to(dtype) for letters in (c.a, c.b))
    factor = torch.randn([sizes[x] for x in c.out], generator=gen).to(dtype)
    y64 = torch.einsum(spec, a.double(), b.double())
    reduced = [c.out.index(x) for x in c.out if x not in sum_letters]
    for gradient, f64 in (("relu", (factor.double() > 0) * 1.25), ("gelu", _gelu_derivative(factor.double()))):
        reference = y64 * f64
        baseline = (torch.einsum(spec, a, b).float() * f64.float()).to(dtype)
        tolerance = 1.5 * float((baseline.double() - reference).norm() / reference.norm()) + 1e-4
        sums_tolerance = 1.5 * float((baseline.float().sum(reduced).double() - reference.sum(reduced)).norm()
                                     / reference.sum(reduced).norm()) + 1e-4
        ran = []
        for config in valid_configs(dtype):
            for layout in dict.fromkeys((c.out, c.out[1:] + c.out[0], c.out[-1] + c.out[:-1], c.out[::-1])):
                out = empty_in_layout(c.out, layout, sizes, dtype, DEVICE).fill_(float("nan"))
                stored = empty_in_layout(c.out, layout, sizes, dtype, DEVICE).copy_(factor)  # M-major with C
                sums = torch.full((sizes[sum_letters],), float("nan"), dtype=dtype)
                epilogue = Epilogue(gradient=gradient, factor=stored, factor_scale=1.25, sums=sums, sum_letters=sum_letters)
                try:
                    contract(spec, a, b, out, backend="triton", epilogue=epilogue, config=config)
                except ValueError as refused:  # a reversal that is no GEMM; a TMA store off 16-byte strides
                    assert layout != c.out and ("in order" in str(refused) or "TMA-compatible C" in str(refused))
                    continue
                ran.append(layout)
                assert float((out.double() - reference).norm() / reference.norm()) <= tolerance, (gradient, config, layout)
                assert float((sums.double() - reference.sum(reduced)).norm() / reference.sum(reduced).norm()) \
                    <= sums_tolerance, (gradient, config, layout)
        assert ran.count(c.out) == len(valid_configs(dtype)) and len(set(ran)) >= 2


def test_template_refuses_a_gradient_with_forward_work_or_sums_off_a_gemm_group():
    spec, sizes = "iu,ibj->ubj", dict(i=16, u=16, b=2, j=16)
    c = parse(spec)
    a, b = (torch.randn([sizes[x] for x in letters]) for letters in (c.a, c.b))
    out, factor = torch.empty(16, 2, 16), torch.randn(16, 2, 16)
    with pytest.raises(ValueError, match="no bias, activation, dropout or save"):
        contract(spec, a, b, out, backend="triton",
                 epilogue=Epilogue(gradient="relu", factor=factor, bias=torch.zeros(16), bias_letters="u"))
    with pytest.raises(ValueError, match="not the letters of the GEMM's m group"):
        contract(spec, a, b, out, backend="triton",
                 epilogue=Epilogue(gradient="relu", factor=factor, sums=torch.empty(2), sum_letters="b"))


def test_derivative_tells_relu_and_gelu_from_other_maps():
    assert derivative("in0 * (in1 > 0) * s", 0, {"s": 1.25}) == ("relu", 1.25)
    assert derivative("(in0 > 0) * in1", 1, {}) == ("relu", 1.0)
    gelu = ("in0 * (0.5 * (1 + tanh(0.7978845608028654 * (in1 + 0.044715 * in1 ** 3))) + 0.5 * in1 * "
            "(1 - tanh(0.7978845608028654 * (in1 + 0.044715 * in1 ** 3)) ** 2) * 0.7978845608028654 * "
            "(1 + 3 * 0.044715 * in1 ** 2))")
    assert derivative(gelu, 0, {}) == ("gelu", 1.0)
    for other in ("in0 * in1", "in0 + in1", "in0 * (in1 > 0.5)", "in0 * (in1 >= 0)", "in0 * in0 * (in1 > 0)",
                  "in0 * (in1 > 0) * -1.0", "in0 * tanh(in1)"):
        assert derivative(other, 0, {}) is None, other


def test_found_in_bert_and_gpt2_with_their_rest():
    bert, gpt2 = (snapshot.stored_fused()[name] for name in ("bert", "gpt2"))
    found = {name: [(g.name, ge.gradient_epilogue_of(t, g)) for g in cv.training_gemms(t)] for name, t in
             (("bert", bert), ("gpt2", gpt2))}
    (name, ep), = [(n, e) for n, e in found["bert"] if e]
    scale = bert.graph.scalars()["scale_drop_act"]
    assert name == "d_hidden" and (ep.consumer, ep.factor, ep.gradient, ep.output, ep.summed, ep.sum_letters) == \
        ("d_b1", "hidden", "relu", "d_pre_act", "d_b1", "u") and ep.scale == pytest.approx(scale)
    assert ep.rest == ()  # d_b2 is joined with the layernorm backward that writes d_ffn
    joined = with_joined_bias_gradients(bert)
    ep = ge.gradient_epilogue_of(joined, next(g for g in cv.training_gemms(joined) if g.name == "d_hidden"))
    assert ep.consumer == "d_b1" and ep.rest == ("reduce:d_b2",)
    rest = ge.rest_operator(joined, ep)
    assert (rest.name, rest.inputs, rest.outputs) == ("d_b1_rest", ("d_ffn",), ("d_b2",))
    (name, ep), = [(n, e) for n, e in found["gpt2"] if e]
    assert name == "d_gelu" and (ep.consumer, ep.factor, ep.gradient, ep.sum_letters, ep.rest) == \
        ("d_bfc", "up", "gelu", "f", ())
    order = execution_order(gpt2)
    assert order.index("d_bfc") == order.index("d_gelu") + 1 and "d_bfc" != [o.name for o in gpt2.operators][
        [o.name for o in gpt2.operators].index("d_gelu") + 1]  # moved up past d_wout, which it does not read
    with pytest.raises(ValueError, match="not whole parts"):
        rest_part(next(o for o in joined.operators if o.name == "d_b1"), ("map:d_pre_act",))


@pytest.mark.parametrize("spec,joined", [("bert", False), ("bert", True), ("gpt2", False)])
def test_variants_pass_the_float64_check_through_the_sweep(spec, joined, tmp_path):
    """Each spec's variants; BERT's also with its bias gradients as one operator (a rest to run)."""
    training = snapshot.stored_fused()[spec].with_dims(SMALL[spec])
    training = with_joined_bias_gradients(training) if joined else training
    gemm = next(g for g in cv.training_gemms(training) if ge.gradient_epilogue_of(training, g))
    ep = ge.gradient_epilogue_of(training, gemm)
    dtype = torch.bfloat16
    variants = ge.gradient_variants(spec, training, gemm, ep, valid_configs(dtype)[:3], DEVICE, dtype)
    assert len({id(v.operands) for v in variants}) == 1  # one float64 evaluation for all of them
    pairs = {tuple(v.layout[k] for k in ("a", "b")) for v in variants}
    assert pairs == set(cv.epilogue_inputs(gemm))
    assert bool(ep.rest) == joined
    if ep.rest:  # the rest reads the GEMM's B operand (d_ffn) in B's layout
        assert {ge.rest_layouts(training, gemm, ep, pair)["d_ffn"] for pair in pairs} == {b for _, b in pairs}
    with TuningDB(tmp_path / "tuning.db") as db:  # the joined case compiled ahead in a compile worker
        report = Sweep(db, variants, progress=False, compile_workers=int(joined)).run()
        assert report.counts["wrong"] == 0 and report.counts["failed"] == 0
        assert report.compiling.tasks == (len(variants) if joined else 0)
        records = db.query(op=ge.gradient_op(spec, training, gemm, ep))
        assert len(records) == len(variants)
        checked = {name for r in records for name in (ep.output, ep.summed, *(["d_b2"] if ep.rest else []))
                   if name in r.detail}
        assert checked == {ep.output, ep.summed, *(["d_b2"] if ep.rest else [])}


def test_a_variant_that_skips_the_derivative_is_judged_wrong():
    """The check can fail: the same kernel without the factor's derivative (the plain GEMM's output
    as the product) is far from the float64 chain."""
    training = snapshot.stored_fused()["bert"].with_dims(SMALL["bert"])
    gemm = next(g for g in cv.training_gemms(training) if g.name == "d_hidden")
    ep = ge.gradient_epilogue_of(training, gemm)
    operands = ge.ConsumerOperands(training, gemm, ep, DEVICE, torch.float32)
    variant = ge.GradientVariant("bert", operands, valid_configs(torch.float32)[0], ("iu", "ibj"))
    variant.build()
    assert variant.check().passed
    variant.tensors["factor"].fill_(1.0)  # relu' = 1 everywhere: the mask dropped
    assert not variant.check().passed


@pytest.mark.parametrize("spec", ["bert", "gpt2"])
def test_cost_model_plan_takes_the_gradient_epilogue(spec):
    fused = snapshot.stored_fused()[spec]
    plan = plan_layer(fused, spec, dtype="bfloat16", figures=device_figures("H100"))
    (step,) = [s for s in plan.steps if s.kind == "gemm_epilogue" and isinstance(s.config.epilogue, GradientEpilogueConfig)]
    name = {"bert": "d_hidden+d_b1", "gpt2": "d_gelu+d_bfc"}[spec]
    assert step.name == name and step.operators == tuple(name.split("+"))
    assert "d_hidden" not in plan.layouts and "d_gelu" not in plan.layouts  # the GEMM's own output is never stored


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["bert", "gpt2"])
def test_full_size_gpu(spec, tmp_path):
    """At the spec's sizes on the GPU: every variant of the first three configs passes the check."""
    training = snapshot.stored_fused()[spec]
    gemm = next(g for g in cv.training_gemms(training) if ge.gradient_epilogue_of(training, g))
    ep = ge.gradient_epilogue_of(training, gemm)
    variants = ge.gradient_variants(spec, training, gemm, ep, valid_configs(torch.bfloat16)[:3], "cuda")
    with TuningDB(tmp_path / "tuning.db") as db:
        report = Sweep(db, variants, progress=False).run()
        assert report.counts["wrong"] == 0 and report.counts["failed"] == 0 and report.counts["ok"] == len(variants)
