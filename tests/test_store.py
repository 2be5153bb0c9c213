"""The store writer on real SQLite files: buffering, chunks, concurrency, faults, compaction."""
import logging
import sqlite3
import time

import pytest

from store import queries
from store.db import Store
from store.errors import StoreError

T0 = 1_700_000_000.0


@pytest.fixture
def path(tmp_path):
    return tmp_path / "flashmoe.db"


def chunk_sizes(path, name):
    with sqlite3.connect(path) as conn:
        return [n for (n,) in conn.execute(
            "SELECT n_points FROM chunks JOIN series s ON s.id = series_id WHERE s.name = ? "
            "ORDER BY t_start", (name,))]


def test_flushed_points_reach_readers_before_the_chunk_is_full(path):
    with Store(path, chunk_points=120, autoflush_s=0) as store:
        for i in range(10):
            store.append("block.vda.util", T0 + i, i / 100)
        store.flush()
        assert queries.points(path, "block.vda.util")[1].tolist() == [i / 100 for i in range(10)]
        for i in range(10, 15):
            store.append("block.vda.util", T0 + i, i / 100)
        store.flush()
        assert len(queries.points(path, "block.vda.util")[0]) == 15
        assert chunk_sizes(path, "block.vda.util") == [15]      # the open chunk was rewritten


def test_autoflush_delivers_points_without_an_explicit_flush(path):
    store = Store(path, autoflush_s=0.2)
    try:
        store.append("mem.free_bytes", T0, 4096 * 10)
        deadline = time.monotonic() + 10
        while queries.latest(path, "mem.free_bytes") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queries.latest(path, "mem.free_bytes") == (T0, 40960.0)
    finally:
        store.close()


def test_writing_to_a_closed_store_is_refused(path):
    store = Store(path, autoflush_s=0)
    store.close()
    with pytest.raises(StoreError, match="is closed"):
        store.append("block.vda.util", T0, 0.1)
    with pytest.raises(StoreError, match="is closed"):
        store.record_event(T0, "x", "y")


def test_chunks_are_sealed_at_chunk_points(path):
    with Store(path, chunk_points=50, autoflush_s=0) as store:
        for i in range(120):
            store.append("psi.io.some_total_us", T0 + i, 1000 * i)
            if i % 7 == 0:
                store.flush()
    assert chunk_sizes(path, "psi.io.some_total_us") == [50, 50, 20]
    assert queries.points(path, "psi.io.some_total_us")[1].tolist() == [1000 * i for i in range(120)]


def test_counters_are_exact_and_gauges_within_precision(path):
    big = 2**60 + 12345
    with Store(path, autoflush_s=0) as store:
        store.append("nvme.nvme0.data_read_bytes", T0, big)
        store.append("block.vda.r_await_s", T0, 0.0123456)
    with sqlite3.connect(path) as conn:
        (data,) = conn.execute("SELECT data FROM chunks JOIN series s ON s.id = series_id "
                               "WHERE s.name = 'nvme.nvme0.data_read_bytes'").fetchone()
    from store.codec import decode
    assert decode(data).q.tolist() == [big]                     # bit-exact in the chunk
    assert queries.latest(path, "block.vda.r_await_s")[1] == pytest.approx(0.01235, abs=5e-6)


def test_undeclared_series_and_bad_values_are_refused_by_name(path):
    with Store(path, autoflush_s=0) as store:
        with pytest.raises(ValueError, match="not declared.*Store.declare"):
            store.append("my.thing", T0, 1.0)
        with pytest.raises(ValueError, match="not finite"):
            store.append("block.vda.util", T0, float("inf"))
        with pytest.raises(ValueError, match="kind must be"):
            store.declare("my.thing", "x", kind="histogram")
        store.declare("my.thing", "x", precision=0.5)
        store.append("my.thing", T0, 2.5)
    assert queries.latest(path, "my.thing") == (T0, 2.5)


def test_redeclaring_a_precision_keeps_old_points_decodable(path):
    with Store(path, autoflush_s=0) as store:
        store.declare("agent.thing", "x", precision=1.0)
        store.append("agent.thing", T0, 7)
        store.flush()
        store.declare("agent.thing", "x", precision=0.001)
        store.append("agent.thing", T0 + 1, 0.125)
        store.flush()
        store.append("agent.thing", T0 + 2, 3.0)            # unflushed when redeclared
        store.declare("agent.thing", "x", precision=0.5)
    assert queries.points(path, "agent.thing")[1].tolist() == [7.0, 0.125, 3.0]
    assert chunk_sizes(path, "agent.thing") == [1, 1, 1]


def test_two_writers_and_a_reader_share_the_file(path):
    agent, collector = Store(path, autoflush_s=0), Store(path, autoflush_s=0)
    reader = queries.connect_ro(path)
    try:
        for i in range(300):
            agent.append("agent.tokens_per_s", T0 + i, i % 50)
            collector.append("block.vda.util", T0 + i, (i % 10) / 10)
            if i % 10 == 0:
                agent.record_request(T0 + i, f"r{i}", 0.1, 0.01, 0.5, 8, 16, 3, 1, 4096)
                agent.flush()
                collector.flush()
                assert len(queries.points(reader, "block.vda.util")[0]) == i + 1
    finally:
        agent.close()
        collector.close()
        reader.close()
    assert queries.points(path, "agent.tokens_per_s")[1].tolist() == [float(i % 50) for i in range(300)]
    assert len(queries.requests(path)) == 30


def test_a_locked_database_is_reported_held_and_written_when_it_clears(path, caplog):
    store = Store(path, autoflush_s=0, busy_timeout_s=0.05)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        store.append("block.vda.util", T0, 0.5)
        assert store.flush()
        blocker.execute("BEGIN IMMEDIATE")                   # a real second writer holds the lock
        for i in range(1, 20):
            store.append("block.vda.util", T0 + i, 0.5)
        store.record_request(T0 + 5, "held", 0.1, 0.01, 0.5, 1, 2, 3, 4, 5)
        with caplog.at_level(logging.ERROR, logger="store.db"):
            assert store.flush() is False
            assert store.flush() is False
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1                              # said once, not on every retry
        assert "locked" in errors[0] and "fuser" in errors[0] and "Holding 19 points" in errors[0]
        assert len(queries.points(path, "block.vda.util")[0]) == 1
        blocker.execute("ROLLBACK")
        assert store.flush()
        assert len(queries.points(path, "block.vda.util")[0]) == 20
        assert [r["request_id"] for r in queries.requests(path)] == ["held"]
        [event] = queries.events(path, kind="store.recovered")
        assert "locked" in event["message"] and "0 points" in event["message"]
    finally:
        blocker.close()
        store.close()


def test_held_samples_are_bounded_and_the_drop_is_counted(path, caplog):
    store = Store(path, autoflush_s=0, busy_timeout_s=0.05, max_held_points=100)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        for i in range(250):
            store.append("block.vda.util", T0 + i, 0.1)
        with caplog.at_level(logging.WARNING, logger="store.db"):
            assert store.flush() is False
        assert any("dropped the 150 oldest" in r.getMessage() for r in caplog.records)
        blocker.execute("ROLLBACK")
        assert store.flush()
        t, _ = queries.points(path, "block.vda.util")
        assert t.tolist() == [T0 + i for i in range(150, 250)]
        assert "150 points" in queries.events(path, kind="store.recovered")[0]["message"]
    finally:
        blocker.close()
        store.close()


def test_a_full_disk_is_reported_held_and_written_when_space_returns(path, caplog):
    store = Store(path, autoflush_s=0)
    try:
        store.append("block.vda.util", T0, 0.5)
        store.flush()
        pages = store.conn.execute("PRAGMA page_count").fetchone()[0]
        store.conn.execute(f"PRAGMA max_page_count = {pages}")     # the file cannot grow
        for name in (f"agent.series{i}" for i in range(40)):
            store.declare(name, "x", precision=1.0)
            for i in range(200):
                store.append(name, T0 + i, i * 1000)
        with caplog.at_level(logging.ERROR, logger="store.db"):
            assert store.flush() is False
        assert any("full" in r.getMessage() and "free space" in r.getMessage() for r in caplog.records)
        assert "agent.series0" not in queries.series_names(path)
        store.conn.execute("PRAGMA max_page_count = 1073741823")
        assert store.flush()
        assert queries.points(path, "agent.series39")[1].tolist() == [i * 1000.0 for i in range(200)]
    finally:
        store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_compaction_merges_small_chunks_and_keeps_every_point(path):
    for session in range(6):                 # restarts leave small chunks behind
        with Store(path, autoflush_s=0) as store:
            for i in range(session * 30, session * 30 + 30):
                store.append("mem.free_bytes", T0 + i, 4096 * (i % 17))
    before = queries.points(path, "mem.free_bytes")
    assert chunk_sizes(path, "mem.free_bytes") == [30] * 6
    with Store(path, autoflush_s=0) as store:
        report = store.compact(now=T0 + 86400, target_points=100)
    assert (report.chunks_merged, report.chunks_written) == (6, 2)
    assert chunk_sizes(path, "mem.free_bytes") == [100, 80]
    after = queries.points(path, "mem.free_bytes")
    assert after[0].tolist() == before[0].tolist() and after[1].tolist() == before[1].tolist()


def test_compaction_leaves_recent_chunks_alone(path):
    with Store(path, chunk_points=10, autoflush_s=0) as store:
        for i in range(30):
            store.append("block.vda.util", T0 + i, 0.1)
        assert store.compact(now=T0 + 60).chunks_merged == 0
    assert chunk_sizes(path, "block.vda.util") == [10, 10, 10]


def test_retention_deletes_old_data_but_keeps_results_and_current_knobs(path):
    old, new = T0, T0 + 8 * 86400
    with Store(path, autoflush_s=0) as store:
        for t in (old, new):
            store.append("block.vda.util", t, 0.2)
            store.flush()
            store.record_request(t, "r", 0.1, 0.01, 0.5, 1, 2, 3, 4, 5)
            store.record_cache_stats(t, 0, 5, 5, 1, 0, 100, 0.001)
            store.record_activations(t, {(0, 1): 3})
            store.record_event(t, "test", "e")
        store.record_knob_change(old, "policy", None, "lru", "test")
        store.record_knob_change(old, "cache_cap_bytes", None, 100, "test")
        store.record_knob_change(old + 1, "cache_cap_bytes", 100, 200, "test")
        store.record_simulation(old, "trace", "lru", 64, "layer", 0.5)
        store.record_sweep(old, 1 << 30, 12.5, 0.6)
        store.compact(now=new + 60)
    assert queries.points(path, "block.vda.util")[0].tolist() == [new]
    assert [r["t"] for r in queries.requests(path)] == [new]
    assert queries.latest_knobs(path) == {"cache_cap_bytes": 200, "policy": "lru"}
    assert len(queries.knob_history(path)) == 2
    assert len(queries.simulations(path)) == 1 and len(queries.sweeps(path)) == 1
    assert queries.activations(path) == {(0, 1): 3}


def test_a_file_that_is_not_a_store_is_refused_with_advice(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="junk.db.*FlashMoE store"):
        Store(junk)
    newer = tmp_path / "newer.db"
    Store(newer, autoflush_s=0).close()
    with sqlite3.connect(newer) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="schema version 99.*move the old file aside"):
        Store(newer)
