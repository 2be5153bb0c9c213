"""The whole product in a real browser: agent, collector and dashboard as processes on loopback,
Debian's Chromium driven by playwright (never a downloaded browser).

Opens every page and checks its plotly charts render, changes the cache cap on the Tuning page (the
agent requires a token; the dashboard has it in FLASHMOE_TOKEN) and checks that the agent's
/v1/knobs and the page both show the new value, and saves a screenshot of
each page (to FLASHMOE_SCREENSHOT_DIR if set, e.g. docs/, else the test's tmp dir). The README's
pictures come from a longer run of the same test:

    FLASHMOE_SCREENSHOT_DIR=docs FLASHMOE_TRAFFIC_REQUESTS=120 .venv/bin/pytest -m browser tests/test_browser.py
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from agents import CLI, ROOT, demo_model, free_port, spawn, start_agent, stop, wait_http
from dashboard import pages
from test_dashboard_agent import TOKEN

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
CHARTS = {"overview": 4, "cache": 4, "ssd": 5, "memory": 4, "tuning": 0,   # with traffic, before any sweep
          "fleet": 0}                                                     # without Prometheus (tests/test_fleet.py)
RENDER_TIMEOUT_MS = 60_000

pytestmark = pytest.mark.browser


class Traffic:
    """Two clients sending completions in the background (they share decode steps in the agent)."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url, self.sent, self.errors = url, 0, []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(f"client {i}",), daemon=True)
                         for i in range(clients)]

    def _run(self, prompt: str) -> None:
        while not self._stop.is_set():
            reply = httpx.post(f"{self.url}/v1/completions", timeout=120,
                               json={"prompt": f"{prompt}: an expert cache", "max_tokens": 4})
            with self._lock:
                if reply.status_code != 200:
                    self.errors.append(f"{reply.status_code}: {reply.text[:300]}")
                    return
                self.sent += 1

    def wait_for(self, n: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while self.sent < n and not self.errors and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not self.errors and self.sent >= n, f"{self.sent} of {n} completions: {self.errors}"

    def __enter__(self) -> "Traffic":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)


@pytest.fixture(scope="module")
def product(tmp_path_factory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("product")
    agent = start_agent(demo_model(tmp_path_factory), root, "--token", TOKEN)      # control calls need the token
    db, agent_url = agent.db, agent.url
    collector = spawn([*CLI, "collect", "--db", str(db), "--pid-file", str(agent.pid_file)], root / "collector.log")
    port = free_port()
    dash_log = root / "dashboard.log"
    dashboard = spawn([str(Path(sys.executable).with_name("streamlit")), "run", str(ROOT / "dashboard" / "app.py"),
                       "--server.headless", "true", "--server.port", str(port), "--server.address", "127.0.0.1",
                       "--browser.gatherUsageStats", "false"], dash_log,
                      env={"FLASHMOE_DB": str(db), "FLASHMOE_AGENT_URL": agent_url, "FLASHMOE_TOKEN": TOKEN})
    try:
        dash_url = f"http://127.0.0.1:{port}"
        wait_http(f"{dash_url}/_stcore/health", dashboard, dash_log)
        yield {"agent": agent_url, "dashboard": dash_url, "root": str(root)}
    finally:
        for proc in (dashboard, collector, agent.proc):
            stop(proc)


@pytest.fixture(scope="module")
def page(product) -> Iterator[Page]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1600, "height": 1100})
        yield context.new_page()
        browser.close()


def screenshot_dir(product: dict[str, str]) -> Path:
    out = Path(os.environ.get("FLASHMOE_SCREENSHOT_DIR", product["root"]))
    out.mkdir(parents=True, exist_ok=True)
    return out


def open_page(page: Page, product: dict[str, str], key: str) -> None:
    shown = pages.page(key)
    page.goto(f"{product['dashboard']}/{shown.url_path}")
    expect(page.get_by_role("heading", name=shown.heading).first).to_be_visible(timeout=RENDER_TIMEOUT_MS)


def test_every_page_renders_its_charts_with_real_traffic(product, page):
    with Traffic(product["agent"]) as traffic:
        traffic.wait_for(int(os.environ.get("FLASHMOE_TRAFFIC_REQUESTS", 6)))   # requests, cache stats, samples
    # The agent is idle again: its CPU goes to the browser (this machine has two cores).
    for shown in pages.PAGES:
        open_page(page, product, shown.key)
        charts = page.locator(".js-plotly-plot")
        expect(charts).to_have_count(CHARTS[shown.key], timeout=RENDER_TIMEOUT_MS)
        for i in range(CHARTS[shown.key]):
            expect(charts.nth(i).locator(".main-svg").first).to_be_visible()
        if shown.key == "ssd":        # SMART values, or the collector's statement of why there are none
            expect(page.get_by_text("Temperature").or_(page.get_by_text("cannot read:")).first).to_be_visible()
        page.wait_for_timeout(1500)  # let the remaining charts finish drawing before the picture
        name = "dashboard.png" if shown.default else f"dashboard-{shown.key}.png"
        page.screenshot(path=str(screenshot_dir(product) / name), full_page=True)


def test_cache_cap_changed_on_the_tuning_page_reaches_the_agent(product, page):
    knobs_url = f"{product['agent']}/v1/knobs"
    cap = httpx.get(knobs_url).json()["cache_cap_bytes"]
    new = cap["value"] + (1 << 20) if cap["value"] + (1 << 20) <= cap["max"] else cap["min"]
    open_page(page, product, "tuning")
    field = page.get_by_role("spinbutton", name="cache_cap_bytes", exact=True)
    field.fill(str(new))
    page.get_by_role("button", name="Apply").click()
    expect(page.get_by_text(f"accepted: cache_cap_bytes = {new}")).to_be_visible(timeout=RENDER_TIMEOUT_MS)
    assert httpx.get(knobs_url).json()["cache_cap_bytes"]["value"] == new
    row = page.locator("table tr", has_text="cache_cap_bytes")
    expect(row).to_contain_text(str(new), timeout=RENDER_TIMEOUT_MS)
    expect(page.get_by_role("spinbutton", name="cache_cap_bytes", exact=True)).to_have_value(str(new))
    page.screenshot(path=str(screenshot_dir(product) / "dashboard-tuning-applied.png"), full_page=True)
