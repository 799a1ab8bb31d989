"""``datamove.dtypes``: one precision object for every spelling of a layer's dtype."""
import json

import pytest
import torch

from datamove.dtypes import BF16, FP16, FP32, PRECISIONS, Precision, parse

SPELLINGS = [(BF16, "bfloat16", "bf16", torch.bfloat16, 2), (FP16, "float16", "fp16", torch.float16, 2),
             (FP32, "float32", "fp32", torch.float32, 4)]


@pytest.mark.parametrize("precision, name, short, torch_dtype, itemsize", SPELLINGS)
def test_every_spelling_gives_the_one_object(precision, name, short, torch_dtype, itemsize):
    for spelling in (name, short, torch_dtype, precision):
        assert parse(spelling) is precision
    assert (precision.name, precision.short, precision.torch, precision.itemsize) == (name, short, torch_dtype, itemsize)
    assert precision.itemsize == torch_dtype.itemsize
    assert str(precision) == f"{precision}" == name  # messages and paths read as the stored string did


@pytest.mark.parametrize("value", ["bfloat", "BF16", "torch.bfloat16", "float64", "", torch.float64, torch.int8, 2, None])
def test_other_values_are_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"unknown dtype .*: expected one of bf16 / bfloat16 / torch.bfloat16, ") as err:
        parse(value)
    assert "\n" not in str(err.value)


def test_immutable_and_hashable():
    with pytest.raises(AttributeError):
        BF16.name = "float16"
    assert {parse("bf16"): 1}[parse(torch.bfloat16)] == 1
    assert len(set(PRECISIONS)) == len(PRECISIONS) == 3 and all(isinstance(p, Precision) for p in PRECISIONS)


def test_round_trip_to_the_stored_strings():
    """plan.json, the manifest and the tuning database keep "bfloat16"; the command line "bf16"."""
    from datamove.job import JobOptions, default_out
    from datamove.layouts.plan import Plan

    plan = Plan("s", {"B": 1}, "bf16", "d", "predicted", {}, [], [], 0.0, 0.0)
    assert plan.dtype is BF16
    stored = json.loads(plan.dumps())
    assert stored["dtype"] == "bfloat16" and list(stored)[:3] == ["spec", "dims", "dtype"]
    again = Plan.from_json(stored)
    assert again.dtype is BF16 and again == plan and again.dumps() == plan.dumps()
    assert Plan.from_json({**stored, "dtype": "float16"}).dtype is FP16
    assert JobOptions(spec="x.py", dtype=torch.float16).dtype is FP16 and JobOptions(spec="x.py").dtype is BF16
    assert default_out("bert", [{"B": 8}], torch.float16, "costmodel").name == "bert-B8-fp16-costmodel"
    for precision in PRECISIONS:
        assert parse(precision.name).name == precision.name and parse(precision.short).short == precision.short


def test_cost_model_and_timings_take_any_spelling():
    from datamove.candidates import Timings
    from datamove.harness.tuning_db import Key, Record
    from datamove.layouts.cost_model import device_figures

    figures = device_figures("H100")
    assert figures.peak("bfloat16") == figures.peak(BF16) == figures.peak(torch.bfloat16) == figures.peak("bf16")
    assert figures.peak("float32") == figures.peak(FP32) < figures.peak(FP16)
    key = Key("GPU", {}, "gemm:ui,ibj->ubj", {}, "float16", {}, {"backend": "cublas"})
    for spelling in ("float16", "fp16", FP16, torch.float16):
        assert Timings([Record(key, "ok", 0.05)], "GPU", spelling).dtype is FP16
    with pytest.raises(ValueError, match="GPU / float16; this selection is for GPU / bfloat16"):
        Timings([Record(key, "ok", 0.05)], "GPU", BF16)
