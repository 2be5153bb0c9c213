"""The store writer on real SQLite files: buffering, chunks, concurrency, faults, compaction."""
import logging
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from store import codec, compaction, queries
from store.database import remove_unshared
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


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_store_removed_or_replaced_under_its_writer_is_said_once(path, caplog, how):
    """`rm flashmoe.db` while the agent ran: it wrote on into the removed file without a word, and the readers
    said there was no store and to start the agent."""
    with Store(path, autoflush_s=0) as store, caplog.at_level(logging.ERROR, logger="store.db"):
        store.append("block.vda.util", T0, 0.5)
        store.flush()
        for name in ("flashmoe.db", "flashmoe.db-wal", "flashmoe.db-shm"):
            (path.parent / name).unlink(missing_ok=True)
        if how == "replaced":
            path.write_bytes(b"")
        for i in range(1, 4):
            store.append("block.vda.util", T0 + i, 0.5)
            store.flush()
    said = [r.getMessage() for r in caplog.records if "was removed or replaced" in r.getMessage()]
    assert said == [f"the store {path} was removed or replaced while this process writes it: what it writes goes to "
                    f"the removed file and is lost when it stops; restart it to write a new store there"], said


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


# Buffers points and a request, never calls close(); "sigterm": then waits for a SIGTERM that it
# handles by exiting normally, as a service does.
_EXITS_WITHOUT_CLOSE = f"""
import signal, sys
from store.db import Store
path, autoflush_s, how = sys.argv[1], float(sys.argv[2]), sys.argv[3]
store = Store(path, autoflush_s=autoflush_s)
for i in range(5):
    store.append("block.vda.util", {T0} + i, i / 100)
store.record_request({T0}, "req-1", 0.1, 0.05, 1.0, 12, 16, 48, 16, 1024)
if how == "sigterm":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    signal.pause()
"""


@pytest.mark.parametrize("how,autoflush_s", [("exit", 0), ("exit", 3600), ("sigterm", 3600)])
def test_a_process_that_exits_without_close_still_writes_its_buffer(path, how, autoflush_s):
    """autoflush 0: no flusher thread; 3600: one that would not flush before the exit."""
    proc = subprocess.Popen([sys.executable, "-c", _EXITS_WITHOUT_CLOSE, str(path), str(autoflush_s), how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if how == "sigterm":
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert queries.points(path, "block.vda.util")[1].tolist() == [i / 100 for i in range(5)]
    assert [r["request_id"] for r in queries.requests(path)] == ["req-1"]


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


def codec_calls(store: Store, action) -> tuple[list[str], int]:
    """Run `action()` profiled: the codec's calls made inside a transaction of the store's connection,
    and the chunks it encoded outside one."""
    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == codec.__file__:
            calls.append(("codec", frame.f_code.co_name))

    store.conn.set_trace_callback(lambda sql: calls.append(("sql", sql.split()[0].upper())))
    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
        store.conn.set_trace_callback(None)
    inside, within, encoded_outside = False, [], 0
    for kind, name in calls:
        inside = (inside or name == "BEGIN") and name not in ("COMMIT", "ROLLBACK")
        if kind == "codec":
            within += [name] if inside else []
            encoded_outside += not inside and name == "to_bytes"
    return within, encoded_outside


def test_a_flush_holds_the_write_lock_for_its_sql_alone(path):
    """The codec's work on every open chunk runs before BEGIN IMMEDIATE: the agent's flush, squeezed by
    memory thrash, held the lock past the collector's 2 s busy timeout."""
    def write():
        for i in range(60):          # open chunks extended flush after flush, one sealed and a new one opened
            store.append("block.vda.util", T0 + i, i / 100)
            store.append("agent.tokens_per_s", T0 + i, 20.0)
            store.record_request(T0 + i, f"r{i}", 0.1, 0.01, 0.5, 1, 2, 3, 4, 5)
            if i % 7 == 0 or i == 59:
                store.flush()

    with Store(path, chunk_points=50, autoflush_s=0) as store:
        within, encoded = codec_calls(store, write)
    assert within == [] and encoded >= 2 * 10
    assert chunk_sizes(path, "block.vda.util") == [50, 10]
    assert queries.points(path, "agent.tokens_per_s")[1].tolist() == [20.0] * 60


def test_a_flush_that_holds_the_write_lock_past_half_the_busy_timeout_says_so(path, caplog, monkeypatch):
    """A writer held inside its transaction (as by a thrashing agent's pages faulting back in) is
    warned about once the hold passes half the busy timeout: other writers are that close to failing."""
    with Store(path, autoflush_s=0, busy_timeout_s=0.2) as store:
        store.append("agent.tokens_per_s", T0, 20.0)
        store.record_request(T0, "r0", 0.1, 0.01, 0.5, 1, 2, 3, 4, 5)
        write = store._rows.write
        monkeypatch.setattr(store._rows, "write", lambda *a: (time.sleep(0.3), write(*a)))   # held 0.3 s
        with caplog.at_level(logging.WARNING, logger="store.db"):
            assert store.flush()
    (warning,) = [r.getMessage() for r in caplog.records if "held the write lock" in r.getMessage()]
    assert "over half the 0.2 s that other writers wait for it (1 series, 1 rows)" in warning
    assert queries.points(path, "agent.tokens_per_s")[1].tolist() == [20.0]    # and the flush went through
    caplog.clear()
    with Store(path, autoflush_s=0, busy_timeout_s=60) as store, caplog.at_level(logging.WARNING, logger="store.db"):
        store.append("agent.tokens_per_s", T0 + 1, 20.0)
        assert store.flush()
    assert not [r for r in caplog.records if "held the write lock" in r.getMessage()]


def test_compaction_holds_the_write_lock_for_its_sql_alone(path):
    """Retention trims the chunk it cuts through, merging re-encodes runs of chunks: before the transaction."""
    for session in range(4):                 # restarts leave small chunks behind
        with Store(path, autoflush_s=0) as store:
            for i in range(session * 30, session * 30 + 30):
                store.append("mem.free_bytes", T0 + i, 4096 * i)
    with Store(path, autoflush_s=0) as store:
        within, encoded = codec_calls(store, lambda: store.compact(now=T0 + 15 + 86400, retention_days=1,
                                                                   target_points=100))
    assert within == [] and encoded == 1 + 2           # the trimmed chunk; 105 points merged into 2
    assert chunk_sizes(path, "mem.free_bytes") == [100, 5]
    assert queries.points(path, "mem.free_bytes")[1].tolist() == [4096.0 * i for i in range(15, 120)]


def test_a_run_another_compaction_merged_meanwhile_is_left_as_it_merged_it(path, monkeypatch):
    """Encoded before its transaction, a merge checks inside it that its chunks are still as read."""
    for session in range(4):
        with Store(path, autoflush_s=0) as store:
            for i in range(session * 30, session * 30 + 30):
                store.append("mem.free_bytes", T0 + i, 4096 * i)
    merged, raced = compaction._merged, []

    def merged_while_another_compacts(run, target_points):
        if not raced:
            raced.append(run)
            with Store(path, autoflush_s=0) as other:
                assert other.compact(now=T0 + 86400, target_points=100).chunks_merged == 4
        return merged(run, target_points)

    monkeypatch.setattr(compaction, "_merged", merged_while_another_compacts)
    with Store(path, autoflush_s=0) as store:
        assert store.compact(now=T0 + 86400, target_points=100).chunks_merged == 0
    assert chunk_sizes(path, "mem.free_bytes") == [100, 20]
    assert queries.points(path, "mem.free_bytes")[1].tolist() == [4096.0 * i for i in range(120)]   # none twice


def test_a_locked_database_is_reported_held_and_written_when_it_clears(path, caplog):
    store = Store(path, autoflush_s=0, busy_timeout_s=0.05, retry_s=0)
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
    store = Store(path, autoflush_s=0, busy_timeout_s=0.05, max_held_points=100, retry_s=0)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        for i in range(250):
            store.append("block.vda.util", T0 + i, 0.1)
        with caplog.at_level(logging.WARNING, logger="store.db"):
            assert store.flush() is False
        assert any("backlog is full" in r.getMessage() for r in caplog.records)
        assert (store.lost.points, queries.lost(path)["points"]) == (150, 0)  # counted, not yet written
        blocker.execute("ROLLBACK")
        assert store.flush()
        t, _ = queries.points(path, "block.vda.util")
        assert t.tolist() == [T0 + i for i in range(150, 250)]
        assert "150 points" in queries.events(path, kind="store.recovered")[0]["message"]
        assert queries.lost(path) == {"points": 150, "rows": 0}
    finally:
        blocker.close()
        store.close()


def test_a_full_disk_is_reported_held_and_written_when_space_returns(path, caplog):
    store = Store(path, autoflush_s=0, retry_s=0)
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
        store.record_simulation(old, "trace", "lru", 0.25, "layer", 0.5)
        store.record_sweep(old, 1 << 30, 12.5, 0.6)
        store.compact(now=new + 2 * compaction.COMPACT_MIN_AGE_S)  # old and new share a chunk: trimmed once sealed
    assert queries.points(path, "block.vda.util")[0].tolist() == [new]
    assert [r["t"] for r in queries.requests(path)] == [new]
    assert queries.latest_knobs(path) == {"cache_cap_bytes": 200, "policy": "lru"}
    assert len(queries.knob_history(path)) == 2
    assert len(queries.simulations(path)) == 1 and len(queries.sweeps(path)) == 1
    assert queries.activations(path) == {(0, 1): 3}


def test_retention_leaves_another_writers_open_chunk_whole(path):
    """The collector's retention must not trim the chunk the agent still extends: the agent's next
    flush would find it gone and write every point of it again beside the trimmed copy."""
    times = [T0 + 100 * i for i in range(11)]
    with Store(path, chunk_points=600, autoflush_s=0) as agent:
        for t in times:
            agent.append("block.vda.util", t, 0.5)
        agent.flush()
        with Store(path, autoflush_s=0) as collector:   # cutoff T0 + 600, inside the agent's open chunk
            collector.append("mem.free_bytes", T0 + 1050, 4096)   # a newer chunk: no rowid is reused
            collector.compact(retention_days=500 / 86400, now=T0 + 1100)
        agent.append("block.vda.util", T0 + 1100, 0.5)
    assert queries.points(path, "block.vda.util")[0].tolist() == times + [T0 + 1100]


def test_a_file_that_is_not_a_store_is_refused_with_advice(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="junk.db.*FlashMoE store"):
        Store(junk)
    newer = tmp_path / "newer.db"
    Store(newer, autoflush_s=0).close()
    with sqlite3.connect(newer) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="schema version 99, written by a newer FlashMoE.*move it aside"):
        Store(newer)


@pytest.mark.parametrize("damage", ["UPDATE meta SET value = 'abc' WHERE key = 'schema_version'",
                                    "DELETE FROM meta WHERE key = 'schema_version'"])
def test_a_store_whose_schema_version_is_damaged_is_refused_by_name_by_writers_and_readers(tmp_path, damage):
    damaged = tmp_path / "damaged.db"
    Store(damaged, autoflush_s=0).close()
    with sqlite3.connect(damaged) as conn:
        conn.execute(damage)
    before = damaged.read_bytes()
    for open_it in (Store, queries.stats):
        with pytest.raises(StoreError, match="damaged.db is a damaged FlashMoE store: its meta table holds"):
            open_it(damaged)
    assert damaged.read_bytes() == before     # no schema_version written over the damage


def test_a_new_store_is_removed_only_when_no_other_connection_has_it(tmp_path):
    """What a failed agent start does with the store it made (agent.serve.server): a collector or a reader that
    opened it meanwhile keeps it, as does a store whose journal mode gives no sign of them."""
    db = tmp_path / "new.db"
    Store(db, autoflush_s=0).close()
    other = queries.connect_ro(db)
    other.execute("SELECT COUNT(*) FROM meta").fetchone()
    Store(db, autoflush_s=0).close()
    assert not remove_unshared(db) and sorted(p.name for p in tmp_path.iterdir()) == ["new.db", "new.db-shm",
                                                                                      "new.db-wal"]
    other.close()                          # a read-only connection cannot remove them: the next writer's close does
    Store(db, autoflush_s=0).close()
    assert remove_unshared(db) and list(tmp_path.iterdir()) == []
    with sqlite3.connect(db) as conn:      # rollback journal: another connection would leave no trace
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    assert not remove_unshared(db) and db.exists()


def test_a_reader_kept_out_by_a_writers_lock_says_so_and_does_not_call_the_store_unreadable(tmp_path):
    db = tmp_path / "held.db"
    Store(db, autoflush_s=0).close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")      # as a writer mid-creation holds it: readers wait
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO meta VALUES ('x', 'y')")
    try:
        with pytest.raises(StoreError) as raised:
            queries.stats(db)
    finally:
        holder.close()
    assert f"cannot read {db} yet (database is locked): another connection holds the write lock" in str(raised.value)
    assert "not a readable FlashMoE store" not in str(raised.value)
    assert queries.stats(db)["series"] == []


def test_a_simulation_capacity_must_be_a_fraction_of_experts(path):
    with Store(path, autoflush_s=0) as store:
        for bad in (64, 0, 1.5):
            with pytest.raises(ValueError, match="fraction of all experts in \\(0, 1\\]"):
                store.record_simulation(T0, "trace", "lru", bad, "layer", 0.5)
        store.record_simulation(T0, "trace", "lru", 1, "global", 0.9)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT capacity, typeof(capacity) FROM simulations").fetchall() == [(1.0, "real")]
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):     # the schema holds the line too
            conn.execute("INSERT INTO simulations VALUES (0, 'x', 'lru', 16, 'layer', 0.5)")


# The schema FlashMoE wrote as store version 2 (before rollups, prefetches and fractional capacity).
SCHEMA_V2 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE series (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, unit TEXT NOT NULL,
    kind TEXT NOT NULL, precision REAL NOT NULL, description TEXT NOT NULL DEFAULT '');
CREATE TABLE chunks (id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL REFERENCES series(id),
    t_start REAL NOT NULL, t_end REAL NOT NULL, n_points INTEGER NOT NULL,
    precision REAL NOT NULL, data BLOB NOT NULL);
CREATE INDEX chunks_series_t ON chunks (series_id, t_end);
CREATE TABLE requests (t REAL NOT NULL, request_id TEXT NOT NULL, ttft_s REAL, tpot_s REAL, latency_s REAL,
    prompt_tokens INTEGER, completion_tokens INTEGER, hits INTEGER, misses INTEGER, bytes_read INTEGER);
CREATE INDEX requests_t ON requests (t);
CREATE TABLE cache_stats (t REAL NOT NULL, layer INTEGER NOT NULL, hits INTEGER NOT NULL, misses INTEGER NOT NULL,
    evictions INTEGER NOT NULL, prefetch_hits INTEGER NOT NULL, bytes_read INTEGER NOT NULL, read_latency_s REAL);
CREATE INDEX cache_stats_t ON cache_stats (t);
CREATE TABLE activations (t REAL NOT NULL, layer INTEGER NOT NULL, expert INTEGER NOT NULL, count INTEGER NOT NULL);
CREATE INDEX activations_t ON activations (t);
CREATE TABLE knob_changes (id INTEGER PRIMARY KEY, t REAL NOT NULL, knob TEXT NOT NULL, old TEXT, new TEXT NOT NULL,
    source TEXT NOT NULL);
CREATE INDEX knob_changes_t ON knob_changes (t);
CREATE TABLE events (id INTEGER PRIMARY KEY, t REAL NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL);
CREATE INDEX events_t ON events (t);
CREATE TABLE simulations (t REAL NOT NULL, trace TEXT NOT NULL, policy TEXT NOT NULL, capacity INTEGER NOT NULL,
    scope TEXT NOT NULL, hit_rate REAL NOT NULL);
CREATE TABLE sweeps (t REAL NOT NULL, cache_cap_bytes INTEGER NOT NULL, tokens_per_s REAL NOT NULL,
    hit_rate REAL NOT NULL);
INSERT INTO meta VALUES ('schema_version', '2');
"""


def version_2_store(path, capacities=(0.25, 0.5)):
    """A store as version 2 left it: 5 minutes of cache rows for 2 layers, activations, simulations."""
    with sqlite3.connect(path) as conn:
        conn.executescript(SCHEMA_V2)
        conn.executemany("INSERT INTO cache_stats VALUES (?,?,?,?,?,?,?,?)",
                         [(T0 + i + 0.25, layer, 3 + layer, 1, layer, 1, 4096, None if i % 4 else 0.002)
                          for i in range(300) for layer in (0, 1)])
        conn.executemany("INSERT INTO activations VALUES (?,?,?,?)", [(T0 + i, 0, i % 8, 2) for i in range(300)])
        conn.executemany("INSERT INTO simulations VALUES (?,?,?,?,?,?)",
                         [(T0, "trace", "lru", c, "layer", 0.5) for c in capacities])
    return path


def test_a_version_2_store_is_upgraded_in_place_keeping_every_row(path, caplog):
    version_2_store(path)
    with sqlite3.connect(path) as conn:
        before = conn.execute("SELECT * FROM cache_stats ORDER BY rowid").fetchall()
    with pytest.raises(StoreError, match="schema version 2.*upgrade it in place"):
        queries.connect_ro(path)                # a reader cannot upgrade: it says who can
    with caplog.at_level(logging.WARNING, logger="store.db"):
        Store(path, autoflush_s=0).close()
    assert "upgraded" in caplog.text and "schema version 3" in caplog.text
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("5",)
        assert conn.execute("SELECT COUNT(*) FROM disk_readers").fetchone() == (0,)          # version 4's table
        assert "write_bytes_per_s" in {c[1] for c in conn.execute("PRAGMA table_info(disk_readers)")}  # version 5's
        assert conn.execute("SELECT * FROM cache_stats ORDER BY rowid").fetchall() == [row + (None,) for row in before]
        assert conn.execute("SELECT capacity, typeof(capacity) FROM simulations").fetchall() == \
            [(0.25, "real"), (0.5, "real")]
        assert conn.execute("SELECT SUM(n_rows), SUM(hits) FROM cache_stats_1m").fetchone() == (600, 7 * 300)
    stats = queries.cache_stats(path, T0, T0 + 300, buckets=5)       # through the rollup built from the old rows
    assert [r["hits"] for r in stats["per_layer"]] == [3 * 300, 4 * 300]
    assert [r["hits"] + r["misses"] for r in stats["over_time"]] == [(3 + 4 + 1 + 1) * 60] * 5
    assert stats["total"]["read_latency_s"] == pytest.approx(0.002)
    assert stats["total"]["prefetch_accuracy"] is None              # version 2 did not record prefetches
    assert queries.activations(path) == {(0, e): 2 * (300 // 8 + (e < 300 % 8)) for e in range(8)}
    with Store(path, autoflush_s=0) as store:                        # and it is written like a new store
        store.record_cache_stats(T0 + 301, 0, 1, 1, 0, 1, 0, None, prefetches=2)
    assert queries.cache_stats(path)["total"]["prefetch_accuracy"] == 0.5


@pytest.mark.parametrize("version, what", [(0, "a version no FlashMoE wrote"), (-3, "a version no FlashMoE wrote"),
                                           (1, "written by an early FlashMoE")])
def test_a_store_of_a_version_no_upgrade_reaches_is_not_told_to_upgrade_and_writers_leave_it_as_it_was(
        tmp_path, version, what):
    """Readers told such a store to be upgraded by the agent, the collector or `store compact`, which all refuse it.
    The file is in SQLite's default journal mode, as another application's may be: a writer that refuses it must
    not have switched it to WAL first (a rewrite of its header)."""
    path = tmp_path / "odd.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(SCHEMA_V2.replace("'schema_version', '2'", f"'schema_version', '{version}'"))
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError) as read:
        queries.stats(path)
    message = str(read.value)
    assert f"{path} has store schema version {version}, {what}" in message, message
    assert "upgrade it in place" not in message and f"move it aside (e.g. `mv {path} {path}.old`)" in message
    for create in (True, False):               # the agent and the collector; `store compact`
        with pytest.raises(StoreError) as written:
            Store(path, autoflush_s=0, create=create)
        assert str(written.value) == message
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["odd.db"]


def test_a_version_4_store_gets_the_readers_write_column_keeping_its_rows(path):
    """Version 4 recorded the disk's other readers without their writes: their rows stay, writes NULL."""
    Store(path, autoflush_s=0).close()
    with sqlite3.connect(path) as conn:             # back to version 4's table
        conn.execute("DROP TABLE disk_readers")
        conn.execute("CREATE TABLE disk_readers (t REAL NOT NULL, device TEXT NOT NULL, pid INTEGER NOT NULL, "
                     "name TEXT NOT NULL, read_bytes_per_s REAL NOT NULL)")
        conn.execute("INSERT INTO disk_readers VALUES (?, 'vda', 4242, 'dd', 800e6)", (T0,))
        conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    Store(path, autoflush_s=0).close()
    assert queries.disk_readers(path, "vda", T0, T0) == [
        {"t": T0, "device": "vda", "pid": 4242, "name": "dd", "read_bytes_per_s": 800e6, "write_bytes_per_s": None}]


def test_a_version_2_store_with_slot_count_capacities_is_refused_with_advice_and_left_as_it_was(path):
    version_2_store(path, capacities=(0.25, 64))
    with pytest.raises(StoreError, match="1 simulation results whose capacity \\(64\\).*DELETE FROM simulations"):
        Store(path, autoflush_s=0)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("2",)
        assert "prefetches" not in [c[1] for c in conn.execute("PRAGMA table_info(cache_stats)")]
        assert conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name LIKE '%_1m'").fetchone() == (0,)
        conn.execute("DELETE FROM simulations WHERE NOT (capacity > 0 AND capacity <= 1)")   # the advice
    Store(path, autoflush_s=0).close()
    assert [s["capacity"] for s in queries.simulations(path)] == [0.25]
