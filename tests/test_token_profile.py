"""Where a generated token's time goes, on the agent side: the model's and the cache's phase times
become per-token ms in each one-second tick, exported to /metrics and to the store's
agent.token_ms.<phase> series that the Overview page charts."""
from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry
from test_serve import demo_model
from test_serve_metrics import cache_stats

from agent.model.profile import PHASES
from agent.residency import LayerStats
from agent.serve.metrics import Metrics
from agent.serve.recorder import Recorder
from agent.serve.runtime import Runtime, ServeOptions
from agent.serve.scheduler import Event, Request
from store import queries
from store.db import Store
from store.schema import TOKEN_PHASES, spec_for


def test_every_phase_the_agent_times_has_a_series():
    assert set(PHASES) | {"crc", "policy"} == set(TOKEN_PHASES)
    assert all(spec_for(f"agent.token_ms.{p}").unit == "ms" for p in TOKEN_PHASES)


def test_a_tick_gives_ms_per_token_by_phase_from_the_interval_alone():
    reg = CollectorRegistry()
    m = Metrics(reg, n_layers=1)
    stats = cache_stats([LayerStats(hits=1, misses=1)], 4096, 1, [0.001], 1)
    m.tick(1.0, stats, 1, 0, 16, 10, {}, profile={"wait": 2.0, "experts": 1.0})
    tick = m.tick(2.0, stats, 1, 0, 16, 14, {}, profile={"wait": 2.2, "experts": 1.4})   # 4 tokens in this second
    assert tick.token_ms["token_ms_wait"] == pytest.approx(50.0)
    assert tick.token_ms["token_ms_experts"] == pytest.approx(100.0)
    assert reg.get_sample_value("flashmoe_step_phase_seconds_total", {"phase": "wait"}) == pytest.approx(2.2)
    assert Recorder.series(tick)["agent.token_ms.experts"] == pytest.approx(100.0)
    idle = m.tick(3.0, stats, 0, 0, 16, 14, {}, profile={"wait": 2.2, "experts": 1.4})
    assert idle.token_ms == {} and not any(k.startswith("agent.token_ms") for k in Recorder.series(idle))


def test_a_real_agent_records_its_token_profile(tmp_path_factory, tmp_path):
    store = Store(tmp_path / "flashmoe.db", autoflush_s=0)
    rt = Runtime(ServeOptions(demo_model(tmp_path_factory), cache_cap="50%"), CollectorRegistry())
    rt.start(store)
    try:
        rt.tick()
        done = []
        rt.submit(Request("r", [72, 105, 32], 6, 0.0, lambda e: e.kind == "done" and done.append(e)))
        deadline = time.monotonic() + 120
        while not done and time.monotonic() < deadline:
            time.sleep(0.05)
        rt.tick()
    finally:
        rt.stop()
        store.close()
    latest = {p: queries.latest(str(tmp_path / "flashmoe.db"), f"agent.token_ms.{p}") for p in TOKEN_PHASES}
    assert done and all(point is not None and point[1] >= 0 for point in latest.values())
    assert latest["experts"][1] > 0 and latest["attention"][1] > 0
