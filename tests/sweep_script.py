"""A sweep script run in a subprocess (so that a test can stop it midway), and waiting for its records."""
import os
import subprocess
import sys
import time
from pathlib import Path

from datamove.harness.tuning_db import TuningDB

REPO = Path(__file__).resolve().parents[1]


def start(script: str, *args, **popen) -> subprocess.Popen:
    """``python -c script args...`` with the repository and tests/ importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env, **popen)


def wait_for_records(proc: subprocess.Popen, path: Path, count: int, timeout_s: float = 120) -> None:
    """Until the tuning DB at ``path`` holds ``count`` records, ``proc`` has exited or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists():
            with TuningDB(path) as db:
                if len(db.query()) >= count:
                    return
        time.sleep(0.02)
