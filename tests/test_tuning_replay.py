"""The tuning's pruning rules replayed on a recorded GPU tuning (``tests/tuning_replay.py``): which
variants they measure, when they stop, the plan they end with, and a re-run reading everything back."""
from unittest import mock

import pytest

from datamove import knob_climb, tuning
from datamove.dataflow.snapshot import stored_fused
from tuning_replay import _without_gpu, key_of, replay

KNOB_STAGES = ("fused operators: knobs of the fastest patterns", "plan: knobs of its layouts")


def _every_knob(tuner, groups, *, stage, reserve=True):
    """``tuning.climb`` as the recording's tuning ran its knob stages: every setting at once."""
    variants = [v for group in groups for v in group]
    tuner.measure(variants, stage=stage)
    return {knob_climb.variant_key(v) for v in variants}


def _measured(tuner, stage: str) -> int:
    return tuner.report.stages[stage].counts.get("ok", 0)


@pytest.fixture(scope="module")
def replays():
    fused = stored_fused()["bert"]
    with mock.patch.object(tuning, "climb", _every_knob):
        every = replay("bert", fused)
    return every, replay("bert", fused)


def test_climbing_the_knobs_measures_under_half_and_ends_with_the_same_plan(replays):
    """BERT-large on an H200 (the recording): the knob stages measure under half the settings the
    recording's rule (every setting of the chosen patterns) measured, and the selection ends with
    the same plan, step for step, at the recording's measured 0.7397 ms."""
    (every, every_plan), (climbed, plan) = replays
    assert not climbed.unrecorded or {v.op for v in climbed.unrecorded} <= {v.op for v in every.unrecorded}
    for stage in KNOB_STAGES:
        assert _measured(climbed, stage) < 0.5 * _measured(every, stage), stage
    assert climbed.report.stages[KNOB_STAGES[0]].pruned > every.report.stages[KNOB_STAGES[0]].pruned
    assert plan.timing == every_plan.timing == "measured"
    assert plan.total_ms == pytest.approx(every_plan.total_ms) == pytest.approx(0.7397, abs=5e-5)
    assert [(s.name, s.reads, s.writes, s.config) for s in plan.steps] == \
        [(s.name, s.reads, s.writes, s.config) for s in every_plan.steps]


def test_every_climb_ends_at_a_setting_no_neighbour_beats():
    """Each pattern's climb stops where no setting next to its fastest (``knob_climb.adjacent``)
    was faster: the rounds end by themselves, not by a count."""
    from datamove.knob_climb import adjacent, numeric_steps

    fused = stored_fused()["bert"]
    tuner, _ = replay("bert", fused)
    with _without_gpu():
        spaces = tuning.fused_spaces(fused, "bert", "bf16")
    for space in spaces:
        for group in space.fastest_patterns(tuner.ranked(space.first_stage()), 1):
            ranked = tuner.ranked(group)
            if not ranked:
                continue
            steps = numeric_steps([v.config.knobs for v in group])
            best = ranked[0]
            neighbours = [v for v in group if adjacent(best.config.knobs, v.config.knobs, steps)]
            assert all(key_of(v) in tuner.measured for v in neighbours), space.op.name


def test_a_rerun_reads_everything_back():
    """The same tuning again over what the first measured: nothing new, every sweep read back."""
    from datamove.tuning import TuningReport, fused_spaces, tune

    fused = stored_fused()["bert"]
    tuner, _ = replay("bert", fused)
    tuner.report = TuningReport()
    with _without_gpu():
        tune(tuner, fused, fused_spaces(fused, "bert", "bf16"), spec="bert", dtype="bf16", attention=[])
    assert tuner.report.counts.get("ok", 0) == 0 and tuner.report.counts["skipped"] > 1000


def test_neighbours_are_one_knob_or_two_numeric_steps_apart():
    from datamove.knob_climb import adjacent, numeric_steps

    sets = [dict(mode=m, block_row=r, num_warps=w) for m in ("row", "loop") for r in (1, 2, 4, 8) for w in (1, 2, 4)]
    steps = numeric_steps(sets)
    assert set(steps) == {"block_row", "num_warps"}
    a = dict(mode="row", block_row=2, num_warps=2)
    assert adjacent(a, dict(a, block_row=8), steps)  # one knob, any value
    assert adjacent(a, dict(a, mode="loop"), steps)
    assert adjacent(a, dict(a, block_row=4, num_warps=4), steps)  # the diagonal: a thread's elements kept
    assert adjacent(a, dict(a, block_row=1, num_warps=4), steps)
    assert not adjacent(a, dict(a, block_row=8, num_warps=4), steps)  # two steps along one
    assert not adjacent(a, dict(a, mode="loop", num_warps=4), steps)  # a non-numeric knob and another
    assert not adjacent(a, a, steps)


def test_a_climb_stopped_by_the_budget_ends():
    """Once the budget is spent a round measures nothing, so the beam stays and the climb ends with
    no setting offered twice."""
    from types import SimpleNamespace

    group = [SimpleNamespace(op="x", layout={"x": "ab"}, knobs=dict(block_row=r, num_warps=w))
             for r in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8)]
    offered: list = []

    class Spent:
        ranker = SimpleNamespace(ranked=lambda variants: [group[0]])

        def measure(self, variants, **_):
            offered.extend(variants)

    tuning.climb(Spent(), [group], stage="s")
    keys = [knob_climb.variant_key(v) for v in offered]
    assert len(keys) == len(set(keys)) and 0 < len(keys) < len(group) - 1
