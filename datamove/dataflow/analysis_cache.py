"""A spec's analysis kept on disk, so that a re-run of the job on the same spec reads it back.

The analysis (``dataflow.pipeline.analyse_loaded``: the spec parsed into an SDFG by DaCe, the
forward, training and fused graphs and their rows) takes 2.5-6 s of a warm job that otherwise
reads every timing back from the tuning database.  It depends only on the spec's source, the
sources of the local modules it imports, its dims and ``--set`` options, and the code that analyses
it, so it is kept under a key made of all of those (``analysis_key``): the values of the spec
module's plain constants (those it imports too), datamove's own source files, the DaCe, SymPy, NumPy
and Python versions.  Any change to one of them makes a new key.

Each entry is one pickle file, ``<folder>/<key>.pkl`` (``DATAMOVE_ANALYSIS_CACHE``, default
``~/.cache/datamove/analysis``), written whole or not at all (a temporary file renamed over it).
The loaded spec itself is not kept (its function lives in a module made when the spec is loaded):
a hit loads the spec again (milliseconds) and the rest from the file.  A file that cannot be read
back (damaged, written by another datamove) is analysed again and rewritten; a folder that cannot
be written leaves the job as it was, without the cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import platform
import sys
import types
from functools import cache
from pathlib import Path

from datamove.dataflow.pipeline import Analysis, analyse_loaded, loaded_spec
from datamove.dataflow.spec import LayerSpec

PACKAGE = Path(__file__).resolve().parents[1]  # datamove/


def cache_folder() -> Path:
    return Path(os.environ.get("DATAMOVE_ANALYSIS_CACHE", Path.home() / ".cache" / "datamove" / "analysis"))


def cached_analysis(path, dims: dict[str, int] | None = None, options: dict[str, str] | None = None,
                    folder: Path | None = None) -> Analysis:
    """``dataflow.pipeline.analyse_spec(path, dims, options)``, read from ``folder`` (default
    ``cache_folder()``) where an earlier run kept it, else analysed and kept there."""
    spec = loaded_spec(path, dims, options)
    try:
        entry = (folder or cache_folder()) / f"{analysis_key(spec)}.pkl"
    except OSError:  # a module the spec reads is not a file that can be read (a zip import): nothing kept
        return analyse_loaded(spec)
    try:
        kept = pickle.loads(entry.read_bytes())
        return Analysis(spec=spec, **kept)
    except Exception:  # no entry yet, or one that does not load: analysed again and rewritten
        pass
    analysis = analyse_loaded(spec)
    kept = {f.name: getattr(analysis, f.name) for f in dataclasses.fields(analysis) if f.name != "spec"}
    temporary = entry.with_suffix(f".{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_bytes(pickle.dumps(kept, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(temporary, entry)
    except (OSError, pickle.PicklingError, TypeError, AttributeError):  # not kept: the next run analyses again
        pass
    finally:  # interrupted or failed before the rename: no partial file left
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
    return analysis


def analysis_key(spec: LayerSpec) -> str:
    """Hex digest of what a loaded spec's analysis depends on: its file and the local modules its
    module refers to (not datamove's, not installed packages'), its dims, letters and options, its
    module's plain constants, datamove's sources, and the DaCe / SymPy / NumPy / Python versions."""
    import dace
    import numpy
    import sympy

    digest = hashlib.sha256()
    versions = (dace.__version__, sympy.__version__, numpy.__version__, platform.python_version())
    for part in (repr(sorted(spec.dim_values.items())), repr(sorted(spec.letter_dims.items())),
                 repr(sorted(spec.options.items())), repr(plain_constants(spec)), *versions, sources_digest()):
        digest.update(part.encode() + b"\0")
    for file in [Path(spec.path).resolve(), *sorted(local_modules(spec))]:
        digest.update(str(file).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


def local_modules(spec: LayerSpec) -> set[Path]:
    """Source files of the modules a spec's module refers to by its globals (modules, functions,
    classes), other than the spec itself, datamove's and installed packages' (``sys.prefix``)."""
    spec_file = Path(spec.path).resolve()
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    files = set()
    for value in spec.function.__globals__.values():
        name = getattr(value, "__module__", None)
        module = value if isinstance(value, types.ModuleType) else sys.modules.get(name) if isinstance(name, str) else None
        source = getattr(module, "__file__", None)
        if not source or not source.endswith(".py"):
            continue
        source = Path(source).resolve()
        if source == spec_file or PACKAGE in source.parents or any(p in source.parents for p in installed):
            continue
        files.add(source)
    return files


PLAIN = (bool, int, float, complex, str, bytes, type(None))


def plain_constants(spec: LayerSpec) -> list[tuple[str, str]]:
    """(name, repr) of the spec module's globals that are numbers, strings or containers of them
    (a constant imported from anywhere, which the layer may read)."""
    def plain(value) -> bool:
        if isinstance(value, (tuple, list, frozenset, set)):
            return all(plain(v) for v in value)
        if isinstance(value, dict):
            return all(plain(k) and plain(v) for k, v in value.items())
        return isinstance(value, PLAIN)

    def stable(value) -> str:  # a set's repr in sorted order (its iteration order varies with the process)
        if isinstance(value, (set, frozenset)):
            return "{" + ", ".join(sorted(map(stable, value))) + "}"
        if isinstance(value, (tuple, list)):
            return type(value).__name__ + "(" + ", ".join(map(stable, value)) + ")"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{stable(k)}: {stable(v)}" for k, v in value.items()) + "}"
        return repr(value)

    return sorted((name, stable(value)) for name, value in spec.function.__globals__.items()
                  if not name.startswith("__") and plain(value))


@cache
def sources_digest() -> str:
    """Hex digest of datamove's own source files (paths and contents)."""
    digest = hashlib.sha256()
    for file in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(file.relative_to(PACKAGE)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()
