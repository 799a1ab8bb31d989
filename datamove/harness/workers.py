"""Supervised worker processes: tasks with time limits, crashed or hung workers replaced.

``Pool(name, count, setup, args)`` starts ``count`` spawned processes.  Each starts with ``env(i)``
in its environment (e.g. ``CUDA_VISIBLE_DEVICES``: there from its first instruction, before any
import could initialise CUDA), then runs ``setup(*args)`` once, which returns the
handler of its tasks (``setup`` and ``args`` travel in one pickle, made once: objects shared among
the arguments stay shared in the worker), says it is ready, and answers the tasks the parent hands
it one at a time with ``handler(payload)``.  The parent never blocks on a worker: ``wait(pools,
timeout)`` returns once any worker has something to say or has died, and ``Pool.collect()`` turns
that into one ``Event`` per task that ended:

- "done": the handler returned ``value``;
- "error": it raised; ``value`` is ``"ExceptionType: text"`` (the worker goes on, unless it was a
  MemoryError: then it is replaced);
- "timeout": no answer within the task's time limit: the worker is killed (SIGKILL) and replaced;
- "died": the worker exited while on the task; ``value`` says how (``"died (SIGABRT)"``, a signal:
  abort, segfault, killed for memory; or ``"exited with code N"``); it is replaced.

Each event carries the last ``note()`` the worker made during the task (the stage it had reached).
A worker that dies while idle is replaced without an event (``retire()`` in a handler asks for
that once its answer is sent).  A worker that dies or hangs before it is ready counts as a failed
start; ``START_FAILURES`` of them in a row make ``collect`` raise ``WorkerStartError`` with the
last one's reason.  Workers ignore SIGINT (the parent handles Ctrl-C and kills them) and end
within a second of their parent's death, even inside a task.  Only a pipe per worker connects it
to the parent, so killing a worker at any moment leaves nothing shared broken.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

START_FAILURES = 3  # workers in a row that die before being ready: the pool gives up
PARENT_CHECK_S = 0.5  # how often a worker checks that its parent is alive
ABANDON_GRACE_S = 2.0  # an abandoned task may run this much longer before its worker is replaced
_CONTEXT = multiprocessing.get_context("spawn")


class WorkerStartError(RuntimeError):
    """Workers of a pool keep dying (or hanging) before they are ready."""


@dataclass(frozen=True)
class Event:
    """How one task ended: ``kind`` "done" / "error" / "timeout" / "died" (see the module doc)."""

    task: object  # the id it was submitted with
    kind: str
    value: object  # "done": the handler's return value; otherwise why it failed, as text
    note: str | None  # the worker's last ``note()`` during the task
    seconds: float  # from hand-out to the end


# --- inside a worker ---------------------------------------------------------------------------

_connection = None  # this process's pipe to its parent, once it is a ready worker
_retiring = False


def note(text: str) -> None:
    """Tell the parent how far the current task got (e.g. "build"); nothing outside a worker."""
    if _connection is not None:
        _connection.send(("note", text))


def retire() -> None:
    """Have this worker replaced once it has answered its current task (e.g. its CUDA context is
    lost); nothing outside a worker."""
    global _retiring
    _retiring = True


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def _serve(connection, blob: bytes, parent: int) -> None:
    global _connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        setup, args = pickle.loads(blob)
        handle = setup(*args)
    except BaseException:  # noqa: BLE001 - whatever it is, the parent needs the text
        connection.send(("unready", traceback.format_exc(limit=-8)))
        return
    _connection = connection
    connection.send(("ready",))
    while True:
        try:
            message = connection.recv()
        except EOFError:  # the parent has gone
            return
        task, payload = message
        try:
            value = handle(payload)
            connection.send(("done", task, value, _retiring))
        except Exception as exc:  # noqa: BLE001 - the task's failure is the parent's to record
            if isinstance(exc, MemoryError):
                retire()  # what is left of its memory is not to be trusted
            connection.send(("error", task, f"{type(exc).__name__}: {exc}", _retiring))
        if _retiring:
            return


# --- in the parent -----------------------------------------------------------------------------

def _ending(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"died ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"died (signal {-exitcode})"
    return f"exited with code {exitcode}"


@contextlib.contextmanager
def _environment(env: dict):
    """``env`` in ``os.environ`` for the duration (what a process spawned meanwhile is executed with)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class _Worker:
    def __init__(self, pool: Pool, index: int):
        self.connection, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_serve, args=(child, pool.blob, os.getpid()),
                                        name=f"{pool.name}-{index}", daemon=True)
        with _environment(pool.env(index)):
            self.process.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.lost = False  # found dead when handed a task: replaced at the next ``collect``
        self.unready_reason: str | None = None
        self.task = None  # (id, handed out at, time limit or None)
        self.abandoned = False  # its task's end is not reported (``Pool.abandon``)
        self.note: str | None = None
        self.state: dict = {}  # the parent's notes on what this process holds (``Pool.submit``'s payload)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.connection.close()


class Pool:
    """``count`` supervised workers running ``setup(*args)``'s handler (see the module doc).

    ``env(i)``: extra environment of worker ``i`` (and of its replacements); ``start_timeout_s``:
    how long a worker may take to become ready."""

    def __init__(self, name: str, count: int, setup: Callable, args: tuple = (), *,
                 env: Callable[[int], dict] | None = None, start_timeout_s: float = 300.0):
        self.name, self.env, self.start_timeout_s = name, env or (lambda index: {}), start_timeout_s
        self.blob = pickle.dumps((setup, args))
        self.failed_starts = 0
        self.workers = [_Worker(self, i) for i in range(count)]

    def idle(self) -> bool:
        """Whether a ready worker is free for a task."""
        return any(self._free(w) for w in self.workers)

    @staticmethod
    def _free(worker: _Worker) -> bool:
        return worker.ready and not worker.lost and worker.task is None

    def submit(self, task, payload, timeout_s: float | None = None) -> bool:
        """Hand ``(task, payload)`` to a free ready worker (``idle()`` must be True); the task ends
        as an ``Event`` of ``collect()``, at the latest ``timeout_s`` seconds from now.  False: that
        worker had died meanwhile (nothing handed out; it is replaced at the next ``collect``).
        A callable ``payload`` is called with the chosen worker's ``state`` (a dict the parent keeps
        per process, empty for a new one: what it was sent before) and what it returns is sent."""
        worker = next(w for w in self.workers if self._free(w))
        if callable(payload):
            payload = payload(worker.state)
        try:
            worker.connection.send((task, payload))
        except OSError:
            worker.lost = True
            return False
        worker.task, worker.note = (task, time.monotonic(), timeout_s), None
        return True

    def waitables(self) -> list:
        return [x for w in self.workers for x in (w.connection, w.process.sentinel)]

    def collect(self) -> list[Event]:
        """The tasks that ended since the last call (without blocking); dead, hung or retired workers
        are replaced.  Raises ``WorkerStartError`` (see the module doc)."""
        events = []
        for index, worker in enumerate(self.workers):
            event, replace = self._inspect(worker)
            if event is not None:
                events.append(event)
            if replace:
                worker.kill()
                self.workers[index] = _Worker(self, index)
        return events

    def _inspect(self, worker: _Worker) -> tuple[Event | None, bool]:
        """(the event of ``worker``'s task if it ended, whether to replace the worker)."""
        event, answered, retiring = None, False, False
        try:
            while not answered and worker.connection.poll():
                message = worker.connection.recv()
                if message[0] == "ready":
                    worker.ready, self.failed_starts = True, 0
                elif message[0] == "unready":
                    worker.unready_reason = message[1]
                elif message[0] == "note":
                    worker.note = message[1]
                else:
                    kind, task, value, retiring = message
                    event, answered = self._ended(worker, kind, value), True
        except Exception:  # noqa: BLE001 - the worker has gone (or went while writing): its process says how, below
            pass
        if answered:
            return event, retiring
        if worker.lost:
            return None, True
        now = time.monotonic()
        if not worker.process.is_alive():
            worker.process.join()
            if not worker.ready:
                self._failed_start(worker, worker.unready_reason or _ending(worker.process.exitcode))
                return None, True
            if worker.task is None:
                return None, True
            return self._ended(worker, "died", _ending(worker.process.exitcode)), True
        if not worker.ready and now - worker.started > self.start_timeout_s:
            self._failed_start(worker, f"not ready after {self.start_timeout_s:g} s")
            return None, True
        if worker.task is not None and worker.task[2] is not None and now - worker.task[1] > worker.task[2]:
            return self._ended(worker, "timeout", f"timed out after {worker.task[2]:g} s"), True
        return None, False

    def _ended(self, worker: _Worker, kind: str, value) -> Event | None:
        """The event of ``worker``'s task, which ended; None for an abandoned task (``abandon``)."""
        task, handed_out, _ = worker.task
        worker.task = None
        if worker.abandoned:
            worker.abandoned = False
            return None
        return Event(task, kind, value, worker.note, time.monotonic() - handed_out)

    def _failed_start(self, worker: _Worker, reason: str) -> None:
        self.failed_starts += 1
        if self.failed_starts >= START_FAILURES:
            raise WorkerStartError(f"{self.failed_starts} {self.name} processes in a row could not start; "
                                   f"the last: {reason}")

    def abandon(self, grace_s: float = ABANDON_GRACE_S) -> None:
        """Drop the tasks running, with no event (a sweep stopped by its budget leaves the pool to
        the next): their workers may finish them within ``grace_s`` seconds (and are free again),
        else are killed then and replaced; starting a process anew (imports, a CUDA context) costs
        more than most tasks left to finish."""
        now = time.monotonic()
        for worker in self.workers:
            if worker.task is not None:
                task, handed_out, timeout_s = worker.task
                deadline = now + grace_s - handed_out
                worker.task = (task, handed_out, deadline if timeout_s is None else min(timeout_s, deadline))
                worker.abandoned = True

    def close(self) -> None:
        """Kill every worker (tasks still running are dropped)."""
        for worker in self.workers:
            worker.kill()
        self.workers = []


def wait(pools: list[Pool], timeout: float) -> None:
    """Until a worker of ``pools`` has something to say or has died, or ``timeout`` seconds."""
    objects = [x for pool in pools for x in pool.waitables()]
    if objects:
        multiprocessing.connection.wait(objects, timeout)
    else:
        time.sleep(timeout)
