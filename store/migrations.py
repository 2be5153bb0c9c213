"""Upgrading a store written by an older FlashMoE in place, inside the opener's transaction.

`UPGRADES[v]` turns a version-v store into version v + 1 and says what it did. A store whose
version no chain of them lifts (1: chunks without a format byte; a newer FlashMoE's; one no FlashMoE
wrote) is refused by writers and readers alike with `version_problem`'s reason and advice: readers
advise an upgrade only for a version the chain lifts.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from store.errors import StoreError
from store.schema import DDL, ROLLUPS, ROW_TABLE, SCHEMA_VERSION


def _v2_to_v3(conn: sqlite3.Connection, path: Path) -> str:
    """Per-minute rollups (built from the rows already there), cache_stats.prefetches (NULL for old
    rows: prefetches were not recorded), simulations.capacity as a fraction of experts."""
    counts = conn.execute("SELECT COUNT(*), GROUP_CONCAT(DISTINCT capacity) FROM simulations "
                          "WHERE NOT (capacity > 0 AND capacity <= 1)").fetchone()
    if counts[0]:
        raise StoreError(
            f"{path} holds {counts[0]} simulation results whose capacity ({counts[1]}) is not a "
            f"fraction of experts in (0, 1], as `flashmoe-cli simulate` reports it; delete them "
            f"(sqlite3 {path} \"DELETE FROM simulations WHERE NOT (capacity > 0 AND capacity <= 1)\") "
            f"and start again, or move the file aside to start a new store")
    conn.execute("ALTER TABLE cache_stats ADD COLUMN prefetches INTEGER")
    conn.execute("ALTER TABLE simulations RENAME TO simulations_v2")
    conn.execute(ROW_TABLE["simulations"].ddl()[0])
    conn.execute("INSERT INTO simulations SELECT t, trace, policy, CAST(capacity AS REAL), scope, hit_rate "
                 "FROM simulations_v2")
    conn.execute("DROP TABLE simulations_v2")
    for statement in DDL:            # the rollup tables and their triggers
        conn.execute(statement)
    for rollup in ROLLUPS:
        conn.execute(rollup.backfill())
    return "added per-minute rollups and cache_stats.prefetches; simulations.capacity is now a fraction"


def _v3_to_v4(conn: sqlite3.Connection, path: Path) -> str:
    """The disk_readers table (and its index)."""
    for statement in ROW_TABLE["disk_readers"].ddl():
        conn.execute(statement)
    return "added the disk_readers table"


def _v4_to_v5(conn: sqlite3.Connection, path: Path) -> str:
    """disk_readers.write_bytes_per_s (NULL for old rows: writes were not counted); a store upgraded from 3
    has it already, with the table made from this version's schema."""
    if "write_bytes_per_s" not in {column[1] for column in conn.execute("PRAGMA table_info(disk_readers)")}:
        conn.execute("ALTER TABLE disk_readers ADD COLUMN write_bytes_per_s REAL")
    return "added disk_readers.write_bytes_per_s"


UPGRADES: dict[int, Callable[[sqlite3.Connection, Path], str]] = {2: _v2_to_v3, 3: _v3_to_v4, 4: _v4_to_v5}
FIRST_VERSION = 1     # the first FlashMoE's stores: none was ever written with a lower version


def upgradable(version: int) -> bool:
    """Whether UPGRADES lift a store of `version` to SCHEMA_VERSION, one step after another (or it is there)."""
    while version < SCHEMA_VERSION and version in UPGRADES:
        version += 1
    return version == SCHEMA_VERSION


def version_problem(path: Path, version: int) -> str | None:
    """Why this FlashMoE cannot use a store of schema `version`, and what to do; None if a writer can (upgrading
    it in place if it is older)."""
    if upgradable(version):
        return None
    aside = f"move it aside (e.g. `mv {path} {path}.old`) and let the agent or the collector start a new store there"
    if version > SCHEMA_VERSION:
        why = (f"written by a newer FlashMoE (this one uses {SCHEMA_VERSION}): update this FlashMoE to the version "
               f"that wrote it, or {aside}")
    elif version >= FIRST_VERSION:
        why = f"written by an early FlashMoE whose stores this one (version {SCHEMA_VERSION}) cannot upgrade: {aside}"
    else:
        why = (f"a version no FlashMoE wrote (theirs run from {FIRST_VERSION} to {SCHEMA_VERSION}), so the file is "
               f"damaged or another application's: {aside}")
    return f"{path} has store schema version {version}, {why}"
