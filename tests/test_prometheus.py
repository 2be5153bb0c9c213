"""A real Prometheus server scrapes the agent's /metrics and the collector's `collect --listen` with
examples/alerts.yml loaded; the hit-rate series, the device name on every series, the count of knob
changes and the machine's readings under node_exporter's names are read back through its query API."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from agents import CLI, ROOT, demo_model, free_port, spawn, start_agent, start_prometheus, stop, wait_http
from test_serve import wait_for

DEVICE = "edge-test"
HIT_RATE = ('sum(flashmoe_expert_cache_hits_total) / '
            '(sum(flashmoe_expert_cache_hits_total) + sum(flashmoe_expert_cache_misses_total))')


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = start_agent(demo_model(tmp_path_factory), tmp_path_factory.mktemp("prom-agent"), "--cache-cap", "25%",
                    "--device-name", DEVICE)
    yield a
    a.stop()


@pytest.fixture(scope="module")
def collector(agent) -> str:
    """`collect --listen` for the agent's device, writing to the agent's store; yields its scrape address."""
    port, log = free_port(), agent.db.parent / "collector.log"
    proc = spawn([*CLI, "collect", "--db", str(agent.db), "--pid-file", str(agent.pid_file), "--device-name", DEVICE,
                  "--listen", f"127.0.0.1:{port}"], log)
    wait_http(f"http://127.0.0.1:{port}/metrics", proc, log)
    yield f"127.0.0.1:{port}"
    assert stop(proc) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def prometheus(agent, collector, tmp_path_factory):
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(ROOT / "examples" / "alerts.yml")],
              "scrape_configs": [
                  {"job_name": "flashmoe", "static_configs": [{"targets": [agent.url.removeprefix("http://")]}]},
                  {"job_name": "flashmoe-collector", "static_configs": [{"targets": [collector]}]}]}
    server = start_prometheus(tmp_path_factory.mktemp("prometheus"), config)
    yield server
    server.stop()


def test_prometheus_scrapes_the_hit_rate_and_per_layer_counters(agent, prometheus):
    wait_for(lambda: prometheus.query('up{job="flashmoe"} == 1'), 30, "the first successful scrape")
    for i in range(3):
        agent.complete(prompt=f"scrape me {i}", max_tokens=4, temperature=0)
    status = wait_for(lambda: (s := agent.get("/v1/status").json()) and s["cache"]["hits"] > 0 and s, 15, "hits")
    expected = status["cache"]["hits"] / (status["cache"]["hits"] + status["cache"]["misses"])

    def scraped_rate():
        rows = prometheus.query(HIT_RATE)
        return rows and abs(float(rows[0]["value"][1]) - expected) < 1e-9 and float(rows[0]["value"][1])
    rate = wait_for(scraped_rate, 30, "Prometheus to hold the agent's hit rate")
    assert 0 < rate < 1
    layers = prometheus.query("flashmoe_expert_cache_misses_total")
    assert sorted(r["metric"]["layer"] for r in layers) == ["0", "1"]
    series = httpx.get(prometheus.url + "/api/v1/query_range",
                       params={"query": "flashmoe_expert_cache_hit_ratio", "start": time.time() - 120,
                               "end": time.time(), "step": "1s"},
                       timeout=10).json()["data"]["result"]
    assert series and len(series[0]["values"]) >= 1
    latency = prometheus.query("flashmoe_request_latency_seconds_count")
    assert float(latency[0]["value"][1]) >= 3


def test_every_series_carries_the_device_name_and_knob_changes_are_counted(agent, prometheus):
    wait_for(lambda: prometheus.query('up{job="flashmoe"} == 1'), 30, "the first successful scrape")
    unlabelled = prometheus.query('{job="flashmoe", device_name="", __name__=~"flashmoe_.*"}')
    assert unlabelled == []
    assert [r["metric"]["device_name"] for r in prometheus.query("flashmoe_agent_info")] == [DEVICE]
    before = float(prometheus.query("flashmoe_knob_changes_total")[0]["value"][1])
    cap = agent.get("/v1/knobs").json()["cache_cap_bytes"]
    r = httpx.put(agent.url + "/v1/knobs", json={"cache_cap_bytes": cap["min"], "prefetch": False}, timeout=30)
    assert r.status_code == 200, r.text
    wait_for(lambda: float(prometheus.query("flashmoe_knob_changes_total")[0]["value"][1]) == before + 2, 30,
             "two more knob changes")


def test_the_collector_exports_the_machine_under_exporter_names(agent, prometheus):
    wait_for(lambda: prometheus.query('up{job="flashmoe-collector"} == 1'), 30, "the collector's first scrape")
    for name in ("node_memory_MemAvailable_bytes", "node_disk_read_bytes_total", "node_disk_io_time_seconds_total",
                 "node_vmstat_pgmajfault", "flashmoe_agent_resident_memory_bytes",
                 "flashmoe_agent_major_page_faults_total"):
        rows = prometheus.query(name)
        assert rows and all(r["metric"]["device_name"] == DEVICE for r in rows), name
    assert float(prometheus.query("flashmoe_agent_resident_memory_bytes")[0]["value"][1]) > 0
    if Path("/proc/pressure/memory").exists():
        assert prometheus.query("node_pressure_memory_stalled_seconds_total")
    utilisation = wait_for(lambda: prometheus.query("device_name:node_disk_io_time_seconds:max_rate5m"), 30,
                           "the recorded disk utilisation")
    assert utilisation[0]["metric"]["device_name"] == DEVICE and 0 <= float(utilisation[0]["value"][1]) <= 1
