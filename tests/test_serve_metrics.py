"""Metrics: one Tick of deltas feeds both /metrics and the store rows."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

import bisect

from agent.experts.cache import READ_LATENCY_BOUNDS, CacheStats
from agent.prefetch_gate import MIN_SCORED, PrefetchGate
from agent.residency import LayerStats
from agent.serve.metrics import Metrics
from agent.serve.recorder import Recorder
from agent.serve.scheduler import RequestStats


def cache_stats(layers: list[LayerStats], bytes_read: int, reads: int, latencies: list[float],
                resident: int) -> CacheStats:
    """The cache's cumulative statistics after `reads` reads, the latencies of every one of them given."""
    counts = [0] * (len(READ_LATENCY_BOUNDS) + 1)
    for s in latencies:
        counts[bisect.bisect_left(READ_LATENCY_BOUNDS, s)] += 1
    return CacheStats(hits=sum(l.hits for l in layers), misses=sum(l.misses for l in layers), evictions=0,
                      prefetches=sum(l.prefetches for l in layers), prefetch_hits=0, bytes_read=bytes_read,
                      reads=reads, resident=resident, capacity=8, cap_bytes=8 * 4096, slot_bytes=4096,
                      backend="direct", policy="lru", scope="layer", layers=layers, read_latency_counts=counts,
                      read_s=sum(latencies))


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels)


def test_tick_exports_interval_deltas_once_to_prometheus():
    reg = CollectorRegistry()
    m = Metrics(reg, n_layers=2)
    assert sample(reg, "flashmoe_expert_cache_hits_total", layer="1") == 0.0  # every layer exported from the start
    first = m.tick(100.0, cache_stats([LayerStats(hits=3, misses=1), LayerStats(hits=1, misses=1)], 8192, 2,
                                      [0.001, 0.003], 2), 2, 1, 16, 10, {(0, 1): 3})
    second = m.tick(102.0, cache_stats([LayerStats(hits=7, misses=1), LayerStats(hits=1, misses=3, prefetches=2)],
                                       8192 + 4 * 4096, 6, [0.001, 0.003, 0.002, 0.002, 0.002, 0.002], 6),
                    3, 0, 12, 30, {})
    assert (second.hits, second.misses, second.interval_s, second.tokens) == (4, 2, 2.0, 20)
    assert second.tokens_per_s == 10.0
    assert second.layers[1].bytes_read == 4 * 4096 and second.layers[0].bytes_read == 0  # by each layer's reads
    assert second.reads == 4 and abs(second.read_latency_s - 0.002) < 1e-12  # only the reads new since the last tick
    assert sample(reg, "flashmoe_expert_cache_hits_total", layer="0") == 7
    assert sample(reg, "flashmoe_expert_cache_misses_total", layer="1") == 3
    assert sample(reg, "flashmoe_expert_cache_prefetches_total", layer="1") == 2
    assert sample(reg, "flashmoe_expert_read_bytes_total") == 8192 + 4 * 4096
    assert sample(reg, "flashmoe_expert_read_latency_seconds_count") == 6
    assert sample(reg, "flashmoe_batch_size") == 3 and sample(reg, "flashmoe_batch_limit") == 12
    assert sample(reg, "flashmoe_cache_bytes") == 6 * 4096
    assert sample(reg, "flashmoe_generated_tokens_total") == 30
    assert abs(sample(reg, "flashmoe_expert_cache_hit_ratio") - 8 / 12) < 1e-12  # both ticks are recent
    assert first.hit_rate == 4 / 6


def test_the_read_latency_histogram_counts_every_read_however_many_come_between_ticks():
    """It observed a sample of the latest 4,096 reads each tick: a preload of 50,000 lost 266 of them."""
    reg = CollectorRegistry()
    m = Metrics(reg, n_layers=1)
    latencies = [0.002] * 5000 + [0.3] * 3 + [5e-5] * 2
    m.tick(1.0, cache_stats([LayerStats()], 0, len(latencies), latencies, 1), 0, 0, 16, 0, {})
    assert sample(reg, "flashmoe_expert_read_latency_seconds_count") == 5005
    assert sample(reg, "flashmoe_expert_read_latency_seconds_bucket", le="5e-05") == 2     # le: at most
    assert sample(reg, "flashmoe_expert_read_latency_seconds_bucket", le="0.0025") == 5002
    assert sample(reg, "flashmoe_expert_read_latency_seconds_bucket", le="0.25") == 5002
    assert abs(sample(reg, "flashmoe_expert_read_latency_seconds_sum") - sum(latencies)) < 1e-9


def test_requests_that_end_unanswered_are_counted_by_reason(tmp_path):
    from store.db import Store
    from store import queries

    reg = CollectorRegistry()
    m = Metrics(reg, n_layers=1)
    assert sample(reg, "flashmoe_requests_unserved_total", reason="failed") == 0      # exported from the start
    stats = cache_stats([LayerStats()], 0, 0, [], 0)
    m.tick(1.0, stats, 0, 0, 16, 0, {}, unserved={"failed": 1, "refused": 2})
    tick = m.tick(2.0, stats, 0, 0, 16, 0, {}, unserved={"failed": 1, "refused": 5})
    assert (tick.requests_failed, tick.requests_refused) == (0, 3)     # the second's own
    assert sample(reg, "flashmoe_requests_unserved_total", reason="failed") == 1
    assert sample(reg, "flashmoe_requests_unserved_total", reason="refused") == 5
    with Store(tmp_path / "s.db", autoflush_s=0) as store:
        Recorder(store).write(tick, [])
    assert queries.latest(tmp_path / "s.db", "agent.requests_refused") == (2.0, 3)


def test_requests_feed_histograms_and_the_store_rows_alike(tmp_path):
    from store.db import Store
    from store import queries

    reg = CollectorRegistry()
    m = Metrics(reg, n_layers=1)
    m.request(RequestStats("r1", 50.0, ttft_s=0.2, tpot_s=0.05, latency_s=1.2, prompt_tokens=4,
                           completion_tokens=21, hits=10.4, misses=2.6, bytes_read=8192.0))
    assert sample(reg, "flashmoe_request_ttft_seconds_count") == 1
    assert sample(reg, "flashmoe_request_latency_seconds_sum") == 1.2
    assert sample(reg, "flashmoe_request_tpot_seconds_bucket", le="0.05") == 1
    tick = m.tick(60.0, cache_stats([LayerStats(hits=5, misses=5, prefetches=4, prefetch_hits=3)], 4096, 1, [0.004], 1),
                  1, 0, 16, 21, {(0, 2): 5})
    with Store(tmp_path / "s.db", autoflush_s=0) as store:
        Recorder(store).write(tick, m.drain_requests())
    rows = queries.requests(tmp_path / "s.db")
    assert [(r["request_id"], r["completion_tokens"], r["hits"], r["misses"], r["t"]) for r in rows] == \
        [("r1", 21, 10, 3, 51.2)]
    assert queries.activations(tmp_path / "s.db") == {(0, 2): 5}
    total = queries.cache_stats(tmp_path / "s.db")["total"]
    assert (total["prefetches"], total["prefetch_hits"]) == (4, 3)
    assert queries.latest(tmp_path / "s.db", "agent.hit_rate") == (60.0, 0.5)
    assert m.drain_requests() == []
    assert "flashmoe_request_latency_seconds_bucket" in generate_latest(reg).decode()


def test_every_exposed_sample_names_the_device():
    from prometheus_client.parser import text_string_to_metric_families

    from agent.serve.metrics import DeviceLabelled

    reg = CollectorRegistry()
    m = Metrics(reg, n_layers=2)
    m.tick(1.0, cache_stats([LayerStats(hits=1, misses=1), LayerStats()], 4096, 1, [0.001], 1), 1, 0, 16, 3, {})
    m.knob_changes.inc()
    exposed = generate_latest(DeviceLabelled(reg, "edge-01")).decode()
    families = {f.name: f for f in text_string_to_metric_families(exposed)}
    samples = [s for f in families.values() for s in f.samples]
    assert len(samples) > 50 and all(s.labels["device_name"] == "edge-01" for s in samples)
    assert families["flashmoe_agent_info"].samples[0].value == 1
    hits = {s.labels["layer"]: s.value for s in families["flashmoe_expert_cache_hits"].samples
            if s.name.endswith("_total")}
    assert hits == {"0": 1.0, "1": 0.0}                      # the layer label is kept beside the device's
    assert families["flashmoe_knob_changes"].samples[0].value == 1
    assert sample(reg, "flashmoe_expert_cache_hits_total", layer="0") == 1   # the registry itself is unchanged


def test_rereads_and_the_caps_bounds_reach_prometheus_and_the_store(tmp_path):
    from store.db import Store
    from store import queries

    reg = CollectorRegistry()
    m = Metrics(reg, n_layers=2)
    m.tick(10.0, cache_stats([LayerStats(), LayerStats()], 0, 0, [], 0), 0, 0, 16, 0, {}, (1024, 8192))
    tick = m.tick(11.0, cache_stats([LayerStats(hits=4, misses=4, rereads=3), LayerStats(hits=4, misses=4, rereads=1)],
                                    0, 0, [], 0), 0, 0, 16, 0, {}, (1024, 8192))
    assert tick.reread_rate == 0.25       # of the 16 lookups, not of the 8 misses
    assert sample(reg, "flashmoe_expert_cache_rereads_total", layer="0") == 3
    assert sample(reg, "flashmoe_cache_cap_max_bytes") == 8192 and sample(reg, "flashmoe_cache_cap_min_bytes") == 1024
    with Store(tmp_path / "s.db", autoflush_s=0) as store:
        Recorder(store).write(tick, [])
    assert queries.latest(tmp_path / "s.db", "agent.reread_rate") == (11.0, 0.25)
    assert queries.latest(tmp_path / "s.db", "agent.cache_cap_max_bytes") == (11.0, 8192)
    idle = m.tick(12.0, cache_stats([LayerStats(hits=4, misses=4, rereads=3), LayerStats(hits=4, misses=4, rereads=1)],
                                    0, 0, [], 0), 0, 0, 16, 0, {}, (1024, 8192))
    assert idle.reread_rate is None and "agent.reread_rate" not in Recorder.series(idle)   # no lookups: no rate


def test_the_adaptive_prefetchs_state_reaches_prometheus():
    reg = CollectorRegistry()
    m = Metrics(reg, n_layers=1)
    gate = PrefetchGate()
    gate.score(1, 3 * MIN_SCORED)                         # poor guesses: reads held back
    stats = cache_stats([LayerStats()], 0, 0, [], 0)
    stats.prefetch = gate.state()
    m.tick(1.0, stats, 0, 0, 16, 0, {})
    assert sample(reg, "flashmoe_prefetch_issuing") == 0
    assert sample(reg, "flashmoe_prefetch_guess_accuracy") == 1 / (1 + 3 * MIN_SCORED)
    assert sample(reg, "flashmoe_prefetch_break_even") == 0.5
