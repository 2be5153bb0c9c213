"""SIGKILL the agent and the collector at random points while both write one store, and a bare
writer while it appends: no store is ever corrupt, and what a kill loses is counted.

Figures for RELIABILITY.md: run with `-s` to print them."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from agents import CLI, ROOT, demo_model, spawn, start_agent, wait_for
from store import codec, queries
from store.schema import ROLLUPS

COLLECTOR_KILLS, AGENT_KILLS, WRITER_KILLS = 40, 12, 20

WRITER = """
import sys, time
from store.db import Store
store = Store(sys.argv[1], autoflush_s=0.2)
start = int(sys.argv[2])
for i in range(start, start + 10**9):
    store.append("agent.tokens_per_s", 1_700_000_000 + i * 0.01, i % 1000)
    print("appended", i, flush=True)
    time.sleep(0.001)        # ~1000 points a second: a busy agent writes tens
"""


def check_store(db: Path) -> None:
    """The file is intact: SQLite's own check, every chunk decodes to its point count, and each
    per-minute rollup still equals the rows it sums. One read transaction: the agent writes on, and a
    flush between two statements (rows and their rollup, committed together) would tell them apart."""
    with sqlite3.connect(db, isolation_level=None) as conn:
        conn.execute("BEGIN")
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        for n_points, data in conn.execute("SELECT n_points, data FROM chunks"):
            assert len(codec.decode(data).t_ms) == n_points
        for rollup in ROLLUPS:
            counted = conn.execute(f"SELECT COALESCE(SUM(n_rows), 0) FROM {rollup.table}").fetchone()[0]
            assert counted == conn.execute(f"SELECT COUNT(*) FROM {rollup.source}").fetchone()[0]
        conn.execute("COMMIT")
    queries.stats(db)                                    # and the readers take it


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s process group; a group already gone (a test that failed between a kill and the
    restart) is no error, so that failure shows and not this."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def collector_points(db: Path) -> int:
    return len(queries.points(db, "mem.available_bytes")[0])


class Traffic:
    """Completions and knob changes against whichever agent is up; remembers every knob change the
    agent acknowledged, which is written through to the store before the answer."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.acknowledged: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = random.Random(11)
        while not self._stop.is_set():
            url = self.url
            try:
                if url is None:
                    raise httpx.TransportError("no agent")
                if rng.random() < 0.5:
                    value = round(0.5 + len(self.acknowledged) * 1e-4, 4)   # each a new value
                    if httpx.put(url + "/v1/knobs", json={"recompute_threshold": value}, timeout=10).status_code == 200:
                        self.acknowledged.append(value)
                else:
                    httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
            except httpx.HTTPError:
                time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


@pytest.mark.slow
def test_sigkill_of_agent_and_collector_never_corrupts_the_store(tmp_path_factory, tmp_path):
    model, db = demo_model(tmp_path_factory), tmp_path / "flashmoe.db"
    rng = random.Random(7)
    collector_args = [*CLI, "collect", "--db", str(db), "--interval", "0.05", "--pid-file", str(tmp_path / "agent.pid")]
    collector = spawn(collector_args, tmp_path / "collector.log")
    agent = start_agent(model, tmp_path, "--policy", "lru")
    traffic = Traffic()
    traffic.url = agent.url
    kills = {"collector": 0, "agent": 0}
    try:
        order = ["agent"] * AGENT_KILLS + ["collector"] * COLLECTOR_KILLS
        rng.shuffle(order)
        for victim in order:
            if victim == "collector":
                before = collector_points(db) if db.exists() else 0
                wait_for(lambda: collector_points(db) > before, 60, "the collector's new points")
                time.sleep(rng.uniform(0.0, 0.3))                     # anywhere in a tick or a flush
                kill(collector)
                check_store(db)
                collector = spawn(collector_args, tmp_path / "collector.log")
            else:
                time.sleep(rng.uniform(0.2, 2.0))                     # ticks, requests, knob changes
                traffic.url = None
                kill(agent.proc)
                check_store(db)
                history = [h["new"] for h in queries.knob_history(db, limit=10**6)
                           if h["knob"] == "recompute_threshold" and h["source"] == "api"]
                assert set(traffic.acknowledged) <= set(history)    # no acknowledged change is lost
                agent = start_agent(model, tmp_path, "--policy", "lru")
                if history:                                         # and the newest comes back
                    knob = httpx.get(agent.url + "/v1/knobs", timeout=30).json()["recompute_threshold"]["value"]
                    assert knob == history[0]
                traffic.url = agent.url
            kills[victim] += 1
    finally:
        traffic.close()
        kill(collector)
        kill(agent.proc)
    check_store(db)
    print(f"\nkills: {kills}, corrupt stores: 0, acknowledged knob changes: {len(traffic.acknowledged)}, "
          f"lost: 0; collector points committed: {collector_points(db)}")


@pytest.mark.slow
def test_sigkill_of_a_writer_loses_only_its_unflushed_points_and_never_a_committed_one(tmp_path):
    """A bare writer appends numbered points and says so after each; killed at random points, the
    store holds exactly a gap-free prefix of them, and the count of the rest is exact."""
    db = tmp_path / "flashmoe.db"
    rng = random.Random(3)
    appended_total = lost_total = 0
    for _ in range(WRITER_KILLS):
        start = len(queries.points(db, "agent.tokens_per_s")[0]) if db.exists() else 0
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(start)], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        seen = 0
        deadline = time.monotonic() + rng.uniform(0.3, 1.5)
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("appended"):
                seen = int(line.split()[1]) + 1 - start
        kill(proc)
        seen += sum(1 for line in proc.stdout if line.startswith("appended"))   # said before the kill
        check_store(db)
        values = queries.points(db, "agent.tokens_per_s")[1]
        stored = len(values) - start
        assert values.tolist() == [float(i % 1000) for i in range(start + stored)]   # a gap-free prefix
        assert stored <= seen + 1              # at most the point appended while it was being said
        appended_total += max(seen, stored)
        lost_total += max(0, seen - stored)
    print(f"\nwriter kills: {WRITER_KILLS}, points appended: {appended_total}, lost (never flushed): {lost_total}")
    assert appended_total > lost_total
