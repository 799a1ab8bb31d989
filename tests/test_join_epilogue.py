"""The join epilogue (``datamove.families.join_epilogue``) on a Llama layer's SwiGLU MLP: the pattern
found where it is (the gate/up pair's forward, the backward of ``silu(gate) * up`` after the down
projection's input gradient) and nowhere in BERT or GPT-2; the cost model's plan takes both; the
exported layer matches the float64 executor through the Triton interpreter (kernels) and in
PyTorch operations (torch), forward and every gradient; each variant the tuning would time passes
its own check against float64; the step configuration's JSON round trip.  Small odd sizes."""
import json

import pytest
import torch

from datamove.dataflow.pipeline import analyse_spec
from datamove.families import GEMM_FAMILIES
from datamove.families.join_epilogue import Join, JoinEpilogueFamily, join_of, join_variants
from datamove.harness.contraction_variants import training_gemms
from datamove.job import fused_training
from datamove.kernels.gemm import valid_configs
from datamove.layouts.plan import GEMM_EPILOGUE, Plan
from datamove.layouts.step_config import ContractionConfig
from test_export import check_against_executor, load, randomize
from test_llama_gqa import SPEC, job, set_constants

SIZES = dict(B=2, T=21, D=48, H=6, KV=2, E=16, F=40)
FORWARD = ("stack(gate,h_2_w_up)", "gate_expr_times_expr")  # (GEMM, consumer)
BACKWARD = ("d_gate_expr_times_expr", "d_gate")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="float32 through the Triton interpreter (CPU)")


@pytest.fixture(scope="module")
def llama():
    return fused_training(analyse_spec(SPEC, SIZES))


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    return job(tmp_path_factory.mktemp("llama_join") / "out")


def test_the_swiglu_joins_are_found_and_nothing_else(llama):
    found = {g.name: join_of(llama, g) for g in training_gemms(llama)}
    found = {name: j for name, j in found.items() if j is not None}
    assert set(found) == {FORWARD[0], BACKWARD[0]}
    forward, backward = found[FORWARD[0]], found[BACKWARD[0]]
    assert (forward.consumer, forward.products, forward.loads, forward.stored) == \
        (FORWARD[1], ("gate", "h_2_w_up"), (), ("gate", "h_2_w_up"))  # the backward reads both products
    assert forward.pair and set(forward.outputs) == {"gate_expr_times_expr"}  # silu(gate): recomputed in the backward
    assert (backward.consumer, backward.products, backward.stored) == (BACKWARD[1], ("d_gate_expr_times_expr",), ())
    assert not backward.pair and set(backward.loads) == {"h_2_w_up", "gate"}  # (dataflow.recompute)
    for spec in ("configs/bert.py", "configs/gpt2.py"):  # bias adds, residual adds, gradient epilogues: other families'
        fused = fused_training(analyse_spec(spec, None))
        assert [g.name for g in training_gemms(fused) if join_of(fused, g)] == []


def test_the_family_is_registered():
    assert any(isinstance(f, JoinEpilogueFamily) for f in GEMM_FAMILIES)


def test_the_plan_takes_both_joins(joined):
    plan = Plan.from_json(json.loads((joined / "plan.json").read_text()))
    steps = {s.operators: s for s in plan.steps if s.kind == GEMM_EPILOGUE and isinstance(s.config.epilogue, Join)}
    assert set(steps) == {FORWARD, BACKWARD}
    assert set(steps[FORWARD].writes) == {"gate", "h_2_w_up", "gate_expr_times_expr"}
    assert set(steps[BACKWARD].writes) == {"d_h_2_w_up", "d_gate"}  # d_gate_expr_times_expr never stored
    assert not any("d_gate_expr_times_expr" in s.reads for s in plan.steps)


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_joined_layer_matches_the_executor(joined, backend):
    layer = load(joined, backend=backend, allow_mismatch=True)
    randomize(layer, 2)
    set_constants(layer)
    check_against_executor(layer, {"x": None})


@pytest.mark.parametrize("pattern", [FORWARD, BACKWARD], ids=["forward", "backward"])
def test_every_variant_passes_its_check(llama, pattern):
    gemm = next(g for g in training_gemms(llama) if g.name == pattern[0])
    join = join_of(llama, gemm)
    variants = join_variants("llama", llama, gemm, join, valid_configs(torch.float32), "cpu", torch.float32)
    assert variants
    compile_ahead, args = variants[0].compile_task()  # what a compile worker runs: built once, operands let go
    made = []
    make = variants[0].operands.make
    variants[0].operands.make = lambda: made.append(make()) or made[-1]
    compile_ahead(*args)
    del variants[0].operands.make
    assert variants[0].operands._tensors is None and list(made[0]) == ["values"]  # no float64 reference made
    for variant in variants[:3]:
        variant.build()
        verdict = variant.check()
        assert verdict.passed, (variant.config, verdict)
        assert set(name for name, _ in verdict.results) == set(join.outputs) | set(join.stored)


def test_the_step_configuration_round_trips(joined):
    data = json.loads((joined / "plan.json").read_text())
    for step in data["steps"]:
        if step["kind"] == GEMM_EPILOGUE and "products" in step["config"]["epilogue"]:
            config = ContractionConfig.from_json(step["config"])
            assert isinstance(config.epilogue, Join) and config.to_json() == step["config"]


def test_pair_mode_takes_the_gemms_fastest_tiles_halved_until_two_accumulators_fit():
    from datamove.families.join_epilogue import pair_sized
    from datamove.kernels.gemm import GemmConfig, pair_fits
    fastest = GemmConfig(128, 256, 64, 8, 3, 8, tma=True, persistent=True, store_tma=True)
    assert pair_sized(fastest) == GemmConfig(128, 128, 64, 8, 3, 8, tma=True, persistent=True, store_tma=True)
    assert pair_sized(GemmConfig(256, 128, 64, 8, 3, 8)) == GemmConfig(128, 128, 64, 8, 3, 8)
    assert pair_sized(GemmConfig(128, 128, 64, 8, 4, 4)) == GemmConfig(128, 64, 64, 8, 4, 4)
    assert all(pair_fits(pair_sized(c)) for c in (fastest, GemmConfig(64, 64, 64, 8, 4, 4)))


def test_a_join_timing_is_keyed_by_the_join_kernels_source(llama):
    from datamove.candidates import _stale
    from datamove.harness.tuning_db import Key
    from datamove.kernels.gemm import TEMPLATE_ID
    from datamove.kernels.gemm_join import JOIN_TEMPLATE_ID
    gemm = next(g for g in training_gemms(llama) if g.name == BACKWARD[0])
    variant = join_variants("llama", llama, gemm, join_of(llama, gemm), valid_configs(torch.float32)[:1], "cpu",
                            torch.float32)[0]
    assert variant.knobs["template"] == JOIN_TEMPLATE_ID != TEMPLATE_ID
    def key(template: str) -> Key:
        return Key("cpu", {}, variant.op, variant.dims, "float32", variant.layout, {**variant.knobs, "template": template})
    assert not _stale(key(JOIN_TEMPLATE_ID)) and _stale(key("an older join kernel"))
