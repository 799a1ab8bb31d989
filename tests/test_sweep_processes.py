"""The sweep's process machinery on CPU (``harness.workers``, ``harness.bench.Sweep``), with fake variants.

Compile tasks that abort, hang or raise, and measuring processes that die or hang, each end up
recorded 'failed' with the reason while the sweep measures the others; the budget holds while a
variant hangs; a sweep SIGKILLed at a random moment and rerun loses no finished record and
measures none again; real variants survive the pickle that takes them to a measuring process.
"""
import io
import math
import os
import pickle
import random
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

import sweep_script
from fake_variants import PAUSE_S, FakeVariant, broken_setup, measured, pid_server
from datamove.harness.bench import Sweep, WorkerPools
from datamove.harness.tuning_db import TuningDB
from datamove.harness.workers import Pool, WorkerStartError, wait

LIMIT_S = 3  # compile and variant time limits in these tests


def sweep(db, variants, **kwargs):
    out = io.StringIO()
    began = time.monotonic()
    report = Sweep(db, variants, progress=False, console=Console(file=out, width=200), **kwargs).run()
    return report, time.monotonic() - began


def details(db) -> dict:
    return {r.key.knobs["name"]: (r.status, r.detail) for r in db.query()}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_pool_replaces_retired_workers_and_gives_up_on_broken_starts():
    pool = Pool("test", 1, pid_server, (True,), env=lambda index: {"DATAMOVE_WORKER": f"worker {index}"})
    answers = []
    try:
        for task in range(3):
            while not pool.idle():
                wait([pool], 0.5)
                pool.collect()
            pool.submit(task, "DATAMOVE_WORKER")
            events = []
            while not events:
                wait([pool], 0.5)
                events = pool.collect()
            assert [(e.task, e.kind) for e in events] == [(task, "done")]
            answers.append(events[0].value)
    finally:
        pool.close()
    pids = {pid for pid, _ in answers}
    assert len(pids) == 3 and os.getpid() not in pids  # a fresh worker after each retirement
    assert {value for _, value in answers} == {"worker 0"} and "DATAMOVE_WORKER" not in os.environ
    pool = Pool("test", 1, broken_setup)
    try:
        with pytest.raises(WorkerStartError, match="setup cannot start"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                wait([pool], 0.5)
                pool.collect()
    finally:
        pool.close()


def test_compile_failures_are_recorded_with_reasons_and_never_built(tmp_path):
    log = tmp_path / "builds.log"
    variants = [FakeVariant("a", log, compile="ok"), FakeVariant("abort", log, compile="abort"),
                FakeVariant("hang", log, compile="hang"), FakeVariant("raise", log, compile="raise"),
                FakeVariant("memory", log, compile="memory"), FakeVariant("b", log, compile="ok"), FakeVariant("c", log)]
    with TuningDB(tmp_path / "t.db") as db:
        report, seconds = sweep(db, variants, compile_workers=2, compile_timeout_s=LIMIT_S)
        assert report.stopped is None and report.counts["checked"] == 3 and report.counts["failed"] == 4
        got = details(db)
    assert got["abort"] == ("failed", "compile: worker died (SIGABRT)")
    assert got["hang"] == ("failed", f"compile: timed out after {LIMIT_S} s")
    assert got["raise"] == ("failed", "compile: RuntimeError: raise: planted failure")
    assert got["memory"] == ("failed", "compile: MemoryError: memory: planted")  # and its worker replaced
    assert {name: status for name, (status, _) in got.items() if status == "checked"} == dict.fromkeys("abc", "checked")
    assert {name: len(pids) for name, pids in measured(log).items()} == dict.fromkeys("abc", 1)
    assert seconds < 30


def test_measuring_process_failures_are_recorded_and_the_rest_measured(tmp_path):
    log = tmp_path / "builds.log"
    variants = [FakeVariant("a", log), FakeVariant("abort", log, build="abort"), FakeVariant("b", log),
                FakeVariant("hang", log, build="hang"), FakeVariant("raise", log, build="raise"),
                FakeVariant("wrong", log, check="wrong"), FakeVariant("c", log), FakeVariant("d", log)]
    with TuningDB(tmp_path / "t.db") as db:
        report, seconds = sweep(db, variants, processes=2, variant_timeout_s=LIMIT_S)
        assert report.stopped is None and report.remaining == 0
        assert report.counts == {"ok": 0, "checked": 4, "failed": 3, "too slow": 0, "wrong": 1, "skipped": 0}
        got = details(db)
    assert got["abort"] == ("failed", "build: measuring process died (SIGABRT)")
    assert got["hang"] == ("failed", f"build: timed out after {LIMIT_S} s (measuring process replaced)")
    assert got["raise"] == ("failed", "build: RuntimeError: raise: planted failure")
    assert got["wrong"][0] == "wrong" and all(got[n][0] == "checked" for n in "abcd")
    builds = measured(log)
    assert all(len(pids) == 1 for pids in builds.values()) and len(builds) == len(variants)
    assert os.getpid() not in {pid for pids in builds.values() for pid in pids}
    assert not any(alive(pid) for pids in builds.values() for pid in pids)  # the sweep leaves no process behind
    assert seconds < 30


@pytest.mark.parametrize("where", ["compile", "measure"])
def test_budget_is_honoured_while_a_variant_hangs(tmp_path, where):
    log = tmp_path / "builds.log"
    hung = FakeVariant("hung", log, compile="hang") if where == "compile" else FakeVariant("hung", log, build="hang")
    variants = [hung, FakeVariant("after", log, compile="ok" if where == "compile" else None)]
    budget_s = 2.0
    with TuningDB(tmp_path / "t.db") as db:
        report, seconds = sweep(db, variants, budget_s=budget_s, compile_workers=1, processes=1,
                                compile_timeout_s=600, variant_timeout_s=600)
        assert report.stopped == f"time budget of {budget_s:g} s used" and report.remaining == 2
        assert db.query() == []  # a variant stopped by the budget is not its own failure: left for the next run
    assert budget_s <= seconds < budget_s + 3


def test_sweeps_sharing_worker_pools_reuse_their_processes_and_drop_a_stopped_sweeps_tasks(tmp_path):
    """``Sweep(pools=)`` (a job's tuning): the measuring processes of one sweep measure the next
    (each given the new sweep's variants), a sweep stopped by its budget leaves no task of its own
    to the next (a variant finishing within the grace unrecorded and its process kept, the hung
    variant's process replaced), and ``close()`` ends every process."""
    log = tmp_path / "builds.log"
    pools = WorkerPools(compile_workers=1, processes=2, measured=False, env=lambda index: {}, abandon_grace_s=2.0)
    try:
        with TuningDB(tmp_path / "t.db") as db:
            first, _ = sweep(db, [FakeVariant(n, log, compile="ok", build="pause") for n in "abcd"], processes=2,
                             compile_workers=1, pools=pools)
            second, _ = sweep(db, [FakeVariant(n, log, build="pause") for n in "efgh"], processes=2, pools=pools)
            stopped, _ = sweep(db, [FakeVariant("hung", log, build="hang"), FakeVariant("slow", log, build="slow")],
                               budget_s=1.0, processes=2, pools=pools, variant_timeout_s=600)
            last, _ = sweep(db, [FakeVariant(n, log, build="pause") for n in "ijkl"], processes=2, pools=pools)
            got = details(db)
        builds = measured(log)
        processes = [w.process for pool in (pools.compiler, pools.measurers) for w in pool.workers]
    finally:
        pools.close()
    pids = {name: set(pid_list) for name, pid_list in builds.items()}
    first_pids = set().union(*(pids[n] for n in "abcd"))
    last_pids = set().union(*(pids[n] for n in "ijkl"))
    assert first.counts["checked"] == 4 and first.first_result_s is not None and first.compiling.tasks == 4
    assert set(first.measuring.phases) == {"build", "check"} and first.measuring.phases["build"] >= 4 * PAUSE_S
    assert second.counts["checked"] == 4 and set().union(*(pids[n] for n in "efgh")) <= first_pids
    assert stopped.stopped and stopped.counts["checked"] == 0 and pids["hung"] | pids["slow"] <= first_pids
    assert last.counts["checked"] == 4 and set(got) == set("abcdefghijkl") and last.compiling.workers == 0
    assert len(first_pids) == 2 and pids["slow"] <= last_pids  # finished within the grace: its process kept
    assert not pids["hung"] & last_pids  # the hung one's process replaced
    assert not any(process.is_alive() for process in processes)


def test_started_pools_have_measuring_processes_and_compile_workers_come_with_a_compile(tmp_path):
    """``WorkerPools.start()`` (the job, before its analysis): measuring processes only; a sweep the
    database answers starts no compile worker; the first sweep with something to compile does."""
    log = tmp_path / "builds.log"
    pools = WorkerPools(compile_workers=1, processes=2, measured=False, env=lambda index: {}).start()
    try:
        assert pools.compiler is None and len(pools.measurers.workers) == 2
        with TuningDB(tmp_path / "t.db") as db:
            sweep(db, [FakeVariant("a", log)], processes=2, pools=pools)
            again, _ = sweep(db, [FakeVariant("a", log, compile="ok")], processes=2, compile_workers=1, pools=pools)
            assert again.counts["skipped"] == 1 and pools.compiler is None
            compiled, _ = sweep(db, [FakeVariant("b", log, compile="ok")], processes=2, compile_workers=1, pools=pools)
            assert compiled.counts["checked"] == 1 and compiled.compiling.tasks == 1 and len(pools.compiler.workers) == 1
    finally:
        pools.close()


def test_a_workspace_too_large_to_keep_stays_with_its_object(monkeypatch):
    """Values over ``KEPT_SHARE`` of the GPU's memory (Llama-8B's float64 graph on an H100) are not
    kept for the process between sweeps: they stay with the workspace object and do not travel."""
    from datamove.dataflow import snapshot
    from datamove.harness import sweep_variants as sv

    monkeypatch.setattr(sv, "_keepable", lambda values, device: False)
    training = snapshot.stored_fused()["bert"].with_dims(dict(B=2, L=5, N=12, H=3, P=4, U=7))
    ws = sv.sweep_variants("bert", training, "cpu", dtype=torch.float32, limit_configs=1)[0][0].variants()[0].ws
    sv._VALUES.clear()
    values = ws.values
    assert ws.values is values and not sv._VALUES and ws._values is values
    copy = pickle.loads(pickle.dumps(ws))
    assert "_values" not in copy.__dict__ and copy.values is not values


SWEEP = textwrap.dedent("""
    import sys
    from fake_variants import FakeVariant
    from datamove.harness.bench import Sweep, WorkerPools
    from datamove.harness.tuning_db import TuningDB
    variants = [FakeVariant(f"v{i}", sys.argv[2], compile="ok" if i % 3 == 0 else None, build="pause") for i in range(12)]
    Sweep(TuningDB(sys.argv[1]), variants, processes=2, compile_workers=1, progress=False).run()
""")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sweep_killed_at_a_random_moment_loses_nothing_and_repeats_nothing(tmp_path, seed):
    rng = random.Random(seed)
    records_before_kill, extra_s = rng.randint(1, 8), rng.uniform(0.0, 0.3)
    path, log = tmp_path / "t.db", tmp_path / "builds.log"
    proc = sweep_script.start(SWEEP, path, log, stderr=subprocess.PIPE)
    try:
        sweep_script.wait_for_records(proc, path, records_before_kill, timeout_s=60)
        time.sleep(extra_s)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    with TuningDB(path) as db:
        finished = {r.key.knobs["name"] for r in db.query()}
    assert records_before_kill <= len(finished) < 12, "the sweep finished before it could be killed"
    children = {pid for pids in measured(log).values() for pid in pids}
    end = time.monotonic() + 5
    while any(alive(pid) for pid in children) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children)  # the orphans ended with their parent
    before = measured(log)

    variants = [FakeVariant(f"v{i}", log, compile="ok" if i % 3 == 0 else None) for i in range(12)]
    with TuningDB(path) as db:
        report, _ = sweep(db, variants, processes=2, compile_workers=1)
        assert report.counts["skipped"] == len(finished) and report.counts["checked"] == 12 - len(finished)
        assert len(db.query(status="checked")) == 12
    after = measured(log)
    for name in finished:
        assert len(after[name]) == 1, name  # finished before the kill: not measured again
    for name in set(after) - finished:
        assert len(after[name]) == len(before.get(name, [])) + 1, name  # the rest: once more, by the rerun


def test_real_variants_travel_pickled_without_their_tensors():
    """What a measuring process receives: the variants of one pickle share their workspace, which
    arrives without the tensors computed here and builds and checks there; a later sweep's copy of
    the same workspace finds the float64 values the process evaluated for the first."""
    from datamove.dataflow import snapshot
    from datamove.families.attention import variants as av
    from datamove.harness import contraction_variants as cv
    from datamove.harness import sweep_variants as sv

    training = snapshot.stored_fused()["bert"].with_dims(dict(B=2, L=5, N=12, H=3, P=4, U=7))
    spaces, _ = sv.sweep_variants("bert", training, "cpu", dtype=torch.float32, limit_configs=1)
    fused = [v for s in spaces if s.op.name == "alpha" for v in s.variants()]
    gemm = cv.training_gemms(training)[0]
    gemms = cv.gemm_variants(gemm, "cpu", layouts=1, first_configs=[])
    attention = av.config_variants(av.Workspace(av.AttentionCase(2, 3, 21, 16, 0.2, dtype=torch.float32), "cpu"))[:2]
    values = fused[0].ws.values
    gemms[0].operands.tensors(), attention[0].ws.exact  # computed here
    fused[0].ws.activate(fused[0])
    blob = pickle.dumps(fused + gemms + attention)
    sv._VALUES.clear()  # as in another process
    copies = pickle.loads(blob)
    copied_fused, copied_gemm, copied_attention = copies[:len(fused)], copies[len(fused)], copies[len(fused) + 1:]
    assert all(v.ws is copied_fused[0].ws for v in copied_fused) and copied_attention[0].ws is copied_attention[1].ws
    assert len(blob) < sum(t.numel() * t.element_size() for t in values.values())  # the values did not travel
    assert copied_fused[0].ws._active is None and copied_fused[0].ws.token == fused[0].ws.token
    assert copied_gemm.operands._tensors is None and "exact" not in copied_attention[0].ws.__dict__
    for variant in (copied_fused[1], copied_gemm, copied_attention[1]):
        variant.build()
        assert variant.check().passed
    evaluated = copied_fused[0].ws.values
    assert pickle.loads(blob)[0].ws.values is evaluated  # the next sweep's copy: evaluated once per process


def test_a_job_stopped_by_its_budget_names_that_budget(tmp_path):
    """The main job's sweeps share one budget: the one that runs out says the job's budget was used
    (the H200 run of 2026-11-25 said "time budget of 0 s used": what was left for that sweep)."""
    from datamove.tuning import Tuner

    log = tmp_path / "builds.log"
    with TuningDB(tmp_path / "t.db") as db:
        with Tuner(db, budget_s=2.0, progress=False, compile_workers=0, gpus=1) as tuner:
            time.sleep(0.5)
            tuner.measure([FakeVariant("hung", log, build="hang"), FakeVariant("after", log)], stage="fakes")
            assert tuner.report.stopped == "time budget of 2 s used (25% of it kept for what the plan chose)"


def test_the_tunings_cost_per_stage_and_what_finishing_takes(tmp_path):
    """Each stage's variants by outcome, those its rule pruned and those the budget left; once the
    budget is spent a stage measures nothing but counts what it would have measured (not what the
    database holds), and the summary says how much more budget finishing takes."""
    from datamove.report import tuning_rows
    from datamove.tuning import Tuner

    log = tmp_path / "builds.log"
    with TuningDB(tmp_path / "t.db") as db:
        sweep(db, [FakeVariant("known", log)])
        with Tuner(db, budget_s=4.0, progress=False, compile_workers=0, gpus=1) as tuner:
            tuner.pools.abandon_grace_s = 0.0  # the hung variant's process replaced at once, in time for "plan"
            tuner.measure([FakeVariant("one", log), FakeVariant("known", log)], stage="first", pruned=5, pruned_why="a rule")
            tuner.measure([FakeVariant("hung", log, build="hang"), FakeVariant("after", log)], stage="second")
            tuner.measure([FakeVariant(name, log) for name in ("x", "y", "known")], stage="third")
            tuner.measure([FakeVariant("x", log)], stage="third")  # asked for again (a later selection round): once
            tuner.measure([FakeVariant("known", log)], stage="read back")  # nothing to measure: no time needed
            tuner.measure([FakeVariant("chosen", log)], stage="plan", reserve=False)  # the share kept for the plan
            report = tuner.report
            first, second, third, read_back, plan = report.stages.values()
            assert read_back.counts == {} and read_back.left == 0
            assert plan.counts["checked"] == 1 and "chosen" in measured(log)
            assert first.counts == {"ok": 0, "checked": 1, "failed": 0, "too slow": 0, "wrong": 0, "skipped": 1}
            assert (first.pruned, first.pruned_why, first.left) == (5, "a rule", 0)
            assert second.left == 2 and not any(second.counts.values())  # the hung one abandoned unrecorded, then "after"
            assert third.left == 2 and not any(third.counts.values()) and third.wall_s == 0.0
            assert report.left() == 4 and "after" not in measured(log) and "x" not in measured(log)
            lines = report.lines()
            assert lines[0].startswith("Tuning: 2 checked, 1 read back in ")
            assert "stopped: time budget of 4 s used (25% of it kept for what the plan chose); 4 variant(s) not measured (about " in lines[0]
            assert lines[0].endswith(f"rerun to go on, or give --budget-s {math.ceil(4 + 4 * report.rate_s() / 0.75)}")
            assert lines[1].startswith("  first: 1 checked, 1 read back; 5 pruned (a rule); ")
            assert [s["left"] for s in report.to_json()["stages"]] == [0, 2, 2, 0, 0]
    rows = tuning_rows(report.to_json())  # the report's table: stage, timed, failed, read back, pruned, left, s
    assert [row[:6] for row in rows] == [["first", "1", "0", "1", "5 (a rule)", "0"], ["second", "0", "0", "0", "0", "2"],
                                         ["third", "0", "0", "0", "0", "2"], ["read back", "0", "0", "0", "0", "0"],
                                         ["plan", "1", "0", "0", "0", "0"],
                                         ["total", "2", "0", "1", "5", "4"]]


def test_the_budget_a_stopped_tuning_asks_for_is_rounded_up_past_the_one_given():
    """One variant left at 0.08 s under a 320 s budget: finishing takes 321 s, not the 320 s given
    (rounded to the nearest, the suggestion was the budget that had just stopped the run)."""
    from datamove.tuning import StageCost, TuningReport

    report = TuningReport(budget_s=320.0, stopped="time budget of 320 s used")
    report.stages["sweep"] = StageCost("sweep", counts={"ok": 3000}, left_keys={"one"}, wall_s=240.0)
    assert report.stop_message().endswith(
        "1 variant(s) not measured (about 1 s more at this run's 0.08 s a variant): rerun to go on, or give --budget-s 321")


def test_a_spent_budget_does_not_stop_what_the_database_answers(tmp_path):
    """A warm re-run past its budget's sweeps share measures nothing and is not reported stopped."""
    from datamove.tuning import Tuner

    log = tmp_path / "builds.log"
    with TuningDB(tmp_path / "t.db") as db:
        sweep(db, [FakeVariant("known", log)])
        with Tuner(db, budget_s=0.2, progress=False, compile_workers=0, gpus=1) as tuner:
            time.sleep(0.3)
            tuner.measure([FakeVariant("known", log)], stage="warm")
            assert tuner.report.stopped is None and tuner.report.left() == 0
            tuner.measure([FakeVariant("new", log)], stage="cold")
            assert tuner.report.stopped.startswith("time budget of 0.2 s used") and tuner.report.left() == 1
