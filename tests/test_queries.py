"""Read-only queries: downsampling against a reference, every record type, missing files."""
import sqlite3

import numpy as np
import pytest

from store import queries
from store.db import Store
from store.errors import StoreError

T0 = 1_700_000_000.0


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "flashmoe.db"


def reference_buckets(t, v, since, until, buckets):
    width = (until - since) / buckets
    out = {}
    for ti, vi in zip(t, v):
        if since <= ti <= until:
            out.setdefault(min(int((ti - since) // width), buckets - 1), []).append(vi)
    return [(since + i * width, min(g), sum(g) / len(g), max(g)) for i, g in sorted(out.items())]


@pytest.mark.parametrize("buckets,window", [(7, (T0, T0 + 999)), (50, (T0 + 123.5, T0 + 700)),
                                            (2000, (T0 - 50, T0 + 2000))])
def test_series_downsamples_like_a_plain_reference(store_path, buckets, window):
    rng = np.random.default_rng(3)
    t = T0 + np.arange(1000)
    v = np.round(rng.normal(50, 10, 1000), 2)
    with Store(store_path, chunk_points=64, autoflush_s=0) as store:
        for ti, vi in zip(t, v):
            store.append("psi.io.some_avg10", float(ti), float(vi))
    got = queries.series(store_path, "psi.io.some_avg10", *window, buckets=buckets)
    want = reference_buckets(t.tolist(), v.tolist(), *window, buckets)
    assert len(got) == len(want) and len(got) <= buckets
    assert np.allclose(np.array(got), np.array(want))


def test_series_without_a_window_spans_all_points(store_path):
    with Store(store_path, autoflush_s=0) as store:
        for i in range(10):
            store.append("mem.dirty_bytes", T0 + i, 4096 * i)
    [(start, lo, avg, hi)] = queries.series(store_path, "mem.dirty_bytes", buckets=1)
    assert (start, lo, avg, hi) == (T0, 0.0, 4096 * 4.5, 4096 * 9.0)
    assert queries.latest(store_path, "mem.dirty_bytes") == (T0 + 9, 36864.0)
    with pytest.raises(ValueError, match="buckets must be >= 1"):
        queries.series(store_path, "mem.dirty_bytes", buckets=0)
    with pytest.raises(ValueError, match="is before since"):
        queries.series(store_path, "mem.dirty_bytes", T0 + 5, T0)


def test_missing_file_gives_empty_results(tmp_path):
    missing = tmp_path / "not-yet.db"
    assert queries.series(missing, "block.vda.util") == []
    assert queries.series_names(missing) == [] and queries.latest(missing, "x") is None
    assert queries.requests(missing) == [] and queries.latency_quantiles(missing) == []
    assert queries.cache_stats(missing) == {"over_time": [], "per_layer": [], "total": None}
    assert queries.activations(missing) == {} and queries.latest_knobs(missing) == {}
    assert queries.knob_history(missing) == [] and queries.events(missing) == []
    assert queries.simulations(missing) == [] and queries.sweeps(missing) == []
    assert not missing.exists()                       # reading never creates the file


def test_a_file_that_is_not_a_store_raises_store_error(tmp_path):
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE x (a)")
    with pytest.raises(StoreError,
                       match="other.db is not a FlashMoE store: it is an SQLite database of another application"):
        queries.series_names(other)


def test_readers_are_read_only(store_path):
    Store(store_path, autoflush_s=0).close()
    conn = queries.connect_ro(store_path)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        conn.execute("INSERT INTO events (t, kind, message) VALUES (0, 'x', 'y')")
    conn.close()


def test_requests_and_latency_quantiles(store_path):
    rng = np.random.default_rng(5)
    latencies = rng.exponential(0.5, 200)
    with Store(store_path, autoflush_s=0) as store:
        for i, latency in enumerate(latencies):
            ttft = None if i % 10 == 0 else latency / 4
            store.record_request(T0 + i, f"r{i}", ttft, 0.02, float(latency), 10, 30, 5, 1, 1 << 20)
    assert len(queries.requests(store_path, T0 + 50, T0 + 59)) == 10
    rows = queries.latency_quantiles(store_path, T0, T0 + 200, buckets=2)
    assert [r["n"] for r in rows] == [100, 100]
    first = latencies[:100]
    assert rows[0]["latency_s"][0.95] == pytest.approx(np.quantile(first, 0.95))
    ttfts = [x / 4 for i, x in enumerate(first) if i % 10]
    assert rows[0]["ttft_s"][0.5] == pytest.approx(np.quantile(ttfts, 0.5))


def test_cache_stats_over_time_per_layer_and_total(store_path):
    with Store(store_path, autoflush_s=0) as store:
        for i in range(10):
            store.record_cache_stats(T0 + i, 0, hits=9, misses=1, evictions=1, prefetch_hits=2,
                                     bytes_read=100, read_latency_s=0.001, prefetches=4)
            store.record_cache_stats(T0 + i, 1, hits=i, misses=10 - i, evictions=0, prefetch_hits=3,
                                     bytes_read=1000, read_latency_s=None)      # prefetches not counted
    stats = queries.cache_stats(store_path, T0, T0 + 10, buckets=2)
    assert [b["hits"] for b in stats["over_time"]] == [45 + 10, 45 + 35]
    assert stats["over_time"][0]["hit_rate"] == pytest.approx(55 / 100)
    layer0, layer1 = stats["per_layer"]
    assert (layer0["layer"], layer0["hit_rate"], layer0["prefetch_accuracy"]) == (0, 0.9, 0.5)
    assert layer0["reads_per_lookup"] == 0.5     # 90% hits, yet every other lookup cost a read: 1 miss, 4 prefetches
    assert layer0["read_latency_s"] == pytest.approx(0.001)
    assert (layer1["hits"], layer1["misses"], layer1["read_latency_s"]) == (45, 55, None)
    assert (layer1["prefetches"], layer1["prefetch_accuracy"]) == (0, None)    # not counted: no ratio
    total = stats["total"]
    assert (total["hits"], total["misses"], total["evictions"], total["prefetches"], total["prefetch_hits"]) == \
        (135, 65, 10, 40, 50)
    assert (total["hit_rate"], total["prefetch_accuracy"], total["bytes_read"]) == (135 / 200, 0.5, 11_000)
    assert total["reads_per_lookup"] == (65 + 40) / 200
    assert total["read_latency_s"] == pytest.approx(0.001)
    assert queries.cache_stats(store_path, T0 + 100, T0 + 200) == {"over_time": [], "per_layer": [], "total": None}


def test_activations_knobs_events_simulations_sweeps(store_path):
    with Store(store_path, autoflush_s=0) as store:
        store.record_activations(T0, {(0, 1): 5, (0, 2): 1, (3, 7): 2})
        store.record_activations(T0 + 10, {(0, 1): 4})
        store.record_knob_change(T0, "policy", "lru", "flashmoe", "dashboard")
        store.record_knob_change(T0 + 1, "prefetch", None, {"depth": 2}, "api")
        store.record_knob_change(T0 + 2, "policy", "flashmoe", "arc", "dashboard")
        store.record_event(T0, "agent.down", "the agent is not running")
        store.record_event(T0 + 5, "device.hotplug", "add block device sdb")
        store.record_simulation(T0, "held-out.jsonl", "belady", 0.25, "layer", 0.81)
        store.record_sweep(T0, 2 << 30, 14.2, 0.7)
        store.record_sweep(T0, 1 << 30, 9.5, 0.55)
    assert queries.activations(store_path) == {(0, 1): 9, (0, 2): 1, (3, 7): 2}
    assert queries.activations(store_path, since=T0 + 5) == {(0, 1): 4}
    assert queries.latest_knobs(store_path) == {"policy": "arc", "prefetch": {"depth": 2}}
    history = queries.knob_history(store_path, limit=2)
    assert [(h["knob"], h["old"], h["new"]) for h in history] == [("policy", "flashmoe", "arc"),
                                                                  ("prefetch", None, {"depth": 2})]
    assert [e["kind"] for e in queries.events(store_path)] == ["agent.down", "device.hotplug"]
    assert [e["kind"] for e in queries.events(store_path, since=T0 + 1)] == ["device.hotplug"]
    assert [(s["capacity"], s["hit_rate"]) for s in queries.simulations(store_path)] == [(0.25, 0.81)]
    assert [s["cache_cap_bytes"] for s in queries.sweeps(store_path)] == [1 << 30, 2 << 30]


def test_series_info_counts_points_and_bytes(store_path):
    with Store(store_path, chunk_points=100, autoflush_s=0) as store:
        for i in range(250):
            store.append("block.vda.util", T0 + i, 0.25)
        store.declare("agent.idle", "x")
    info = {i.name: i for i in queries.series_info(store_path)}
    util = info["block.vda.util"]
    assert (util.points, util.chunks, util.t_first, util.t_last) == (250, 3, T0, T0 + 249)
    assert 0 < util.bytes_per_point < 0.5
    assert queries.series_names(store_path) == ["block.vda.util"]    # declared, no points: not listed
