"""The store writer: one SQLite file in WAL mode shared by the agent, the collector and readers.

`Store` buffers series points (store.series_writer) and rows (store.row_writer) in memory, and
`flush()` commits both in one short `BEGIN IMMEDIATE` transaction, so a writer never holds the
write lock for long and readers (WAL) never block: the points are encoded into chunks before it,
and inside it only SQL runs. A background thread flushes every
`autoflush_s` (default 1 s), so points reach readers within about a second even from a writer that
never calls `flush()`. `close()` writes the rest; a process that exits without calling it has it
written at interpreter exit (atexit), which a SIGTERM handler that ends in a normal exit reaches
too. SIGKILL, or a SIGTERM the process leaves to its default action, runs no Python at all: up to
`autoflush_s` of buffered data is then lost.

Failures: if a flush fails (database locked beyond the busy timeout, disk full, read-only file),
the error is logged once with what to do, and every buffered point and row is kept in memory
(bounded: the oldest are dropped beyond `max_held_points` per series / `max_held_rows` per table)
and written by the next flush that succeeds; an event then records the outage. While it lasts, a
flush tries again at most every `retry_s`, and on a full disk only once there is FREE_TO_RETRY of
space, so a failing store costs the writer no CPU. Points and rows that are lost (dropped from
the backlog, or still held when the store closes) are counted, logged, and added to the store's
counters (`meta` keys lost_points, lost_rows; store.queries.lost) by the next write that succeeds.

The write-ahead log stays bounded (store.database.WAL_LIMIT_BYTES), and a write that fails for
want of space checkpoints it at once, so that the log starts over in its own space rather than
grow into a full disk.

Rare, operator-visible records (knob changes, events, simulations, sweeps) are written through
immediately; frequent ones (series points, requests, cache stats, activations) are buffered.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store.compaction import COMPACT_MIN_AGE_S, COMPACT_POINTS, Compaction, compact
from store.database import advice_for, open_database, record_lost, transaction
from store.errors import StoreError
from store.row_writer import Row, RowWriter
from store.schema import DEFAULT_RETENTION_DAYS, ROW_TABLE, SeriesSpec
from store.series_writer import SeriesWriter

log = logging.getLogger(__name__)

FREE_TO_RETRY = 1 << 20             # on a full disk, try again once this much space is free


@dataclass
class _Outage:
    since: float
    reason: str
    next_try: float                 # monotonic time of the next attempt
    disk_full: bool = False
    dropped_points: int = 0
    dropped_rows: int = 0


@dataclass
class Lost:
    """Points and rows this writer could not write: in all, and not yet counted in the store."""
    points: int = 0
    rows: int = 0
    unrecorded_points: int = 0
    unrecorded_rows: int = 0

    def add(self, points: int, rows: int) -> None:
        self.points += points
        self.rows += rows
        self.unrecorded_points += points
        self.unrecorded_rows += rows


class Store:
    """Writer for the telemetry store. Thread-safe; one per process is enough."""

    def __init__(self, path: str | os.PathLike[str], *, chunk_points: int = 600,
                 autoflush_s: float = 1.0, busy_timeout_s: float = 2.0,
                 max_held_points: int = 3_600, max_held_rows: int = 100_000, retry_s: float = 5.0,
                 create: bool = True, device_name: str | None = None) -> None:
        self.path = Path(path)
        self.max_held_points = max_held_points
        self.max_held_rows = max_held_rows
        self.retry_s = retry_s
        self.busy_timeout_s = busy_timeout_s
        self.conn = open_database(self.path, busy_timeout_s, create, device_name)
        self._file, self._gone = _identity(self.path), False
        self.lost = Lost()
        self._series = SeriesWriter(chunk_points)
        self._rows = RowWriter()
        self._lock = threading.Lock()          # guards the buffers
        self._write_lock = threading.Lock()    # serialises transactions on the one connection
        self._outage: _Outage | None = None
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        if autoflush_s > 0:
            self._flusher = threading.Thread(target=self._autoflush, args=(autoflush_s,),
                                             name="store-autoflush", daemon=True)
            try:
                self._flusher.start()
            except BaseException:   # "can't start new thread": no one would close the connection
                self.conn.close()
                raise
        atexit.register(self.close)   # the owner may exit without closing: the buffer still goes out

    # --- series -------------------------------------------------------------------------
    def declare(self, name: str, unit: str, kind: str = "gauge", precision: float = 0.01,
                description: str = "") -> SeriesSpec:
        """Declare a series not in the catalogue (idempotent; the latest declaration wins for new chunks)."""
        spec = SeriesSpec(name, unit, kind, float(precision), description)
        with self._lock:
            self._series.declare(spec)
        return spec

    def append(self, name: str, t: float, value: float) -> None:
        """Buffer one point of a series; undeclared catalogue names are declared on first use."""
        self._check_open()
        with self._lock:
            self._series.append(name, t, value)

    # --- rows ---------------------------------------------------------------------------
    def record_request(self, t: float, request_id: str, ttft_s: float | None, tpot_s: float | None,
                       latency_s: float, prompt_tokens: int, completion_tokens: int, hits: int,
                       misses: int, bytes_read: int) -> None:
        """One finished completion request (buffered)."""
        self._record("requests", [(t, request_id, ttft_s, tpot_s, latency_s, prompt_tokens,
                                   completion_tokens, hits, misses, bytes_read)])

    def record_cache_stats(self, t: float, layer: int, hits: int, misses: int, evictions: int,
                           prefetch_hits: int, bytes_read: int, read_latency_s: float | None,
                           prefetches: int | None = None) -> None:
        """Cache counters of one layer over the interval ending at t (deltas, not totals; buffered).
        Use layer -1 for a global-scope cache. `prefetches` issued and `prefetch_hits` (demand hits
        on blocks a prefetch brought in) give the prefetch accuracy; None (the default) records
        "not counted", so the row stays out of the accuracy instead of pushing it above 1."""
        self._record("cache_stats", [(t, layer, hits, misses, evictions, prefetch_hits, bytes_read,
                                      read_latency_s, prefetches)])

    def record_activations(self, t: float, counts: dict[tuple[int, int], int]) -> None:
        """How often each (layer, expert) was routed to over the interval ending at t (buffered)."""
        self._record("activations", ((t, layer, expert, n) for (layer, expert), n in counts.items()))

    def record_knob_change(self, t: float, knob: str, old: Any, new: Any, source: str) -> None:
        """A knob changed (values stored as JSON; written through)."""
        self._record("knob_changes", [(t, knob, json.dumps(old), json.dumps(new), source)])

    def record_event(self, t: float, kind: str, message: str) -> None:
        """Something an operator should see on the timeline (written through)."""
        self._record("events", [(t, kind, message)])

    def record_disk_readers(self, t: float, device: str, readers: Iterable[tuple[int, str, float, float]]) -> None:
        """The processes besides the agent reading or writing its disk `device` over the interval ending at
        t: (pid, name, read bytes per second, write bytes per second) each (buffered)."""
        self._record("disk_readers", ((t, device, *reader) for reader in readers))

    def record_simulation(self, t: float, trace: str, policy: str, capacity: float, scope: str,
                          hit_rate: float) -> None:
        """One simulator result (written through); `capacity` is the fraction of all experts the
        cache held, in (0, 1], as `flashmoe-cli simulate --capacity` takes it."""
        if not 0 < capacity <= 1:
            raise ValueError(f"simulation capacity must be a fraction of all experts in (0, 1], not "
                             f"{capacity!r}; divide a slot count by the number of experts")
        self._record("simulations", [(t, trace, policy, float(capacity), scope, hit_rate)])

    def record_sweep(self, t: float, cache_cap_bytes: int, tokens_per_s: float, hit_rate: float) -> None:
        """One point of a cache-cap sweep (written through)."""
        self._record("sweeps", [(t, cache_cap_bytes, tokens_per_s, hit_rate)])

    def _record(self, table: str, rows: Iterable[Row]) -> None:
        self._check_open()
        with self._lock:
            self._rows.add(table, rows)
        if not ROW_TABLE[table].buffered:
            self.flush()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise StoreError(f"the store {self.path} is closed; open a new Store to write")

    # --- flushing -----------------------------------------------------------------------
    def flush(self, force: bool = False) -> bool:
        """Write everything buffered in one transaction. False (and logged) if the write failed, or
        if during an outage the next attempt is not due yet (`force` tries anyway); the data is then
        still held and goes out with the next successful flush."""
        with self._write_lock:
            if not force and not self._retry_due():
                with self._lock:
                    self._drop_excess()
                return False
            with self._lock:
                rows, series = self._rows.pending(), self._series.pending()
                lost = (self.lost.unrecorded_points, self.lost.unrecorded_rows)
            if not rows and not series and not any(lost):
                return True
            chunks = self._series.encode(series)
            try:
                with transaction(self.conn):
                    began = time.monotonic()
                    self._rows.write(self.conn, rows)
                    opened = self._series.write(self.conn, chunks)
                    record_lost(self.conn, *lost)
                self._warn_if_held_long(time.monotonic() - began, len(series), sum(map(len, rows.values())))
            except sqlite3.Error as e:
                with self._lock:
                    self._series.failed()
                    self._on_failure(e)
                return False
            with self._lock:
                self._rows.written(rows)
                self._series.written(series, opened)
                self.lost.unrecorded_points -= lost[0]
                self.lost.unrecorded_rows -= lost[1]
                outage, self._outage = self._outage, None
        if outage is not None:
            self._on_recovery(outage)
        self._check_still_there()
        return True

    def _check_still_there(self) -> None:
        """Say once when the path no longer names the file written (`rm flashmoe.db` to start afresh, a file
        moved over it): the writes went on into the removed file without a word, lost at exit, while every reader
        said there was no store and to start the very writer that was running."""
        gone = _identity(self.path) != self._file
        if gone and not self._gone:
            log.error("the store %s was removed or replaced while this process writes it: what it writes goes to "
                      "the removed file and is lost when it stops; restart it to write a new store there", self.path)
        self._gone = gone

    def _warn_if_held_long(self, held_s: float, series: int, rows: int) -> None:
        """Say so when a flush held the write lock past half the busy timeout: another writer waiting
        that long (the collector, the agent) is that close to failing with "database is locked"."""
        if held_s > self.busy_timeout_s / 2:
            log.warning("store %s: a flush held the write lock for %.1f s, over half the %g s that other writers "
                        "wait for it (%d series, %d rows); a machine short of memory or a slow disk makes this",
                        self.path, held_s, self.busy_timeout_s, series, rows)

    def _retry_due(self) -> bool:
        outage = self._outage
        if outage is None:
            return True
        return time.monotonic() >= outage.next_try and (not outage.disk_full or _free_bytes(self.path) >= FREE_TO_RETRY)

    def _on_failure(self, error: sqlite3.Error) -> None:
        disk_full = isinstance(error, sqlite3.OperationalError) and "full" in str(error).lower()
        if self._outage is None:
            self._outage = _Outage(time.time(), str(error), 0.0, disk_full)
            log.error("cannot write to the store %s: %s. %s. Holding %d points and %d rows in memory "
                      "(up to %d points per series, %d rows per table) and retrying every %g s.",
                      self.path, error, advice_for(error, self.path), self._series.held(),
                      self._rows.held(), self.max_held_points, self.max_held_rows, self.retry_s)
        self._outage.next_try = time.monotonic() + self.retry_s
        self._drop_excess()
        if disk_full:
            self._checkpoint()

    def _drop_excess(self) -> None:
        """Keep the backlog within its bounds: the oldest points and rows go, counted as lost."""
        points, rows = self._series.trim(self.max_held_points), self._rows.trim(self.max_held_rows)
        if not points and not rows:
            return
        if not self._outage.dropped_points and not self._outage.dropped_rows:
            log.warning("store %s still failing and its backlog is full: dropping the oldest points and rows "
                        "from now on (counted; see store.queries.lost)", self.path)
        self.lost.add(points, rows)
        self._outage.dropped_points += points
        self._outage.dropped_rows += rows

    def _checkpoint(self) -> None:
        """Move the log's committed pages into the database file, where they fit, so the next write
        starts the log over in the space it already holds instead of asking the disk for more."""
        try:
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as e:
            log.debug("checkpointing %s failed: %s", self.path, e)

    def _on_recovery(self, outage: _Outage) -> None:
        seconds = time.time() - outage.since
        message = (f"store writes failed for {seconds:.0f} s ({outage.reason}); held data written, "
                   f"{outage.dropped_points} points and {outage.dropped_rows} rows dropped")
        log.warning("store %s is writable again: %s", self.path, message)
        with self._lock:                   # also while closing: the event goes out with the next flush
            self._rows.add("events", [(time.time(), "store.recovered", message)])
        self.flush()

    def _autoflush(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            try:
                self.flush()
            except Exception:  # a bug must not silently stop flushing for the process's lifetime
                log.exception("store autoflush failed")

    # --- retention and compaction --------------------------------------------------------
    def compact(self, retention_days: float = DEFAULT_RETENTION_DAYS, now: float | None = None,
                target_points: int = COMPACT_POINTS, min_age_s: float = COMPACT_MIN_AGE_S) -> Compaction:
        """Delete chunks and rows older than `retention_days` (simulations, sweeps and each knob's
        latest value are kept), then merge runs of small chunks whose data is older than
        `min_age_s` into chunks of up to `target_points` (store.compaction)."""
        now = time.time() if now is None else now
        self.flush()
        with self._lock:                 # our own open chunks may be merged: never rewrite them
            self._series.seal_all()
        with self._write_lock:
            try:
                report = compact(self.conn, now - retention_days * 86400, now - min_age_s, target_points)
            except sqlite3.Error as e:
                raise StoreError(f"compacting {self.path} failed: {e}; {advice_for(e, self.path)}") from e
        log.info("compacted %s: %s", self.path, report)
        if report.chunks_damaged:
            log.warning("compaction left %d chunk(s) of %s as they were: their bytes do not decode (damaged); "
                        "`flashmoe-cli store export` of their series names each and how to delete it",
                        report.chunks_damaged, self.path)
        return report

    # --- lifecycle ----------------------------------------------------------------------
    def close(self) -> bool:
        """Flush what is buffered and close. False if data could not be written (it is lost)."""
        if self._closed.is_set():
            return True
        self._closed.set()
        atexit.unregister(self.close)
        if self._flusher is not None:
            self._flusher.join()
        ok = self.flush(force=True)
        if not ok:
            self._count_unwritten()
        with self._write_lock:
            self.conn.close()
        return ok

    def _count_unwritten(self) -> None:
        """Closing with data that cannot be written: count it lost, say so, and try to record the
        count alone (a tiny write, into the log's space after a checkpoint)."""
        with self._lock:
            points, rows = self._series.held(), self._rows.held()
            self._series.trim(0)
            self._rows.trim(0)
            self.lost.add(points, rows)
        log.error("closing the store %s with unwritten data (%s): %d points and %d rows lost, %d points "
                  "and %d rows in all since it opened", self.path,
                  self._outage.reason if self._outage else "unknown error", points, rows,
                  self.lost.points, self.lost.rows)
        with self._write_lock:
            self._checkpoint()
            try:
                with transaction(self.conn):
                    record_lost(self.conn, self.lost.unrecorded_points, self.lost.unrecorded_rows)
            except sqlite3.Error as e:
                log.error("the count of lost data could not be written to %s either: %s", self.path, e)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _free_bytes(path: Path) -> int:
    """Space left for this user on the filesystem holding `path`."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, None if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
