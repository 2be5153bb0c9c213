"""The fleet through Prometheus: three real agents (three ports, three device names, three tokens),
edge-a's collector (`collect --listen`) and a fourth address where no agent answers, scraped by
Debian's Prometheus with examples/alerts.yml loaded; the Fleet page in Chromium lists every device
and the firing FlashMoEAgentDown alert with its severity and summary, and
pushes a knob change to two agents, which alone change. Under AppTest, a push that one agent
refuses (a wrong token) changes nothing there and shows that agent's answer. Unit tests cover the
pure parts of dashboard/fleet.py.

The Fleet page's picture in the README comes from this test:

    FLASHMOE_SCREENSHOT_DIR=docs .venv/bin/pytest -m browser tests/test_fleet.py
"""
from __future__ import annotations

import http.server
import json
import os
import re
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import streamlit as st
from playwright.sync_api import Page, expect, sync_playwright
from streamlit import config
from streamlit.testing.v1 import AppTest

from agents import (CLI, ROOT, Agent, Prometheus, demo_model, free_port, spawn, start_agent, start_prometheus, stop,
                    wait_http)
from dashboard import fleet
from dashboard.agent_client import TOKEN_ENV
from test_browser import CHROMIUM, CHROMIUM_ARGS, RENDER_TIMEOUT_MS, picture
from test_serve import wait_for

APP = str(ROOT / "dashboard" / "app.py")
DEVICES = ("edge-a", "edge-b", "edge-c")
THRASH, PRESSURE = fleet.MEMORY_ALERTS          # the agent's own thrash alert, and another process's
TOKENS = {name: f"control-token-of-{name}" for name in DEVICES}
WRONG_TOKENS = {**TOKENS, "edge-c": "not-edge-c's-token"}   # what the dashboard holds: edge-c will refuse it
ALERT_WAIT_S = 180          # FlashMoEAgentDown needs a minute of failed scrapes


@dataclass
class Fleet:
    agents: dict[str, Agent]
    dead: str                   # the scrape address where no agent answers
    prometheus: Prometheus
    tokens_file: Path
    targets: Path               # the agents' scrape addresses, which Prometheus watches

    def scrape(self, *more: Agent) -> None:
        """Have Prometheus scrape the dead address, the fleet's agents and `more`."""
        agents = [*self.agents.values(), *more]
        write_targets(self.targets, [self.dead, *(a.url.removeprefix("http://") for a in agents)])


def write_targets(path: Path, addresses: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": addresses}]))
    tmp.replace(path)           # Prometheus watches the file: never let it read half of one


@pytest.fixture(scope="module")
def real_fleet(tmp_path_factory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    model = demo_model(tmp_path_factory)
    dead, targets = f"127.0.0.1:{free_port()}", root / "targets.json"
    collector = f"127.0.0.1:{free_port()}"
    write_targets(targets, [dead])
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(ROOT / "examples" / "alerts.yml")],
              "scrape_configs": [{"job_name": fleet.AGENT_JOB, "file_sd_configs": [{"files": [str(targets)]}]},
                                 {"job_name": "flashmoe-collector", "static_configs": [{"targets": [collector]}]}]}
    # Prometheus first: the dead target's minute before its alert fires runs while the agents load.
    prometheus = start_prometheus(root, config)
    agents: dict[str, Agent] = {}
    real = Fleet(agents, dead, prometheus, root / "tokens.json", targets)
    collecting = None
    try:
        for name in DEVICES:
            (root / name).mkdir()
            agents[name] = start_agent(model, root / name, "--device-name", name, "--token", TOKENS[name])
        edge_a = agents["edge-a"]
        collecting = spawn([*CLI, "collect", "--db", str(edge_a.db), "--pid-file", str(edge_a.pid_file),
                            "--device-name", "edge-a", "--listen", collector], root / "collector.log")
        real.scrape()
        wait_for(lambda: len(prometheus.query(f'up{{job="{fleet.AGENT_JOB}"}} == 1')) == 3, 60, "three agents up")
        for i in range(3):      # after the first scrape, so rate() sees the counters rise
            for agent in agents.values():
                agent.complete(prompt=f"fleet traffic {i}", max_tokens=8, temperature=0)
        real.tokens_file.write_text(json.dumps(WRONG_TOKENS))
        yield real
    finally:
        if collecting is not None:
            stop(collecting)
        for agent in agents.values():
            agent.stop()
        prometheus.stop()


def scraped(f: Fleet) -> None:
    """Wait until Prometheus has recorded the three agents' figures and fires the dead address's alert."""
    wait_for(lambda: len(f.prometheus.query("device_name:flashmoe_expert_cache_hit_ratio:rate5m")) == 3, 60,
             "the recorded hit rate of all three")
    wait_for(lambda: f.prometheus.query("device_name:node_disk_io_time_seconds:max_rate5m"), 60,
             "edge-a's recorded disk utilisation")
    wait_for(lambda: f.prometheus.query('ALERTS{alertname="FlashMoEAgentDown", alertstate="firing"}'), ALERT_WAIT_S,
             "FlashMoEAgentDown to fire for the dead address")


@contextmanager
def fleet_page(tmp_path: Path, env: dict[str, str]) -> Iterator[Page]:
    """A dashboard server with `env` (FLASHMOE_PROMETHEUS_URL...) and its /fleet page in Chromium."""
    port, log = free_port(), tmp_path / "dashboard.log"
    dashboard = spawn([str(Path(sys.executable).with_name("streamlit")), "run", APP, "--server.headless", "true",
                       "--server.port", str(port), "--server.address", "127.0.0.1",
                       "--browser.gatherUsageStats", "false"], log,
                      env={"FLASHMOE_DB": str(tmp_path / "none.db"), **env})
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", dashboard, log)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_context(viewport={"width": 1600, "height": 1100}).new_page()
            page.goto(f"http://127.0.0.1:{port}/fleet")
            yield page
            browser.close()
    finally:
        stop(dashboard)


def knob(agent: Agent, name: str):
    return httpx.get(f"{agent.url}/v1/knobs", timeout=10).json()[name]["value"]


@pytest.mark.browser
def test_fleet_page_shows_every_device_and_pushes_to_the_two_chosen(real_fleet, tmp_path):
    scraped(real_fleet)
    before = {name: knob(agent, "max_batch_size") for name, agent in real_fleet.agents.items()}
    new = before["edge-a"] - 1
    with fleet_page(tmp_path, {"FLASHMOE_PROMETHEUS_URL": real_fleet.prometheus.url,
                               "FLASHMOE_FLEET_TOKENS": str(real_fleet.tokens_file)}) as page:
        tables = page.get_by_test_id("stDataFrame")
        cells = tables.first.locator("td[role=gridcell]")     # the grid's accessible copy
        for text in (*DEVICES, real_fleet.dead, "FlashMoEAgentDown"):
            expect(cells.filter(has_text=re.compile(f"^{re.escape(text)}$"))).to_have_count(
                1, timeout=RENDER_TIMEOUT_MS)
        alerts = tables.nth(1).locator("td[role=gridcell]")     # the firing alerts, with what they say
        for text in ("critical", f"FlashMoE agent {real_fleet.dead} is not answering its scrape"):
            expect(alerts.filter(has_text=text).first).to_be_attached(timeout=RENDER_TIMEOUT_MS)
        expect(page.get_by_test_id("stMetric").filter(has_text="Firing alerts")).to_contain_text("1")

        devices = page.get_by_test_id("stMultiSelect")
        for name in ("edge-a", "edge-b"):
            devices.click()
            page.get_by_role("option", name=name, exact=True).click()
        page.get_by_test_id("stSelectbox").filter(has_text="Knob").click()
        page.get_by_role("option", name="max_batch_size", exact=True).click()
        field = page.get_by_role("spinbutton", name="max_batch_size", exact=True)
        field.fill(str(new))
        field.press("Enter")
        page.get_by_role("button", name=f"Push max_batch_size = {new} to 2 device(s)").click()
        expect(page.get_by_text("2 of 2 agents accepted the change")).to_be_visible(timeout=RENDER_TIMEOUT_MS)
        for name in ("edge-a", "edge-b"):
            expect(page.get_by_test_id("stTable").first.locator("tr", has_text=name)).to_contain_text(
                f"accepted: max_batch_size = {new}")
        out = Path(os.environ.get("FLASHMOE_SCREENSHOT_DIR", tmp_path))
        picture(page, out / "fleet.png")
    after = {name: knob(agent, "max_batch_size") for name, agent in real_fleet.agents.items()}
    assert after == {**before, "edge-a": new, "edge-b": new}


def test_an_agent_that_refuses_a_push_keeps_its_value_and_its_answer_is_shown(real_fleet, monkeypatch):
    scraped(real_fleet)
    monkeypatch.setenv(fleet.PROMETHEUS_ENV, real_fleet.prometheus.url)
    monkeypatch.setenv(fleet.TOKENS_ENV, str(real_fleet.tokens_file))
    before = {name: knob(agent, "prefetch_depth") for name, agent in real_fleet.agents.items()}
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.switch_page("views/fleet.py").run()
    assert not at.exception, [e.value for e in at.exception]
    rows = at.dataframe[0].value.set_index("device")
    assert list(rows.index) == sorted([*DEVICES, real_fleet.dead])
    assert list(rows["agent"]) == ["down", "up", "up", "up"] and rows.loc[real_fleet.dead, "firing alerts"] == (
        "FlashMoEAgentDown")
    # edge-a's collector reports, so its memory is a verdict; which one follows this machine's memory
    # pressure (the pressure alert reads the node's PSI, high while other work thrashes), and any but "ok"
    # needs its alert in Prometheus
    memory = rows.loc["edge-a", "memory"]
    assert 0 <= rows.loc["edge-a", "SSD utilisation"] <= 1
    assert memory == "ok" or any(memory.startswith(verdict) and real_fleet.prometheus.query(
        f'max_over_time(ALERTS{{alertname="{name}", device_name="edge-a"}}[5m])')
        for name, verdict in fleet.MEMORY_ALERTS.items()), memory
    assert list(rows.loc[["edge-b", "edge-c"], "memory"]) == ["no collector", "no collector"]
    assert all(0 <= rows.loc[name, "hit rate"] <= 1 for name in DEVICES)
    # each firing alert with what a user needs: severity, where, its summary filled in, its value, since when
    down = at.dataframe[1].value.set_index("alert").loc["FlashMoEAgentDown"]
    assert (down["severity"], down["device"], down["value"]) == ("critical", real_fleet.dead, "0")    # up == 0
    assert down["summary"] == f"FlashMoE agent {real_fleet.dead} is not answering its scrape"
    assert down["active since"].endswith(" UTC") and "could not scrape" in down["description"]
    at.multiselect(key="fleet-devices").set_value(["edge-b", "edge-c"]).run()
    at.selectbox(key="fleet-knob").set_value("prefetch_depth").run()
    spec = httpx.get(f"{real_fleet.agents['edge-b'].url}/v1/knobs", timeout=10).json()["prefetch_depth"]
    new = spec["max"] if before["edge-b"] != spec["max"] else spec["min"]
    next(w for w in at.number_input if w.label == "prefetch_depth").set_value(new).run()
    next(b for b in at.button if b.label.startswith("Push prefetch_depth")).click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "1 of 2 agents accepted" in " ".join(w.value for w in at.warning)
    answers = at.table[0].value["answer"].to_dict()
    assert answers["edge-b"].startswith("accepted")
    assert answers["edge-c"].startswith("refused (401)") and "token" in answers["edge-c"]
    assert "not-edge-c" not in at.table[0].value.to_string()    # a token is never shown
    after = {name: knob(agent, "prefetch_depth") for name, agent in real_fleet.agents.items()}
    assert after == {**before, "edge-b": new}


def test_a_name_two_agents_up_report_is_offered_no_push(real_fleet, monkeypatch, tmp_path, tmp_path_factory):
    """A push goes with the token of the name an agent reports. With a second agent calling itself edge-a (a
    cloned box, or a target claiming the name), the form offered edge-a once and pushed to whichever of the two
    was listed last, with edge-a's token, and said "1 of 1 agents accepted"."""
    scraped(real_fleet)
    twin = start_agent(demo_model(tmp_path_factory), tmp_path, "--device-name", "edge-a", "--token",
                       "control-token-of-the-twin")
    try:
        real_fleet.scrape(twin)
        wait_for(lambda: len(real_fleet.prometheus.query('flashmoe_agent_info{device_name="edge-a"}')) == 2, 60,
                 "both agents called edge-a")
        monkeypatch.setenv(fleet.PROMETHEUS_ENV, real_fleet.prometheus.url)
        monkeypatch.setenv(fleet.TOKENS_ENV, str(real_fleet.tokens_file))
        at = AppTest.from_file(APP, default_timeout=60).run()
        at.switch_page("views/fleet.py").run()
        assert not at.exception, [e.value for e in at.exception]
        assert at.multiselect(key="fleet-devices").options == ["edge-b", "edge-c"]
        assert "` edge-a ` is not offered: two agents that are up call themselves that" in " ".join(
            c.value for c in at.caption)
    finally:
        real_fleet.scrape()
        twin.stop()
        wait_for(lambda: len(real_fleet.prometheus.query(f'up{{job="{fleet.AGENT_JOB}"}}')) == 4, 60, "the twin gone")
        st.cache_data.clear()           # the page's snapshot of Prometheus, with the twin, for the next test


LINKED = "[edge-x](http://x.invalid)"          # names a target that is not our agent may report
OTHER = "**edge-y** [y](http://y.invalid)"


class InFlight:
    """How many knob reads the loopback targets answer at once now, and the most at any time."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self._lock = threading.Lock()

    @contextmanager
    def one(self) -> Iterator[None]:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            yield
        finally:
            with self._lock:
                self.now -= 1


def imitation(name: str, knobs: dict, delay_s: float = 0.0,
              in_flight: InFlight | None = None) -> http.server.ThreadingHTTPServer:
    """A loopback server that is not our agent: its /metrics reports the device name `name`, and it answers
    GET /v1/knobs with `knobs` after `delay_s`, counted in `in_flight`; stopped by shutdown()."""
    reads = in_flight or InFlight()

    class Imitation(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            metrics = self.path.startswith("/metrics")
            if not metrics:
                with reads.one():
                    time.sleep(delay_s)
            body = (f'flashmoe_agent_info{{device_name="{name}"}} 1\n' if metrics else json.dumps(knobs)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4" if metrics else "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Imitation)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@contextmanager
def scraping(servers: list[http.server.ThreadingHTTPServer], workdir: Path, *more: str) -> Iterator[str]:
    """Prometheus scraping `servers` and the addresses `more` as the agent job; yields its address once it has
    every server's name. Stops it and the servers."""
    addresses = [f"127.0.0.1:{s.server_address[1]}" for s in servers]
    config = {"global": {"scrape_interval": "1s"},
              "scrape_configs": [{"job_name": fleet.AGENT_JOB, "static_configs": [{"targets": [*addresses, *more]}]}]}
    prometheus = start_prometheus(workdir, config)
    try:
        wait_for(lambda: len(prometheus.query("flashmoe_agent_info")) == len(servers), 60, "the targets' names")
        yield prometheus.url
    finally:
        prometheus.stop()
        for server in servers:
            server.shutdown()


@pytest.fixture(scope="module")
def foreign_fleet(tmp_path_factory) -> Iterator[str]:
    """Prometheus scraping three loopback servers that are not our agent: two report the device name LINKED, one
    OTHER, and each answers GET /v1/knobs with JSON of another shape, {"max_batch_size": 5}; yields Prometheus's
    address once it has the three names."""
    servers = [imitation(name, {"max_batch_size": 5}) for name in (LINKED, LINKED, OTHER)]
    with scraping(servers, tmp_path_factory.mktemp("foreign")) as url:
        yield url


def test_a_target_answering_knobs_of_another_shape_is_one_line_in_the_push_form(foreign_fleet, monkeypatch):
    """{"max_batch_size": 5} for a target's knobs was a KeyError's box in the push form."""
    monkeypatch.setenv(fleet.PROMETHEUS_ENV, foreign_fleet)
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.switch_page("views/fleet.py").run()
    at.multiselect(key="fleet-devices").set_value([OTHER]).run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.error) == 1, [e.value for e in at.error]
    assert at.error[0].value.startswith(f"` {OTHER} `: http://127.0.0.1:"), at.error[0].value
    assert " is not a FlashMoE agent: it answered GET /v1/knobs with ` max_batch_size ` not an object" in (
        at.error[0].value), at.error[0].value


@pytest.mark.browser
def test_device_names_with_markdown_show_as_they_are(foreign_fleet, tmp_path):
    """A name a target reports, [edge-x](http://x.invalid), rendered as a link in the duplicate-name warning. (The
    push form's line naming a target is checked as text by the test above.)"""
    with fleet_page(tmp_path, {"FLASHMOE_PROMETHEUS_URL": foreign_fleet}) as page:
        warning = page.get_by_test_id("stAlert").filter(has_text="Two agents call themselves")
        expect(warning).to_contain_text(f"Two agents call themselves {LINKED}:", timeout=RENDER_TIMEOUT_MS)
        caption = page.get_by_test_id("stCaptionContainer").filter(has_text="is not offered")
        expect(caption).to_contain_text(f"{LINKED} is not offered")
        expect(page.locator("a[href*='.invalid']")).to_have_count(0)


CROWD = [f"edge-{i:02d}" for i in range(1, 13)]     # more than the ten rows st.dataframe's default height holds
MODE = {"mode": {"type": "str", "value": LINKED, "choices": [LINKED, "plain"]}}     # a choice with Markdown
READ_S = 0.3                # each crowd target's answer to GET /v1/knobs
ROW_PX = 35                 # a row's height, and the header's, in Streamlit's data grid


@dataclass
class Crowd:
    url: str                # Prometheus's
    dead: str               # a scraped address where nothing answers
    reads: InFlight         # the targets' knob reads


@pytest.fixture(scope="module")
def crowded_fleet(tmp_path_factory) -> Iterator[Crowd]:
    """Prometheus scraping twelve loopback targets, edge-01..12, each answering GET /v1/knobs with MODE in READ_S,
    and an address where nothing answers."""
    reads, dead = InFlight(), f"127.0.0.1:{free_port()}"
    servers = [imitation(name, MODE, READ_S, reads) for name in CROWD]
    with scraping(servers, tmp_path_factory.mktemp("crowd"), dead) as url:
        yield Crowd(url, dead, reads)


@pytest.mark.browser
def test_the_table_shows_every_device_without_scrolling(crowded_fleet, tmp_path):
    """The table had Streamlit's default height, ten rows: with twenty boxes, edge-11..20 were below its fold, the
    one down among them (BENCHMARKS.md, the Fleet view at twenty boxes)."""
    with fleet_page(tmp_path, {"FLASHMOE_PROMETHEUS_URL": crowded_fleet.url}) as page:
        expect(page.get_by_test_id("stMetric").filter(has_text="Devices")).to_contain_text(
            str(len(CROWD) + 1), timeout=RENDER_TIMEOUT_MS)
        grid = page.get_by_test_id("stDataFrame").first
        grid.locator("td[role=gridcell]").first.wait_for(state="attached", timeout=RENDER_TIMEOUT_MS)
        assert grid.bounding_box()["height"] >= ROW_PX * (len(CROWD) + 2)      # the header and thirteen rows


def crowd_form(crowd: Crowd, chosen: list[str], monkeypatch) -> AppTest:
    """The Fleet page in AppTest with `chosen` devices chosen in its push form."""
    monkeypatch.setenv(fleet.PROMETHEUS_ENV, crowd.url)
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.switch_page("views/fleet.py").run()
    at.multiselect(key="fleet-devices").set_value(chosen).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_push_form_reads_the_chosen_agents_knobs_at_once(crowded_fleet, monkeypatch):
    """It read each agent's knobs after the other's: 0.46-0.74 s for nineteen agents (BENCHMARKS.md)."""
    crowded_fleet.reads.most = 0
    at = crowd_form(crowded_fleet, CROWD, monkeypatch)
    assert list(at.table[0].value.index) == CROWD
    assert crowded_fleet.reads.most > 1, "one knob read at a time"


def test_a_string_knob_choice_shows_as_it_is_on_the_push_button(crowded_fleet, monkeypatch):
    """A target's choice for a string knob, [edge-x](http://x.invalid), was written into the push button's label,
    which is Markdown: a link. (The knob's name is checked by the agent client, its value is not.)"""
    at = crowd_form(crowded_fleet, CROWD[:2], monkeypatch)
    (button,) = [b for b in at.button if b.label.startswith("Push mode")]
    assert button.label == f"Push mode = ` {LINKED} ` to 2 device(s)"


def test_a_push_loads_no_trust_store_per_device(monkeypatch):
    """fleet.push built a new httpx client per device, each loading the TLS trust store into a context of its own
    (~20 ms of CPU), even for http://: 0.44 s of CPU to nineteen closed loopback ports (BENCHMARKS.md). Counted,
    not timed: how often a trust store is loaded during a push to twenty devices."""
    targets = [fleet.Device(f"edge-{i:02d}", f"127.0.0.1:{port}", f"http://127.0.0.1:{port}", "", True)
               for i, port in enumerate(free_port() for _ in range(20))]
    fleet.push(targets[:1], {"max_batch_size": 4}, {}, None)        # once per process: the shared context
    loads, load = [], ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                        lambda context, *args, **kwargs: loads.append(1) or load(context, *args, **kwargs))
    answers = fleet.push(targets, {"max_batch_size": 4}, {}, None)
    assert [a.answer.split(":")[0] for a in answers] == ["not sent"] * len(targets)
    assert loads == []


# -- the pure parts ---------------------------------------------------------------------------------------

def target(instance: str, health: str = "up", **labels: str) -> dict:
    return {"labels": {"job": fleet.AGENT_JOB, "instance": instance, **labels}, "health": health,
            "scrapeUrl": f"http://{instance}/metrics"}


def result(labels: dict, value: float = 1.0) -> dict:
    return {"metric": labels, "value": [0, str(value)]}


def alert(name: str, state: str, severity: str | None = None, **labels: str) -> dict:
    """One entry of /api/v1/alerts, its annotations templated as Prometheus sends them."""
    return {"labels": {"alertname": name, **({"severity": severity} if severity else {}), **labels},
            "annotations": {"summary": f"{name} summary", "description": f"{name} description"},
            "state": state, "activeAt": "2026-12-01T10:00:00.123456789Z", "value": "2.5e-01"}


def test_devices_joins_targets_figures_alerts_and_memory_by_device_name():
    snap = fleet.Snapshot(
        targets=[target("10.0.0.1:8600"), target("10.0.0.2:8600", dashboard="https://b.lan/dash"),
                 target("[fd00::3]:8600", health="down")],
        names=[result({"instance": "10.0.0.1:8600", "device_name": "edge-a"}),
               result({"instance": "10.0.0.2:8600", "device_name": "edge-b"})],
        figures=[result({"__name__": fleet.FIGURES["hit_rate"], "device_name": "edge-a"}, 0.75),
                 result({"__name__": fleet.FIGURES["p99_s"], "device_name": "edge-a"}, float("nan")),
                 result({"__name__": fleet.FIGURES["ssd_util"], "device_name": "edge-b"}, 0.5),
                 result({"__name__": fleet.FIGURES["tokens_per_s"], "device_name": "unknown"}, 9)],
        alerts=[alert("FlashMoEAgentDown", "firing", "critical", instance="[fd00::3]:8600"),
                alert(THRASH, "pending", "warning", device_name="edge-a"),
                alert(PRESSURE, "firing", "warning", device_name="edge-b"),
                alert(THRASH, "firing", "warning", device_name="edge-b"),
                alert("FlashMoESSDMediaErrors", "firing", "critical", device_name="edge-b")],
        collected=[result({"device_name": "edge-a"}), result({"device_name": "edge-b"})])
    down, a, b = fleet.devices(snap)     # by name
    assert (a.name, a.hit_rate, a.p99_s, a.memory, a.alerts) == ("edge-a", 0.75, None, "agent thrashing (pending)", [])
    assert (a.agent_url, a.dashboard_url) == ("http://10.0.0.1:8600", "http://10.0.0.1:8501")
    assert (b.ssd_util, b.memory, b.dashboard_url) == (0.5, "agent thrashing", "https://b.lan/dash")  # the graver
    assert [x.name for x in b.alerts] == ["FlashMoESSDMediaErrors", THRASH, PRESSURE]    # critical first
    assert (down.name, down.up, down.memory, [x.name for x in down.alerts]) == (
        "[fd00::3]:8600", False, "no collector", ["FlashMoEAgentDown"])
    assert down.dashboard_url == "http://[fd00::3]:8501"
    assert fleet.duplicate_names([a, b, down]) == []
    assert fleet.duplicate_names([a, a, b]) == ["edge-a"]
    # the page's list of firing alerts: severity, where, what it says, the rule's value, since when
    assert fleet.alert_rows([down, a, b]) == [
        {"severity": "critical", "device": "[fd00::3]:8600", "alert": "FlashMoEAgentDown",
         "summary": "FlashMoEAgentDown summary", "value": "0.25", "active since": "2026-12-01 10:00:00 UTC",
         "description": "FlashMoEAgentDown description"},
        {"severity": "critical", "device": "edge-b", "alert": "FlashMoESSDMediaErrors",
         "summary": "FlashMoESSDMediaErrors summary", "value": "0.25", "active since": "2026-12-01 10:00:00 UTC",
         "description": "FlashMoESSDMediaErrors description"},
        *({"severity": "warning", "device": "edge-b", "alert": name, "summary": f"{name} summary", "value": "0.25",
           "active since": "2026-12-01 10:00:00 UTC", "description": f"{name} description"}
          for name in (THRASH, PRESSURE))]


def test_the_table_lists_devices_down_then_alerting_then_the_rest():
    def device(name: str, up: bool = True, *severities: str) -> fleet.Device:
        return fleet.Device(name, name, f"http://{name}", "", up,
                            alerts=[fleet.Alert("A", s, None, None, None, None) for s in severities])
    rows = [device("edge-a"), device("edge-b", True, "warning"), device("edge-c", True, "info", "critical"),
            device("edge-d", True, "info"), device("edge-z", False, "critical"), device("edge-y", False)]
    assert [d.name for d in fleet.trouble_first(rows)] == ["edge-z", "edge-y", "edge-c", "edge-b", "edge-d", "edge-a"]


def test_only_agents_up_under_a_name_of_their_own_are_pushable():
    snap = fleet.Snapshot(
        targets=[target("10.0.0.1:8600"), target("10.0.0.2:8600"), target("10.0.0.3:8600"),
                 target("10.0.0.4:8600", health="down"), target("10.0.0.5:8600", health="down")],
        names=[result({"instance": f"10.0.0.{i}:8600", "device_name": name})
               for i, name in [(1, "edge-a"), (2, "edge-a"), (3, "edge-b"), (4, "edge-b"), (5, "edge-c")]],
        figures=[], alerts=[], collected=[])
    online, shared = fleet.pushable(fleet.devices(snap))
    assert (list(online), shared) == (["edge-b"], ["edge-a"])        # edge-b's other address is down
    assert online["edge-b"].instance == "10.0.0.3:8600"


def test_an_alert_without_severity_annotations_or_a_number_reads_as_missing_not_none():
    bare = {"labels": {"alertname": "Custom", "instance": "10.0.0.1:8600"}, "state": "firing", "value": "NaN"}
    snap = fleet.Snapshot(targets=[target("10.0.0.1:8600")], names=[], figures=[], alerts=[bare], collected=[])
    (row,) = fleet.alert_rows(fleet.devices(snap))
    assert row == {"severity": "–", "device": "10.0.0.1:8600", "alert": "Custom", "summary": "–", "value": "–",
                   "active since": "–", "description": "–"}


@pytest.mark.parametrize("content, words", [
    (None, "cannot read the tokens file"), ("{not json", "is not JSON"), ('["edge-a"]', "one JSON object"),
    ('{"edge-a": 5}', "one JSON object"), ('{"edge-a": ""}', "non-empty")])
def test_a_bad_tokens_file_is_one_clear_line_that_never_echoes_its_content(tmp_path, content, words):
    path = tmp_path / "tokens.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(fleet.FleetError) as err:
        fleet.load_tokens(str(path))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert "edge-a" not in str(err.value)
    assert fleet.load_tokens(None) == {}


def test_without_prometheus_the_page_says_how_to_enable_it(monkeypatch):
    monkeypatch.delenv(fleet.PROMETHEUS_ENV, raising=False)
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.switch_page("views/fleet.py").run()
    assert not at.exception
    assert fleet.PROMETHEUS_ENV in at.info[0].value and "examples/alerts.yml" in at.info[0].value


def test_an_unreachable_prometheus_is_one_line_not_a_traceback(monkeypatch):
    monkeypatch.setenv(fleet.PROMETHEUS_ENV, f"http://127.0.0.1:{free_port()}")
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.switch_page("views/fleet.py").run()
    assert not at.exception
    assert "did not answer" in at.error[0].value and fleet.PROMETHEUS_ENV in at.error[0].value
    assert len(at.error) == 1, [e.value for e in at.error]       # said once, not again by the push form


def test_an_address_that_answers_html_is_named_as_not_prometheus(monkeypatch, html_server):
    """A wrong port answered HTML, and the page said Prometheus 'did not answer (JSONDecodeError)'."""
    monkeypatch.setenv(fleet.PROMETHEUS_ENV, html_server)
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.switch_page("views/fleet.py").run()
    assert not at.exception
    assert at.error[0].value.startswith(f"{html_server} is not a Prometheus API: it answered with something other "
                                        f"than JSON"), at.error[0].value
    assert fleet.PROMETHEUS_ENV in at.error[0].value


def test_an_exposed_dashboard_pushes_nothing_before_the_token_is_entered(real_fleet, monkeypatch):
    """The Fleet push is a control action behind dashboard/auth.py's gate, like the Tuning page's Apply."""
    scraped(real_fleet)
    monkeypatch.setenv(fleet.PROMETHEUS_ENV, real_fleet.prometheus.url)
    monkeypatch.setenv(fleet.TOKENS_ENV, str(real_fleet.tokens_file))
    monkeypatch.setenv(TOKEN_ENV, "the-dashboard-token")
    before = knob(real_fleet.agents["edge-a"], "prefetch")
    address = config.get_option("server.address")
    config.set_option("server.address", "0.0.0.0")
    try:
        at = AppTest.from_file(APP, default_timeout=60).run()
        at.switch_page("views/fleet.py").run()
        at.multiselect(key="fleet-devices").set_value(["edge-a"]).run()
        at.selectbox(key="fleet-knob").set_value("prefetch").run()
        assert "control is locked" in " ".join(i.value for i in at.info)
        toggle = next(t for t in at.toggle if t.label == "prefetch")
        button = next(b for b in at.button if b.label.startswith("Push prefetch"))
        assert button.disabled
        toggle.set_value(not before)
        button.proto.disabled = False                       # as a hostile browser would
        button.click().run()
    finally:
        config.set_option("server.address", address)
    assert not at.exception, [e.value for e in at.exception]
    shown = " ".join(t.value.to_string() for t in at.table) + " ".join(w.value for w in [*at.success, *at.warning])
    assert "accepted" not in shown
    assert knob(real_fleet.agents["edge-a"], "prefetch") == before
