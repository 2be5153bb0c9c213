"""SIGKILL the collector again and again while it writes: the store must stay intact."""
import random
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from store import codec, queries

KILLS = 10


def committed_points(db):
    return len(queries.points(db, "mem.free_bytes")[0]) if db.exists() else 0


def check_store(db):
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        chunks = conn.execute("SELECT n_points, data FROM chunks").fetchall()
    for n_points, data in chunks:
        assert len(codec.decode(data).t_ms) == n_points        # every committed chunk decodes


@pytest.mark.slow
def test_sigkill_while_writing_never_corrupts_the_store(tmp_path):
    db = tmp_path / "flashmoe.db"
    rng = random.Random(7)
    seen = 0
    for _ in range(KILLS):
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "collect", "--db", str(db),
                                 "--interval", "0.02"], stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while committed_points(db) <= seen and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.4))                 # land anywhere in a write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        check_store(db)
        now = committed_points(db)
        assert now > seen                                     # each run committed new points
        seen = now
