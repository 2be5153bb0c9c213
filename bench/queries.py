"""Dashboard queries over 24 h of 1 Hz data for 12 series: ours vs a plain SQLite table.

    .venv/bin/python bench/queries.py            # table + bench/results/queries.json

The 24 h (12 x 86,400 points, seeded random walks, noisy gauges, bursts and counters) are written
into a temporary store through the real writer (`Store.append`, flushed every 10 simulated
minutes), then compacted as the collector does. The same points go into a plain table
`points(series, t, v)` with an index, the obvious alternative. Both answer the dashboard's
question: min/avg/max in 500 buckets per series over the whole day and over the last hour.
"""
from __future__ import annotations

import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.codec import machine  # noqa: E402
from store import queries  # noqa: E402
from store.db import Store  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "queries.json"
DAY, BUCKETS, REPEATS = 86_400, 500, 5
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


def timed(fn) -> float:
    runs = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main() -> int:
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
    print(f"{'window':10} {'series':>6} {'points':>10} {'ours s':>8} {'plain s':>8} {'plain/ours':>10}")
    for r in rows:
        print(f"{r['window']:10} {r['series']:>6} {r['points']:>10} {r['ours_s']:>8.3f} {r['plain_s']:>8.3f} "
              f"{r['plain_over_ours']:>10.2f}")
    print(f"file size: ours {sizes['ours_bytes'] / 1e6:.2f} MB, plain table {sizes['plain_bytes'] / 1e6:.2f} MB "
          f"({sizes['plain_bytes'] / sizes['ours_bytes']:.1f}x); writing 24 h through Store took {write_s:.1f} s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "sizes": sizes, "write_s": write_s, "buckets": BUCKETS,
                                   "repeats": REPEATS, "machine": machine()}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
