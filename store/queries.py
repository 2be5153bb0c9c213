"""Read-only queries over the telemetry store, for the dashboard, the agent and the CLI.

Every function takes `db` first: a path to the store file, or an open connection (e.g. from
`connect_ro`, to reuse one across calls). A path is opened read-only (`mode=ro` URI), so a reader
can never write or lock out the writers.

A store file that does not exist yet (the collector and agent have not started), or is still
empty (a writer is creating it), is not an error: every query then returns its empty result (`[]`, `{}` or `None`). A
file that exists but is not a FlashMoE store raises `StoreError` naming the file.

Times are Unix seconds; `since` / `until` of None mean "from the first" / "to the last" record.
"""
from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from store import codec, rollup
from store.database import (advice_for, foreign, is_busy, no_room, not_a_file, place_problem,
                            stored_schema_version, table_names)
from store.errors import StoreError
from store.migrations import version_problem
from store.schema import ACTIVATIONS_ROLLUP, CACHE_STATS_ROLLUP, ROW_TABLES, SCHEMA_VERSION

Db = str | Path | sqlite3.Connection
Bucket = tuple[float, float, float, float]     # (bucket start t, min, avg, max)


def connect_ro(path: str | Path, setting: str = "--db") -> sqlite3.Connection | None:
    """A read-only connection to the store at path, or None if the file does not exist yet. `setting`
    is what the reader's user sets to choose the store (the CLI's --db, the dashboard's FLASHMOE_DB)."""
    path = Path(path)
    if not path.exists():
        return None
    advice = f"point {setting} at the file the collector and agent write (e.g. data/flashmoe.db)"
    if not path.is_file():   # before SQLite: a directory is a "disk I/O error", /dev/null empty, a pipe a hang
        raise StoreError(f"{path} is {not_a_file(path)}, not a store file; {advice}")
    try:
        conn = _open_ro(path)
        tables = table_names(conn)
        problem = foreign(conn)
    except sqlite3.DatabaseError as e:
        # a writer creating the file, descheduled under load; a full disk, where SQLite cannot make the log's
        # index beside the store: neither is a file that is no store
        if is_busy(e) or no_room(path):
            raise StoreError(f"cannot read {path} yet ({e}): {advice_for(e, path)}") from e
        raise StoreError(f"{path} is not a readable FlashMoE store ({e}); {advice}") from e
    if problem is None and tables and not {"meta", "chunks"} <= tables:
        problem = f"an SQLite file without the store's tables (tables: {', '.join(sorted(tables))})"
    if problem is not None:
        conn.close()
        raise StoreError(f"{path} is not a FlashMoE store: {problem}; {advice}")
    if not tables:            # just created by a writer that has not yet made the schema
        conn.close()
        return None
    try:
        version = stored_schema_version(conn, path)
    except StoreError:
        conn.close()
        raise
    if version != SCHEMA_VERSION:
        conn.close()
        raise StoreError(version_problem(path, version)
                         or f"{path} has store schema version {version}, this reader needs {SCHEMA_VERSION}: start "
                            f"the agent or the collector on it, or run `flashmoe-cli store compact --db {path}`, to "
                            f"upgrade it in place")
    return conn


def _open_ro(path: Path) -> sqlite3.Connection:
    """mode=ro; on a read-only place with no write-ahead log left, immutable=1: a WAL-mode reader must
    create the -shm file next to the store otherwise, and nothing there can change under it."""
    uri = f"file:{path.resolve()}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=2.0, check_same_thread=False)
    try:
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1")
        return conn
    except sqlite3.OperationalError:
        conn.close()
        if place_problem(path) is None or Path(f"{path}-wal").exists():
            raise
    return sqlite3.connect(uri + "&immutable=1", uri=True, timeout=2.0, check_same_thread=False)


@contextmanager
def _reader(db: Db) -> Iterator[sqlite3.Connection | None]:
    """A connection to read with (`db` itself when it is one); a damaged file read through it is a StoreError
    that says so (it was sqlite3's "database disk image is malformed" and a traceback)."""
    conn = db if isinstance(db, sqlite3.Connection) else connect_ro(db)
    try:
        yield conn
    except _Damaged as e:
        path = _path(conn)
        raise StoreError(f"{path} holds {e.what}; {e.reads_again} once it is gone ({e.lost} either way): "
                         f"`sqlite3 {path} 'DELETE FROM {e.table} WHERE id = {e.id}'`") from None
    except sqlite3.DatabaseError as e:
        path = _path(conn)
        if is_busy(e):
            raise StoreError(f"cannot read {path} yet ({e}): {advice_for(e, Path(path))}") from e
        raise damaged(path, str(e)) from e
    finally:
        if conn is not None and conn is not db:
            conn.close()


def _path(conn: sqlite3.Connection) -> str:
    return next(file for _, name, file in conn.execute("PRAGMA database_list") if name == "main")


class _Damaged(Exception):
    """A row of `table` whose values mean nothing, though SQLite finds its pages whole (it checks their structure,
    not what a value says): a chunk the codec refuses, a knob change without a JSON value."""

    def __init__(self, what: str, table: str, row_id: int, reads_again: str, lost: str) -> None:
        super().__init__(what)
        self.what, self.table, self.id, self.reads_again, self.lost = what, table, row_id, reads_again, lost


def _decode(chunk_id: int, series: str, n_points: int, data: bytes) -> codec.Decoded:
    """A chunk's points, read inside `_reader`, which names the damaged one and how to remove it (the codec's
    error, a ValueError, was a traceback on the dashboard's pages and "--since/--until: …" in `store export`)."""
    try:
        return codec.decode(data)
    except codec.CodecError as e:
        raise _Damaged(f"a damaged chunk of {series} (chunk id {chunk_id}, {n_points} points: {e})", "chunks",
                       chunk_id, "the series reads again", "its points are lost") from None


def damaged(path: str | Path, problem: str) -> StoreError:
    return StoreError(f"{path} is damaged ({problem}): `sqlite3 {path} .recover > saved.sql` saves what can be read; "
                      f"move the file aside to start a new store")


def _dicts(conn: sqlite3.Connection, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
    cur = conn.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _rows(db: Db, sql: str, params: Sequence[Any] = (), each: Callable[[dict[str, Any]], Any] | None = None) -> list:
    """The rows of `sql` as dicts, or what `each` makes of each (inside `_reader`: it names a damaged one)."""
    with _reader(db) as conn:
        rows = [] if conn is None else _dicts(conn, sql, params)
        return rows if each is None else [each(row) for row in rows]


def _window(since: float | None, until: float | None) -> tuple[float, float]:
    if since is not None and until is not None and until < since:
        raise ValueError(f"until ({until}) is before since ({since}); pass the window oldest first")
    return (-np.inf if since is None else since), (np.inf if until is None else until)


# --- series -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SeriesInfo:
    """One series as declared, with what the store holds of it."""
    name: str
    unit: str
    kind: str
    precision: float
    description: str
    chunks: int
    points: int
    encoded_bytes: int
    t_first: float | None
    t_last: float | None

    @property
    def bytes_per_point(self) -> float:
        return self.encoded_bytes / self.points if self.points else 0.0


def series_info(db: Db) -> list[SeriesInfo]:
    """Every declared series with its chunk count, points, encoded bytes and time span."""
    rows = _rows(db, """
        SELECT s.name, s.unit, s.kind, s.precision, s.description, COUNT(c.id) AS chunks,
               COALESCE(SUM(c.n_points), 0) AS points, COALESCE(SUM(LENGTH(c.data)), 0) AS encoded_bytes,
               MIN(c.t_start) AS t_first, MAX(c.t_end) AS t_last
        FROM series s LEFT JOIN chunks c ON c.series_id = s.id GROUP BY s.id ORDER BY s.name""")
    return [SeriesInfo(**row) for row in rows]


def series_names(db: Db) -> list[str]:
    """Names of the series that hold at least one point, sorted."""
    return [info.name for info in series_info(db) if info.points]


def points(db: Db, name: str, since: float | None = None,
           until: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All decoded points of a series in [since, until], sorted by time: (t seconds, values)."""
    lo, hi = _window(since, until)
    with _reader(db) as conn:
        if conn is None:
            return np.empty(0), np.empty(0)
        chunks = conn.execute(
            "SELECT c.id, c.n_points, c.precision, c.data FROM chunks c JOIN series s ON s.id = c.series_id "
            "WHERE s.name = ? AND c.t_end >= ? AND c.t_start <= ? ORDER BY c.t_start",
            (name, lo, hi)).fetchall()
        decoded = [(_decode(chunk_id, name, n, data), precision) for chunk_id, n, precision, data in chunks]
    if not chunks:
        return np.empty(0), np.empty(0)
    t = np.concatenate([d.t_ms for d, _ in decoded]) / 1000.0
    v = np.concatenate([fixed_to_values(d.q, p) for d, p in decoded])
    keep = (t >= lo) & (t <= hi)
    t, v = t[keep], v[keep]
    order = np.argsort(t, kind="stable")
    return t[order], v[order]


def fixed_to_values(q: np.ndarray, precision: float) -> np.ndarray:
    """Values of the codec's fixed-point integers, without binary noise in the last digits."""
    values = q * precision
    if precision < 1:      # undo binary noise such as 0.1 * 3 = 0.30000000000000004
        values = np.round(values, int(np.ceil(-np.log10(precision))) + 1)
    return values


def series(db: Db, name: str, since: float | None = None, until: float | None = None,
           buckets: int = 500) -> list[Bucket]:
    """A series downsampled to at most `buckets` equal time buckets over [since, until]:
    (bucket start, min, avg, max) for each bucket that holds points, oldest first."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, not {buckets}")
    t, v = points(db, name, since, until)
    if not len(t):
        return []
    start = t[0] if since is None else since
    end = t[-1] if until is None else until
    width = max((end - start) / buckets, 1e-3)
    index = np.minimum(((t - start) // width).astype(np.int64), buckets - 1)
    # t is sorted, so each bucket's points are one contiguous run
    firsts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
    counts = np.diff(np.r_[firsts, len(t)])
    mins = np.minimum.reduceat(v, firsts)
    maxs = np.maximum.reduceat(v, firsts)
    avgs = np.add.reduceat(v, firsts) / counts
    starts = start + index[firsts] * width
    return list(zip(starts.tolist(), mins.tolist(), avgs.tolist(), maxs.tolist()))


def latest(db: Db, name: str) -> tuple[float, float] | None:
    """The most recent (t, value) of a series, or None if it has no points."""
    with _reader(db) as conn:
        if conn is None:
            return None
        row = conn.execute(
            "SELECT c.id, c.n_points, c.precision, c.data FROM chunks c JOIN series s ON s.id = c.series_id "
            "WHERE s.name = ? ORDER BY c.t_end DESC LIMIT 1", (name,)).fetchone()
        if row is None:
            return None
        decoded = _decode(row[0], name, row[1], row[3])
    i = int(np.argmax(decoded.t_ms))
    return float(decoded.t_ms[i]) / 1000.0, float(fixed_to_values(decoded.q[i:i + 1], row[2])[0])


# --- rows ---------------------------------------------------------------------------------
def requests(db: Db, since: float | None = None, until: float | None = None) -> list[dict[str, Any]]:
    """Finished requests in [since, until], oldest first, one dict per row (columns as recorded)."""
    lo, hi = _window(since, until)
    return _rows(db, "SELECT * FROM requests WHERE t >= ? AND t <= ? ORDER BY t", (lo, hi))


def _span(conn: sqlite3.Connection, table: str, since: float | None,
          until: float | None) -> tuple[float, float] | None:
    """The [since, until] window with open ends closed at the table's first/last row."""
    window = _window(since, until)     # two subqueries: each a single index probe, not a range scan
    lo, hi = conn.execute(f"SELECT (SELECT MIN(t) FROM {table} WHERE t >= ? AND t <= ?), "
                          f"(SELECT MAX(t) FROM {table} WHERE t >= ? AND t <= ?)", window + window).fetchone()
    if lo is None:
        return None
    return (lo if since is None else since), (hi if until is None else until)


def latency_quantiles(db: Db, since: float | None = None, until: float | None = None,
                      buckets: int = 60, qs: Sequence[float] = (0.5, 0.95, 0.99)) -> list[dict[str, Any]]:
    """Per time bucket: {"t", "n", "ttft_s", "tpot_s", "latency_s"}, each of the last three a
    dict {q: value} over the requests in that bucket (None where no request had that value)."""
    with _reader(db) as conn:
        if conn is None or (span := _span(conn, "requests", since, until)) is None:
            return []
        rows = conn.execute("SELECT t, ttft_s, tpot_s, latency_s FROM requests WHERE t >= ? AND t <= ? "
                            "ORDER BY t", span).fetchall()
    data = np.array(rows, dtype=np.float64)          # NULL becomes NaN
    width = max((span[1] - span[0]) / buckets, 1e-3)
    index = np.minimum(((data[:, 0] - span[0]) // width).astype(np.int64), buckets - 1)
    out = []
    for b in np.unique(index):
        group = data[index == b]
        entry: dict[str, Any] = {"t": span[0] + int(b) * width, "n": len(group)}
        for col, name in ((1, "ttft_s"), (2, "tpot_s"), (3, "latency_s")):
            values = group[:, col][~np.isnan(group[:, col])]
            entry[name] = {q: (float(np.quantile(values, q)) if len(values) else None) for q in qs}
        out.append(entry)
    return out


_CACHE_COUNTERS = ("hits", "misses", "evictions", "prefetches", "prefetch_hits", "bytes_read")


def _cache_row(cells: list[dict[str, Any]], **head: Any) -> dict[str, Any]:
    """Rollup cells summed into one row: the counters, hit_rate, reads_per_lookup (misses and
    prefetches over lookups: a hit on a block prefetch brought in was read too, ahead of time; rows
    from before prefetches were recorded count their misses only), prefetch_accuracy (prefetched
    experts later used, over experts prefetched, from the rows that recorded prefetches) and
    read_latency_s (mean of the recorded ones); a ratio is None where its denominator is 0."""
    row = head | {c: sum(cell[c] for cell in cells) for c in _CACHE_COUNTERS}
    lookups = row["hits"] + row["misses"]
    latency_n = sum(cell["latency_n"] for cell in cells)
    counted_hits = sum(cell["counted_prefetch_hits"] for cell in cells)
    return row | {"hit_rate": row["hits"] / lookups if lookups else None,
                  "reads_per_lookup": (row["misses"] + row["prefetches"]) / lookups if lookups else None,
                  "prefetch_accuracy": counted_hits / row["prefetches"] if row["prefetches"] else None,
                  "read_latency_s": sum(cell["latency_sum"] for cell in cells) / latency_n if latency_n else None}


def _grouped(cells: list[dict[str, Any]], key: str) -> dict[Any, list[dict[str, Any]]]:
    groups: dict[Any, list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault(cell[key], []).append(cell)
    return dict(sorted(groups.items()))


def cache_stats(db: Db, since: float | None = None, until: float | None = None,
                buckets: int = 60) -> dict[str, Any]:
    """Cache counters (hits, misses, evictions, prefetches recorded, prefetch_hits, bytes_read) with
    hit_rate, prefetch_accuracy and read_latency_s: summed over all layers per time bucket
    ("over_time": rows with "t", the bucket start), per layer over the window ("per_layer": rows
    with "layer"), and over everything ("total": one row, None when the window holds no rows).
    Summed in SQLite, through the per-minute rollup for long windows (store.rollup)."""
    empty: dict[str, Any] = {"over_time": [], "per_layer": [], "total": None}
    with _reader(db) as conn:
        if conn is None or (span := _span(conn, "cache_stats", since, until)) is None:
            return empty
        width = max((span[1] - span[0]) / buckets, 1e-3)
        cells = _dicts(conn, *rollup.sums_query(CACHE_STATS_ROLLUP, span[0], span[1], width, buckets - 1))
    if not cells:
        return empty
    return {"over_time": [_cache_row(group, t=span[0] + b * width) for b, group in _grouped(cells, "bucket").items()],
            "per_layer": [_cache_row(group, layer=layer) for layer, group in _grouped(cells, "layer").items()],
            "total": _cache_row(cells)}


def activations(db: Db, since: float | None = None, until: float | None = None) -> dict[tuple[int, int], int]:
    """Routing counts per (layer, expert) summed over [since, until] (for the heatmap)."""
    with _reader(db) as conn:
        if conn is None or (span := _span(conn, "activations", since, until)) is None:
            return {}
        cells = _dicts(conn, *rollup.sums_query(ACTIVATIONS_ROLLUP, span[0], span[1], max(span[1] - span[0], 1e-3), 0))
    return {(c["layer"], c["expert"]): c["count"] for c in cells}


def _knob_row(row: dict[str, Any]) -> dict[str, Any]:
    """A knob change with its values decoded, read inside `_reader`, which names a damaged one."""
    try:
        return {**row, "old": json.loads(row["old"]) if row["old"] is not None else None,
                "new": json.loads(row["new"])}
    except (TypeError, ValueError):    # a NULL or a value that is no JSON (the agent writes only json.dumps)
        raise _Damaged(f"a damaged knob change (knob_changes id {row['id']}, {row['knob']}: old {row['old']!r:.40}, "
                       f"new {row['new']!r:.40})", "knob_changes", row["id"], "the knobs' history reads again",
                       "that change is lost") from None


def lost(db: Db) -> dict[str, int]:
    """Points and rows the writers lost to write failures (a backlog over its bound, or still
    unwritten when the writer closed), since the store was created: {"points": n, "rows": m}."""
    rows = {r["key"]: int(r["value"]) for r in _rows(db, "SELECT key, value FROM meta WHERE key IN "
                                                         "('lost_points', 'lost_rows')")}
    return {"points": rows.get("lost_points", 0), "rows": rows.get("lost_rows", 0)}


def total(db: Db, name: str, since: float | None = None, until: float | None = None) -> int:
    """The sum of a series of counts over [since, until]."""
    return int(points(db, name, since, until)[1].sum())


def missed_samples(db: Db, since: float | None = None, until: float | None = None) -> int:
    """Ticks the collector was too late for in [since, until] (collector.missed_samples): each is a
    sample of every collector series that was never taken."""
    return total(db, "collector.missed_samples", since, until)


def unserved(db: Db, since: float | None = None, until: float | None = None) -> dict[str, int]:
    """Requests that ended unanswered in [since, until] by reason: "failed" (an error in their step), "refused"
    (the queue full, or the agent stopping) and "abandoned" (the client went away first), from
    agent.requests_<reason>."""
    return {reason: total(db, f"agent.requests_{reason}", since, until)
            for reason in ("failed", "refused", "abandoned")}


def knob_history(db: Db, limit: int = 100) -> list[dict[str, Any]]:
    """The latest knob changes, newest first: {"id", "t", "knob", "old", "new", "source"}."""
    return _rows(db, "SELECT * FROM knob_changes ORDER BY t DESC, id DESC LIMIT ?", (limit,), each=_knob_row)


def latest_knobs(db: Db) -> dict[str, Any]:
    """Each knob's most recent value (what the agent restores on restart)."""
    rows = _rows(db, "SELECT k.* FROM knob_changes k JOIN (SELECT knob, MAX(id) AS id FROM knob_changes "
                     "GROUP BY knob) last ON last.id = k.id ORDER BY k.knob", each=_knob_row)
    return {r["knob"]: r["new"] for r in rows}


def events(db: Db, since: float | None = None, kind: str | None = None) -> list[dict[str, Any]]:
    """Events since `since`, oldest first: {"id", "t", "kind", "message"}; optionally one kind."""
    lo, _ = _window(since, None)
    if kind is None:
        return _rows(db, "SELECT * FROM events WHERE t >= ? ORDER BY t, id", (lo,))
    return _rows(db, "SELECT * FROM events WHERE t >= ? AND kind = ? ORDER BY t, id", (lo, kind))


def disk_readers(db: Db, device: str, since: float, until: float) -> list[dict[str, Any]]:
    """The other processes the collector found reading `device` (the agent's disk) in [since, until],
    oldest first: {"t", "device", "pid", "name", "read_bytes_per_s"}."""
    return _rows(db, "SELECT * FROM disk_readers WHERE device = ? AND t >= ? AND t <= ? ORDER BY t, pid",
                 (device, since, until))


def simulations(db: Db) -> list[dict[str, Any]]:
    """Simulator results, oldest first: {"t", "trace", "policy", "capacity", "scope", "hit_rate"}."""
    return _rows(db, "SELECT * FROM simulations ORDER BY t")


def sweeps(db: Db) -> list[dict[str, Any]]:
    """Cache-cap sweep points, oldest first: {"t", "cache_cap_bytes", "tokens_per_s", "hit_rate"}."""
    return _rows(db, "SELECT * FROM sweeps ORDER BY t, cache_cap_bytes")


# --- the store as a whole (flashmoe-cli store) ----------------------------------------------
def stats(db: str | Path) -> dict[str, Any]:
    """Per series: points, chunks, encoded bytes and bytes per point; the row count of every row
    table; totals and the file's size. Raises StoreError if there is no store at `db` or it is damaged
    anywhere: the counts alone read little of it (a row table's COUNT(*) reads its index), and missed
    a damaged table."""
    with _reader(db) as conn:
        if conn is None:
            raise StoreError(f"there is no store at {db}; start `flashmoe-cli collect --db {db}` "
                             f"or the agent to create it")
        problem = _quick_check(conn)
        if problem is not None:
            raise damaged(db, problem)
        series = [asdict(info) | {"bytes_per_point": round(info.bytes_per_point, 3)} for info in series_info(conn)]
        rows = {t.name: conn.execute(f"SELECT COUNT(*) FROM {t.name}").fetchone()[0] for t in ROW_TABLES}
    points = sum(s["points"] for s in series)
    encoded = sum(s["encoded_bytes"] for s in series)
    return {"db": str(db), "file_bytes": Path(db).stat().st_size, "series": series, "rows": rows,
            "points": points, "encoded_bytes": encoded,
            "bytes_per_point": round(encoded / points, 3) if points else 0.0}


def _quick_check(conn: sqlite3.Connection) -> str | None:
    """SQLite's quick_check of every page (the b-trees, not index against table) on one line, naming the tables
    and indexes whose root page it faults; None when the file is sound."""
    found = [line for (text,) in conn.execute("PRAGMA quick_check(2)") for line in text.splitlines()
             if not line.startswith("***")]
    if found == ["ok"]:
        return None
    pages = {int(page) for page in re.findall(r"tree page (\d+)", " ".join(found))}
    names = [f"{kind} {name}" for kind, name, root in conn.execute("SELECT type, name, rootpage FROM sqlite_master")
             if root in pages]
    return (f"{', '.join(names)}: " if names else "") + "; ".join(found)


def export(db: str | Path, series: str, since: float | None = None, until: float | None = None,
           csv: bool = False) -> Iterator[str]:
    """The decoded points of one series as lines: JSON objects {"t", "value"}, or CSV under a
    header `t,value`. Raises StoreError if there is no store at `db` or the series has no points."""
    with _reader(db) as conn:
        if conn is None:
            raise StoreError(f"there is no store at {db}; check --db")
        names = series_names(conn)
        if series not in names:
            raise StoreError(f"series {series!r} has no points in {db}; series with points: "
                             f"{', '.join(names) or 'none'}")
        t, values = points(conn, series, since, until)
    pairs = zip(t.tolist(), values.tolist())
    if csv:
        yield "t,value\n"
        yield from (f"{a!r},{b!r}\n" for a, b in pairs)
    else:
        yield from (json.dumps({"t": a, "value": b}) + "\n" for a, b in pairs)
