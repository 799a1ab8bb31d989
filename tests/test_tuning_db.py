"""Tuning DB: write / lookup / resume, failed records kept, atomic writes under SIGKILL, a concurrent reader,
a file that is not one refused untouched."""
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from datamove.harness.tuning_db import Key, Record, TuningDB, TuningDBError

REPO = Path(__file__).resolve().parents[1]
VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "cuda_runtime": "13.0", "cuda_driver": "13.0"}


def key(block=128, **overrides):
    fields = dict(device="NVIDIA H100 80GB HBM3", versions=VERSIONS, op="scale[i->i]", dims={"i": 1023, "b": 3},
                  dtype="bfloat16", layout={"x": "bi"}, knobs={"BLOCK": block, "num_warps": 4})
    fields.update(overrides)
    return Key(**fields)


def test_write_lookup_and_key_canonical(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        assert db.lookup(key()) is None
        db.put(Record(key(), "ok", median_ms=0.25, q20_ms=0.24, q80_ms=0.27, n_reps=400, cuda_graph=False,
                      bytes=2 * 1023 * 3 * 2, flop=1023 * 3))
        # Same key with dicts in another insertion order: same record.
        reordered = key(dims={"b": 3, "i": 1023}, knobs={"num_warps": 4, "BLOCK": 128},
                        versions=dict(reversed(list(VERSIONS.items()))))
        got = db.lookup(reordered)
        assert got is not None and got.status == "ok" and got.median_ms == 0.25 and got.n_reps == 400
        assert got.cuda_graph is False and got.key == key()
        assert got.bytes_per_s == pytest.approx(2 * 1023 * 3 * 2 / 0.25e-3)
        # Any other key field differing: not found.
        for other in (key(block=256), key(dtype="float16"), key(layout={"x": "ib"}), key(device="NVIDIA H200"),
                      key(versions={**VERSIONS, "triton": "3.9.0"}), key(dims={"i": 1025, "b": 3})):
            assert db.lookup(other) is None
        # Rewriting a key replaces the record.
        db.put(Record(key(), "ok", median_ms=0.20, q20_ms=0.19, q80_ms=0.22))
        assert db.lookup(key()).median_ms == 0.20 and len(db.query()) == 1


def test_failed_wrong_checked_kept_and_best(tmp_path):
    path = tmp_path / "t.db"
    with TuningDB(path) as db:
        db.put(Record(key(100), "failed", detail="build: CompilationError: arange's range must be a power of 2"))
        db.put(Record(key(64), "wrong", rel_error=0.5, baseline_error=1e-3, detail="rel.err 5e-1: FAILED"))
        db.put(Record(key(32), "checked", rel_error=1e-6, baseline_error=1e-6))
        for block, ms in ((128, 0.30), (256, 0.21), (512, 0.26)):
            db.put(Record(key(block), "ok", median_ms=ms, q20_ms=ms * 0.95, q80_ms=ms * 1.05))
    with TuningDB(path) as db:  # reopened: everything is still there
        failed = db.lookup(key(100))
        assert failed.status == "failed" and "power of 2" in failed.detail and failed.median_ms is None
        assert db.lookup(key(64)).status == "wrong" and db.lookup(key(64)).rel_error == 0.5
        assert db.lookup(key(32)).status == "checked"
        best = db.best("scale[i->i]", {"i": 1023, "b": 3}, "bfloat16", limit=2)
        assert [r.key.knobs["BLOCK"] for r in best] == [256, 512]
        assert db.best("scale[i->i]", {"i": 1023, "b": 3}, "float16") == []
        assert len(db.query(status="failed")) == 1 and len(db.query()) == 6


def test_schema_refuses_times_without_ok_and_ok_without_times(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        with pytest.raises(sqlite3.IntegrityError):
            db.put(Record(key(), "checked", median_ms=1.0, q20_ms=1.0, q80_ms=1.0))
        with pytest.raises(sqlite3.IntegrityError):
            db.put(Record(key(), "ok"))
        with pytest.raises(ValueError):
            db.put(Record(key(), "fast"))
        assert db.query() == []


def test_a_file_that_is_not_a_tuning_database_is_named_and_left_untouched(tmp_path):
    text = tmp_path / "notes.db"
    text.write_text("my notes, not a database\n")
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE songs (title TEXT)")
    conn.close()
    for path, problem in ((text, "not a readable SQLite database (file is not a database)"),
                          (other, "an SQLite database without the measurements table (it holds songs)")):
        before = path.read_bytes()
        with pytest.raises(TuningDBError) as raised:
            TuningDB(path)
        assert str(raised.value) == f"{path}: {problem}: move it away or pass another --db"
        assert path.read_bytes() == before and not path.with_name(path.name + "-wal").exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    with TuningDB(empty) as db:  # an empty file is an empty database: the tables are made
        assert db.query() == []


def test_a_folder_or_a_path_that_cannot_be_a_file_is_named(tmp_path):
    with pytest.raises(TuningDBError, match=f"{tmp_path}: a folder, not a tuning database file: pass a file path"):
        TuningDB(tmp_path)
    blocker = tmp_path / "plain.txt"
    blocker.write_text("a file where a folder would have to be\n")
    with pytest.raises(TuningDBError, match=r"plain.txt/tuning.db: cannot be opened \(.*\): check its permissions or pass"):
        TuningDB(blocker / "tuning.db")
    assert blocker.read_text() == "a file where a folder would have to be\n"


def test_the_cli_prints_a_damaged_database_in_one_line(tmp_path, capsys, monkeypatch):
    from datamove.cli import main

    path = tmp_path / "notes.db"
    path.write_text("my notes\n")
    monkeypatch.setattr("datamove.job.run_job", lambda options: TuningDB(options.db))  # opens it as a GPU run does
    assert main([str(REPO / "configs" / "bert.py"), "--db", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"optimize-layer: error: {path}: not a readable SQLite database (file is not a database): " \
                  "move it away or pass another --db\n"


WRITER = textwrap.dedent("""
    import sys
    import time
    from datamove.harness.tuning_db import Key, Record, TuningDB
    db = TuningDB(sys.argv[1])
    for i in range(int(sys.argv[2])):
        k = Key(device="dev", versions={}, op="op", dims={"i": i}, dtype="float32", layout=[], knobs={"BLOCK": i})
        db.put(Record(k, "ok", median_ms=i + 0.5, q20_ms=i + 0.25, q80_ms=i + 0.75, n_reps=i, bytes=7 * i, flop=3 * i,
                      detail="x" * (i % 97)))
        print(i, flush=True)
        time.sleep(float(sys.argv[3]))
""")


def writer(path, count, pause_s=0.0):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(count), str(pause_s)],
                            stdout=subprocess.PIPE, text=True, env=env)


def check_prefix(db: TuningDB) -> int:
    """Every record i in the DB is complete, and the records are exactly 0..m-1; return m."""
    records = db.query(op="op")
    indices = sorted(r.key.dims["i"] for r in records)
    assert indices == list(range(len(indices)))
    for r in records:
        i = r.key.dims["i"]
        assert (r.status, r.median_ms, r.q20_ms, r.q80_ms, r.n_reps, r.bytes, r.flop, r.detail) == \
            ("ok", i + 0.5, i + 0.25, i + 0.75, i, 7 * i, 3 * i, "x" * (i % 97))
    return len(indices)


def test_sigkill_midway_keeps_every_committed_record(tmp_path):
    path = tmp_path / "t.db"
    proc = writer(path, 1_000_000)
    last = -1
    for line in proc.stdout:
        last = int(line)
        if last >= 300:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with TuningDB(path) as db:
        assert db._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert check_prefix(db) >= last + 1  # all that were reported committed, and nothing half-written


def test_concurrent_reader_sees_consistent_growing_prefix(tmp_path):
    path = tmp_path / "t.db"
    TuningDB(path).close()
    proc = writer(path, 400, pause_s=0.002)
    seen = []
    with TuningDB(path) as db:
        while proc.poll() is None:
            seen.append(check_prefix(db))
            time.sleep(0.01)
        proc.stdout.read()
        assert proc.wait() == 0
        seen.append(check_prefix(db))
    assert seen == sorted(seen) and seen[-1] == 400
    assert len(set(seen) - {0, 400}) >= 3  # the reader really ran while records were being written
