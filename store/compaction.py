"""Retention and compaction: delete what is older than the retention, merge runs of small chunks.

Restarts leave small chunks behind (each writer seals its open chunk when it stops); merging them
into chunks of up to `target_points` makes reads decode fewer, larger chunks. Only chunks whose
data is older than `min_age_s` are merged, which is older than any writer's open chunk
(store.series_writer.STALE_OPEN_S), so no open chunk is ever rewritten by two writers. Retention
trims a chunk that straddles its cutoff by the same rule; a younger one is kept whole until then.

It runs on a nearly full disk: old chunks and rows go DELETE_BATCH at a time, each batch committed and, on a disk
short of room, the log checkpointed after it, so the log starts over in the room it already holds instead of
growing by all that is deleted (elsewhere the autocheckpoint does, less often: deleting 160,000 rows took 1.8 s
here with a checkpoint per batch, 0.47 s without, 0.29 s in one transaction); and freed pages are not zeroed
(SQLite's secure_delete, Debian's default, writes each freed page to the log: a deletion then needed free room
about its own size). The file keeps its size; no VACUUM.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from store import codec
from store.database import WAL_LIMIT_BYTES, short_of_room, transaction
from store.schema import ROW_TABLES
from store.series_writer import EncodedChunk, write_chunk

COMPACT_MIN_AGE_S = 3600.0  # compaction merges only chunks whose data is older than this (> STALE_OPEN_S)
COMPACT_POINTS = 7200       # merged chunk size: 2 h at 1 Hz (fewer, larger chunks decode faster)
DELETE_BATCH = 100          # chunks or rows deleted per transaction: the log holds one batch's pages at a time

ChunkRow = tuple[int, float, bytes, int]    # id, precision, data, n_points


@dataclass
class Compaction:
    """What one compaction did."""
    chunks_deleted: int = 0
    rows_deleted: int = 0
    chunks_merged: int = 0
    chunks_written: int = 0
    chunks_damaged: int = 0     # left as they are: their bytes do not decode (the readers name each)


def compact(conn: sqlite3.Connection, cutoff: float, merge_before: float,
            target_points: int = COMPACT_POINTS) -> Compaction:
    """Delete chunks and rows older than `cutoff` (tables that do not expire, and the newest row of
    each knob, are kept), then merge runs of small chunks whose data ends before `merge_before`.
    Short transactions: one per DELETE_BATCH deleted, one for the chunks retention trims and one per run
    merged, their chunks decoded and encoded before it, so the write lock is held for the SQL alone."""
    report = Compaction()
    with _freed_pages_not_zeroed(conn):
        _retain(conn, cutoff, merge_before, report)
        for (series_id,) in conn.execute("SELECT id FROM series").fetchall():
            _merge_series(conn, series_id, merge_before, target_points, report)
    return report


@contextmanager
def _freed_pages_not_zeroed(conn: sqlite3.Connection) -> Iterator[None]:
    """secure_delete FAST: deleted content is zeroed only where its page is written anyway (telemetry, not
    secrets; the file's permissions guard it), so the log takes the pages a deletion changes, not each freed one."""
    (previous,) = conn.execute("PRAGMA secure_delete").fetchone()
    conn.execute("PRAGMA secure_delete = FAST")
    try:
        yield
    finally:
        conn.execute(f"PRAGMA secure_delete = {('OFF', 'ON', 'FAST')[previous]}")   # it reads 2 for FAST, and 2 sets ON


def _delete_in_batches(conn: sqlite3.Connection, table: str, where: str, args: tuple) -> int:
    """DELETE FROM table WHERE `where`, DELETE_BATCH rows per transaction, room made after each that deleted
    any; returns how many rows went. What one batch deleted stays deleted whatever a later one meets."""
    deleted = 0
    while True:
        with transaction(conn):
            n = conn.execute(f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} WHERE {where} "
                             f"LIMIT {DELETE_BATCH})", args).rowcount
        deleted += n
        if n:
            _make_room(conn)
        if n < DELETE_BATCH:
            return deleted


def _make_room(conn: sqlite3.Connection) -> None:
    """On a disk with less free than the log's bound, move the log's pages into the file now, so the next
    transaction starts the log over in its own room. A checkpoint that cannot finish (a reader on an older
    snapshot, no room to grow the file) is not an error: the next transaction then appends to the log."""
    path = conn.execute("PRAGMA database_list").fetchone()[2]
    if path and short_of_room(Path(path), WAL_LIMIT_BYTES):
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")


class _Moved(Exception):
    """A chunk read for rewriting changed before the transaction (another compaction merged it, or a
    writer extended it): the transaction is rolled back and the chunk left to the next compaction."""


_DELETE_AS_READ = "DELETE FROM chunks WHERE id = ? AND n_points = ?"


def _retain(conn: sqlite3.Connection, cutoff: float, sealed_before: float, report: Compaction) -> None:
    """A straddling chunk whose data ends after `sealed_before` may be a writer's open chunk: were it
    trimmed, that writer's next flush would find it gone and write all its points again."""
    straddling = conn.execute("SELECT id, series_id, precision, data, n_points FROM chunks "
                              "WHERE t_start < ? AND t_end >= ? AND t_end < ?",
                              (cutoff, cutoff, sealed_before)).fetchall()
    trimmed = []
    for chunk_id, series_id, precision, data, n_points in straddling:
        try:
            trimmed.append((chunk_id, n_points, series_id, _recent(data, precision, cutoff)))  # the recent points
        except codec.CodecError:
            report.chunks_damaged += 1               # kept whole: deleted once all of it is past the cutoff
    report.chunks_deleted = _delete_in_batches(conn, "chunks", "t_end < ?", (cutoff,))
    try:
        with transaction(conn):
            for chunk_id, n_points, series_id, chunk in trimmed:
                if conn.execute(_DELETE_AS_READ, (chunk_id, n_points)).rowcount != 1:
                    raise _Moved
                write_chunk(conn, series_id, chunk)
    except _Moved:
        pass                                                     # rolled back: the next compaction trims them
    if trimmed:
        _make_room(conn)
    for table in ROW_TABLES:
        if table.expires:
            keep = (f" AND id NOT IN (SELECT MAX(id) FROM {table.name} GROUP BY {table.keep_latest_of})"
                    if table.keep_latest_of else "")
            report.rows_deleted += _delete_in_batches(conn, table.name, f"t < ?{keep}", (cutoff,))


def _recent(data: bytes, precision: float, cutoff: float) -> EncodedChunk:
    decoded = codec.decode(data)
    keep = decoded.t_ms >= cutoff * 1000
    return EncodedChunk.of(codec.ChunkEncoder.of(decoded.t_ms[keep].tolist(), decoded.q[keep].tolist()), precision)


def _merge_series(conn: sqlite3.Connection, series_id: int, before: float, target_points: int,
                  report: Compaction) -> None:
    rows = conn.execute(
        "SELECT id, precision, data, n_points FROM chunks WHERE series_id = ? AND t_end < ? "
        "AND n_points < ? ORDER BY t_start, id", (series_id, before, target_points)).fetchall()
    for run in _runs_to_merge(rows, target_points):
        merged, taken = _merged(run, target_points)
        report.chunks_damaged += len(run) - len(taken)
        if len(taken) < 2:
            continue
        try:
            with transaction(conn):
                if conn.executemany(_DELETE_AS_READ, [(r[0], r[3]) for r in taken]).rowcount != len(taken):
                    raise _Moved
                for chunk in merged:
                    write_chunk(conn, series_id, chunk)
        except _Moved:
            continue                                             # rolled back: merged already
        _make_room(conn)
        report.chunks_written += len(merged)
        report.chunks_merged += len(taken)


def _merged(run: list[ChunkRow], target_points: int) -> tuple[list[EncodedChunk], list[ChunkRow]]:
    """A run's points in time order, in chunks of up to `target_points`, and the chunks they came from: a
    chunk that does not decode is left out, to stay as it is (it ended the collector in a CodecError)."""
    t_ms, q, taken = [], [], []
    for row in run:
        try:
            decoded = codec.decode(row[2])
        except codec.CodecError:
            continue
        taken.append(row)
        t_ms.extend(decoded.t_ms.tolist())
        q.extend(decoded.q.tolist())
    order = sorted(range(len(t_ms)), key=t_ms.__getitem__)
    return [EncodedChunk.of(codec.ChunkEncoder.of([t_ms[i] for i in part], [q[i] for i in part]), run[0][1])
            for part in (order[start:start + target_points] for start in range(0, len(order), target_points))], taken


def _runs_to_merge(rows: list[ChunkRow], target_points: int) -> list[list[ChunkRow]]:
    """Group time-ordered small chunks into runs of the same precision worth merging (>= 2 chunks;
    a run is closed at 16 x target_points to bound one transaction's work)."""
    runs: list[list[ChunkRow]] = []
    current: list[ChunkRow] = []
    for row in rows:
        if current and (row[1] != current[0][1] or sum(r[3] for r in current) >= 16 * target_points):
            runs.append(current)
            current = []
        current.append(row)
    runs.append(current)
    return [run for run in runs if len(run) >= 2]
