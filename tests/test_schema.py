"""The schema catalogue declares every series and row table once; what is derived from it holds."""
from __future__ import annotations

import dataclasses
import sqlite3

from agent.serve.metrics import Tick
from machine.block import BlockRates
from machine.nvme import SmartLog
from store.db import Store
from store.schema import CATALOGUE, ROW_TABLES, fields_of, series_of, spec_for


def test_every_series_names_the_reading_that_produces_it():
    readings = {spec.reading for spec in CATALOGUE}
    assert "" not in readings
    assert readings == {"block", "meminfo", "status", "faults", "cgroup", "vmstat", "psi", "smart", "self", "tick",
                        "disk_readers"}


def test_the_fields_of_block_rates_and_of_the_agents_tick_are_attributes_there():
    assert set(fields_of("block")) == {f.name for f in dataclasses.fields(BlockRates)}
    tick = Tick(t=10.0, interval_s=2.0, layers=[], bytes_read=4096, reads=2, read_s=0.004, batch_size=3,
                batch_limit=8, queue_depth=1, tokens=20, cache_bytes=1 << 20, cap_bytes=2 << 20, activations={},
                unserved={"failed": 0, "refused": 1})
    values = {name: getattr(tick, name) for name in fields_of("tick")}
    assert series_of("tick", values) == {
        "agent.tokens_per_s": 10.0, "agent.batch_size": 3, "agent.batch_limit": 8, "agent.queue_depth": 1,
        "agent.cache_bytes": 1 << 20, "agent.cache_cap_bytes": 2 << 20, "agent.read_latency_s": 0.002,
        "agent.read_bytes_per_s": 2048.0, "agent.requests_failed": 0, "agent.requests_refused": 1,
        "agent.requests_abandoned": 0}
    # no hit rate in a tick without accesses: not written
    smart = {f.name for f in dataclasses.fields(SmartLog)} | {
        name for name, v in vars(SmartLog).items() if isinstance(v, property)} | {"temp_sensor{n}_c"}
    assert set(fields_of("smart")) <= smart


def test_series_of_fills_labels_and_the_fields_own_placeholders():
    out = series_of("smart", {"temp_sensor3_c": 40.0, "composite_temperature_c": 31.2, "media_errors": None,
                              "not_in_the_catalogue": 1.0}, ctrl="nvme1")
    assert out == {"nvme.nvme1.temp_sensor3_c": 40.0, "nvme.nvme1.temperature_c": 31.2}
    assert all(spec_for(name) is not None for name in out)


def test_a_new_store_has_exactly_the_declared_row_tables_and_their_inserts_work(tmp_path):
    path = tmp_path / "flashmoe.db"
    Store(path, autoflush_s=0).close()
    with sqlite3.connect(path) as conn:
        for table in ROW_TABLES:
            columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table.name})")]
            assert columns == [name for name, _ in table.columns]
            assert table.insert.count("?") == len(table.inserted) == len(columns) - ("id" in columns)
