"""Typed step configurations (``layouts.step_config``): each kind's own dataclass, checked, and
plan.json's form unchanged through a round trip."""
import json

import pytest

from datamove.dataflow.snapshot import stored_fused
from datamove.layouts.plan import GEMM, LAYOUT_CHANGE, Plan, Step
from datamove.layouts.step_config import GeneratedConfig, LayoutChangeConfig, config_from_json
from plans import selected_plan


@pytest.mark.parametrize("spec", ["bert", "gpt2"])
def test_a_plan_survives_its_json(spec):
    """Every kind the selection makes (generated, GEMMs with epilogues, attention) reads back as the
    same typed configurations and writes the same JSON again (knobs' tuples come back as lists)."""
    plan = selected_plan(stored_fused()[spec], spec, dtype="bfloat16")
    text = plan.dumps()
    again = Plan.from_json(json.loads(text))
    assert again.dumps() == text
    assert [type(s.config) for s in again.steps] == [type(s.config) for s in plan.steps]
    assert [s.config.epilogue for s in again.steps if s.kind == "gemm_epilogue"] == \
        [s.config.epilogue for s in plan.steps if s.kind == "gemm_epilogue"]
    assert {s.kind for s in plan.steps} >= {"generated", "gemm", "gemm_epilogue", "attention_forward", "attention_backward"}


def test_the_json_form_is_the_one_artifacts_hold():
    change = Step("c", "forward", LAYOUT_CHANGE, (), {"x": "ab"}, {}, LayoutChangeConfig("x", "ab", "ba"), 0.1, "measured")
    assert change.to_json()["config"] == {"tensor": "x", "from": "ab", "to": "ba"}
    cublas = config_from_json(GEMM, {"einsum": "ab,bc->ac", "backend": "cublas", "gemm": None,
                                     "operands": {"a": ["x"], "b": ["w"], "out": ["y"]}})
    assert cublas.algorithm == 0 and cublas.residual is None and "algorithm" not in cublas.to_json()


def test_a_config_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="a gemm step's config is a ContractionConfig, not GeneratedConfig"):
        Step("s", "forward", GEMM, (), {}, {}, GeneratedConfig({}), 0.0, "predicted")
    with pytest.raises(ValueError, match="unknown step kind 'dense'"):
        config_from_json("dense", {})
