"""Benchmark: each dashboard page's first full render over 24 h of 1 Hz telemetry.

Writes 24 h of 1 Hz samples for every series the pages chart (collector and agent series, plus
request, cache-statistics and activation rows) through the real Store and compacts it as the
collector does every hour, then renders each page
with Streamlit's AppTest on the "24 h" window, data caches cleared before each page so every
query really runs. The agent is offline (closed port), as it would be when looking at history.
Goal (issue 12): every page <= 1 s on this machine.

    .venv/bin/python bench/dashboard.py [--hours 24] [--db PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file would shadow the `dashboard` package it measures: the repo, not bench/, goes on the path.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import streamlit as st  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

from bench.common import machine, write_results  # noqa: E402
from bench import synthetic  # noqa: E402
from dashboard import pages  # noqa: E402
from store.db import Store  # noqa: E402

APP = str(ROOT / "dashboard" / "app.py")
GOAL_S = 1.0


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill(db: Path, hours: float) -> dict[str, float]:
    """Write the telemetry, then compact as the collector does every hour (steady state)."""
    seconds = int(hours * 3600)
    start = time.perf_counter()
    synthetic.write(str(db), synthetic.Spec(start=time.time() - seconds, seconds=seconds))
    with Store(db, autoflush_s=0) as store:
        store.compact()
    n_series = len(synthetic.series_at(0, memory="healthy", smart=True))
    return {"seconds": seconds, "series": n_series, "points": seconds * n_series,
            "write_s": time.perf_counter() - start, "db_bytes": db.stat().st_size}


def render(page: pages.Page) -> tuple[float, float, int]:
    """(wall seconds and CPU seconds of the page's first full render with cold data caches, charts)."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.session_state["window"] = "24 h"
    at.run()                               # imports and the app shell are warm, as in a running server
    st.cache_data.clear()
    start, cpu = time.perf_counter(), time.process_time()   # CPU of every thread: load-independent
    if page.default:
        at.run()
    else:
        at.switch_page(page.path).run()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if at.exception:
        raise RuntimeError(f"page {page.title} failed: {at.exception[0].value}")
    return elapsed, cpu, len(at.get("plotly_chart"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=24.0, help="hours of 1 Hz data to write (default 24)")
    parser.add_argument("--db", type=Path, help="reuse (or keep) this store instead of a temporary one")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    db = args.db or Path(tmp.name) / "flashmoe.db"
    data = fill(db, args.hours) if not db.exists() else {"reused": str(db), "db_bytes": db.stat().st_size}
    os.environ["FLASHMOE_DB"] = str(db)
    os.environ["FLASHMOE_AGENT_URL"] = f"http://127.0.0.1:{closed_port()}"
    rows = []
    for page in pages.PAGES:
        seconds, cpu, charts = render(page)
        rows.append({"page": page.title, "first_render_s": seconds, "cpu_s": cpu, "charts": charts,
                     "ok": seconds <= GOAL_S})
    load = os.getloadavg()[0]
    print(f"store: {json.dumps(data)}")
    print(f"load average (1 min) {load:.1f} on {os.cpu_count()} cores")
    print(f"{'page':<10} {'first render (s)':>17} {'CPU (s)':>8} {'charts':>7} {f'goal <= {GOAL_S:g} s':>12}")
    for r in rows:
        print(f"{r['page']:<10} {r['first_render_s']:>17.2f} {r['cpu_s']:>8.2f} {r['charts']:>7} "
              f"{'yes' if r['ok'] else 'NO':>12}")
    write_results("dashboard", {"store": data, "goal_s": GOAL_S, "load_average": load, "pages": rows,
                                "machine": machine()})
    tmp.cleanup()


if __name__ == "__main__":
    main()
