"""Opening the store file: WAL mode, the schema created or upgraded in one transaction."""
from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from store.errors import StoreError
from store.migrations import UPGRADES
from store.schema import DDL, SCHEMA_VERSION

log = logging.getLogger(__name__)


def advice_for(error: sqlite3.Error, path: Path) -> str:
    """What an operator should do about a write error (shared by the writer and the CLI)."""
    text = str(error).lower()
    if "locked" in text or "busy" in text:
        return (f"another connection holds the write lock on {path} beyond the busy timeout; "
                f"find it with `fuser {path}` and end its long transaction")
    if "full" in text:
        return f"the disk holding {path} is full; free space there or shorten the retention"
    if "readonly" in text or "read-only" in text:
        return f"{path} or its directory is not writable by this user; fix the permissions"
    return f"check that {path} is a FlashMoE store on a healthy disk"


def open_database(path: Path, busy_timeout_s: float, create: bool = True) -> sqlite3.Connection:
    """Open (or, with `create`, create) the store file in WAL mode with the schema in place.

    Plain sqlite3, not sqlite-utils: importing sqlite-utils imports pandas when it is installed
    (streamlit brings it), which cost the always-on collector 1.7 s at start and ~80 MB of RSS on
    a box whose RAM is for experts."""
    if not create and not path.exists():
        raise StoreError(f"there is no store at {path}; check --db")
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None,
                           check_same_thread=False)
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            log.warning("%s stays in %s journal mode (WAL refused, e.g. a network filesystem): "
                        "readers may briefly block writers", path, mode)
        conn.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: a crash loses no committed data
        # One transaction: a writer killed mid-creation or mid-upgrade leaves no half-made schema behind.
        conn.execute("BEGIN IMMEDIATE")
        try:
            _ensure_schema(conn, path)
            conn.execute("COMMIT")
        except BaseException:
            conn.rollback()
            raise
    except sqlite3.DatabaseError as e:
        conn.close()
        raise StoreError(f"cannot open {path} as a FlashMoE store: {e}; "
                         f"{advice_for(e, path)}") from e
    except StoreError:
        conn.close()
        raise
    return conn


def _ensure_schema(conn: sqlite3.Connection, path: Path) -> None:
    """Create the schema in a new file, or upgrade an older store in place (store.migrations)."""
    has_meta = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() if has_meta else None
    if row is None:
        for statement in DDL:
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        return
    version = int(row[0])
    while version < SCHEMA_VERSION and version in UPGRADES:
        done = UPGRADES[version](conn, path)
        version += 1
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
        log.warning("upgraded %s to store schema version %d: %s", path, version, done)
    if version != SCHEMA_VERSION:
        raise StoreError(f"{path} has store schema version {version}, this FlashMoE uses "
                         f"{SCHEMA_VERSION} and cannot upgrade it; move the old file aside to start a new store")
