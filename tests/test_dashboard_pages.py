"""Every dashboard page under AppTest, reading a real store that the test filled through Store.

The agent is offline here (a closed loopback port); tests/test_dashboard_agent.py covers the pages
against a running agent, and tests/test_browser.py the whole product in Chromium. The pages' clock
is fixed at the instant the test's telemetry ends (`NOW`): a page judges how old the latest points
are by it, and the first page a process renders imports the app (20 s under load), long enough for
the telemetry of a collector that is "up" to read as 20 s old.
"""
from __future__ import annotations

import json
import socket
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from agents import free_port
from bench import synthetic
from dashboard import pages, timerange
from store.database import record_lost
from store import queries
from store.db import Store
from store.errors import StoreError
from test_store import version_2_store

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
SPAN_S = 600
NOW = 1_750_000_000.5     # what the pages read as now (the `clock` fixture): a page reading the wall clock
                          # instead finds the telemetry over a year old; samples fall between whole seconds,
                          # never on the edge of a range typed in minutes


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> None:
    monkeypatch.setattr(timerange, "now", lambda: NOW)


def fill(path: Path, ended_s_ago: float = 0.0, **options) -> Path:
    """`SPAN_S` of synthetic telemetry whose last sample is `ended_s_ago` + 1 s before NOW."""
    start = NOW - ended_s_ago - SPAN_S
    synthetic.write(str(path), synthetic.Spec(start=start, seconds=SPAN_S, **options))
    return path


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("FLASHMOE_AGENT_URL", f"http://127.0.0.1:{free_port()}")   # nothing listens there


@pytest.fixture
def busy(monkeypatch):
    """An agent that takes connections and never answers, as a thrashing one can for longer than the
    dashboard waits: the kernel accepts into the listen backlog, nothing reads."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        monkeypatch.setenv("FLASHMOE_AGENT_URL", f"http://127.0.0.1:{listener.getsockname()[1]}")
        yield


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


def tokens_now(last: int) -> float:
    """What the Overview's tokens/s metric shows: the mean of the synthetic samples in the last 10 s."""
    return sum(synthetic.tokens_per_s(i) for i in range(last - 10, last + 1)) / 11


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


@pytest.fixture
def db(tmp_path) -> Path:
    return fill(tmp_path / "flashmoe.db")


def test_overview_shows_latest_values_latency_tail_and_processes(monkeypatch, offline, db):
    at = open_page(monkeypatch, db)
    last = SPAN_S - 1
    shown = metrics(at)
    # the mean of the last 10 s: the agent's latest 1 s sample alone read 0 while a step took longer
    assert (shown["Tokens/s (last 10 s)"] == f"{tokens_now(last):.1f} tokens/s"
            != f"{synthetic.tokens_per_s(last):.1f} tokens/s")
    # per sample: hits 10+11+12+13 = 46, misses 10+9+8+7 = 34 (the same on every page)
    assert shown["Hit rate (last 1 min)"] == f"{100 * 46 / 80:.1f} %"
    assert shown["Requests"] == str(SPAN_S // 10)
    assert shown["P99 latency"] == "3.00 s"     # 3 of the 60 requests are 3 s tails: P99 is one of them
    figs = figures(at)
    assert {"Tokens per second", "Expert cache hit rate", "Request latency", "Requests per interval"} <= set(figs)
    hit = next(d for d in figs["Expert cache hit rate"]["data"] if d["name"] == "hit rate")
    assert max(hit["y"]) <= 100 and figs["Expert cache hit rate"]["layout"]["yaxis"]["ticksuffix"] == " %"
    at.selectbox(key="window").set_value("1 h").run()      # 1 min buckets: 6 requests in each
    p50, p95, p99 = figures(at)["Request latency"]["data"][:3]
    assert (p50["line"]["dash"], p95["line"]["dash"], p99["line"]["dash"]) == ("solid", "dash", "dot")
    assert max(p50["y"]) < 2.0 < max(p99["y"]) <= 3.0       # the 3 s tails show in P99 only
    assert "Agent down" in texts(at.error)
    assert "Collector up: last sample 1 s ago" in texts(at.success)


def test_every_time_chart_spans_the_range_and_marks_the_knob_changes_in_it(monkeypatch, offline, db):
    at = open_page(monkeypatch, db)
    for title in ("Tokens per second", "Request latency", "Requests per interval"):
        spec = figures(at)[title]
        marks = next(d for d in spec["data"] if d["name"] == "knob changes")
        assert marks["hovertext"][:2] == ["cache_cap_bytes: 2.0 GiB → 4.0 GiB (dashboard)",
                                          "policy: lru → flashmoe (api)"]
        assert "sweep: 21.0 tokens/s at cache cap 4.0 GiB" in marks["hovertext"]
        assert spec["layout"]["dragmode"] == "select"           # a drag picks a new range for the page


def test_a_custom_range_applies_to_every_chart(monkeypatch, offline, db):
    at = open_page(monkeypatch, db)
    at.selectbox(key="window").set_value("Custom").run()
    start = datetime.fromtimestamp(NOW, timezone.utc).replace(tzinfo=None, second=0, microsecond=0)
    start -= timedelta(minutes=5)
    at.datetime_input(key="range-to").set_value(start + timedelta(minutes=2)).run()
    at.datetime_input(key="range-from").set_value(start).run()
    assert not at.exception
    chosen = [(start + timedelta(minutes=m)).replace(tzinfo=timezone.utc).timestamp() for m in (0, 2)]
    for title, spec in figures(at).items():
        if spec["layout"]["xaxis"].get("type") == "date":
            shown = [datetime.fromisoformat(x).replace(tzinfo=timezone.utc).timestamp()
                     for x in spec["layout"]["xaxis"]["range"]]
            assert shown == chosen, title
    assert metrics(at)["Requests"] == "12"                     # one every 10 s in those 2 minutes
    assert [b for b in at.button if b.key == "zoom-out"]


def test_the_refresh_can_be_paused(monkeypatch, offline, db):
    at = open_page(monkeypatch, db)
    refresh = at.selectbox(key="refresh")
    assert refresh.value == "5 s" and refresh.options[0] == "off"
    refresh.set_value("off").run()
    assert not at.exception


def test_overview_now_metrics_are_a_dash_with_their_age_when_the_agent_stopped_writing(monkeypatch, offline,
                                                                                        tmp_path):
    # the last sample is an hour old (outside the 15 min range)
    at = open_page(monkeypatch, fill(tmp_path / "old.db", ended_s_ago=3570))
    last = SPAN_S - 1
    now = {m.label: m for m in at.metric}
    assert now["Hit rate (last 1 min)"].value == "–" and now["Tokens/s (last 10 s)"].value == "–"
    assert now["Tokens/s (last 10 s)"].delta == f"last {tokens_now(last):.1f} tokens/s, 60 min ago"
    assert "no data in this range" in texts(at.caption)
    assert "Collector down" in texts(at.error)


def test_cache_page_hit_rates_heatmap_policies_and_sweep(monkeypatch, offline, db):
    at = open_page(monkeypatch, db, "cache")
    shown = metrics(at)
    assert shown["Hit rate (time range)"] == shown["Hit rate (last 1 min)"] == f"{100 * 46 / 80:.1f} %"
    assert shown["Evictions"] == f"{6 * SPAN_S:,}"
    # 34 misses and 16 prefetches read for 80 lookups, whatever the 57.5% hit rate says
    assert shown["Reads per lookup"] == f"{100 * (34 + 4 * synthetic.PREFETCHES) / 80:.1f} %"
    # agent offline: from the store, 1 of the PREFETCHES per layer and sample used
    assert shown["Prefetch accuracy"] == f"{100 / synthetic.PREFETCHES:.1f} %"
    figs = figures(at)
    assert figs["Hit rate per layer"]["data"][0]["y"] == pytest.approx([100 * (10 + l) / 20
                                                                         for l in range(synthetic.N_LAYERS)])
    z = figs["Expert activations (layer × expert)"]["data"][0]["z"]
    assert len(z) == synthetic.N_LAYERS and len(z[0]) == synthetic.N_EXPERTS
    assert sum(map(sum, z)) == synthetic.N_LAYERS * SPAN_S
    bars = figs["Hit rate by policy on recorded traces"]["data"][0]
    assert dict(zip(bars["x"], bars["y"]))["flashmoe"] == 71.0 and bars["name"] == "olmoe-report @ 25% of experts"
    curve = figs["Tokens/s by cache cap (latest per cap)"]["data"][0]
    assert curve["x"] == [1.0, 2.0, 4.0] and curve["y"] == [8.0, 15.0, 21.0]        # GiB
    assert "The sweep needs the agent: the agent at http://127.0.0.1:" in texts(at.caption)    # and why: offline
    assert not [b for b in at.button if b.key == "start-sweep"]      # no sweep without an agent


def test_ssd_page_charts_the_device_and_shows_smart(monkeypatch, offline, db):
    at = open_page(monkeypatch, db, "ssd")
    assert at.selectbox(key="ssd-device").options == [synthetic.DEVICE]
    figs = figures(at)
    assert {f"vda {name}" for name in ("throughput", "utilisation", "queue depth", "IOPS", "await")} == set(figs)
    read = next(d for d in figs["vda throughput"]["data"] if d["name"] == "read")
    assert figs["vda throughput"]["layout"]["yaxis"]["ticksuffix"] == " MiB/s"
    assert 150e6 / 2**20 <= min(read["y"]) and max(read["y"]) <= 250e6 / 2**20      # 200 ± 50 MB/s
    assert figs["vda await"]["layout"]["yaxis"]["ticksuffix"] == " ms"
    assert metrics(at)["Temperature"] == "41 °C"
    assert metrics(at)["Media errors"] == "0"


def test_ssd_page_says_why_smart_is_missing(monkeypatch, offline, tmp_path):
    at = open_page(monkeypatch, fill(tmp_path / "virtio.db", smart=False), "ssd")
    assert synthetic.SMART_REASON in texts(at.warning)
    assert "Temperature" not in metrics(at)


def evidence(at: AppTest) -> dict[str, dict]:
    """The Memory page's evidence table, by signal."""
    return {row["signal"]: dict(row) for _, row in at.dataframe[0].value.iterrows()}


def test_memory_page_healthy_states_every_signal_against_its_threshold(monkeypatch, offline, db):
    at = open_page(monkeypatch, db, "memory")
    assert set(figures(at)) == {"Agent memory", "Major faults", "Workingset refaults",
                                "Memory pressure stall (PSI avg10)",
                                "Expert lookups re-reading a block the cache evicted"}
    assert "Healthy" in texts(at.success)
    rows = evidence(at)
    assert rows["agent major faults"] | {} == {"counts": "", "signal": "agent major faults", "whose": "agent",
                                              "peak": "2.0 /s", "mean": "2.0 /s", "over for": "0 s",
                                              "threshold": "50.0 /s"}
    assert not at.button


def test_memory_page_agent_thrashing_shows_evidence_thresholds_and_a_fix_within_the_bounds(monkeypatch, offline,
                                                                                            tmp_path):
    at = open_page(monkeypatch, fill(tmp_path / "thrash.db", memory="agent thrashing"), "memory")
    assert "Agent thrashing" in texts(at.error)
    rows = evidence(at)
    counted = {name for name, row in rows.items() if row["counts"] == "yes"}
    assert counted == {"agent major faults", "agent cgroup major faults", "agent cgroup file refaults",
                       "memory PSI some (avg10)", "memory PSI full (avg10)"}
    assert rows["agent major faults"]["peak"] == "400 /s"
    faults = figures(at)["Major faults"]
    assert [(a["text"], a["hovertext"]) for a in faults["layout"]["annotations"]] == [
        ("threshold 50 faults/s", "threshold 50 faults/s: agent major faults, agent cgroup major faults")]
    # 4 GiB by a quarter: 3 GiB, inside [CAP_MIN, CAP_MAX] the agent last recorded
    assert "Shrink the cache cap from 4.0 GiB to 3.0 GiB" in texts(at.markdown)
    button = at.button(key="apply-recommendation")
    assert button.label == "Apply: cache_cap_bytes = 3.0 GiB"
    assert button.disabled            # the agent is offline: the recommendation cannot be applied


def test_an_agent_too_busy_to_answer_is_busy_not_down_and_is_still_offered_the_fix(monkeypatch, busy, tmp_path):
    """Under memory thrash the agent answers slower than the dashboard's 3 s: the Overview said "Agent
    down ... start it" and the Memory page disabled its fix, in the one case the fix is for."""
    db = fill(tmp_path / "thrash.db", memory="agent thrashing")
    at = open_page(monkeypatch, db)
    assert "Agent busy" in texts(at.warning) and "did not answer within 3 s" in texts(at.warning)
    assert "Agent down" not in texts(at.error)
    at = open_page(monkeypatch, db, "memory")
    assert "Agent thrashing" in texts(at.error)
    assert not at.button(key="apply-recommendation").disabled


def test_memory_page_pressure_from_another_process_never_offers_to_shrink_the_cache(monkeypatch, offline, tmp_path):
    at = open_page(monkeypatch, fill(tmp_path / "other.db", memory="pressure from another process"), "memory")
    assert "Pressure from another process" in texts(at.warning)
    assert "The fix is outside the agent" in texts(at.markdown)
    assert not at.button


def test_memory_page_cache_thrashing_offers_a_larger_cap(monkeypatch, offline, tmp_path):
    at = open_page(monkeypatch, fill(tmp_path / "churn.db", memory="cache thrashing"), "memory")
    assert "Cache thrashing" in texts(at.warning)
    # twice 4 GiB, but no more than half the 3 GiB available on top: 5.5 GiB, under CAP_MAX (5.6 GiB)
    assert at.button(key="apply-recommendation").label == "Apply: cache_cap_bytes = 5.5 GiB"


def test_memory_page_names_the_process_whose_reads_slow_the_agents_disk_and_what_to_do(monkeypatch, offline,
                                                                                       tmp_path):
    """The last 2 minutes: the agent's reads 30x slower while dd reads its disk at 800 MB/s."""
    db = fill(tmp_path / "disk.db")
    start = NOW - SPAN_S
    with Store(db, autoflush_s=0) as store:
        for i in range(SPAN_S):
            t, crowded = start + i, i >= SPAN_S - 120
            for name, calm, busy in (("agent.read_latency_s", 0.8e-3, 25e-3),
                                     ("io.vda.agent_read_bytes_per_s", 25e6, 20e6),
                                     ("io.vda.others_read_bytes_per_s", 0.0, 800e6)):
                store.append(name, t, busy if crowded else calm)
            if crowded:
                store.record_disk_readers(t, "vda", [(4242, "dd", 800e6, 0.0)])
    at = open_page(monkeypatch, db, "memory")
    assert "Healthy" in texts(at.success)      # memory is calm
    assert "**Disk (vda): disk contention from another process**" in texts(at.warning)
    assert "`dd` read vda" in texts(at.warning)
    assert "reader: `dd` (pid 4242)" in texts(at.markdown) and "`ionice -c3 -p 4242`" in texts(at.markdown)


def test_tuning_page_offline_shows_stored_knobs_read_only_and_history(monkeypatch, offline, db):
    at = open_page(monkeypatch, db, "tuning")
    assert "Agent offline" in texts(at.warning)
    knobs, history = at.table[0].value, at.dataframe[0].value
    assert dict(zip(knobs.index, knobs["value"])) == {"cache_cap_bytes": "4.0 GiB", "policy": "flashmoe"}
    assert not at.slider and not at.number_input and not at.button       # nothing to apply while offline
    assert list(history["knob"]) == ["policy", "cache_cap_bytes"]          # newest first
    assert list(history["source"]) == ["api", "dashboard"]
    assert list(history["new"]) == ["flashmoe", "4.0 GiB"]


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


@pytest.mark.parametrize("make", [Path.mkdir, lambda p: p.write_text("not SQLite")], ids=["directory", "text"])
def test_a_store_that_cannot_be_read_names_the_dashboards_setting_not_the_clis(monkeypatch, offline, tmp_path, make):
    """The advice said "point --db at ...": the dashboard has no --db, its user sets FLASHMOE_DB."""
    path = tmp_path / "flashmoe.db"
    make(path)
    for at in walk(monkeypatch, path):
        shown = texts([*at.error, *at.warning, *at.info])
        assert "point FLASHMOE_DB at the file" in shown and "--db" not in shown, shown
    with pytest.raises(StoreError, match="point --db at the file"):     # the CLI's wording stays
        queries.connect_ro(path)


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:abc", "notaurl", "http://127.0.0.1:99999"])
def test_a_mistyped_agent_or_prometheus_address_is_said_on_every_page(monkeypatch, db, url):
    """FLASHMOE_AGENT_URL that httpx cannot parse was a traceback on every page (and the Fleet page's
    FLASHMOE_PROMETHEUS_URL likewise); one it could, e.g. a port over 65535, read as the agent down."""
    monkeypatch.setenv("FLASHMOE_AGENT_URL", url)
    monkeypatch.setenv("FLASHMOE_PROMETHEUS_URL", url)
    said = []
    for at in walk(monkeypatch, db):
        said.append(texts([*at.error, *at.warning]))
    assert f"Agent address wrong: {url!r} is not an agent's address" in said[0]
    assert all("set FLASHMOE_AGENT_URL to the address" in s for s in said if "Agent" in s), said
    at.switch_page(pages.page("fleet").path).run()
    assert not at.exception, [e.value for e in at.exception]
    assert f"FLASHMOE_PROMETHEUS_URL {url!r} is not a Prometheus server's address" in texts(at.error)


def test_a_damaged_chunk_is_named_on_the_page_that_reads_it(monkeypatch, offline, db):
    """A chunk whose bytes the codec refuses was an exception box (CodecError) on the Memory page."""
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE chunks SET data = X'00'")
    shown = [texts(at.error) for at in walk(monkeypatch, db)]          # walk asserts no page raised
    assert any(f"{db} holds a damaged chunk of " in s and "DELETE FROM chunks WHERE id =" in s for s in shown)


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
    warnings = texts(open_page(monkeypatch, lossy).warning)
    assert "Telemetry lost to store write failures: 1,234 points and 5 rows" in warnings


def test_overview_says_how_many_requests_went_unanswered(monkeypatch, offline, db, tmp_path):
    assert "unanswered" not in texts(open_page(monkeypatch, db).warning)
    failing = fill(tmp_path / "failing.db")
    with Store(failing, autoflush_s=0) as store:   # as the agent's ticks write them, a count a second
        for k, (failed, refused, abandoned) in enumerate([(1, 0, 0), (0, 3, 1), (0, 0, 0), (1, 2, 3)]):
            store.append("agent.requests_failed", NOW - 40 + k, failed)
            store.append("agent.requests_refused", NOW - 40 + k, refused)
            store.append("agent.requests_abandoned", NOW - 40 + k, abandoned)
    shown = texts(open_page(monkeypatch, failing).warning)
    assert "Requests unanswered in this range: 2 failed" in shown and ", 5 refused" in shown
    assert "and 4 abandoned (the client went away first" in shown


def test_overview_and_memory_page_say_how_many_samples_the_collector_missed(monkeypatch, offline, db, tmp_path):
    assert "missed" not in texts(open_page(monkeypatch, db).warning)
    late = fill(tmp_path / "late.db")
    with Store(late, autoflush_s=0) as store:      # as the collector writes it after ticks it was too late for
        store.append("collector.missed_samples", NOW - 30, 7)
    for page in (None, "memory"):
        assert "The collector fell behind and missed 7 of its" in texts(open_page(monkeypatch, late, page).warning)
