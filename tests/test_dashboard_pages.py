"""Every dashboard page under AppTest, reading a real store that the test filled through Store.

The agent is offline here (a closed loopback port); tests/test_dashboard_agent.py covers the pages
against a running agent, and tests/test_browser.py the whole product in Chromium.
"""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from agents import free_port
from bench import synthetic
from dashboard import pages
from store.database import record_lost
from store.db import Store
from test_store import version_2_store

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
SPAN_S = 600


def fill(path: Path, ended_s_ago: float = 0.0, **options) -> Path:
    """`SPAN_S` of synthetic telemetry whose last sample is `ended_s_ago` before now."""
    start = time.time() - ended_s_ago - SPAN_S
    synthetic.write(str(path), synthetic.Spec(start=start, seconds=SPAN_S, **options))
    return path


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("FLASHMOE_AGENT_URL", f"http://127.0.0.1:{free_port()}")   # nothing listens there


def open_page(monkeypatch, db: Path, page: str | None = None) -> AppTest:
    monkeypatch.setenv("FLASHMOE_DB", str(db))
    at = AppTest.from_file(APP, default_timeout=60).run()
    if page:
        at.switch_page(pages.page(page).path).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def figures(at: AppTest) -> dict[str, dict]:
    """Every plotly chart on the page, by its title."""
    specs = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
    return {spec["layout"]["title"]["text"]: spec for spec in specs}


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


@pytest.fixture
def db(tmp_path) -> Path:
    return fill(tmp_path / "flashmoe.db")


def test_overview_shows_latest_values_latency_tail_and_processes(monkeypatch, offline, db):
    at = open_page(monkeypatch, db)
    last = SPAN_S - 1
    shown = metrics(at)
    assert shown["Tokens/s (now)"] == f"{synthetic.tokens_per_s(last):.1f}"
    assert shown["Hit rate (now)"] == f"{synthetic.hit_rate(last):.1%}"
    assert shown["Requests"] == str(SPAN_S // 10)
    assert shown["P99 latency"] == "3.00 s"     # 3 of the 60 requests are 3 s tails: P99 is one of them
    figs = figures(at)
    assert {"Tokens per second", "Expert cache hit rate", "Request latency", "Requests per interval"} <= set(figs)
    at.selectbox(key="window").set_value("1 h").run()      # 1 min buckets: 6 requests in each
    p50, p95, p99 = figures(at)["Request latency"]["data"]
    assert max(p50["y"]) < 2.0 < max(p99["y"]) <= 3.0       # the 3 s tails show in P99 only
    assert "Agent down" in texts(at.error)
    assert "Collector up" in texts(at.success)


def test_overview_now_metrics_are_a_dash_with_their_age_when_the_agent_stopped_writing(monkeypatch, offline,
                                                                                        tmp_path):
    # the last sample is an hour old (outside the 15 min window): "60 min ago" for the next minute
    at = open_page(monkeypatch, fill(tmp_path / "old.db", ended_s_ago=3570))
    last = SPAN_S - 1
    now = {m.label: m for m in at.metric}
    assert now["Hit rate (now)"].value == "–" and now["Tokens/s (now)"].value == "–"
    assert now["Hit rate (now)"].delta == f"last {synthetic.hit_rate(last):.1%}, 60 min ago"
    assert now["Tokens/s (now)"].delta == f"last {synthetic.tokens_per_s(last):.1f}, 60 min ago"
    assert "no data in this window" in texts(at.caption)
    assert "Collector down" in texts(at.error)


def test_cache_page_hit_rates_heatmap_policies_and_sweep(monkeypatch, offline, db):
    at = open_page(monkeypatch, db, "cache")
    shown = metrics(at)
    # per sample: hits 10+11+12+13 = 46, misses 10+9+8+7 = 34, evictions 0+1+2+3 = 6
    assert shown["Hit rate (window)"] == f"{46 / 80:.1%}"
    assert shown["Evictions (window)"] == f"{6 * SPAN_S:,}"
    # agent offline: from the store, 1 of the PREFETCHES per layer and sample used
    assert shown["Prefetch accuracy (window)"] == f"{1 / synthetic.PREFETCHES:.1%}"
    figs = figures(at)
    assert figs["Hit rate per layer"]["data"][0]["y"] == [(10 + l) / 20 for l in range(synthetic.N_LAYERS)]
    z = figs["Expert activations (layer × expert)"]["data"][0]["z"]
    assert len(z) == synthetic.N_LAYERS and len(z[0]) == synthetic.N_EXPERTS
    assert sum(map(sum, z)) == synthetic.N_LAYERS * SPAN_S
    bars = figs["Hit rate by policy on recorded traces"]["data"][0]
    assert dict(zip(bars["x"], bars["y"]))["flashmoe"] == 0.71 and bars["name"] == "olmoe-report @ 25% of experts"
    curve = figs["Tokens/s by cache cap (latest per cap)"]["data"][0]
    assert curve["x"] == [1024.0, 2048.0, 4096.0] and curve["y"] == [8.0, 15.0, 21.0]
    assert "offline" in texts(at.caption)
    assert not [b for b in at.button if b.key == "start-sweep"]      # no sweep without an agent


def test_ssd_page_charts_the_device_and_shows_smart(monkeypatch, offline, db):
    at = open_page(monkeypatch, db, "ssd")
    assert at.selectbox(key="ssd-device").options == [synthetic.DEVICE]
    figs = figures(at)
    assert {f"vda {name}" for name in ("throughput", "utilisation", "queue depth", "IOPS", "await")} == set(figs)
    read = next(d for d in figs["vda throughput"]["data"] if d["name"] == "read")
    assert 150 <= min(read["y"]) and max(read["y"]) <= 250      # 200 ± 50 MB/s
    assert metrics(at)["Temperature"] == "41 °C"
    assert metrics(at)["Media errors"] == "0"


def test_ssd_page_says_why_smart_is_missing(monkeypatch, offline, tmp_path):
    at = open_page(monkeypatch, fill(tmp_path / "virtio.db", smart=False), "ssd")
    assert synthetic.SMART_REASON in texts(at.warning)
    assert "Temperature" not in metrics(at)


def test_memory_page_healthy(monkeypatch, offline, db):
    at = open_page(monkeypatch, db, "memory")
    assert {"Agent memory", "Major faults", "Workingset refaults", "Memory pressure stall (PSI avg10)"} <= set(figures(at))
    assert "Healthy" in texts(at.success)
    assert not at.button


def test_memory_page_diagnoses_thrash_with_evidence_and_recommendation(monkeypatch, offline, tmp_path):
    at = open_page(monkeypatch, fill(tmp_path / "thrash.db", thrash=True), "memory")
    assert "Thrashing" in texts(at.error)
    evidence = texts(at.markdown)
    for signal in ("memory PSI full", "memory PSI some", "agent major faults", "file refaults"):
        assert signal in evidence
    assert "anon refaults" not in evidence
    # 7.5 GiB in use, 4 GiB of it the cache: the cap that keeps use within 70% of 8 GiB
    expected_mib = int((0.7 * 8 - 3.5) * 1024)
    button = at.button(key="apply-recommendation")
    assert f"{expected_mib:,} MiB" in button.label
    assert button.disabled            # the agent is offline: the recommendation cannot be applied


def test_tuning_page_offline_shows_stored_knobs_read_only_and_history(monkeypatch, offline, db):
    at = open_page(monkeypatch, db, "tuning")
    assert "Agent offline" in texts(at.warning)
    knobs, history = at.table[0].value, at.dataframe[0].value
    assert dict(zip(knobs.index, knobs["value"])) == {"cache_cap_bytes": f"{synthetic.CACHE_CAP} (4.0 GiB)",
                                                       "policy": "flashmoe"}
    assert all(w.disabled for w in at.number_input) and at.number_input
    assert list(history["knob"]) == ["policy", "cache_cap_bytes"]          # newest first
    assert list(history["source"]) == ["api", "dashboard"]


def walk(monkeypatch, db: Path):
    """The default page, then every other page that reads the store, in one app session."""
    at = open_page(monkeypatch, db)
    yield at
    for page in pages.PAGES:
        if page.default or not page.reads_store:
            continue
        at.switch_page(page.path).run()
        assert not at.exception, (page, [e.value for e in at.exception])
        yield at


def test_missing_database_is_stated_plainly_on_every_page(monkeypatch, offline, tmp_path):
    for at in walk(monkeypatch, tmp_path / "absent.db"):
        assert "No store at" in texts(at.info)


def test_a_store_being_created_reads_as_no_store_yet(monkeypatch, offline, tmp_path):
    path = tmp_path / "new.db"
    path.touch()                       # a writer has opened it but not made the schema yet
    for at in walk(monkeypatch, path):
        assert "No store at" in texts(at.info)


def test_an_older_store_says_how_to_upgrade_it_on_every_page(monkeypatch, offline, tmp_path):
    path = version_2_store(tmp_path / "v2.db")
    for at in walk(monkeypatch, path):
        assert "schema version 2" in texts(at.info) and "upgrade it in place" in texts(at.info)


def test_empty_database_renders_every_page_without_charts(monkeypatch, offline, tmp_path):
    path = tmp_path / "empty.db"
    Store(path, autoflush_s=0).close()
    for at in walk(monkeypatch, path):
        assert not at.get("plotly_chart")
        assert "No store at" not in texts(at.info)
        assert texts(at.caption) or texts(at.info)       # says that there is nothing yet


def test_overview_says_how_much_telemetry_was_lost(monkeypatch, offline, db, tmp_path):
    assert "Telemetry lost" not in texts(open_page(monkeypatch, db).warning)
    lossy = fill(tmp_path / "lossy.db")
    with sqlite3.connect(lossy) as conn:         # as a writer counts what a full disk made it drop
        record_lost(conn, 1234, 5)
    assert "Telemetry lost to store write failures: 1,234 points and 5 rows" in texts(open_page(monkeypatch, lossy).warning)
