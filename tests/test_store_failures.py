"""The store where disks fail: full, read-only, the kernel's filesystems, another application's file.

A real tmpfs of a few MiB stands in for the disk (conftest.py's `tmpfs`: mounting it needs root, as CI runs)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from agents import CLI, ROOT, fill, spawn, stop, wait_for
from store import queries
from store.database import APPLICATION_ID, COMPACT_ROOM_BYTES, WAL_LIMIT_BYTES
from store.db import Store
from store.errors import StoreError

TRACE = str(ROOT / "tests" / "data" / "traces" / "olmoe_math.jsonl")  # a small real trace

T0 = 1_700_000_000.0
SERIES = [f"block.d{k}.reads_per_s" for k in range(30)]   # a collector's worth of series


def wal_bytes(db: Path) -> int:
    wal = Path(f"{db}-wal")
    return wal.stat().st_size if wal.exists() else 0


def cli_error(*args: str) -> tuple[int, list[str]]:
    """Exit code and the output lines of a flashmoe-cli command."""
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    return done.returncode, (done.stdout + done.stderr).splitlines()


def test_a_full_disk_keeps_the_log_bounded_counts_what_it_drops_and_writing_resumes(tmpfs):
    disk = tmpfs("4m")
    db = disk / "flashmoe.db"
    store = Store(db, autoflush_s=0, retry_s=0, max_held_points=40)
    tick, written, outage_ticks, wal_seen = 0, [], 0, []

    def one_tick() -> bool:
        nonlocal tick
        for name in SERIES:
            store.append(name, T0 + tick, (tick * 7919 + hash(name)) % 100_000 / 10)
        tick += 1
        ok = store.flush()
        wal_seen.append(wal_bytes(db))
        return ok

    while one_tick():                  # fill the disk once the store has found its size
        if tick == 150:
            filler = fill(disk)
    while outage_ticks < 100:          # 100 ticks without space: 60 more than the backlog holds
        assert not one_tick()
        outage_ticks += 1
    assert store.lost.points == store.lost.unrecorded_points > 0
    filler.unlink()
    assert one_tick()                  # space is back: the backlog and the count are written
    store.close()
    assert max(wal_seen) <= WAL_LIMIT_BYTES + 256 * 1024   # the limit and one flush, never the whole disk
    stored = sum(len(queries.points(db, name)[0]) for name in SERIES)
    assert stored + store.lost.points == tick * len(SERIES)   # every point written or counted
    assert queries.lost(db) == {"points": store.lost.points, "rows": 0}
    assert "points and 0 rows dropped" in queries.events(db, kind="store.recovered")[0]["message"]
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    print(f"\nfull disk: {tick} ticks x {len(SERIES)} series, {outage_ticks} without space; largest log "
          f"{max(wal_seen)} bytes; points stored {stored}, lost and counted {store.lost.points}")


def test_compaction_on_a_full_disk_runs_in_a_little_room_and_the_store_writes_into_what_it_freed(tmpfs):
    """Compaction wrote every page it freed to the log, all in one transaction: it needed free room about the
    size of what it deleted (960 KiB for this 1 MiB store). It deletes in small batches now, each checkpointed,
    freed pages not zeroed, and needs COMPACT_ROOM_BYTES whatever it deletes."""
    disk = tmpfs("8m")
    db, month_ago = disk / "flashmoe.db", time.time() - 30 * 86400
    with Store(db, autoflush_s=0) as store:                          # a store whose writers stopped, or caught up
        for tick in range(6000):                                   # ~1 MiB of chunks older than the retention
            for name in SERIES:
                store.append(name, month_ago + tick, tick % 100)
            store.record_request(month_ago + tick, f"cmpl-{tick}", 0.1, 0.01, 1.0, 20, 100, 90, 10, 1 << 20)
    old = db.stat().st_size
    filler = fill(disk)
    with pytest.raises(StoreError, match="is full"):
        Store(db, autoflush_s=0)
    os.truncate(filler, filler.stat().st_size - COMPACT_ROOM_BYTES)
    code, lines = cli_error("store", "compact", "--db", str(db), "--retention-days", "7")
    assert code == 0 and json.loads(lines[0]) == {"chunks_deleted": 300, "rows_deleted": 6000, "chunks_merged": 0,
                                                  "chunks_written": 0, "chunks_damaged": 0}, lines
    os.truncate(filler, filler.stat().st_size - WAL_LIMIT_BYTES)    # the new writer's log
    with Store(db, autoflush_s=0) as store:                          # the room it freed takes new data
        for tick in range(3000):
            for name in SERIES:
                store.append(name, T0 + tick, tick % 100)
            assert tick % 100 or store.flush()
    assert db.stat().st_size == old and queries.points(db, SERIES[0])[0].size == 3000
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_full_disk_is_advised_to_compact_in_a_little_room_plus_the_log(tmpfs):
    """A store whose log holds data its file has not taken (the disk filled under a writer) needs room for that
    data too before compaction can run: SQLite's log starts over only once the file holds all it committed."""
    disk = tmpfs("8m")
    db, month_ago = disk / "flashmoe.db", time.time() - 30 * 86400
    store = Store(db, autoflush_s=0, retry_s=0, max_held_points=40)
    for tick in range(6000):
        for name in SERIES:
            store.append(name, month_ago + tick, tick % 100)
    assert store.flush()
    filler = fill(disk)
    tick = 6000
    while store.flush():                                           # until the log has no room left either
        store.append(SERIES[0], month_ago + tick, 1.0)
        tick += 1
    compact = ["store", "compact", "--db", str(db), "--retention-days", "7"]
    code, lines = cli_error(*compact)
    assert code == 1 and f"the disk holding {db} is full: make room in the store with `flashmoe-cli " \
                         f"{' '.join(compact)[:-1]}N` (N under" in lines[-1], lines
    assert f"in {COMPACT_ROOM_BYTES >> 10} KiB of free space plus the size of the store's log ({db}-wal" in lines[-1]
    os.truncate(filler, filler.stat().st_size - COMPACT_ROOM_BYTES - wal_bytes(db))   # as the advice says
    code, lines = cli_error(*compact)
    assert code == 0 and json.loads(lines[0])["chunks_deleted"] > 0, lines
    store.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_on_a_full_disk_says_how_many_points_were_lost(sig, tmpfs, tmp_path):
    """SIGHUP (the terminal or SSH session that ran the collector closed) ended it on the spot: the points it
    held through the outage were lost without a word or a count."""
    disk = tmpfs("4m")
    db, log = disk / "flashmoe.db", tmp_path / "collector.log"
    proc = spawn([*CLI, "collect", "--db", str(db), "--interval", "0.05"], log)
    try:
        wait_for(lambda: db.exists() and queries.series_names(db), what="the collector's first points")
        fill(disk)
        wait_for(lambda: "cannot write to the store" in log.read_text(), what="the outage")
        time.sleep(0.5)                # ticks that cannot be written
        proc.send_signal(sig)
        proc.wait(60)
    finally:
        code = stop(proc)
    text = log.read_text()
    assert code == 1 and "Traceback" not in text
    [line] = [line for line in text.splitlines() if "closing the store" in line]
    assert "with unwritten data (database or disk is full)" in line and " points and 0 rows lost" in line
    assert int(line.split("): ")[1].split()[0]) > 0
    print("\n" + line)


@pytest.mark.parametrize("where", ["/proc/flashmoe.db", "/sys/flashmoe.db", "read-only new", "read-only existing"])
def test_a_store_where_none_can_be_written_is_one_clear_line(where, tmpfs):
    disk = tmpfs("4m")
    Store(disk / "existing.db", autoflush_s=0).close()
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    db = {"read-only new": str(disk / "new.db"), "read-only existing": str(disk / "existing.db")}.get(where, where)
    code, lines = cli_error("collect", "--db", db, "--duration", "1")
    assert code == 1 and len(lines) == 1 and "Traceback" not in lines[0], lines
    reason = "mounted read-only" if where.startswith("read-only") else "filesystem, whose files are kernel interfaces"
    assert f"cannot write the store {db}" in lines[0] and reason in lines[0]


def test_a_store_collect_cannot_create_on_a_full_disk_leaves_no_directory_made_for_it(tmpfs):
    """The store's files were removed and `made/for/` left."""
    disk = tmpfs("256k")
    fill(disk)
    db = disk / "made" / "for" / "new.db"
    code, lines = cli_error("collect", "--db", str(db), "--duration", "1")
    assert code == 1 and len(lines) == 1 and f"cannot create {db} as a FlashMoE store: database or disk is full" in (
        lines[0]), lines
    assert [p.name for p in disk.iterdir()] == ["filler"]


@pytest.mark.parametrize("where, kind", [("/dev/null", "a character device"), ("fifo", "a named pipe")])
def test_a_device_or_pipe_is_no_store_and_says_so(where, kind, tmp_path):
    """--db /dev/null said SQLite's "disk I/O error" and blamed the disk."""
    if where == "fifo":
        os.mkfifo(where := str(tmp_path / "fifo"))
    code, lines = cli_error("collect", "--db", where, "--duration", "1")
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].endswith(f"cannot write the store {where}: it is {kind}, not a file; name a file, e.g. "
                             f"data/flashmoe.db"), lines


@pytest.mark.parametrize("command", [("store", "stats"), ("diagnose",)])
@pytest.mark.parametrize("where, kind", [("/dev/null", "a character device"), ("fifo", "a named pipe")])
def test_readers_of_a_device_or_pipe_say_what_it_is(command, where, kind, tmp_path):
    """A named pipe hung `diagnose`, `store stats` and the dashboard (SQLite waited for a writer to open it);
    /dev/null was "there is no store at /dev/null yet; start the collector ... --db /dev/null"."""
    if where == "fifo":
        os.mkfifo(where := str(tmp_path / "fifo"))
    code, lines = cli_error(*command, "--db", where)
    assert code == 1 and len(lines) == 1 and f"{where} is {kind}, not a store file" in lines[0], lines


def test_a_version_3_store_on_a_full_disk_stays_version_3_and_upgrades_once_there_is_room(tmpfs):
    """The upgrade to version 4 (the disk_readers table) on a full disk logged "upgraded ... to store schema
    version 4" and then rolled back: the store stayed version 3, and the log said otherwise."""
    db = tmpfs("2m") / "flashmoe.db"
    Store(db, autoflush_s=0).close()
    with sqlite3.connect(db) as conn:          # version 3: version 4 without its disk_readers table
        conn.execute("DROP TABLE disk_readers")
        conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    filler = fill(db.parent)
    code, lines = cli_error("collect", "--db", str(db), "--duration", "1")
    assert code == 1 and len(lines) == 1 and "the disk holding" in lines[0] and "is full" in lines[0], lines
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("3",)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    filler.unlink()
    code, lines = cli_error("collect", "--db", str(db), "--duration", "1")
    assert code == 0 and any("upgraded" in line and "store schema version 4" in line for line in lines), lines
    assert queries.disk_readers(db, "vda", 0, time.time()) == []


@pytest.mark.parametrize("table", ["chunks", "disk_readers"])
def test_a_damaged_store_is_one_line_for_its_readers(table, tmp_path):
    """A damaged page ended `diagnose` and `store stats` in sqlite3's DatabaseError traceback ("database disk
    image is malformed"); the dashboard's loaders, which take StoreError, showed it as a failed page."""
    db, now = tmp_path / "flashmoe.db", time.time()
    with Store(db, autoflush_s=0) as store:
        for i in range(300):
            store.append("io.vda.others_read_bytes_per_s", now - i, 800e6)
            store.append("io.vda.agent_read_bytes_per_s", now - i, 20e6)
            store.append("agent.read_latency_s", now - i, 25e-3)
            store.record_disk_readers(now - i, "vda", [(4242, "dd", 800e6, 0.0)])
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (page,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    with db.open("r+b") as f:          # the table's root page: its header and first cells
        f.seek((page - 1) * size + 8)
        f.write(b"\xa5" * 64)
    # stats checks every page: it read disk_readers' index alone, missed the damage and counted 300 rows
    for command, problem in ((("diagnose",), "database disk image is malformed"),
                             (("store", "stats"), f"table {table}: On tree page ")):
        code, lines = cli_error(*command, "--db", str(db))
        assert code == 1 and len(lines) == 1, lines
        assert f"{db} is damaged ({problem}" in lines[0] and f"): `sqlite3 {db} .recover" in lines[0], lines


def test_a_damaged_chunk_is_left_by_compaction_and_named_by_its_readers(tmp_path):
    """SQLite checks its pages, not a blob's bytes: a chunk the codec refuses ended the collector at start (its
    compaction merged it: a CodecError traceback, exit 1, and honcho then stops the rest), `store compact` the
    same, and `store export` blamed --since/--until."""
    db, start = tmp_path / "flashmoe.db", time.time() - 3 * 3600       # old enough to merge
    with Store(db, chunk_points=10, autoflush_s=0) as store:
        for i in range(100):
            store.append("agent.read_latency_s", start + i, 1e-3 * (i + 1))
    with sqlite3.connect(db) as conn:
        (damaged,) = conn.execute("SELECT MIN(id) + 3 FROM chunks").fetchone()
        conn.execute("UPDATE chunks SET data = X'04FFFF' WHERE id = ?", (damaged,))
    done = subprocess.run([*CLI, "collect", "--db", str(db), "--duration", "1"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "compaction left 1 chunk(s) of" in done.stderr and "chunks_merged=9" in done.stderr, done.stderr
    done = subprocess.run([*CLI, "store", "compact", "--db", str(db)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["chunks_damaged"] == 1, done.stderr
    code, lines = cli_error("store", "export", "--db", str(db), "--series", "agent.read_latency_s")
    assert code == 1 and len(lines) == 1, lines
    assert (f"{db} holds a damaged chunk of agent.read_latency_s (chunk id {damaged}, 10 points: chunk truncated "
            f"inside a varint)" in lines[0] and "--since" not in lines[0]), lines
    subprocess.run(lines[0].split("`")[1], shell=True, check=True)    # the command it names (the collector
                                                                      # writes no agent series)
    assert len(queries.points(db, "agent.read_latency_s")[0]) == 90


def test_a_knob_change_whose_value_is_no_json_is_named_with_the_command_that_removes_it(tmp_path):
    """A knob change whose value SQLite holds whole but that is no JSON was a JSONDecodeError traceback in the
    agent's knob restore, the Tuning page's history and every reader of it."""
    db = tmp_path / "flashmoe.db"
    with Store(db, autoflush_s=0) as store:
        for i, new in enumerate((8, 4, 2)):
            store.record_knob_change(T0 + i, "max_batch_size", 16, new, "api")
    with sqlite3.connect(db) as conn:
        (damaged,) = conn.execute("SELECT MAX(id) FROM knob_changes").fetchone()
        conn.execute("UPDATE knob_changes SET new = '{2' WHERE id = ?", (damaged,))
    for read in (queries.knob_history, queries.latest_knobs):
        with pytest.raises(StoreError) as err:
            read(db)
        assert f"{db} holds a damaged knob change (knob_changes id {damaged}, max_batch_size: " in str(err.value)
    subprocess.run(str(err.value).split("`")[1], shell=True, check=True)     # the command it names
    assert queries.latest_knobs(db) == {"max_batch_size": 4}
    assert [h["new"] for h in queries.knob_history(db)] == [4, 8]


def test_a_store_on_a_read_only_mount_can_still_be_read(tmpfs):
    disk = tmpfs("4m")
    db = disk / "flashmoe.db"
    with Store(db, autoflush_s=0) as store:
        for i in range(10):
            store.append("block.vda.util", T0 + i, 0.5)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    code, lines = cli_error("store", "stats", "--db", str(db))
    assert code == 0 and any(line.startswith("block.vda.util") and " 10 " in line for line in lines), lines
    assert len(queries.points(db, "block.vda.util")[0]) == 10
    code, lines = cli_error("store", "compact", "--db", str(db))
    assert code == 1 and len(lines) == 1 and "mounted read-only" in lines[0]


def test_another_applications_sqlite_file_is_refused_and_left_as_it_was(tmp_path):
    other = tmp_path / "other-app.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("PRAGMA application_id = 1234")
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
    before = hashlib.sha256(other.read_bytes()).hexdigest()
    code, lines = cli_error("collect", "--db", str(other), "--duration", "1")
    assert code == 1 and len(lines) == 1 and "another application (application_id 0x4d2; tables: notes)" in lines[0]
    code, lines = cli_error("store", "stats", "--db", str(other))
    assert code == 1 and len(lines) == 1 and "is not a FlashMoE store" in lines[0]
    assert hashlib.sha256(other.read_bytes()).hexdigest() == before
    unmarked = tmp_path / "unmarked.sqlite"
    with sqlite3.connect(unmarked) as conn:
        conn.execute("CREATE TABLE t (x)")
    with pytest.raises(StoreError, match="another application \\(no FlashMoE mark; tables: t\\)"):
        Store(unmarked)


def test_stores_are_marked_and_stores_from_before_the_mark_are_adopted(tmp_path):
    db = tmp_path / "flashmoe.db"
    with Store(db, autoflush_s=0) as store:
        store.append("block.vda.util", T0, 0.5)
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)
        conn.execute("PRAGMA application_id = 0")          # as every store written before the mark
    assert queries.series_names(db) == ["block.vda.util"]   # readers take it
    Store(db, autoflush_s=0).close()                       # a writer marks it
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)


def test_an_empty_file_becomes_a_store(tmp_path):
    db = tmp_path / "empty.db"
    db.touch()
    Store(db, autoflush_s=0).close()
    assert queries.stats(db)["points"] == 0



@pytest.mark.parametrize("command", [["collect", "--duration", "1"], ["simulate", "--trace", TRACE, "--policy", "lru"]])
def test_a_store_that_cannot_be_created_on_a_full_disk_is_not_left_behind_and_the_advice_fits(tmpfs, command):
    """A 0-byte file stayed, and the advice was to compact it, which gave the same advice again."""
    disk = tmpfs("4m")
    filler = fill(disk)
    code, lines = cli_error(*command[:1], "--db", str(disk / "new.db"), *command[1:])
    assert code != 0 and len(lines) == 1 and "Traceback" not in lines[0], lines
    assert f"cannot create {disk / 'new.db'}" in lines[0] and "pass a --db on another disk" in lines[0], lines
    assert "compact" not in lines[0] and sorted(p.name for p in disk.iterdir()) == [filler.name]


def test_a_store_opened_on_a_full_disk_leaves_sqlites_empty_log_and_index_and_opens_once_there_is_room(tmpfs):
    """The 3-byte -shm beside a store after a writer failed to open it on a full disk is SQLite's own: its first
    connection truncates the log's index to 3 bytes (to be rebuilt) and then cannot grow it to 32 KiB. The log
    beside it is empty, so nothing is lost; the next connection once there is room rebuilds the index, and its
    clean close removes both files."""
    db = tmpfs("4m") / "flashmoe.db"
    with Store(db, autoflush_s=0) as store:
        for tick in range(100):
            store.append(SERIES[0], T0 + tick, float(tick))
    assert sorted(p.name for p in db.parent.iterdir()) == ["flashmoe.db"]     # a clean close leaves the file alone
    filler = fill(db.parent)
    with pytest.raises(StoreError, match="disk I/O error; the disk holding .* is full"):
        Store(db, autoflush_s=0)
    assert {p.name: p.stat().st_size for p in db.parent.iterdir() if p.name != "filler"} == \
        {"flashmoe.db": db.stat().st_size, "flashmoe.db-shm": 3, "flashmoe.db-wal": 0}
    with pytest.raises(StoreError, match=f"cannot read {db} yet .*the disk holding {db} is full: make room"):
        queries.points(db, SERIES[0])          # a reader, once told to point --db elsewhere
    filler.unlink()
    assert queries.points(db, SERIES[0])[1].tolist() == [float(tick) for tick in range(100)]   # a reader first
    with Store(db, autoflush_s=0) as store:
        store.append(SERIES[0], T0 + 100, 100.0)
    assert sorted(p.name for p in db.parent.iterdir()) == ["flashmoe.db"]
    assert queries.points(db, SERIES[0])[1].tolist() == [float(tick) for tick in range(101)]
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
