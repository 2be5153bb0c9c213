"""Dashboard queries over 24 h of 1 Hz data: ours vs plain SQLite tables, side by side.

    .venv/bin/python bench/queries.py            # two tables + bench/results/queries.json

Series: 24 h of 12 series (12 x 86,400 points, seeded random walks, noisy gauges, bursts and
counters) are written into a temporary store through the real writer (`Store.append`, flushed
every 10 simulated minutes), then compacted as the collector does. The same points go into a plain
table `points(series, t, v)` with an index, the obvious alternative. Both answer the dashboard's
question: min/avg/max in 500 buckets per series over the whole day and over the last hour.

Rows: 24 h of 1 Hz cache statistics for 4 layers and activations (4 rows a second) are inserted
as `Store.flush` inserts them (executemany, a transaction per 10 simulated minutes) into a store,
where the rollup triggers fire, and into plain tables without rollups: the triggers' write cost. The Cache
page's questions (cache_stats in 60 buckets and per layer, the activation heatmap) are answered by
store.queries (rollups) and by the plain GROUP BY over the raw rows the store ran before; the
answers are checked equal, then timed.
"""
from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, write_results  # noqa: E402
from store import queries  # noqa: E402
from store.db import Store  # noqa: E402
from store.schema import ROW_TABLE  # noqa: E402

DAY, BUCKETS, REPEATS = 86_400, 500, 5
LAYERS, EXPERTS, CACHE_BUCKETS = 4, 8, 60
SERIES = ["block.vda.reads_per_s", "block.vda.read_bytes_per_s", "block.vda.util", "block.vda.r_await_s",
          "block.vda.queue_depth", "mem.available_bytes", "mem.agent.rss_bytes", "mem.agent.majflt_per_s",
          "psi.memory.some_avg10", "psi.io.some_avg10", "psi.io.some_total_us", "agent.hit_rate"]


def synthetic_day(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Plausible shapes per series kind; values are what the collector would produce."""
    n = DAY
    walk = np.cumsum(rng.normal(0, 1, n))
    bursts = (rng.random(n) < 0.05) * rng.exponential(1, n)
    return {
        "block.vda.reads_per_s": np.round(np.abs(walk) * 3 + bursts * 500, 1),
        "block.vda.read_bytes_per_s": 1024 * np.round((np.abs(walk) * 3 + bursts * 500) * 64),
        "block.vda.util": np.clip(np.round(np.abs(walk) / 200 + bursts / 3, 3), 0, 1),
        "block.vda.r_await_s": np.round(8e-5 + bursts * 1e-3, 5),
        "block.vda.queue_depth": np.round(bursts * 4, 2),
        "mem.available_bytes": 4096 * np.round(4e6 + walk * 300),
        "mem.agent.rss_bytes": 4096 * np.round(1e6 + np.abs(walk) * 50),
        "mem.agent.majflt_per_s": np.round(bursts * 200, 1),
        "psi.memory.some_avg10": np.round(bursts * 10, 2),
        "psi.io.some_avg10": np.round(np.abs(walk) / 20, 2),
        "psi.io.some_total_us": np.cumsum(rng.poisson(2000, n) * (rng.random(n) < 0.3)),
        "agent.hit_rate": np.clip(np.round(0.8 + walk / 2000, 4), 0, 1),
    }


def write_store(path: Path, t: np.ndarray, day: dict[str, np.ndarray]) -> float:
    started = time.perf_counter()
    with Store(path, autoflush_s=0) as store:
        for start in range(0, DAY, 600):
            for name, values in day.items():
                for ti, vi in zip(t[start:start + 600].tolist(), values[start:start + 600].tolist()):
                    store.append(name, ti, vi)
            store.flush()
        store.compact(now=float(t[-1]) + 2 * 3600)
    return time.perf_counter() - started


def write_plain(path: Path, t: np.ndarray, day: dict[str, np.ndarray]) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE points (series TEXT, t REAL, v REAL)")
        conn.execute("CREATE INDEX points_series_t ON points (series, t)")
        for name, values in day.items():
            conn.executemany("INSERT INTO points VALUES (?,?,?)", zip([name] * DAY, t.tolist(), values.tolist()))


def plain_series(conn: sqlite3.Connection, name: str, since: float, until: float) -> list[tuple]:
    width = (until - since) / BUCKETS
    return conn.execute(
        "SELECT MIN(CAST((t - ?) / ? AS INTEGER), ?) AS b, MIN(v), AVG(v), MAX(v) FROM points "
        "WHERE series = ? AND t BETWEEN ? AND ? GROUP BY b ORDER BY b",
        (since, width, BUCKETS - 1, name, since, until)).fetchall()


def cache_rows(rng: np.random.Generator, t: np.ndarray) -> tuple[list[tuple], list[tuple]]:
    """(cache_stats rows, activation rows) as the agent records them each second."""
    n = len(t) * LAYERS
    hits, misses = rng.integers(0, 40, n).tolist(), rng.integers(0, 12, n).tolist()
    latency = np.where(rng.random(n) < 0.1, np.nan, rng.uniform(1e-4, 2e-3, n)).tolist()
    stats, acts = [], []
    for i, ti in enumerate(t.tolist()):
        for layer in range(LAYERS):
            k = i * LAYERS + layer
            lat = None if latency[k] != latency[k] else latency[k]
            stats.append((ti, layer, hits[k], misses[k], misses[k] // 2, hits[k] // 8, misses[k] << 20, lat,
                          hits[k] // 4))
            acts.append((ti, layer, (i + layer * 3) % EXPERTS, 1 + hits[k] % 3))
    return stats, acts


PLAIN_TABLES = ROW_TABLE["cache_stats"].ddl() + ROW_TABLE["activations"].ddl()  # the store's tables, no rollups


def write_rows(path: Path, stats: list[tuple], acts: list[tuple], rollups: bool) -> float:
    """Seconds to insert the rows as the Store's flush does (executemany, one transaction per 10
    simulated minutes), into a store (its rollup triggers fire) or into plain tables."""
    if rollups:
        Store(path, autoflush_s=0).close()
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        for statement in () if rollups else PLAIN_TABLES:
            conn.execute(statement)
        started = time.perf_counter()
        for start in range(0, len(stats), 600 * LAYERS):
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(ROW_TABLE["cache_stats"].insert, stats[start:start + 600 * LAYERS])
            conn.executemany(ROW_TABLE["activations"].insert, acts[start:start + 600 * LAYERS])
            conn.execute("COMMIT")
        return time.perf_counter() - started


def plain_cache_page(conn: sqlite3.Connection, since: float, until: float) -> tuple[list, list, dict]:
    """The Cache page's three questions as plain GROUP BYs over the raw rows (the store before rollups)."""
    width = (until - since) / CACHE_BUCKETS
    sums = "SUM(hits), SUM(misses), SUM(evictions), SUM(prefetches), SUM(prefetch_hits), SUM(bytes_read)"
    over = conn.execute(f"SELECT MIN(CAST((t - ?) / ? AS INTEGER), ?) AS b, {sums} FROM cache_stats "
                        "WHERE t >= ? AND t <= ? GROUP BY b ORDER BY b",
                        (since, width, CACHE_BUCKETS - 1, since, until)).fetchall()
    layers = conn.execute(f"SELECT layer, {sums}, AVG(read_latency_s) FROM cache_stats WHERE t >= ? AND t <= ? "
                          "GROUP BY layer ORDER BY layer", (since, until)).fetchall()
    acts = {(layer, expert): n for layer, expert, n in conn.execute(
        "SELECT layer, expert, SUM(count) FROM activations WHERE t >= ? AND t <= ? GROUP BY layer, expert",
        (since, until))}
    return over, layers, acts


def ours_cache_page(conn: sqlite3.Connection, since: float, until: float) -> tuple[list, list, dict]:
    stats = queries.cache_stats(conn, since, until, CACHE_BUCKETS)
    cols = ("hits", "misses", "evictions", "prefetches", "prefetch_hits", "bytes_read")
    width = (until - since) / CACHE_BUCKETS
    over = [(round((r["t"] - since) / width), *(r[c] for c in cols)) for r in stats["over_time"]]
    layers = [(r["layer"], *(r[c] for c in cols), r["read_latency_s"]) for r in stats["per_layer"]]
    return over, layers, queries.activations(conn, since, until)


def same_answers(ours: tuple[list, list, dict], plain: tuple[list, list, dict]) -> bool:
    """Counts equal; the per-layer mean latency equal to rounding (sums in another order)."""
    (o_over, o_layers, o_acts), (p_over, p_layers, p_acts) = ours, plain
    return (o_over == p_over and o_acts == p_acts and [r[:-1] for r in o_layers] == [r[:-1] for r in p_layers]
            and np.allclose([r[-1] for r in o_layers], [r[-1] for r in p_layers], rtol=1e-12))


def rows_benchmark(tmp: Path, t: np.ndarray, rng: np.random.Generator) -> dict:
    stats, acts = cache_rows(rng, t)
    ours_path, plain_path = tmp / "rows.db", tmp / "rows-plain.db"
    write = {"ours_s": write_rows(ours_path, stats, acts, rollups=True),
             "plain_s": write_rows(plain_path, stats, acts, rollups=False), "rows": len(stats) + len(acts)}
    ours_conn = queries.connect_ro(ours_path)
    plain_conn = sqlite3.connect(f"file:{plain_path}?mode=ro", uri=True)
    rows = []
    for label, (since, until) in {"24 h": (t[0] - 0.5, t[-1]), "last 1 h": (t[-3600] - 0.5, t[-1])}.items():
        if not same_answers(ours_cache_page(ours_conn, since, until), plain_cache_page(plain_conn, since, until)):
            raise AssertionError(f"{label}: the rollup answers and the raw rows disagree")
        ours_s = timed(lambda: ours_cache_page(ours_conn, since, until))
        plain_s = timed(lambda: plain_cache_page(plain_conn, since, until))
        rows.append({"window": label, "raw_rows": int(2 * LAYERS * (until - since)), "ours_s": ours_s,
                     "plain_s": plain_s, "plain_over_ours": plain_s / ours_s})
    ours_conn.close()
    plain_conn.close()
    return {"rows": rows, "write": write, "ours_bytes": ours_path.stat().st_size,
            "plain_bytes": plain_path.stat().st_size}


def timed(fn) -> float:
    runs = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rng = np.random.default_rng(42)
    t = 1_700_000_000.0 + np.arange(DAY, dtype=np.float64)
    day = synthetic_day(rng)
    with tempfile.TemporaryDirectory() as tmp:
        ours_path, plain_path = Path(tmp) / "flashmoe.db", Path(tmp) / "plain.db"
        write_s = write_store(ours_path, t, day)
        write_plain(plain_path, t, day)
        for name in SERIES:      # both answer the same question identically
            a = queries.series(ours_path, name, t[0], t[-1], BUCKETS)
            b = plain_series(sqlite3.connect(plain_path), name, t[0], t[-1])
            if not (len(a) == len(b) and np.allclose([r[1:] for r in a], [r[1:] for r in b], rtol=1e-9)):
                raise AssertionError(f"{name}: ours and the plain table disagree")
        ours_conn = queries.connect_ro(ours_path)
        plain_conn = sqlite3.connect(f"file:{plain_path}?mode=ro", uri=True)
        windows = {"24 h": (t[0], t[-1]), "last 1 h": (t[-3600], t[-1])}
        rows = []
        for label, (since, until) in windows.items():
            ours_s = timed(lambda: [queries.series(ours_conn, n, since, until, BUCKETS) for n in SERIES])
            plain_s = timed(lambda: [plain_series(plain_conn, n, since, until) for n in SERIES])
            rows.append({"window": label, "series": len(SERIES), "points": int(len(SERIES) * (until - since + 1)),
                         "ours_s": ours_s, "plain_s": plain_s, "plain_over_ours": plain_s / ours_s})
        sizes = {"ours_bytes": ours_path.stat().st_size, "plain_bytes": plain_path.stat().st_size}
        ours_conn.close()
        plain_conn.close()
        cache = rows_benchmark(Path(tmp), t, rng)
    print(f"{'window':10} {'series':>6} {'points':>10} {'ours s':>8} {'plain s':>8} {'plain/ours':>10}")
    for r in rows:
        print(f"{r['window']:10} {r['series']:>6} {r['points']:>10} {r['ours_s']:>8.3f} {r['plain_s']:>8.3f} "
              f"{r['plain_over_ours']:>10.2f}")
    print(f"file size: ours {sizes['ours_bytes'] / 1e6:.2f} MB, plain table {sizes['plain_bytes'] / 1e6:.2f} MB "
          f"({sizes['plain_bytes'] / sizes['ours_bytes']:.1f}x); writing 24 h through Store took {write_s:.1f} s")
    print(f"\nCache page: cache_stats ({CACHE_BUCKETS} buckets + per layer) and activations, {LAYERS} layers at 1 Hz")
    print(f"{'window':10} {'raw rows':>10} {'ours s':>8} {'plain s':>8} {'plain/ours':>10}")
    for r in cache["rows"]:
        print(f"{r['window']:10} {r['raw_rows']:>10} {r['ours_s']:>8.3f} {r['plain_s']:>8.3f} "
              f"{r['plain_over_ours']:>10.1f}")
    w = cache["write"]
    print(f"inserting the {w['rows']:,} rows as Store.flush does: with the rollup triggers {w['ours_s']:.1f} s "
          f"({1e6 * w['ours_s'] / w['rows']:.1f} us/row), plain tables {w['plain_s']:.1f} s "
          f"({1e6 * w['plain_s'] / w['rows']:.1f} us/row); file size ours {cache['ours_bytes'] / 1e6:.1f} MB, "
          f"plain {cache['plain_bytes'] / 1e6:.1f} MB")
    write_results("queries", {"rows": rows, "sizes": sizes, "write_s": write_s, "buckets": BUCKETS,
                              "cache_page": cache, "repeats": REPEATS, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
