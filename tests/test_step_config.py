"""Typed step configurations (``layouts.step_config``): each kind's own dataclass, checked, and
plan.json's form unchanged through a round trip."""
import json

import pytest

from datamove.dataflow.snapshot import stored_fused
from datamove.layouts.plan import ATTENTION_FORWARD, GEMM, LAYOUT_CHANGE, Plan, Step
from datamove.layouts.step_config import AttentionConfig, GeneratedConfig, LayoutChangeConfig, config_from_json
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


def test_an_attention_config_with_and_without_groups():
    """A plan written before grouped-query attention (no "groups") loads with none; one with groups
    writes and reads them back."""
    old = {"knobs": {}, "roles": {"q": "q", "k": "k", "v": "v", "o": "o", "mask": None, "lse": "lse(p)"},
           "letters": {"batch": "b", "heads": "h", "rows": "s", "keys": "t", "features": "e", "value_features": "e"},
           "scale": 0.125, "causal": True}
    plain = config_from_json(ATTENTION_FORWARD, old)
    assert plain.groups is None and plain.kv_heads == "h" and plain.group_size == 1 and plain.to_json() == old
    groups = {"letter": "k", "size": 4, "repeated": {"k": "k_2", "v": "v_2", "dk": "d_k_2", "dv": "d_v_2"}}
    grouped = AttentionConfig({}, old["roles"], old["letters"], 0.125, True, groups=groups)
    assert grouped.to_json() == {**old, "groups": groups}
    again = config_from_json(ATTENTION_FORWARD, json.loads(json.dumps(grouped.to_json())))
    assert again == grouped and again.kv_heads == "k" and again.group_size == 4


def test_a_config_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="a gemm step's config is a ContractionConfig, not GeneratedConfig"):
        Step("s", "forward", GEMM, (), {}, {}, GeneratedConfig({}), 0.0, "predicted")
    with pytest.raises(ValueError, match="unknown step kind 'dense'"):
        config_from_json("dense", {})
