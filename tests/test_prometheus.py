"""A real Prometheus server scrapes the agent's /metrics; the hit-rate series is read back through its query API."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from test_serve import demo_model, free_port, start_agent, wait_for

PROMETHEUS = "/usr/bin/prometheus"
HIT_RATE = ('sum(flashmoe_expert_cache_hits_total) / '
            '(sum(flashmoe_expert_cache_hits_total) + sum(flashmoe_expert_cache_misses_total))')


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = start_agent(demo_model(tmp_path_factory), tmp_path_factory.mktemp("prom-agent"), "--cache-cap", "25%")
    yield a
    a.stop()


@pytest.fixture(scope="module")
def prometheus(agent, tmp_path_factory):
    assert shutil.which(PROMETHEUS), "Debian's prometheus package is a test dependency (.ci/system-packages)"
    work: Path = tmp_path_factory.mktemp("prometheus")
    target = agent.url.removeprefix("http://")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "flashmoe", "static_configs": [{"targets": [target]}]}]}
    (work / "prometheus.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return httpx.get(url + "/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False
    try:
        wait_for(ready, 60, "prometheus to start")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def query(prometheus: str, expr: str) -> list[dict]:
    r = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    return r.json()["data"]["result"]


def test_prometheus_scrapes_the_hit_rate_and_per_layer_counters(agent, prometheus):
    wait_for(lambda: query(prometheus, 'up{job="flashmoe"} == 1'), 30, "the first successful scrape")
    for i in range(3):
        agent.complete(prompt=f"scrape me {i}", max_tokens=4, temperature=0)
    status = wait_for(lambda: (s := agent.get("/v1/status").json()) and s["cache"]["hits"] > 0 and s, 15, "hits")
    expected = status["cache"]["hits"] / (status["cache"]["hits"] + status["cache"]["misses"])

    def scraped_rate():
        rows = query(prometheus, HIT_RATE)
        return rows and abs(float(rows[0]["value"][1]) - expected) < 1e-9 and float(rows[0]["value"][1])
    rate = wait_for(scraped_rate, 30, "Prometheus to hold the agent's hit rate")
    assert 0 < rate < 1
    layers = query(prometheus, "flashmoe_expert_cache_misses_total")
    assert sorted(r["metric"]["layer"] for r in layers) == ["0", "1"]
    series = httpx.get(prometheus + "/api/v1/query_range",
                       params={"query": "flashmoe_expert_cache_hit_ratio", "start": time.time() - 120,
                               "end": time.time(), "step": "1s"},
                       timeout=10).json()["data"]["result"]
    assert series and len(series[0]["values"]) >= 1
    latency = query(prometheus, "flashmoe_request_latency_seconds_count")
    assert float(latency[0]["value"][1]) >= 3
