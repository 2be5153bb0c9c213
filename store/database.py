"""Opening the store file: WAL mode, the schema created or upgraded in one transaction.

A FlashMoE store is marked in its SQLite header (`PRAGMA application_id`, APPLICATION_ID); a
writer refuses an SQLite file that holds tables of another application rather than add its own to
it. Stores written before the mark (a `meta` and a `chunks` table) are marked when next opened.
A file that cannot be created or written is explained by where it is (machine.mounts).
"""
from __future__ import annotations

import logging
import os
import sqlite3
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from machine.mounts import mount_of
from store.errors import StoreError
from store.migrations import UPGRADES, version_problem
from store.schema import DDL, SCHEMA_VERSION

log = logging.getLogger(__name__)

APPLICATION_ID = 0x464D4F45    # "FMOE"
WAL_CHECKPOINT_PAGES = 256     # checkpoint the write-ahead log once it holds this many pages (1 MiB)...
WAL_LIMIT_BYTES = 1 << 20      # ...and truncate it to this size when it starts over
NO_ROOM_BYTES = 64 << 10       # free bytes under which a disk counts as full
COMPACT_ROOM_BYTES = 128 << 10  # free bytes store compaction needs: the log's index and one batch (measured)


def place_problem(path: Path) -> str | None:
    """Why no store can be written at `path`, if its place says so: a kernel filesystem such as
    /proc or /sys, a read-only mount, a directory this user cannot write, a directory, or a device."""
    mount = mount_of(path)
    if mount is not None and mount.is_kernel_interface:
        return (f"{mount.point} is the kernel's {mount.fstype} filesystem, whose files are kernel "
                f"interfaces; put --db on a disk, e.g. data/flashmoe.db")
    if mount is not None and mount.read_only:
        return f"{mount.point} is mounted read-only; remount it read-write or put --db elsewhere"
    if path.is_dir():
        return "it is a directory; name a file in it, e.g. flashmoe.db"
    if path.exists() and not path.is_file():   # /dev/null: SQLite said "disk I/O error"
        return f"it is {not_a_file(path)}, not a file; name a file, e.g. data/flashmoe.db"
    existing = path if path.exists() else next(p for p in path.absolute().parents if p.exists())
    if not os.access(existing, os.W_OK):
        return f"{existing} is not writable by this user; fix its permissions or put --db elsewhere"
    return None


def check_place(path: Path) -> None:
    """A StoreError if place_problem finds one: a writer checks before it starts work that takes long."""
    problem = place_problem(path)
    if problem is not None:
        raise StoreError(f"cannot write the store {path}: {problem}")


def not_a_file(path: Path) -> str:
    """What an existing `path` that is no regular file is (a device, a named pipe: SQLite calls the one a
    "disk I/O error" and waits for a writer on the other)."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a directory" if stat.S_ISDIR(mode) else "a special file")


def is_busy(error: sqlite3.Error) -> bool:
    """Whether another connection held the lock past the busy timeout (the file itself may be fine)."""
    text = str(error).lower()
    return "locked" in text or "busy" in text


def advice_for(error: sqlite3.Error, path: Path, new: bool = False) -> str:
    """What an operator should do about a write error (shared by the writer and the CLI); `new`: the error
    came while creating the store, which then holds nothing to compact."""
    text = str(error).lower()
    if is_busy(error):
        return (f"another connection holds the write lock on {path} beyond the busy timeout; "
                f"find it with `fuser {path}` and end its long transaction")
    full = "full" in text or ("disk i/o error" in text and no_room(path))
    if full and new:
        return f"the disk holding {path} is full: free space on it, or pass a --db on another disk"
    if full:
        return (f"the disk holding {path} is full: make room in the store with `flashmoe-cli store compact --db {path} "
                f"--retention-days N` (N under the collector's --retention-days, 7 by default), which deletes older "
                f"data a little at a time in {COMPACT_ROOM_BYTES >> 10} KiB of free space plus the size of the store's "
                f"log ({path}-wal, at most about {WAL_LIMIT_BYTES >> 20} MiB), and the store reuses what it frees (the "
                f"file keeps its size); or free space on the disk (delete other files there, or stop the agent and the "
                f"collector and move the store to a larger disk)")
    if "readonly" in text or "read-only" in text or "unable to open" in text:
        return place_problem(path) or f"{path} or its directory is not writable by this user; fix the permissions"
    return f"check that {path} is a FlashMoE store on a healthy disk"


def no_room(path: Path) -> bool:
    """The filesystem holding `path` has less than a few pages free (SQLite calls failing to create its
    shared-memory file there a "disk I/O error")."""
    return short_of_room(path, NO_ROOM_BYTES)


def short_of_room(path: Path, room: int) -> bool:
    """The filesystem holding `path` has less than `room` bytes free."""
    try:
        return shutil.disk_usage(path.absolute().parent).free < room
    except OSError:
        return False


def open_database(path: Path, busy_timeout_s: float, create: bool = True,
                  device_name: str | None = None) -> sqlite3.Connection:
    """Open (or, with `create`, create) the store file in WAL mode with the schema in place; a writer
    that names its device claims the store for it (claim_device). Without `create`, a file that holds
    no store (missing, empty, or no tables) is refused and left as it is.

    Plain sqlite3, not sqlite-utils: importing sqlite-utils imports pandas when it is installed
    (streamlit brings it), which cost the always-on collector 1.7 s at start and ~80 MB of RSS on
    a box whose RAM is for experts."""
    if not create and not path.exists():
        raise StoreError(f"there is no store at {path}; check --db")
    new, made = not path.exists(), missing_parents(path)   # a store that cannot be made leaves neither
    check_place(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    except (OSError, sqlite3.Error) as e:
        remove_empty(made)
        raise StoreError(f"cannot create the store {path}: {e}") from e
    try:
        _refuse_foreign(conn, path)          # before WAL mode, which rewrites the file's header
        if not create and not table_names(conn):   # as readers see it (store.queries.connect_ro): no store yet
            what = "the file is empty" if path.stat().st_size == 0 else "the SQLite file holds no tables"
            raise StoreError(f"there is no store at {path}: {what} (left as it is); check --db")
        usable_version(conn, path)           # before WAL mode too
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            log.warning("%s stays in %s journal mode (WAL refused, e.g. a network filesystem): "
                        "readers may briefly block writers", path, mode)
        conn.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: a crash loses no committed data
        conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_CHECKPOINT_PAGES}")  # not 1000: a small disk
        conn.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT_BYTES}")      # must not fill up with log
        # One transaction: a writer killed mid-creation or mid-upgrade leaves no half-made schema behind.
        with transaction(conn):
            upgrades = _ensure_schema(conn, path)
            if device_name is not None:
                claim_device(conn, path, device_name)
        for version, done in upgrades:   # once committed: a full disk rolls an upgrade back, unsaid
            log.warning("upgraded %s to store schema version %d: %s", path, version, done)
    except sqlite3.DatabaseError as e:
        conn.close()
        if new:   # not left behind as an empty file: the next writer would take it for a store
            for leftover in store_files(path):
                leftover.unlink(missing_ok=True)
            remove_empty(made)
        raise StoreError(f"cannot {'create' if new else 'open'} {path} as a FlashMoE store: {e}; "
                         f"{advice_for(e, path, new)}") from e
    except StoreError:
        conn.close()
        raise
    return conn


def missing_parents(path: Path) -> list[Path]:
    """The directories above `path` that do not exist yet, deepest first: what writing `path` makes."""
    return [d for d in path.absolute().parents if not d.exists()]


def remove_empty(directories: list[Path]) -> None:
    """Remove the directories a write made (deepest first), each only if it is still empty (the agent's pid
    file, a store, an expert store: agent.atomic_file)."""
    for d in directories:
        with suppress(OSError):
            d.rmdir()


def store_files(path: Path) -> tuple[Path, Path, Path]:
    """The store file, and the write-ahead log and its index that SQLite keeps beside it in WAL mode."""
    return path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")


def remove_unshared(path: Path) -> bool:
    """Remove the store at `path`, which this process made and has closed, unless another connection has it
    open (a collector that found it meanwhile would write on into a deleted file). SQLite removes the log and
    its index when the last connection to a WAL-mode store closes; one still there is another connection's. A
    store in another journal mode (WAL refused) shows no such sign, so it is kept."""
    try:
        with path.open("rb") as f:
            wal_mode = f.read(20)[18:20] == b"\x02\x02"   # the header's read and write versions: 2 is WAL
    except OSError:
        return False
    if not wal_mode or any(p.exists() for p in store_files(path)[1:]):
        return False
    path.unlink()
    return True


def table_names(conn: sqlite3.Connection) -> set[str]:
    """The tables of the SQLite file: none in a file that is no store yet (empty, or a writer is creating it)."""
    return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def foreign(conn: sqlite3.Connection) -> str | None:
    """What makes this SQLite file another application's, or None if it is a FlashMoE store (marked,
    or from before the mark) or holds no tables yet."""
    (app_id,) = conn.execute("PRAGMA application_id").fetchone()
    tables = sorted(table_names(conn))
    if app_id == APPLICATION_ID or not tables or (app_id == 0 and {"meta", "chunks"} <= set(tables)):
        return None
    mark = f"application_id {app_id:#x}" if app_id else "no FlashMoE mark"
    shown = ", ".join(tables[:8]) + (f" and {len(tables) - 8} more" if len(tables) > 8 else "")
    return f"it is an SQLite database of another application ({mark}; tables: {shown})"


def _refuse_foreign(conn: sqlite3.Connection, path: Path) -> None:
    problem = foreign(conn)
    if problem is not None:
        raise StoreError(f"{path}: {problem}. FlashMoE adds no tables to it; point --db at a new file "
                         f"or at a FlashMoE store (e.g. data/flashmoe.db)")


def claim_device(conn: sqlite3.Connection, path: Path, device_name: str) -> None:
    """One store holds one device's telemetry, so its rows need no device column: the first writer
    that names its device records it in meta, and a writer for another device is refused."""
    conn.execute("INSERT OR IGNORE INTO meta VALUES ('device_name', ?)", (device_name,))
    stored = conn.execute("SELECT value FROM meta WHERE key = 'device_name'").fetchone()[0]
    if stored != device_name:
        raise StoreError(f"{path} holds the telemetry of device {stored!r}, not {device_name!r}: each device keeps "
                         f"its own store; give this device its own --db, or pass --device-name {stored}")


def _ensure_schema(conn: sqlite3.Connection, path: Path) -> list[tuple[int, str]]:
    """Create the schema in a new file, or upgrade an older store in place (store.migrations); returns
    each upgrade's new version and what it did."""
    if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")   # new, or written before the mark
    version = usable_version(conn, path)   # again in the transaction: another writer may have changed it
    if version is None:
        for statement in DDL:
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        return []
    upgrades = []
    while version < SCHEMA_VERSION:
        done = UPGRADES[version](conn, path)
        version += 1
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
        upgrades.append((version, done))
    return upgrades


def usable_version(conn: sqlite3.Connection, path: Path) -> int | None:
    """The store's schema version (None: no schema yet) if this FlashMoE can write it (an older one once
    upgraded); otherwise a StoreError that says why and what to do (store.migrations.version_problem)."""
    version = stored_schema_version(conn, path)
    problem = None if version is None else version_problem(path, version)
    if problem is not None:
        raise StoreError(problem)
    return version


def stored_schema_version(conn: sqlite3.Connection, path: Path) -> int | None:
    """The schema version the store records, or None for a file with no schema yet. A `meta` table
    without a whole-number version is damage (the schema is made in one transaction), not a new store."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone():
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    try:
        return int(row[0])
    except (TypeError, ValueError):
        found = "no schema_version" if row is None else f"schema_version {row[0]!r}, not a whole number"
        raise StoreError(f"{path} is a damaged FlashMoE store: its meta table holds {found}; "
                         f"move it aside to start a new store") from None


def record_lost(conn: sqlite3.Connection, points: int, rows: int) -> None:
    """Add to the store's counts of the points and rows its writers lost (store.queries.lost reads
    them), inside the caller's transaction."""
    for key, n in (("lost_points", points), ("lost_rows", rows)):
        if n:
            conn.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET "
                         "value = CAST(value AS INTEGER) + CAST(excluded.value AS INTEGER)", (key, str(n)))


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back if anything in it fails."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.rollback()
        raise
