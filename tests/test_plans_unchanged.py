"""Moving code between modules must not change what the main job selects or generates: the cost
model's plans and the kernels' sources of the shipped specs, against those recorded in
``tests/golden/plans.json`` (``tests/golden_plans.py``)."""
import json
import os

import pytest

from golden_plans import CASES, GOLDEN, record

RECORDED = json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_main_job_selects_and_generates_what_it_did(name, tmp_path):
    now = record(name, tmp_path / name)
    before = RECORDED[name]
    assert sorted(now["plans"]) == sorted(before["plans"])
    for path, plan in now["plans"].items():
        assert plan == before["plans"][path], f"{name}: {path} differs from the recorded plan"
    if os.environ.get("TRITON_INTERPRET") == "1":  # recorded as generated for the interpreter
        assert now["kernels"] == before["kernels"], f"{name}: generated kernel sources differ"
