"""SQLite tuning database: one row per (device, software versions, operator, sizes, dtype, layout, knobs).

Every write is a single INSERT in autocommit mode, i.e. its own transaction, and the database runs
in WAL mode: a process killed at any point leaves either the whole record or none of it, and
records already committed stay (``synchronous=NORMAL``: durable against a crashed or killed
process; only an OS crash or power loss may drop the last commits).  Several processes may read
and write at once (writers wait up to ``timeout`` seconds for the lock).

Status values: 'ok' (correct and timed on a GPU), 'failed' (build, launch or timing raised; the
reason is kept), 'wrong' (ran but failed the accuracy check; never timed), 'checked' (built and
checked, but not timed: no GPU, e.g. through the Triton interpreter).  The schema enforces that
only 'ok' rows carry times.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

STATUSES = ("ok", "failed", "wrong", "checked")
KEY_COLUMNS = ("device", "versions", "op", "dims", "dtype", "layout", "knobs")
VALUE_COLUMNS = (
    "status", "median_ms", "q20_ms", "q80_ms", "n_reps", "cuda_graph",
    "rel_error", "baseline_error", "detail", "bytes", "flop", "timestamp",
)

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS measurements (
    device TEXT NOT NULL,
    versions TEXT NOT NULL,
    op TEXT NOT NULL,
    dims TEXT NOT NULL,
    dtype TEXT NOT NULL,
    layout TEXT NOT NULL,
    knobs TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN {STATUSES}),
    median_ms REAL,
    q20_ms REAL,
    q80_ms REAL,
    n_reps INTEGER,
    cuda_graph INTEGER,
    rel_error REAL,
    baseline_error REAL,
    detail TEXT,
    bytes INTEGER,
    flop INTEGER,
    timestamp REAL NOT NULL,
    PRIMARY KEY (device, versions, op, dims, dtype, layout, knobs),
    CHECK ((status = 'ok') = (median_ms IS NOT NULL AND q20_ms IS NOT NULL AND q80_ms IS NOT NULL))
);
CREATE INDEX IF NOT EXISTS measurements_by_op ON measurements (op, dims, dtype, status, median_ms);
CREATE TABLE IF NOT EXISTS ceilings (
    device TEXT PRIMARY KEY,
    copy_bytes_per_s REAL NOT NULL,
    gemm_flop_per_s REAL NOT NULL,
    details TEXT NOT NULL,
    versions TEXT NOT NULL,
    timestamp REAL NOT NULL
);
"""


class TuningDBError(Exception):
    """A file at the database's path that is not a tuning database; its message is meant to be printed as is."""


def _not_a_tuning_db(conn: sqlite3.Connection) -> str | None:
    """Why the database behind ``conn`` is not a tuning database, or None (it is one, or is empty)."""
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as err:
        if err.sqlite_errorname not in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
            raise
        return f"not a readable SQLite database ({err})"
    if tables and "measurements" not in tables:
        return f"an SQLite database without the measurements table (it holds {', '.join(sorted(tables))})"
    return None


def canonical_json(value) -> str:
    """JSON with sorted keys and no spaces: equal values give equal strings (the key columns)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Key:
    """Identity of one measurement.

    ``op`` is the operator signature the caller builds (e.g. ``"softmax_fwd[bhjk->bhjk]"``);
    ``dims`` maps dim letters to sizes (``{"b": 8, "j": 512, ...}``); ``dtype`` is e.g. ``"bfloat16"``;
    ``layout`` is any JSON value naming the storage orders (e.g. ``{"x": "bjhp"}``); ``knobs`` are
    the kernel's tuning parameters (``{"BLOCK": 128, "num_warps": 4}``).
    """

    device: str
    versions: dict
    op: str
    dims: dict
    dtype: str
    layout: object
    knobs: dict

    def columns(self) -> tuple[str, ...]:
        return (
            self.device, canonical_json(self.versions), self.op, canonical_json(self.dims),
            self.dtype, canonical_json(self.layout), canonical_json(self.knobs),
        )


@dataclass(frozen=True)
class Record:
    """One stored measurement.  Times in ms (per call of the variant), ``bytes``/``flop`` per call."""

    key: Key
    status: str
    median_ms: float | None = None
    q20_ms: float | None = None
    q80_ms: float | None = None
    n_reps: int | None = None
    cuda_graph: bool | None = None
    rel_error: float | None = None
    baseline_error: float | None = None
    detail: str | None = None
    bytes: int | None = None
    flop: int | None = None
    timestamp: float = field(default_factory=time.time)

    @property
    def bytes_per_s(self) -> float | None:
        if self.bytes is None or self.median_ms is None:
            return None
        return self.bytes / (self.median_ms * 1e-3)

    @property
    def flop_per_s(self) -> float | None:
        if self.flop is None or self.median_ms is None:
            return None
        return self.flop / (self.median_ms * 1e-3)


def _record_from_row(row: sqlite3.Row) -> Record:
    key = Key(
        device=row["device"], versions=json.loads(row["versions"]), op=row["op"], dims=json.loads(row["dims"]),
        dtype=row["dtype"], layout=json.loads(row["layout"]), knobs=json.loads(row["knobs"]),
    )
    values = {name: row[name] for name in VALUE_COLUMNS}
    if values["cuda_graph"] is not None:
        values["cuda_graph"] = bool(values["cuda_graph"])
    return Record(key=key, **values)


@dataclass(frozen=True)
class Ceilings:
    """Measured ceilings of one device: copy bandwidth (bytes read + written per s) and bf16 GEMM flop/s."""

    device: str
    copy_bytes_per_s: float
    gemm_flop_per_s: float
    details: dict  # sizes, medians and quartiles in ms, the device facts
    versions: dict
    timestamp: float


class TuningDB:
    """The tuning database at ``path`` (created if missing).  One connection per object and thread.
    A file there that is not one (not SQLite, or another program's database) is refused untouched."""

    def __init__(self, path: str | Path, timeout: float = 60.0):
        self.path = Path(path)
        if self.path.is_dir():
            raise TuningDBError(f"{self.path}: a folder, not a tuning database file: pass a file path with --db")
        try:  # isolation_level=None: autocommit, so each statement below is its own transaction.
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        except (OSError, sqlite3.Error) as err:  # a file under a file, one this user may not read, ...
            raise TuningDBError(f"{self.path}: cannot be opened ({err}): check its permissions or pass another --db") from None
        problem = _not_a_tuning_db(self._conn)
        if problem:
            self._conn.close()
            raise TuningDBError(f"{self.path}: {problem}: move it away or pass another --db")
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> TuningDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def put(self, record: Record) -> None:
        """Store ``record``, replacing any earlier one with the same key (one atomic transaction)."""
        if record.status not in STATUSES:
            raise ValueError(f"status {record.status!r} not in {STATUSES}")
        values = [getattr(record, name) for name in VALUE_COLUMNS]
        values[VALUE_COLUMNS.index("cuda_graph")] = None if record.cuda_graph is None else int(record.cuda_graph)
        columns = KEY_COLUMNS + VALUE_COLUMNS
        self._conn.execute(
            f"INSERT OR REPLACE INTO measurements ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
            (*record.key.columns(), *values),
        )

    def lookup(self, key: Key) -> Record | None:
        """The stored record for exactly ``key``, or None (what a resumed sweep skips)."""
        where = " AND ".join(f"{c} = ?" for c in KEY_COLUMNS)
        row = self._conn.execute(f"SELECT * FROM measurements WHERE {where}", key.columns()).fetchone()
        return None if row is None else _record_from_row(row)

    def query(self, *, status: str | None = None, device: str | None = None, versions: dict | None = None,
              op: str | None = None, dims: dict | None = None, dtype: str | None = None,
              layout=None, knobs: dict | None = None) -> list[Record]:
        """All records matching the given fields (None matches anything), fastest 'ok' first."""
        filters = {
            "status": status, "device": device, "op": op, "dtype": dtype,
            "versions": None if versions is None else canonical_json(versions),
            "dims": None if dims is None else canonical_json(dims),
            "layout": None if layout is None else canonical_json(layout),
            "knobs": None if knobs is None else canonical_json(knobs),
        }
        filters = {k: v for k, v in filters.items() if v is not None}
        where = " AND ".join(f"{c} = ?" for c in filters) or "1"
        rows = self._conn.execute(
            f"SELECT * FROM measurements WHERE {where} ORDER BY median_ms IS NULL, median_ms, timestamp",
            tuple(filters.values()),
        ).fetchall()
        return [_record_from_row(r) for r in rows]

    def best(self, op: str, dims: dict, dtype: str, *, device: str | None = None, versions: dict | None = None,
             layout=None, limit: int = 1) -> list[Record]:
        """The ``limit`` fastest 'ok' records of ``op`` at ``dims``/``dtype`` (optionally one device/versions/layout)."""
        return self.query(status="ok", op=op, dims=dims, dtype=dtype, device=device, versions=versions,
                          layout=layout)[:limit]

    def store_ceilings(self, ceilings) -> None:
        """Store a ``Ceilings`` (replacing the device's earlier one)."""
        self._conn.execute(
            "INSERT OR REPLACE INTO ceilings (device, copy_bytes_per_s, gemm_flop_per_s, details, versions, timestamp)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (ceilings.device, ceilings.copy_bytes_per_s, ceilings.gemm_flop_per_s,
             canonical_json(ceilings.details), canonical_json(ceilings.versions), ceilings.timestamp),
        )

    def ceilings(self, device: str):
        """The stored ``Ceilings`` of ``device``, or None."""

        row = self._conn.execute("SELECT * FROM ceilings WHERE device = ?", (device,)).fetchone()
        if row is None:
            return None
        return Ceilings(
            device=row["device"], copy_bytes_per_s=row["copy_bytes_per_s"], gemm_flop_per_s=row["gemm_flop_per_s"],
            details=json.loads(row["details"]), versions=json.loads(row["versions"]), timestamp=row["timestamp"],
        )
