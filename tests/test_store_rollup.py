"""Per-minute rollups: what the queries answer through them equals grouping the raw rows.

The reference is the plain SQL the store used before the rollups (GROUP BY over every raw row in
the window). Windows and bucket counts come from hypothesis, so bucket edges land on, between and
next to minute edges; the rows have fractional times, rows exactly on minute edges, NULL
latencies and several layers.
"""
from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from store import queries, rollup
from store.db import Store
from store.schema import ROLLUPS

T0 = 1_700_000_040.0            # a minute edge
SPAN_S = 3 * 3600
LAYERS = 3


def write_rows(path: Path, seed: int = 7) -> None:
    """SPAN_S of irregular ~1 Hz rows: jittered times, some exactly on minute edges."""
    rng = np.random.default_rng(seed)
    t = T0 + np.sort(rng.uniform(0, SPAN_S, SPAN_S))
    t[::97] = np.round(t[::97] / 60) * 60
    with Store(path, autoflush_s=0, max_held_rows=10**7) as store:
        for i, ti in enumerate(t.tolist()):
            for layer in range(LAYERS):
                latency = None if (i + layer) % 5 == 0 else float(rng.uniform(1e-4, 1e-3))
                store.record_cache_stats(ti, layer, hits=int(rng.integers(0, 20)), misses=int(rng.integers(0, 9)),
                                         evictions=int(rng.integers(0, 3)), prefetch_hits=int(rng.integers(0, 2)),
                                         bytes_read=int(rng.integers(0, 1 << 24)), read_latency_s=latency,
                                         prefetches=None if (i + layer) % 7 == 0 else int(rng.integers(0, 4)))
            store.record_activations(ti, {(layer, int(rng.integers(0, 8))): int(rng.integers(1, 4))
                                          for layer in range(LAYERS)})


def raw_cache_stats(conn: sqlite3.Connection, since: float, until: float, buckets: int) -> list[tuple]:
    """(bucket, layer, hits, misses, evictions, prefetches, prefetch_hits, bytes_read, latency sum, latency n,
    prefetch hits of the rows that counted their prefetches)."""
    width = max((until - since) / buckets, 1e-3)
    return conn.execute(
        "SELECT MIN(CAST((t - ?) / ? AS INTEGER), ?) AS b, layer, SUM(hits), SUM(misses), SUM(evictions), "
        "COALESCE(SUM(prefetches), 0), SUM(prefetch_hits), SUM(bytes_read), TOTAL(read_latency_s), "
        "COUNT(read_latency_s), TOTAL(prefetch_hits) FILTER (WHERE prefetches IS NOT NULL) "
        "FROM cache_stats WHERE t >= ? AND t <= ? GROUP BY b, layer ORDER BY b, layer",
        (since, width, buckets - 1, since, until)).fetchall()


def raw_activations(conn: sqlite3.Connection, since: float, until: float) -> dict[tuple[int, int], int]:
    return {(layer, expert): n for layer, expert, n in conn.execute(
        "SELECT layer, expert, SUM(count) FROM activations WHERE t >= ? AND t <= ? GROUP BY layer, expert",
        (since, until))}


def rollup_rows(conn: sqlite3.Connection, r: rollup.Rollup) -> list[tuple]:
    return conn.execute(f"SELECT * FROM {r.table} ORDER BY minute, {', '.join(r.keys)}").fetchall()


def assert_same_rows(kept: list[tuple], rebuilt: list[tuple]) -> None:
    """Counts exactly; REAL sums (latency) to rounding, as deletes subtract what inserts added."""
    assert len(kept) == len(rebuilt) > 0
    for a, b in zip(kept, rebuilt):
        assert [v for v in a if not isinstance(v, float)] == [v for v in b if not isinstance(v, float)]
        assert [v for v in a if isinstance(v, float)] == pytest.approx([v for v in b if isinstance(v, float)],
                                                                       rel=1e-9, abs=1e-15)


def rebuilt_rows(conn: sqlite3.Connection, r: rollup.Rollup) -> list[tuple]:
    """The rollup as a fresh backfill from the raw rows would make it."""
    conn.execute(f"CREATE TEMP TABLE fresh AS SELECT * FROM {r.table} WHERE 0")
    conn.execute(r.backfill().replace(f"INSERT INTO {r.table}", "INSERT INTO temp.fresh"))
    rows = conn.execute(f"SELECT * FROM temp.fresh ORDER BY minute, {', '.join(r.keys)}").fetchall()
    conn.execute("DROP TABLE temp.fresh")
    return rows


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rollup") / "flashmoe.db"
    write_rows(path)
    return path


def test_the_rollups_equal_a_fresh_grouping_of_the_raw_rows(db):
    with sqlite3.connect(db) as conn:
        for r in ROLLUPS:
            assert_same_rows(rollup_rows(conn, r), rebuilt_rows(conn, r))
        assert conn.execute("SELECT SUM(n_rows) FROM cache_stats_1m").fetchone() == (SPAN_S * LAYERS,)


windows = st.tuples(st.floats(-120, SPAN_S + 120), st.floats(0, SPAN_S + 240),
                    st.sampled_from([0.0, 0.5, 0.999, 59.5]))


def window_of(start: float, length: float, snap: float) -> tuple[float, float]:
    """A window from hypothesis; `snap` puts the start on a minute edge (0) or just off one."""
    since = T0 + (math.floor(start / 60) * 60 + snap if snap else start)
    return since, since + length


@settings(max_examples=60, deadline=None)
@given(window=windows, buckets=st.sampled_from([1, 2, 7, 60, 240, 500]))
def test_cache_stats_through_the_rollup_equal_the_raw_rows(db, window, buckets):
    since, until = window_of(*window)
    got = queries.cache_stats(db, since, until, buckets)
    with sqlite3.connect(db) as conn:
        want = raw_cache_stats(conn, since, until, buckets)
    if not want:
        assert got == {"over_time": [], "per_layer": [], "total": None}
        return
    width = max((until - since) / buckets, 1e-3)
    by_bucket: dict[int, np.ndarray] = {}
    by_layer: dict[int, np.ndarray] = {}
    for b, layer, *sums in want:
        by_bucket[b] = by_bucket.get(b, 0) + np.array(sums, dtype=object)
        by_layer[layer] = by_layer.get(layer, 0) + np.array(sums, dtype=object)
    assert [row["t"] for row in got["over_time"]] == [since + b * width for b in by_bucket]
    for rows, reference in ((got["over_time"], by_bucket), (got["per_layer"], by_layer)):
        assert len(rows) == len(reference)
        for row, sums in zip(rows, reference.values()):
            hits, misses, evictions, prefetches, prefetch_hits, bytes_read, latency_sum, latency_n, counted = sums
            assert (row["hits"], row["misses"], row["evictions"], row["prefetches"], row["prefetch_hits"],
                    row["bytes_read"]) == (hits, misses, evictions, prefetches, prefetch_hits, bytes_read)
            assert row["hit_rate"] == (hits / (hits + misses) if hits + misses else None)
            assert row["prefetch_accuracy"] == (counted / prefetches if prefetches else None)
            if latency_n:
                assert row["read_latency_s"] == pytest.approx(latency_sum / latency_n, rel=1e-12)
            else:
                assert row["read_latency_s"] is None
    assert [row["layer"] for row in got["per_layer"]] == list(by_layer)
    assert got["total"]["hits"] == sum(row["hits"] for row in got["per_layer"])


@settings(max_examples=40, deadline=None)
@given(window=windows)
def test_activations_through_the_rollup_equal_the_raw_rows(db, window):
    since, until = window_of(*window)
    with sqlite3.connect(db) as conn:
        assert queries.activations(db, since, until) == raw_activations(conn, since, until)


def test_the_whole_history_without_a_window(db):
    with sqlite3.connect(db) as conn:
        first, last = conn.execute("SELECT MIN(t), MAX(t) FROM activations").fetchone()
        assert queries.activations(db) == raw_activations(conn, first, last)
        per_layer = {row[1]: row[2] for row in raw_cache_stats(conn, first, last, 1)}
    assert {r["layer"]: r["hits"] for r in queries.cache_stats(db)["per_layer"]} == per_layer


def test_a_long_window_reads_the_rollup_and_only_the_minutes_at_bucket_edges_raw():
    since = T0 + 0.37
    plan = rollup._plan(since, since + 86_400, 86_400 / 60, 59)
    whole = sum(b - a + 1 for a, b, _ in plan.whole)
    raw_s = sum(t_hi - t_lo for t_lo, t_hi, _, _ in plan.edges)
    assert whole >= 1440 - 2 * 61                  # all but the minutes at the 61 bucket edges
    assert raw_s <= 61 * 2 * (60 + 2 * rollup.MARGIN_S)
    assert sorted({b for _, _, b in plan.whole}) == list(range(60))


def test_retention_and_deletes_keep_the_rollups_equal_to_the_raw_rows(tmp_path):
    path = tmp_path / "flashmoe.db"
    write_rows(path, seed=11)
    with Store(path, autoflush_s=0) as store:
        store.compact(retention_days=3600.5 / 86400, now=T0 + SPAN_S - 1234.25)   # the cut lands inside a minute
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM activations WHERE layer = 1 AND t < ?", (T0 + SPAN_S - 600,))
        conn.commit()
        for r in ROLLUPS:
            assert_same_rows(rollup_rows(conn, r), rebuilt_rows(conn, r))
        first = conn.execute("SELECT MIN(t) FROM cache_stats").fetchone()[0]
        assert first >= T0 + SPAN_S - 1234.25 - 3600.5
        assert queries.activations(path) == raw_activations(conn, first, T0 + SPAN_S)


def test_raw_rows_are_append_only(db):
    with sqlite3.connect(db) as conn:
        for table in ("cache_stats", "activations"):
            with pytest.raises(sqlite3.IntegrityError, match=f"{table} rows are append-only"):
                conn.execute(f"UPDATE {table} SET layer = 0 WHERE rowid = 1")
