"""The store writer: one SQLite file in WAL mode shared by the agent, the collector and readers.

Writes are buffered in memory and committed by `flush()` in one short `BEGIN IMMEDIATE`
transaction, so a writer never holds the write lock for long and readers (WAL) never block.
A background thread flushes every `autoflush_s` (default 1 s), so points reach readers within
about a second even from a writer that never calls `flush()`. `close()` writes the rest; a process
that exits without calling it has it written at interpreter exit (atexit), which a SIGTERM handler
that ends in a normal exit reaches too. SIGKILL, or a SIGTERM the process leaves to its default
action, runs no Python at all: up to `autoflush_s` of buffered data is then lost.

Series points: each series has one open chunk in the database that is rewritten in place on every
flush until it holds `chunk_points` points, then sealed; a new open chunk follows. Its encoder is
kept, so a flush encodes only the new points. Readers
therefore see every flushed point, and no chunk ever needs re-reading to be extended. `compact()`
later merges small chunks (left by restarts) and applies retention.

Failures: if a flush fails (database locked beyond the busy timeout, disk full, read-only file),
the error is logged once with what to do, every buffered point and row is kept in memory (bounded:
the oldest are dropped beyond `max_held_points` per series / `max_held_rows` per table, and
counted) and written by the next flush that succeeds; an event then records the outage.

Rare, operator-visible records (knob changes, events, simulations, sweeps) are written through
immediately; frequent ones (series points, requests, cache stats, activations) are buffered.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import numbers
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store import codec
from store.errors import StoreError
from store.migrations import UPGRADES
from store.schema import DDL, DEFAULT_RETENTION_S, SCHEMA_VERSION, SeriesSpec, spec_for

log = logging.getLogger(__name__)

STALE_OPEN_S = 600.0        # an open chunk not extended for this long is sealed, never rewritten
COMPACT_MIN_AGE_S = 3600.0  # compaction merges only chunks whose data is older than this (> STALE_OPEN_S)
COMPACT_POINTS = 7200       # merged chunk size: 2 h at 1 Hz (fewer, larger chunks decode faster)


@dataclass
class _SeriesBuffer:
    spec: SeriesSpec
    open_id: int | None = None              # row id of this writer's open chunk
    encoder: codec.ChunkEncoder | None = None  # that chunk's points so far, ready to extend
    new_points: list[tuple[int, int]] = field(default_factory=list)    # not yet written
    last_write: float = 0.0                 # monotonic time the open chunk was last written


@dataclass
class _Outage:
    since: float
    reason: str
    dropped_points: int = 0
    dropped_rows: int = 0


ROW_SQL = {     # the INSERT behind each row table (bench/queries.py times them as flush runs them)
    "requests": "INSERT INTO requests (t, request_id, ttft_s, tpot_s, latency_s, prompt_tokens, "
                "completion_tokens, hits, misses, bytes_read) VALUES (?,?,?,?,?,?,?,?,?,?)",
    "cache_stats": "INSERT INTO cache_stats (t, layer, hits, misses, evictions, prefetch_hits, "
                   "bytes_read, read_latency_s, prefetches) VALUES (?,?,?,?,?,?,?,?,?)",
    "activations": "INSERT INTO activations (t, layer, expert, count) VALUES (?,?,?,?)",
    "knob_changes": "INSERT INTO knob_changes (t, knob, old, new, source) VALUES (?,?,?,?,?)",
    "events": "INSERT INTO events (t, kind, message) VALUES (?,?,?)",
    "simulations": "INSERT INTO simulations (t, trace, policy, capacity, scope, hit_rate) "
                   "VALUES (?,?,?,?,?,?)",
    "sweeps": "INSERT INTO sweeps (t, cache_cap_bytes, tokens_per_s, hit_rate) VALUES (?,?,?,?)",
}
_WRITE_THROUGH = ("knob_changes", "events", "simulations", "sweeps")


def advice_for(error: sqlite3.Error, path: Path) -> str:
    """What an operator should do about a write error (shared by the writer and the CLI)."""
    text = str(error).lower()
    if "locked" in text or "busy" in text:
        return (f"another connection holds the write lock on {path} beyond the busy timeout; "
                f"find it with `fuser {path}` and end its long transaction")
    if "full" in text:
        return f"the disk holding {path} is full; free space there or shorten the retention"
    if "readonly" in text or "read-only" in text:
        return f"{path} or its directory is not writable by this user; fix the permissions"
    return f"check that {path} is a FlashMoE store on a healthy disk"


def open_database(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """Open (or create) the store file in WAL mode with the schema in place.

    Plain sqlite3, not sqlite-utils: importing sqlite-utils imports pandas when it is installed
    (streamlit brings it), which cost the always-on collector 1.7 s at start and ~80 MB of RSS on
    a box whose RAM is for experts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None,
                           check_same_thread=False)
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            log.warning("%s stays in %s journal mode (WAL refused, e.g. a network filesystem): "
                        "readers may briefly block writers", path, mode)
        conn.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: a crash loses no committed data
        # One transaction: a writer killed mid-creation or mid-upgrade leaves no half-made schema behind.
        conn.execute("BEGIN IMMEDIATE")
        try:
            _ensure_schema(conn, path)
            conn.execute("COMMIT")
        except BaseException:
            conn.rollback()
            raise
    except sqlite3.DatabaseError as e:
        conn.close()
        raise StoreError(f"cannot open {path} as a FlashMoE store: {e}; "
                         f"{advice_for(e, path)}") from e
    except StoreError:
        conn.close()
        raise
    return conn


def _ensure_schema(conn: sqlite3.Connection, path: Path) -> None:
    """Create the schema in a new file, or upgrade an older store in place (store.migrations)."""
    has_meta = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() if has_meta else None
    if row is None:
        for statement in DDL:
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        return
    version = int(row[0])
    while version < SCHEMA_VERSION and version in UPGRADES:
        done = UPGRADES[version](conn, path)
        version += 1
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
        log.warning("upgraded %s to store schema version %d: %s", path, version, done)
    if version != SCHEMA_VERSION:
        raise StoreError(f"{path} has store schema version {version}, this FlashMoE uses "
                         f"{SCHEMA_VERSION} and cannot upgrade it; move the old file aside to start a new store")


def to_fixed(value: float, spec: SeriesSpec) -> int:
    """The codec's fixed-point integer for a value; rejects NaN and infinities by name."""
    if not math.isfinite(value):
        raise ValueError(f"series {spec.name!r}: value {value!r} is not finite; skip the sample instead")
    if spec.precision == 1.0 and isinstance(value, numbers.Integral):
        return int(value)     # counters: exact, even beyond 2**53 (numpy integers too)
    return round(value / spec.precision)


class Store:
    """Writer for the telemetry store. Thread-safe; one per process is enough."""

    def __init__(self, path: str | os.PathLike[str], *, chunk_points: int = 600,
                 autoflush_s: float = 1.0, busy_timeout_s: float = 2.0,
                 max_held_points: int = 86_400, max_held_rows: int = 100_000) -> None:
        self.path = Path(path)
        self.chunk_points = chunk_points
        self.max_held_points = max_held_points
        self.max_held_rows = max_held_rows
        self.conn = open_database(self.path, busy_timeout_s)
        self._series: dict[str, _SeriesBuffer] = {}
        self._rows: dict[str, list[tuple[Any, ...]]] = {table: [] for table in ROW_SQL}
        self._lock = threading.Lock()          # guards the buffers
        self._write_lock = threading.Lock()    # serialises transactions on the one connection
        self._series_ids: dict[SeriesSpec, int] = {}
        self._outage: _Outage | None = None
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        if autoflush_s > 0:
            self._flusher = threading.Thread(target=self._autoflush, args=(autoflush_s,),
                                             name="store-autoflush", daemon=True)
            self._flusher.start()
        atexit.register(self.close)   # the owner may exit without closing: the buffer still goes out

    # --- series -------------------------------------------------------------------------
    def declare(self, name: str, unit: str, kind: str = "gauge", precision: float = 0.01,
                description: str = "") -> SeriesSpec:
        """Declare a series (idempotent; the latest declaration wins for new chunks)."""
        spec = SeriesSpec(name, unit, kind, float(precision), description)
        with self._lock:
            buf = self._series.get(name)
            if buf is None:
                self._series[name] = _SeriesBuffer(spec)
            elif buf.spec != spec:
                self._seal(buf)      # the open chunk keeps its precision; new points start a new one
                ratio = buf.spec.precision / spec.precision
                buf.new_points = [(t, round(q * ratio)) for t, q in buf.new_points]
                buf.spec = spec
        return spec

    def append(self, name: str, t: float, value: float) -> None:
        """Buffer one point of a series; undeclared catalogue names are declared on first use."""
        self._check_open()
        with self._lock:
            buf = self._series.get(name)
            if buf is None:
                spec = spec_for(name)
                if spec is None:
                    raise ValueError(f"series {name!r} is not declared: call Store.declare(name, unit, "
                                     f"kind, precision) first, or add it to store/schema.py CATALOGUE")
                buf = self._series[name] = _SeriesBuffer(spec)
            if not math.isfinite(t):
                raise ValueError(f"series {name!r}: time {t!r} is not a finite Unix time in seconds")
            point = (round(t * 1000), to_fixed(value, buf.spec))
            try:
                codec.check_point(*point)
            except codec.CodecError as e:
                raise ValueError(f"series {name!r}: {e}") from None
            buf.new_points.append(point)

    # --- rows ---------------------------------------------------------------------------
    def record_request(self, t: float, request_id: str, ttft_s: float | None, tpot_s: float | None,
                       latency_s: float, prompt_tokens: int, completion_tokens: int, hits: int,
                       misses: int, bytes_read: int) -> None:
        """One finished completion request (buffered)."""
        self._add_row("requests", (t, request_id, ttft_s, tpot_s, latency_s, prompt_tokens,
                                   completion_tokens, hits, misses, bytes_read))

    def record_cache_stats(self, t: float, layer: int, hits: int, misses: int, evictions: int,
                           prefetch_hits: int, bytes_read: int, read_latency_s: float | None,
                           prefetches: int | None = None) -> None:
        """Cache counters of one layer over the interval ending at t (deltas, not totals; buffered).
        Use layer -1 for a global-scope cache. `prefetches` issued and `prefetch_hits` (demand hits
        on blocks a prefetch brought in) give the prefetch accuracy; None (the default) records
        "not counted", so the row stays out of the accuracy instead of pushing it above 1."""
        self._add_row("cache_stats", (t, layer, hits, misses, evictions, prefetch_hits, bytes_read,
                                      read_latency_s, prefetches))

    def record_activations(self, t: float, counts: dict[tuple[int, int], int]) -> None:
        """How often each (layer, expert) was routed to over the interval ending at t (buffered)."""
        self._check_open()
        with self._lock:
            self._rows["activations"].extend((t, layer, expert, n) for (layer, expert), n in counts.items())

    def record_knob_change(self, t: float, knob: str, old: Any, new: Any, source: str) -> None:
        """A knob changed (values stored as JSON; written through)."""
        self._add_row("knob_changes", (t, knob, json.dumps(old), json.dumps(new), source))

    def record_event(self, t: float, kind: str, message: str) -> None:
        """Something an operator should see on the timeline (written through)."""
        self._add_row("events", (t, kind, message))

    def record_simulation(self, t: float, trace: str, policy: str, capacity: float, scope: str,
                          hit_rate: float) -> None:
        """One simulator result (written through); `capacity` is the fraction of all experts the
        cache held, in (0, 1], as `flashmoe-cli simulate --capacity` takes it."""
        if not 0 < capacity <= 1:
            raise ValueError(f"simulation capacity must be a fraction of all experts in (0, 1], not "
                             f"{capacity!r}; divide a slot count by the number of experts")
        self._add_row("simulations", (t, trace, policy, float(capacity), scope, hit_rate))

    def record_sweep(self, t: float, cache_cap_bytes: int, tokens_per_s: float, hit_rate: float) -> None:
        """One point of a cache-cap sweep (written through)."""
        self._add_row("sweeps", (t, cache_cap_bytes, tokens_per_s, hit_rate))

    def _add_row(self, table: str, row: tuple[Any, ...]) -> None:
        self._check_open()
        self._queue(table, row)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise StoreError(f"the store {self.path} is closed; open a new Store to write")

    def _queue(self, table: str, row: tuple[Any, ...]) -> None:
        with self._lock:
            self._rows[table].append(row)
        if table in _WRITE_THROUGH:
            self.flush()

    # --- flushing -----------------------------------------------------------------------
    def flush(self) -> bool:
        """Write everything buffered in one transaction. False (and logged) if the write failed;
        the data is then still held and goes out with the next successful flush."""
        with self._write_lock:
            with self._lock:
                snapshot = self._snapshot()
            if not snapshot.has_work():
                return True
            try:
                opened = self._write(snapshot)
            except sqlite3.Error as e:
                if self.conn.in_transaction:
                    self.conn.rollback()
                self._series_ids.clear()      # ids inserted by the rolled-back transaction are void
                with self._lock:
                    self._on_failure(e)
                return False
            with self._lock:
                self._apply(snapshot, opened)
                outage, self._outage = self._outage, None
        if outage is not None:
            self._on_recovery(outage)
        return True

    def _snapshot(self) -> "_Snapshot":
        now = time.monotonic()
        series = {}
        for name, buf in self._series.items():
            if buf.open_id is not None and now - buf.last_write > STALE_OPEN_S:
                self._seal(buf)
            if buf.new_points:
                series[name] = (buf.spec, buf.open_id, buf.encoder, list(buf.new_points))
        rows = {table: list(rows) for table, rows in self._rows.items() if rows}
        return _Snapshot(series, rows)

    def _write(self, snap: "_Snapshot") -> dict[str, tuple[int | None, codec.ChunkEncoder | None]]:
        """Run the transaction; returns per series the new open chunk (id, encoder). The buffers'
        encoders are extended on copies, so a failed transaction leaves them as they were."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        opened: dict[str, tuple[int | None, codec.ChunkEncoder | None]] = {}
        for table, rows in snap.rows.items():
            conn.executemany(ROW_SQL[table], rows)
        for name, (spec, chunk_id, encoder, new_points) in snap.series.items():
            series_id = self._series_id(spec)
            encoder = encoder.copy() if encoder is not None else codec.ChunkEncoder()
            for point in new_points:
                if encoder.n == self.chunk_points:
                    self._write_chunk(series_id, spec.precision, chunk_id, encoder)
                    chunk_id, encoder = None, codec.ChunkEncoder()
                encoder.push(*point)
            chunk_id = self._write_chunk(series_id, spec.precision, chunk_id, encoder)
            opened[name] = (None, None) if encoder.n == self.chunk_points else (chunk_id, encoder)
        conn.execute("COMMIT")
        return opened

    def _series_id(self, spec: SeriesSpec) -> int:
        if spec in self._series_ids:
            return self._series_ids[spec]
        conn = self.conn
        conn.execute(
            "INSERT INTO series (name, unit, kind, precision, description) VALUES (?,?,?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET unit=excluded.unit, kind=excluded.kind, "
            "precision=excluded.precision, description=excluded.description",
            (spec.name, spec.unit, spec.kind, spec.precision, spec.description))
        series_id = conn.execute("SELECT id FROM series WHERE name=?", (spec.name,)).fetchone()[0]
        self._series_ids[spec] = series_id
        return series_id

    def _write_chunk(self, series_id: int, precision: float, chunk_id: int | None,
                     encoder: codec.ChunkEncoder) -> int:
        values = (encoder.t_min / 1000, encoder.t_max / 1000, encoder.n, precision, encoder.to_bytes())
        if chunk_id is not None:
            cur = self.conn.execute(
                "UPDATE chunks SET t_start=?, t_end=?, n_points=?, precision=?, data=? WHERE id=?",
                values + (chunk_id,))
            if cur.rowcount == 1:
                return chunk_id
            # The open chunk is gone (deleted by retention): start a new one. Compaction merges
            # only chunks older than any open chunk (see store.compact), so no point is doubled.
        cur = self.conn.execute(
            "INSERT INTO chunks (series_id, t_start, t_end, n_points, precision, data) "
            "VALUES (?,?,?,?,?,?)", (series_id,) + values)
        return int(cur.lastrowid)

    def _apply(self, snap: "_Snapshot", opened: dict[str, tuple[int | None, codec.ChunkEncoder | None]]) -> None:
        for table, rows in snap.rows.items():
            del self._rows[table][:len(rows)]
        now = time.monotonic()
        for name, (spec, _, _, new_points) in snap.series.items():
            buf = self._series[name]
            del buf.new_points[:len(new_points)]
            # redeclared meanwhile: that chunk keeps the old precision, so it stays sealed
            buf.open_id, buf.encoder = opened[name] if buf.spec == spec else (None, None)
            buf.last_write = now

    @staticmethod
    def _seal(buf: _SeriesBuffer) -> None:
        buf.open_id, buf.encoder = None, None

    def _on_failure(self, error: sqlite3.Error) -> None:
        dropped_points = sum(self._trim(buf.new_points, self.max_held_points) for buf in self._series.values())
        dropped_rows = sum(self._trim(rows, self.max_held_rows) for rows in self._rows.values())
        if self._outage is None:
            self._outage = _Outage(time.time(), str(error))
            held = sum(len(b.new_points) for b in self._series.values())
            log.error("cannot write to the store %s: %s. %s. Holding %d points and %d rows in memory "
                      "(up to %d points per series, %d rows per table) and retrying on every flush.",
                      self.path, error, advice_for(error, self.path), held,
                      sum(len(r) for r in self._rows.values()), self.max_held_points, self.max_held_rows)
        self._outage.dropped_points += dropped_points
        self._outage.dropped_rows += dropped_rows
        if dropped_points or dropped_rows:
            log.warning("store %s still failing: dropped the %d oldest held points and %d oldest rows",
                        self.path, dropped_points, dropped_rows)

    @staticmethod
    def _trim(items: list[Any], limit: int) -> int:
        excess = max(0, len(items) - limit)
        del items[:excess]
        return excess

    def _on_recovery(self, outage: _Outage) -> None:
        seconds = time.time() - outage.since
        message = (f"store writes failed for {seconds:.0f} s ({outage.reason}); held data written, "
                   f"{outage.dropped_points} points and {outage.dropped_rows} rows dropped")
        log.warning("store %s is writable again: %s", self.path, message)
        self._queue("events", (time.time(), "store.recovered", message))   # also while closing

    def _autoflush(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            try:
                self.flush()
            except Exception:  # a bug must not silently stop flushing for the process's lifetime
                log.exception("store autoflush failed")

    # --- retention and compaction --------------------------------------------------------
    def compact(self, retention_s: float = DEFAULT_RETENTION_S, now: float | None = None,
                target_points: int = COMPACT_POINTS, min_age_s: float = COMPACT_MIN_AGE_S) -> "Compaction":
        """Delete chunks and rows older than `retention_s` (simulations, sweeps and each knob's
        latest value are kept), then merge runs of small chunks whose data is older than
        `min_age_s` into chunks of up to `target_points`. One short transaction per series."""
        now = time.time() if now is None else now
        self.flush()
        with self._lock:                 # our own open chunks may be merged: never rewrite them
            for buf in self._series.values():
                self._seal(buf)
        report = Compaction()
        with self._write_lock:
            try:
                self._retain(now - retention_s, report)
                series_ids = [r[0] for r in self.conn.execute("SELECT id FROM series")]
                for series_id in series_ids:
                    self._merge_series(series_id, now - min_age_s, target_points, report)
            except sqlite3.Error as e:
                if self.conn.in_transaction:
                    self.conn.rollback()
                raise StoreError(f"compacting {self.path} failed: {e}; {advice_for(e, self.path)}") from e
        log.info("compacted %s: %s", self.path, report)
        return report

    def _retain(self, cutoff: float, report: "Compaction") -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        report.chunks_deleted = conn.execute("DELETE FROM chunks WHERE t_end < ?", (cutoff,)).rowcount
        straddling = conn.execute("SELECT id, series_id, precision, data FROM chunks "
                                  "WHERE t_start < ? AND t_end >= ?", (cutoff, cutoff)).fetchall()
        for chunk_id, series_id, precision, data in straddling:     # keep only the recent points
            decoded = codec.decode(data)
            keep = decoded.t_ms >= cutoff * 1000
            conn.execute("DELETE FROM chunks WHERE id = ?", (chunk_id,))
            self._write_chunk(series_id, precision, None, codec.ChunkEncoder.of(
                decoded.t_ms[keep].tolist(), decoded.q[keep].tolist()))
        for table in ("requests", "cache_stats", "activations", "events"):
            report.rows_deleted += conn.execute(f"DELETE FROM {table} WHERE t < ?", (cutoff,)).rowcount
        report.rows_deleted += conn.execute(
            "DELETE FROM knob_changes WHERE t < ? AND id NOT IN "
            "(SELECT MAX(id) FROM knob_changes GROUP BY knob)", (cutoff,)).rowcount
        conn.execute("COMMIT")

    def _merge_series(self, series_id: int, before: float, target_points: int,
                      report: "Compaction") -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        rows = conn.execute(
            "SELECT id, precision, data, n_points FROM chunks WHERE series_id = ? AND t_end < ? "
            "AND n_points < ? ORDER BY t_start, id", (series_id, before, target_points)).fetchall()
        for run in _runs_to_merge(rows, target_points):
            t_ms, q = [], []
            for _, _, data, _ in run:
                decoded = codec.decode(data)
                t_ms.extend(decoded.t_ms.tolist())
                q.extend(decoded.q.tolist())
            order = sorted(range(len(t_ms)), key=t_ms.__getitem__)
            conn.executemany("DELETE FROM chunks WHERE id = ?", [(r[0],) for r in run])
            for start in range(0, len(order), target_points):
                part = order[start:start + target_points]
                self._write_chunk(series_id, run[0][1], None,
                                  codec.ChunkEncoder.of([t_ms[i] for i in part], [q[i] for i in part]))
                report.chunks_written += 1
            report.chunks_merged += len(run)
        conn.execute("COMMIT")

    # --- lifecycle ----------------------------------------------------------------------
    def close(self) -> bool:
        """Flush what is buffered and close. False if data could not be written (it is lost)."""
        if self._closed.is_set():
            return True
        self._closed.set()
        atexit.unregister(self.close)
        if self._flusher is not None:
            self._flusher.join()
        ok = self.flush()
        if not ok:
            log.error("closing the store %s with unwritten data: %s", self.path,
                      self._outage.reason if self._outage else "unknown error")
        with self._write_lock:
            self.conn.close()
        return ok

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Compaction:
    """What one `Store.compact()` did."""
    chunks_deleted: int = 0
    rows_deleted: int = 0
    chunks_merged: int = 0
    chunks_written: int = 0


def _runs_to_merge(rows: list[tuple[int, float, bytes, int]], target_points: int) -> list[list[tuple[int, float, bytes, int]]]:
    """Group time-ordered small chunks into runs of the same precision worth merging (>= 2 chunks;
    a run is closed at 16 x target_points to bound one transaction's work)."""
    runs: list[list[tuple[int, float, bytes, int]]] = []
    current: list[tuple[int, float, bytes, int]] = []
    for row in rows:
        if current and (row[1] != current[0][1] or sum(r[3] for r in current) >= 16 * target_points):
            runs.append(current)
            current = []
        current.append(row)
    runs.append(current)
    return [run for run in runs if len(run) >= 2]


@dataclass
class _Snapshot:
    series: dict[str, tuple[SeriesSpec, int | None, codec.ChunkEncoder | None, list[tuple[int, int]]]]
    rows: dict[str, list[tuple[Any, ...]]]

    def has_work(self) -> bool:
        return bool(self.series or self.rows)


__all__ = ["Store", "StoreError", "Compaction", "open_database", "advice_for", "to_fixed"]
