"""Variants without a kernel, for the sweep's process machinery: each stage does what it is told.

``FakeVariant(name, log, compile=..., build=..., check=...)``: ``compile`` is what its compile task
does in a compile worker ("ok", "abort": ``os.abort()``, "hang": sleeps forever, "raise",
"memory": raises MemoryError; None: no task); ``build`` what ``build()`` does (the same, or "pause": sleeps ``PAUSE_S``, "slow": ``SLOW_S``); ``check`` "ok" or
"wrong".  Every ``build()`` first appends "<name> <pid>" to ``log``, so tests count measurements
and see which process made them.  Picklable: tests measure them in measuring processes.
"""
import os
import time
from dataclasses import dataclass

PAUSE_S = 0.2
SLOW_S = 1.5


def act(what: str, name: str) -> None:
    if what == "abort":
        os.abort()
    elif what == "hang":
        time.sleep(1e9)
    elif what == "raise":
        raise RuntimeError(f"{name}: planted failure")
    elif what == "memory":
        raise MemoryError(f"{name}: planted")
    elif what == "pause":
        time.sleep(PAUSE_S)
    elif what == "slow":
        time.sleep(SLOW_S)


@dataclass(frozen=True)
class FakeVerdict:
    passed: bool
    error: float = 0.0
    baseline_error: float = 0.0


class FakeVariant:
    op = "fake"
    bytes = 8
    flop = None

    def __init__(self, name: str, log, compile: str | None = None, build: str = "ok", check: str = "ok"):
        self.name, self.log, self.compile, self.behaviour, self.verdict = name, str(log), compile, build, check
        self.dims, self.dtype, self.layout, self.knobs = {"n": 1}, "float32", {}, {"name": name}

    def compile_task(self):
        return None if self.compile is None else (act, (self.compile, self.name))

    def build(self) -> None:
        with open(self.log, "a") as f:
            f.write(f"{self.name} {os.getpid()}\n")
        act(self.behaviour, self.name)

    def run(self) -> None:
        pass

    def check(self) -> FakeVerdict:
        return FakeVerdict(self.verdict == "ok")


def measured(log) -> dict[str, list[int]]:
    """name -> the pids that built it, one per build."""
    builds: dict[str, list[int]] = {}
    if os.path.exists(log):
        for line in open(log).read().splitlines():
            name, pid = line.split()
            builds.setdefault(name, []).append(int(pid))
    return builds


def pid_server(retiring: bool):
    """Setup of a ``harness.workers.Pool`` whose tasks answer the worker's pid and the environment
    variable named by the task (``retiring``: each worker retires after one task)."""
    from datamove.harness.workers import retire

    def handle(variable):
        if retiring:
            retire()
        return os.getpid(), os.environ.get(variable)

    return handle


def broken_setup():
    raise RuntimeError("setup cannot start")
