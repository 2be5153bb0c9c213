"""The whole product in a real browser: agent, collector and dashboard as processes on loopback,
Debian's Chromium driven by playwright (never a downloaded browser).

Opens every page and checks its plotly charts render, with no console error and no request leaving
loopback; changes the cache cap with the Tuning page's slider (the agent requires a token; the
dashboard has it in FLASHMOE_TOKEN) and checks that the agent's /v1/knobs and the page both show
the new value; drags across a chart and checks that every chart follows the new range; and saves
a screenshot of each page (to FLASHMOE_SCREENSHOT_DIR if set, e.g. docs/, else the test's tmp dir). The README's
pictures come from a longer run of the same test:

    FLASHMOE_SCREENSHOT_DIR=docs FLASHMOE_TRAFFIC_REQUESTS=120 .venv/bin/pytest -m browser tests/test_browser.py
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import BrowserContext, Page, expect, sync_playwright

from agents import demo_model, start_agent, start_collector, start_dashboard, stop
from bench import synthetic
from dashboard import pages
from store import diagnosis
from store.units import human
from test_dashboard_agent import TOKEN

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
CHARTS = {"overview": 5, "cache": 4, "ssd": 5, "memory": 5, "tuning": 0,   # with traffic, before any sweep
          "fleet": 0}                                                     # without Prometheus (tests/test_fleet.py)
RENDER_TIMEOUT_MS = 60_000
REBOUND = "rebind.test"   # a name the browser resolves to 127.0.0.1, as a DNS-rebinding page's own name would
MIB = 1 << 20

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
            try:
                reply = httpx.post(f"{self.url}/v1/completions", timeout=120,
                                   json={"prompt": f"{prompt}: an expert cache", "max_tokens": 4})
            except httpx.HTTPError as exc:   # e.g. a squeezed agent slower than the timeout: said, not raised
                reply = httpx.Response(599, text=f"{type(exc).__name__}: {exc}")
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
    collector = start_collector(agent, root)
    try:
        dashboard, dash_url = start_dashboard(agent.db, agent.url, root, TOKEN)
    except BaseException:
        for proc in (collector, agent.proc):
            stop(proc)
        raise
    try:
        yield {"agent": agent.url, "dashboard": dash_url, "root": str(root)}
    finally:
        for proc in (dashboard, collector, agent.proc):
            stop(proc)


@pytest.fixture(scope="module")
def browser_context(product) -> Iterator[BrowserContext]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=[*CHROMIUM_ARGS, f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"])
        context = browser.new_context(viewport={"width": 1600, "height": 1100})
        context.set_default_timeout(RENDER_TIMEOUT_MS)     # a click waits for Streamlit's rerun; slow under load
        yield context
        browser.close()


@pytest.fixture(scope="module")
def page(browser_context) -> Page:
    return browser_context.new_page()


def screenshot_dir(product: dict[str, str]) -> Path:
    out = Path(os.environ.get("FLASHMOE_SCREENSHOT_DIR", product["root"]))
    out.mkdir(parents=True, exist_ok=True)
    return out


def open_page(page: Page, product: dict[str, str], key: str) -> None:
    shown = pages.page(key)
    page.goto(f"{product['dashboard']}/{shown.url_path}")
    expect(page.get_by_role("heading", name=shown.heading).first).to_be_visible(timeout=RENDER_TIMEOUT_MS)


DRAWN = """n => { const plots = [...document.querySelectorAll('.js-plotly-plot')];
    return (n === null || plots.length === n) && plots.every(p => p._fullLayout
        && p.querySelector('.main-svg')?.getBoundingClientRect().width > 0); }"""


NOT_STALE = "() => !document.querySelector('[data-stale=\"true\"]')"
MAIN_HEIGHT = "() => document.querySelector('[data-testid=stMain]').scrollHeight"


def picture(page: Page, path: Path) -> None:
    """A screenshot of the whole page once no element is stale (faded while a rerun replaces it).
    Streamlit scrolls its main area inside the window, so a full-page screenshot stops at the
    window's height (the Overview lost its last charts): the window grows to the main area first."""
    page.wait_for_function(NOT_STALE, timeout=RENDER_TIMEOUT_MS)
    size = page.viewport_size
    page.set_viewport_size({"width": size["width"], "height": max(size["height"], page.evaluate(MAIN_HEIGHT))})
    try:
        # every chart there is at each poll: a count taken once, mid-rerun, may never be seen again
        page.wait_for_function(DRAWN, arg=None, timeout=RENDER_TIMEOUT_MS)
        page.wait_for_function(NOT_STALE, timeout=RENDER_TIMEOUT_MS)
        page.screenshot(path=str(path), full_page=True)
    finally:
        page.set_viewport_size(size)


def charts_drawn(page: Page, n: int) -> None:
    """Wait until the page shows exactly `n` plotly charts and plotly has drawn every one (its layout
    computed and its SVG laid out). The wait is on that condition, not a pause, so a loaded machine
    only makes it slower."""
    page.wait_for_function(DRAWN, arg=n, timeout=RENDER_TIMEOUT_MS)


def test_every_page_renders_its_charts_with_real_traffic(product, page):
    with Traffic(product["agent"]) as traffic:
        traffic.wait_for(int(os.environ.get("FLASHMOE_TRAFFIC_REQUESTS", 6)))   # requests, cache stats, samples
    # The agent is idle again: its CPU goes to the browser (this machine has two cores).
    for shown in pages.PAGES:
        open_page(page, product, shown.key)
        charts_drawn(page, CHARTS[shown.key])
        if shown.key == "ssd":        # SMART values, or the collector's statement of why there are none
            smart = page.get_by_text("Temperature").or_(page.get_by_text("cannot read:")).first
            expect(smart).to_be_visible(timeout=RENDER_TIMEOUT_MS)
        name = "dashboard.png" if shown.default else f"dashboard-{shown.key}.png"
        picture(page, screenshot_dir(product) / name)


WIDTHS = (1280, 1400, 1920)   # window widths every page must read at
CUT = """() => {
  const main = document.querySelector('[data-testid=stMain]');
  const cut = new Set();
  for (const el of main.querySelectorAll('*')) {
    if (el.closest('.js-plotly-plot') || el.closest('[data-testid=stDataFrame]') || !el.textContent.trim()) continue;
    const s = getComputedStyle(el);
    if ((s.textOverflow === 'ellipsis' || s.overflowX === 'hidden') && el.scrollWidth > el.clientWidth + 1)
      cut.add('text: ' + el.textContent.trim());
  }
  for (const plot of main.querySelectorAll('.js-plotly-plot')) {
    const box = plot.getBoundingClientRect();
    for (const t of plot.querySelectorAll('.gtitle, .xtitle, .ytitle, .annotation-text, .xtick text, .ytick text, '
                                          + '.cbtitle text, .colorbar text')) {
      const r = t.getBoundingClientRect();
      if (r.width && (r.left < box.left - 1 || r.right > box.right + 1)) cut.add('chart: ' + t.textContent);
    }
    const bg = plot.querySelector('.legend .bg');
    const items = [...plot.querySelectorAll('.legend .traces')].map(g => ({g, t: g.querySelector('.legendtext')}))
      .filter(x => x.t)
      .map(x => ({name: x.t.textContent, text: x.t.getBoundingClientRect(), item: x.g.getBoundingClientRect()}));
    const right = bg ? bg.getBoundingClientRect().right : box.right;
    for (const a of items) {
      const next = items.filter(b => Math.abs(b.item.top - a.item.top) < 3 && b.item.left > a.item.left + 1)
        .map(b => b.item.left);
      const limit = Math.min(right, ...next);
      if (a.text.right > limit + 1) cut.add('legend: ' + a.name);
    }
  }
  return [...cut];
}"""


def test_no_label_title_or_legend_entry_is_cut_at_common_window_widths(product, browser_context):
    """Text a page cuts (an ellipsis), and chart text past its chart or its legend entry: at 1400 px the
    Cache page read "Reads/lookup (time ran…", at 1280 px legends lost their ends ("agent cgroup, an")
    and the Memory page's threshold labels ran off their plots."""
    page = browser_context.new_page()
    cut = {}
    try:
        for width in WIDTHS:
            page.set_viewport_size({"width": width, "height": 800})
            for shown in pages.PAGES:
                open_page(page, product, shown.key)
                charts_drawn(page, CHARTS[shown.key])
                page.wait_for_function(NOT_STALE, timeout=RENDER_TIMEOUT_MS)
                if found := page.evaluate(CUT):
                    cut[f"{shown.key} at {width} px"] = found
    finally:
        page.close()
    assert cut == {}


def test_the_dashboard_reached_under_a_rebound_host_name_keeps_control_locked(product, browser_context):
    """DNS rebinding, as the browser sees it: a name of the attacker's page resolves to 127.0.0.1 (here by
    Chromium's resolver rules), so the page can load the loopback dashboard as its own origin. Reached
    under that name, control is locked until the token is entered; the knob is not changed."""
    port = product["dashboard"].rsplit(":", 1)[1]
    before = httpx.get(f"{product['agent']}/v1/knobs").json()["prefetch"]["value"]
    page = browser_context.new_page()
    page.goto(f"http://{REBOUND}:{port}/{pages.page('tuning').url_path}")
    expect(page.get_by_text("control is locked: enter the agent's token")).to_be_visible(timeout=RENDER_TIMEOUT_MS)
    expect(page.get_by_role("button", name="Apply")).to_be_disabled()
    expect(page.get_by_role("button", name="Unlock control")).to_be_visible()
    page.close()
    assert httpx.get(f"{product['agent']}/v1/knobs").json()["prefetch"]["value"] == before


def test_the_cap_set_with_the_tuning_pages_slider_reaches_the_agent(product, page):
    knobs_url = f"{product['agent']}/v1/knobs"
    cap = httpx.get(knobs_url).json()["cache_cap_bytes"]
    up = cap["value"] + MIB <= cap["max"]
    open_page(page, product, "tuning")
    page.get_by_role("slider", name="cache_cap_bytes").focus()
    page.keyboard.press("ArrowRight" if up else "ArrowLeft")        # one step of the slider: at most 1 MiB
    page.get_by_role("button", name="Apply").click()
    expect(page.get_by_text("accepted: cache_cap_bytes = ")).to_be_visible(timeout=RENDER_TIMEOUT_MS)
    new = httpx.get(knobs_url).json()["cache_cap_bytes"]["value"]
    assert 0 < (new - cap["value"]) * (1 if up else -1) <= MIB and cap["min"] <= new <= cap["max"]
    expect(page.get_by_text(f"accepted: cache_cap_bytes = {human(new, 'B')}")).to_be_visible()
    row = page.get_by_test_id("stTable").locator("tr", has_text="cache_cap_bytes")   # not the history grid's copy
    expect(row).to_contain_text(human(new, "B"), timeout=RENDER_TIMEOUT_MS)
    picture(page, screenshot_dir(product) / "dashboard-tuning-applied.png")


def test_the_memory_pages_one_click_fix_reaches_the_agent(product, browser_context, tmp_path):
    """A second dashboard over a store of a thrashing agent (bench/synthetic.py's), in front of the real
    agent: the Memory page names the verdict, its button applies the smaller cap the agent allows,
    and the page shows the agent's answer."""
    thrash_db = tmp_path / "thrash.db"
    synthetic.write(str(thrash_db), synthetic.Spec(start=time.time() - 300, seconds=300, memory="agent thrashing"))
    knobs_url = f"{product['agent']}/v1/knobs"
    cap = httpx.get(knobs_url).json()["cache_cap_bytes"]
    expected = max(cap["min"], int(cap["value"] * diagnosis.SHRINK) // MIB * MIB)
    dashboard, dash_url = start_dashboard(thrash_db, product["agent"], tmp_path, TOKEN)
    page = browser_context.new_page()
    try:
        page.goto(f"{dash_url}/{pages.page('memory').url_path}")
        expect(page.get_by_text("Agent thrashing").first).to_be_visible(timeout=RENDER_TIMEOUT_MS)
        page.get_by_role("button", name=f"Apply: cache_cap_bytes = {human(expected, 'B')}").click()
        expect(page.get_by_text(f"accepted: cache_cap_bytes = {human(expected, 'B')}")).to_be_visible(
            timeout=RENDER_TIMEOUT_MS)
        assert httpx.get(knobs_url).json()["cache_cap_bytes"]["value"] == expected
        expect(page.get_by_text("Since the change:")).to_be_visible(timeout=RENDER_TIMEOUT_MS)
        picture(page, screenshot_dir(product) / "dashboard-memory-fix.png")
    finally:
        page.close()
        stop(dashboard)
        restored = httpx.put(knobs_url, json={"cache_cap_bytes": cap["value"]}, timeout=90,
                             headers={"Authorization": f"Bearer {TOKEN}"})
        assert restored.status_code == 200, restored.text


def choose(page: Page, label: str, option: str) -> None:
    """Pick `option` in the sidebar's select box `label`."""
    page.get_by_test_id("stSidebar").get_by_role("combobox", name=label).click()
    page.get_by_role("option", name=option, exact=True).click()


RANGES = """() => [...document.querySelectorAll('.js-plotly-plot')]
    .filter(p => p._fullLayout && p._fullLayout.xaxis.type === 'date').map(p => p._fullLayout.xaxis.range)"""


def settled_ranges(page: Page, unlike: list[str] | None = None, span_s: float | None = None) -> list[list[str]]:
    """The x range of every time chart on the page (plotly's layout as drawn), once at least two are
    drawn and all agree on one range (other than `unlike`, and `span_s` seconds wide if given: the
    charts of a range just chosen, not those of the page before it re-ran)."""
    page.wait_for_function(f"""([unlike, span]) => {{ const r = ({RANGES})();
        return r.length >= 2 && r.every(x => JSON.stringify(x) === JSON.stringify(r[0]))
               && JSON.stringify(r[0]) !== JSON.stringify(unlike)
               && (span === null || Math.abs((Date.parse(r[0][1]) - Date.parse(r[0][0])) / 1000 - span) < 1); }}""",
                           arg=[unlike, span_s], timeout=RENDER_TIMEOUT_MS)
    return page.evaluate(RANGES)


def test_a_drag_across_one_chart_zooms_every_chart_on_the_page(product, page):
    open_page(page, product, "memory")       # the collector's charts: there whether or not traffic ran
    choose(page, "Refresh", "off")           # a paused page keeps its range, so the test compares like with like
    choose(page, "Time range", "5 min")
    charts = page.locator(".js-plotly-plot")
    before = settled_ranges(page, span_s=300)
    drag = charts.first.locator("rect.nsewdrag").first
    drag.scroll_into_view_if_needed()
    area = drag.bounding_box()
    y = area["y"] + area["height"] / 2
    page.mouse.move(area["x"] + area["width"] * 0.85, y)      # the last 45 s: the collector has sampled them
    page.mouse.down()
    page.mouse.move(area["x"] + area["width"] * 0.99, y, steps=10)
    page.mouse.up()
    zoom_out = page.get_by_test_id("stSidebar").get_by_role("button", name="Zoom out")
    expect(zoom_out).to_be_visible(timeout=RENDER_TIMEOUT_MS)
    after = settled_ranges(page, unlike=before[0])      # every chart follows the one dragged
    span = [datetime.fromisoformat(x).timestamp() for x in after[0]]
    old = [datetime.fromisoformat(x).timestamp() for x in before[0]]
    assert (span[1] - span[0]) / (old[1] - old[0]) == pytest.approx(0.14, abs=0.03)   # the 14% dragged across
    zoom_out.click()
    wider = [datetime.fromisoformat(x).timestamp() for x in settled_ranges(page, after[0])[0]]
    assert wider[1] - wider[0] == pytest.approx(2 * (span[1] - span[0]), rel=0.01)
    choose(page, "Time range", "15 min")
    choose(page, "Refresh", "5 s")


def test_pages_load_without_console_errors_or_requests_leaving_the_box(product, browser_context):
    """Loaded at its root and used through the sidebar, no page logs a console error and no request
    leaves loopback (a ":material/" favicon used to be fetched from fonts.gstatic.com). Opening a page's
    own URL directly adds Streamlit's probe of <page>/_stcore/health and host-config, answered 404 by
    design before it tries the root (streamlit/streamlit#7074); nothing else fails."""
    problems: list[str] = []
    page = browser_context.new_page()
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("request", lambda r: problems.append(f"outside: {r.url}")
            if not r.url.startswith(("http://127.0.0.1", "data:", "blob:")) else None)
    open_page(page, product, "overview")
    for shown in pages.PAGES:
        page.get_by_role("link", name=shown.title, exact=True).first.click()
        expect(page.get_by_role("heading", name=shown.heading).first).to_be_visible(timeout=RENDER_TIMEOUT_MS)
        page.wait_for_timeout(2000)          # the page's charts and their requests
    assert problems == []
    failed: list[str] = []
    page.on("response", lambda r: failed.append(r.url.removeprefix(product["dashboard"])) if r.status >= 400 else None)
    open_page(page, product, "memory")
    page.wait_for_timeout(2000)
    assert sorted(failed) <= ["/memory/_stcore/health", "/memory/_stcore/host-config"]
    assert [p for p in problems if not p.startswith("console error: Failed to load resource: the server responded "
                                                     "with a status of 404")] == []
    page.close()
