"""Benchmark harness: sweep statuses (failed / wrong / checked or ok), in this process or in measuring
processes, resume, time budget, SIGKILL midway, and on a GPU the timing of a copy kernel against the
measured ceilings and the per-run limit.  (Crashing and hanging workers: tests/test_sweep_processes.py.)"""
import dataclasses
import io
import signal
import subprocess
import textwrap
import time
from collections import Counter

import pytest
import torch
from rich.console import Console

from datamove.harness.bench import CPU_DEVICE, SLOW_FACTOR, Sweep, time_cuda
from datamove.harness.bench import measure_ceilings
from datamove.kernels.device import query_device
from datamove.harness.tuning_db import Record, TuningDB
import sweep_script
from scale_variants import ScaleVariant, variants

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"
GOOD = "ok" if HAS_GPU else "checked"  # without a GPU, correct variants are checked, never timed
N = 1001  # odd: the last program is partial


def sweep(db, vs, **kwargs):
    out = io.StringIO()
    report = Sweep(db, vs, progress=False, console=Console(file=out, width=200), **kwargs).run()
    return report, out.getvalue()


def builds(log):
    return Counter(log.read_text().splitlines()) if log.exists() else Counter()


@pytest.mark.parametrize("processes", [0, 2], ids=["in-process", "2 measuring processes"])
def test_sweep_records_failed_wrong_and_good_then_resumes(tmp_path, processes):
    if HAS_GPU and processes > torch.cuda.device_count():
        pytest.skip("one measuring process per GPU")
    log = tmp_path / "builds.log"
    with TuningDB(tmp_path / "t.db") as db:
        report, text = sweep(db, variants(N, DEVICE, log=log), processes=processes)
        assert report.counts == {"ok": 0, "checked": 0, "failed": 1, "too slow": 0, "wrong": 1, "skipped": 0, GOOD: 3}
        assert report.stopped is None and report.remaining == 0 and report.measured == HAS_GPU
        by_block = {r.key.knobs["BLOCK"]: r for r in db.query(op=ScaleVariant.op)}
        assert by_block[100].status == "failed" and "power of 2" in by_block[100].detail
        assert by_block[256].status == "wrong" and by_block[256].median_ms is None
        assert by_block[256].rel_error == float("inf")  # the unwritten (NaN) tail
        for block in (64, 128, 512):
            good = by_block[block]
            assert good.status == GOOD and good.rel_error <= 1e-6 and good.bytes == 2 * N * 4
            assert (good.median_ms is not None) == HAS_GPU
        if not HAS_GPU:
            assert "nothing was measured" in text and "No GPU" in text
            assert {r.key.device for r in db.query()} == {CPU_DEVICE}

        began = time.perf_counter()
        again, _ = sweep(db, variants(N, DEVICE, log=log))
        assert again.counts["skipped"] == 5 and sum(again.counts.values()) == 5
        assert time.perf_counter() - began < 2.0
        assert set(builds(log).values()) == {1}  # nothing built twice


def test_time_budget_stops_cleanly_and_next_run_finishes(tmp_path):
    log = tmp_path / "builds.log"
    with TuningDB(tmp_path / "t.db") as db:
        first, text = sweep(db, variants(N, DEVICE, log=log, build_pause_s=0.3), budget_s=0.5)
        assert first.stopped and first.remaining > 0 and "left for the next run" in text
        done = 5 - first.remaining
        assert len(db.query()) == done
        second, _ = sweep(db, variants(N, DEVICE, log=log))
        assert second.counts["skipped"] == done and second.remaining == 0 and len(db.query()) == 5
        assert set(builds(log).values()) == {1}


SWEEP = textwrap.dedent("""
    import signal
    import sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C, even where started ignoring it
    import torch
    from datamove.harness.bench import Sweep
    from datamove.harness.tuning_db import TuningDB
    from scale_variants import variants
    device = "cuda" if torch.cuda.is_available() else "cpu"
    Sweep(TuningDB(sys.argv[1]), variants(int(sys.argv[3]), device, log=sys.argv[2], build_pause_s=0.4),
          progress=False).run()
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_stopped_sweep_resumes_without_redoing_finished_variants(tmp_path, sig):
    path, log = tmp_path / "t.db", tmp_path / "builds.log"
    proc = sweep_script.start(SWEEP, path, log, N, stderr=subprocess.PIPE, text=True)
    try:
        sweep_script.wait_for_records(proc, path, 2)
    finally:
        proc.send_signal(sig)
        stderr = proc.communicate(timeout=60)[1]
    assert proc.returncode != 0, "the sweep finished before it could be stopped"
    if sig == signal.SIGINT:  # Ctrl-C: the sweep says where it stopped, then the interrupt goes on
        assert "stopped (interrupted)" in stderr and "KeyboardInterrupt" in stderr
    with TuningDB(path) as db:
        finished = {(r.key.knobs["BLOCK"], r.key.knobs["grid"]) for r in db.query()}
        assert 2 <= len(finished) < 5
        report, _ = sweep(db, variants(N, DEVICE, log=log))
        assert report.counts["skipped"] == len(finished) and len(db.query()) == 5
    counts = builds(log)
    for block, grid in finished:
        assert counts[f"{block} {grid}"] == 1  # finished before the stop: not built again
    assert len(counts) == 5


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU paths")
def test_without_gpu_nothing_is_timed(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="nothing can be timed"):
        time_cuda(lambda: None)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="neither timed nor run"):
        Sweep(TuningDB(tmp_path / "t.db"), [], progress=False)


@pytest.mark.gpu
def test_copy_kernel_bandwidth_plausible_against_ceilings(tmp_path):
    facts = query_device()
    with TuningDB(tmp_path / "t.db") as db:
        ceilings = measure_ceilings(db)
    n = (1 << 28) + 1  # 1 GiB of fp32 in, 1 GiB out, odd
    variant = ScaleVariant(n, 1024, device="cuda")
    variant.build()
    assert variant.check().passed
    timing = time_cuda(variant.run)
    achieved = variant.bytes / (timing.median_ms * 1e-3)
    print(f"scale kernel {achieved / 1e9:.0f} GB/s, copy ceiling {ceilings.copy_bytes_per_s / 1e9:.0f} GB/s, "
          f"peak {facts.peak_memory_bytes_per_s / 1e9:.0f} GB/s ({timing})")
    assert not timing.cuda_graph and timing.q20_ms <= timing.median_ms <= timing.q80_ms
    assert 0.6 * ceilings.copy_bytes_per_s < achieved < 1.1 * ceilings.copy_bytes_per_s
    assert achieved < facts.peak_memory_bytes_per_s


@pytest.mark.gpu
def test_graph_replay_agrees_with_plain_launches_for_a_short_kernel():
    variant = ScaleVariant((1 << 20) + 1, 1024, device="cuda")
    variant.build()
    plain = time_cuda(variant.run, cuda_graph=False)
    graph = time_cuda(variant.run, cuda_graph=True)
    auto = time_cuda(variant.run)
    print(f"plain {plain}\ngraph {graph}\nauto {auto}")
    assert graph.cuda_graph and not plain.cuda_graph and auto.cuda_graph  # ~8 MB moved: a few microseconds
    assert 0.5 < graph.median_ms / plain.median_ms < 1.5
    warm = time_cuda(variant.run, flush_l2=False, cuda_graph=True)  # many calls per replay, L2 warm
    assert warm.cuda_graph and warm.n > graph.n and warm.median_ms < 1.5 * plain.median_ms


@pytest.mark.gpu
def test_gpu_sweep_times_only_correct_variants(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        report, text = sweep(db, variants((1 << 24) + 1, "cuda"))
        print(text)
        assert report.measured and report.counts["ok"] == 3 and report.counts["failed"] == 1
        assert report.counts["wrong"] == 1
        for record in db.query(status="ok"):
            assert 0 < record.q20_ms <= record.median_ms <= record.q80_ms and record.n_reps >= 10
            assert record.bytes_per_s < query_device().peak_memory_bytes_per_s
        assert all(r.median_ms is None for r in db.query() if r.status != "ok")


@pytest.mark.gpu
def test_a_run_far_slower_than_the_operators_best_is_abandoned(tmp_path):
    """A variant whose one run takes over ``SLOW_FACTOR`` x its operator's best 'ok' time is recorded
    failed with both times, and never timed in full."""
    variant = ScaleVariant((1 << 26) + 1, 1024, device="cuda")
    with TuningDB(tmp_path / "t.db") as db:
        key = Sweep(db, [], progress=False).key(variant)
        db.put(Record(dataclasses.replace(key, knobs={"BLOCK": 1, "grid": "cdiv"}), "ok", median_ms=1e-4, q20_ms=1e-4,
                      q80_ms=1e-4))
        report, _ = sweep(db, [variant])
        record = db.lookup(key)
    assert report.counts["too slow"] == 1 and report.counts["failed"] == 0 and record.status == "failed"
    assert record.detail.startswith("time: RunTooLong: ") and record.detail.endswith(
        f"ms per run, > {SLOW_FACTOR:g}x the operator's best 0.0001 ms")


class _OutOfMemoryOnce(ScaleVariant):
    """A ``ScaleVariant`` whose first ``failures`` builds raise PyTorch's out-of-memory error."""

    def __init__(self, *args, failures: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.failures, self.released = failures, 0

    def build(self):
        if self.failures:
            self.failures -= 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        super().build()

    def release(self):
        self.released += 1


def test_out_of_memory_is_tried_again_once_after_letting_memory_go(tmp_path):
    """Memory a previous variant (or a sweep's kept workspace) held is not this variant's failure:
    one out-of-memory failure, and the variant is built again once its buffers and the cached
    blocks are let go; out of memory twice is recorded, said so, and read back after."""
    from datamove.harness.bench import OOM_AGAIN

    once = _OutOfMemoryOnce(N, 128, device=DEVICE, failures=1)
    twice = _OutOfMemoryOnce(N, 256, device=DEVICE, failures=2)
    with TuningDB(tmp_path / "t.db") as db:
        report, _ = sweep(db, [once, twice])
        assert report.counts[GOOD] == 1 and report.counts["failed"] == 1 and once.released == 1
        records = {r.key.knobs["BLOCK"]: r for r in db.query(op=ScaleVariant.op)}
        assert records[128].status == GOOD
        assert records[256].status == "failed" and records[256].detail.startswith(OOM_AGAIN)
        again, _ = sweep(db, [_OutOfMemoryOnce(N, 256, device=DEVICE, failures=0)])
        assert again.counts["skipped"] == 1


def test_a_variant_recorded_out_of_memory_on_one_try_is_measured_again(tmp_path):
    """A database written before the second try (a variant failed out of memory once, e.g. a
    measuring process that kept every sweep's workspace) gets those variants measured again;
    other failures stay read back."""
    from datamove.harness.tuning_db import Key

    oom, other = ScaleVariant(N, 64, device=DEVICE), ScaleVariant(N, 128, device=DEVICE)
    with TuningDB(tmp_path / "t.db") as db:
        sweeper = Sweep(db, [], progress=False)
        db.put(Record(sweeper.key(oom), "failed", detail="build: OutOfMemoryError: CUDA out of memory."))
        db.put(Record(sweeper.key(other), "failed", detail="build: CompilationError: no"))
        report, _ = sweep(db, [oom, other])
        assert report.counts[GOOD] == 1 and report.counts["skipped"] == 1
        assert {r.key.knobs["BLOCK"]: r.status for r in db.query(op=ScaleVariant.op)} == {64: GOOD, 128: "failed"}
