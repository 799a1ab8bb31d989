"""The output folder of ``optimize-layer``: checked before the long stages, written whole or not at all.

``check_out(path)`` refuses, before any analysis, an ``--out`` that names a file, a folder that is
not an earlier output (a non-empty folder without ``manifest.json``: its files would be replaced),
or a place that cannot be written (under a file, or in a folder without write permission).

``whole_folder(out)`` yields a fresh temporary sibling folder (``<out>.tmp-<pid>``, same parent,
so on the same file system) for everything one run writes; when the block ends normally the
temporary folder takes ``out``'s place (an atomic exchange where Linux's ``renameat2`` offers one,
else the old folder renamed aside to ``<out>.old-<pid>``, the new one renamed in, with Ctrl-C
deferred between the two renames) and the old folder is removed; when it ends with any exception,
Ctrl-C included, the temporary folder is removed and ``out`` is left as it was.  So at every moment
``out`` holds either the previous run's complete output or this run's.  Leftovers of a process that
was killed (``.tmp-<pid>`` / ``.old-<pid>`` of a process that no longer runs) are cleared at the next
run into the same folder.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import threading
from pathlib import Path

MARK = "manifest.json"  # what makes a folder an earlier output, replaceable as a whole
WHAT_TO_DO = "name a new folder or an earlier output of optimize-layer"


class OutputError(Exception):
    """An output folder that cannot be written or must not be replaced."""


def check_out(path: Path, what: str = "--out") -> None:
    """Refuse ``path`` as the output folder (``OutputError``, one line) where writing it would fail
    or would replace files that are not an earlier output."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise OutputError(f"{what} {path}: a broken symbolic link: {WHAT_TO_DO}")
    if path.exists():
        if not path.is_dir():
            raise OutputError(f"{what} {path}: an existing file, not a folder: {WHAT_TO_DO}")
        try:
            entries = [entry.name for entry in os.scandir(path)]
        except OSError as err:
            raise OutputError(f"{what} {path}: cannot be read ({err.strerror}): {WHAT_TO_DO}") from None
        if entries and MARK not in entries:
            raise OutputError(f"{what} {path}: an existing folder that is not an output of optimize-layer (no {MARK}; "
                              f"its {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} would be replaced): {WHAT_TO_DO}")
    _check_place(Path(os.path.realpath(path)).parent, f"{what} {path}", WHAT_TO_DO)


def check_default_parent(parent: Path) -> None:
    """Refuse ``parent`` (``out``) as the folder the default output folder goes into where it cannot be."""
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"{parent}: an existing file where the default output folder {parent}/<spec>-... would go: "
                          f"pass --out DIR")
    _check_place(Path(os.path.realpath(parent)), f"the default output folder {parent}/<spec>-...", "pass --out DIR")


def _check_place(folder: Path, what: str, to_do: str) -> None:
    """``folder`` exists and can be written, or can be made: its first existing ancestor is a writable folder."""
    place = folder
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise OutputError(f"{what}: {place} is a file, not a folder: {to_do}")
    if not os.access(place, os.W_OK | os.X_OK):
        raise OutputError(f"{what}: {place} cannot be written (permissions): {to_do}")


@contextlib.contextmanager
def whole_folder(out: Path):
    """The temporary folder to write one run's output into; it replaces ``out`` when the block
    ends normally and is removed when it does not (see the module's doc)."""
    target = Path(os.path.realpath(out))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _clear_leftovers(target)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as err:
        raise OutputError(f"{out}: cannot be written ({err}): {WHAT_TO_DO}") from None
    try:
        yield tmp
        with _deferred_interrupt():
            _replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, target: Path) -> None:
    """``tmp`` in ``target``'s place; the old ``target`` (if any) removed."""
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        os.replace(tmp, target)  # rename(2) replaces an empty folder
        return
    if _exchange(tmp, target):
        shutil.rmtree(tmp)  # now the old output
        return
    old = target.with_name(f"{target.name}.old-{os.getpid()}")
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not offered."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):  # kernel or file system without it
        return False
    raise OSError(code, os.strerror(code), str(b))


def _clear_leftovers(target: Path) -> None:
    """Remove ``<target>.tmp-<pid>`` / ``.old-<pid>`` of processes that no longer run (a killed run);
    an old output renamed aside with nothing in ``target``'s place goes back there."""
    pattern = re.compile(re.escape(target.name) + r"\.(tmp|old)-(\d+)")
    for entry in target.parent.iterdir():
        found = pattern.fullmatch(entry.name)
        if not found or _running(int(found.group(2))):
            continue
        if found.group(1) == "old" and not target.exists():
            os.rename(entry, target)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a leftover of an earlier run that had this process id
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _deferred_interrupt():
    """Ctrl-C (SIGINT) held back until the block ends, then raised (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
