"""Rows of the declared row tables (store.schema.ROW_TABLES), buffered until the next flush.

Not thread-safe on its own: the Store holds its lock around every call, and runs `write` inside
its transaction.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import Any

from store.schema import ROW_TABLE
from store.series_writer import trim_oldest

Row = tuple[Any, ...]
Pending = dict[str, list[Row]]


class RowWriter:
    def __init__(self) -> None:
        self.rows: dict[str, list[Row]] = {name: [] for name in ROW_TABLE}

    def add(self, table: str, rows: Iterable[Row]) -> None:
        width = len(ROW_TABLE[table].inserted)
        rows = list(rows)
        for row in rows:
            if len(row) != width:
                raise ValueError(f"a {table} row has {width} values ({', '.join(ROW_TABLE[table].inserted)}), "
                                 f"not {len(row)}")
        self.rows[table].extend(rows)

    def pending(self) -> Pending:
        return {table: list(rows) for table, rows in self.rows.items() if rows}

    @staticmethod
    def write(conn: sqlite3.Connection, pending: Pending) -> None:
        for table, rows in pending.items():
            conn.executemany(ROW_TABLE[table].insert, rows)

    def written(self, pending: Pending, _: None = None) -> None:
        for table, rows in pending.items():
            del self.rows[table][:len(rows)]

    def held(self) -> int:
        return sum(len(rows) for rows in self.rows.values())

    def trim(self, limit: int) -> int:
        """Drop the oldest held rows beyond `limit` per table; returns how many were dropped."""
        return sum(trim_oldest(rows, limit) for rows in self.rows.values())
