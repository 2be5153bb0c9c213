"""Benchmark: the Fleet view at twenty boxes, side by side with three, in one run.

Starts N agents (default 20) on the small demo model, each with its own device name and token, and two
Debian Prometheus servers that scrape them every second with examples/alerts.yml loaded (evaluated every
second): one scrapes all N, the other three of them, the fleet tests/test_fleet.py covers. After three
rounds of completions to every agent, one agent both servers scrape is killed (SIGKILL) and stays down.
For each server the bench then measures:
- kill -> down: seconds until Prometheus has `up == 0` for it and until the Fleet page (Streamlit's AppTest,
  the page's own 5 s snapshot cache in effect, rendered back to back) shows it down; kill -> alert: the same
  for FlashMoEAgentDown firing (its rule holds for 1 min);
- the page's first full render in AppTest with cold caches (every device row in its table), median of
  --renders, wall and CPU; and in Chromium (playwright), a dashboard server's /fleet until the Devices count
  is N and the table's grid holds rows, with how many device rows the grid's height holds in view;
- a knob push to every agent up through dashboard.fleet.push, median of --pushes (wall, and the CPU of the
  process it runs in), after each of which every agent must report the new value by GET /v1/knobs; and the
  page's push form with every agent chosen (it reads each agent's knobs);
- the agents' RSS and PSS, the machine's MemAvailable before they started and after their traffic,
  Prometheus's CPU from the kill to the last milestone and its RSS.
Ratios are the large fleet's figure over the small one's.

    flock /work/wt/bench.lock nice -n 19 .venv/bin/python bench/fleet.py [--agents 20] [--renders 5] [--pushes 3]
                                                                         [--screenshots DIR] [--results NAME]
                                                                         [--no-browser]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, bench/ leads sys.path and bench/dashboard.py would shadow the `dashboard` package.
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import httpx  # noqa: E402
import streamlit as st  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

from agents import (Agent, Prometheus, free_port, small_demo, start_agent, start_dashboard,  # noqa: E402
                    start_prometheus, stop, wait_for)
from bench.common import count, machine, results_name, write_results  # noqa: E402
from dashboard import fleet  # noqa: E402
from test_browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

APP = str(ROOT / "dashboard" / "app.py")
PAGE = "views/fleet.py"
SMALL = 3                       # the fleet tests/test_fleet.py runs
KNOB = "max_batch_size"
ALERT = "FlashMoEAgentDown"
ALERT_WAIT_S = 180              # the rule's `for: 1m`, a scrape and an evaluation, and slack for a loaded machine
STARTERS = 4                    # agents loading at once
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Case:
    """One Prometheus server and the agents it scrapes (the victim among them)."""
    label: str
    agents: dict[str, Agent]
    prometheus: Prometheus
    found: dict[str, Any] = field(default_factory=dict)

    @property
    def up(self) -> dict[str, Agent]:
        return {name: a for name, a in self.agents.items() if a.proc.poll() is None}


def device_names(n: int) -> list[str]:
    return [f"edge-{i:02d}" for i in range(1, n + 1)]


def token(name: str) -> str:
    return f"control-token-of-{name}"


def start_agents(model: Path, root: Path, names: list[str], stack: ExitStack) -> dict[str, Agent]:
    """Every agent on its own port, store and token, STARTERS loading at a time; each stopped when `stack` closes."""
    def one(name: str) -> Agent:
        (root / name).mkdir()
        agent = start_agent(model, root / name, "--device-name", name, "--token", token(name))
        stack.callback(stop, agent.proc)
        return agent
    with ThreadPoolExecutor(STARTERS) as pool:
        return dict(zip(names, pool.map(one, names)))


def prometheus_config(agents: dict[str, Agent]) -> dict:
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ROOT / "examples" / "alerts.yml")],
            "scrape_configs": [{"job_name": fleet.AGENT_JOB, "static_configs": [
                {"targets": [a.url.removeprefix("http://") for a in agents.values()]}]}]}


def start_case(label: str, agents: dict[str, Agent], root: Path, stack: ExitStack) -> Case:
    (root / label).mkdir()
    prometheus = start_prometheus(root / label, prometheus_config(agents))
    stack.callback(prometheus.stop)
    return Case(label, agents, prometheus)


def traffic(agents: dict[str, Agent], rounds: int = 3) -> None:
    for i in range(rounds):
        for agent in agents.values():
            agent.complete(prompt=f"fleet traffic {i}", max_tokens=8, temperature=0)


def recorded(case: Case) -> bool:
    return len(case.prometheus.query("device_name:flashmoe_expert_cache_hit_ratio:rate5m")) == len(case.agents)


# -- what the page shows ------------------------------------------------------------------------------------

def page(url: str, clear: bool = False) -> tuple[AppTest, float, float]:
    """The Fleet page rendered in AppTest (the app shell run first, as in a running server); with its wall
    and CPU seconds, after clearing the data caches if `clear`."""
    os.environ[fleet.PROMETHEUS_ENV] = url
    at = AppTest.from_file(APP, default_timeout=120).run()
    if clear:
        st.cache_data.clear()
    start, cpu = time.perf_counter(), time.process_time()
    at.switch_page(PAGE).run()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if at.exception:
        raise RuntimeError(f"the Fleet page failed: {at.exception[0].value}")
    return at, wall, cpu


def shown(at: AppTest) -> dict[str, tuple[str, str]]:
    """Device -> (agent up/down, its firing alerts) as the page's table shows them."""
    if not at.dataframe:
        return {}
    rows = at.dataframe[0].value
    return {r["device"]: (r["agent"], r["firing alerts"]) for _, r in rows.iterrows()}


def render(case: Case, renders: int) -> dict[str, Any]:
    """The page's first full render with cold caches, `renders` times: every device row must be in it."""
    walls, cpus = [], []
    for _ in range(renders):
        at, wall, cpu = page(case.prometheus.url, clear=True)
        rows = shown(at)
        if sorted(rows) != sorted(case.agents):
            raise RuntimeError(f"{case.label}: the page showed {sorted(rows)}, not every agent")
        walls.append(wall)
        cpus.append(cpu)
    return {"render_s": statistics.median(walls), "render_s_all": walls, "render_cpu_s": statistics.median(cpus)}


# -- kill -> down -> alert ----------------------------------------------------------------------------------

def kill(agent: Agent) -> float:
    """SIGKILL to the agent's session; the monotonic time it was sent."""
    sent = time.monotonic()
    os.killpg(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait()
    return sent


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS     # utime + stime


def reached(case: Case, victim: str) -> set[str]:
    """The milestones after the kill that hold now: in Prometheus (two queries), then on the page (one render)."""
    instance = case.agents[victim].url.removeprefix("http://")
    query = case.prometheus.query
    state, alerts = shown(page(case.prometheus.url)[0]).get(victim, ("", ""))
    return {name for name, holds in [
        ("prometheus_down_s", query(f'up{{instance="{instance}"}} == 0')),
        ("prometheus_alert_s", query(f'ALERTS{{alertname="{ALERT}", alertstate="firing", instance="{instance}"}}')),
        ("page_down_s", state == "down"), ("page_alert_s", ALERT in alerts)] if holds}


MILESTONES = 4


def watch_down(cases: list[Case], victim: str) -> None:
    """Kill the victim and time each case's milestones, checking the cases in turn (each time is when the check
    that saw it ended; the slowest round of checks is the times' resolution); Prometheus's CPU meanwhile."""
    cpu = {c.label: cpu_seconds(c.prometheus.proc.pid) for c in cases}
    killed = kill(cases[0].agents[victim])
    rounds = []
    while any(len(c.found) < MILESTONES for c in cases) and time.monotonic() - killed < ALERT_WAIT_S:
        begun = time.monotonic()
        for case in cases:
            for name in reached(case, victim) - set(case.found):
                case.found[name] = time.monotonic() - killed
        rounds.append(time.monotonic() - begun)
        time.sleep(0.1)
    if any(len(c.found) < MILESTONES for c in cases):
        raise RuntimeError(f"not all seen within {ALERT_WAIT_S} s of the kill: {[c.found for c in cases]}")
    wall = time.monotonic() - killed
    for c in cases:
        c.found |= {"prometheus_cpu_cores": (cpu_seconds(c.prometheus.proc.pid) - cpu[c.label]) / wall,
                    "resolution_s": max(rounds) + 0.1}


# -- push ---------------------------------------------------------------------------------------------------

def knob(agent: Agent) -> Any:
    return httpx.get(f"{agent.url}/v1/knobs", timeout=10).json()[KNOB]["value"]


def push(case: Case, value: int) -> tuple[float, float]:
    """`KNOB = value` to every agent the page would offer, through dashboard.fleet.push; its wall seconds and
    this process's CPU seconds meanwhile. Every agent up must accept it and then report it."""
    online, _ = fleet.pushable(fleet.devices(fleet.Prometheus(case.prometheus.url).snapshot()))
    if sorted(online) != sorted(case.up):
        raise RuntimeError(f"{case.label}: the page offers {sorted(online)}, not the agents up {sorted(case.up)}")
    start, cpu = time.perf_counter(), time.process_time()
    answers = fleet.push(list(online.values()), {KNOB: value}, {n: token(n) for n in online}, None)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    refused = [(r.device, r.answer) for r in answers if not r.accepted]
    reported = {name: knob(agent) for name, agent in case.up.items()}
    if refused or set(reported.values()) != {value}:
        raise RuntimeError(f"{case.label}: push of {KNOB} = {value}: refused {refused}, then reported {reported}")
    return seconds, cpu


def pushes(case: Case, values: list[int]) -> dict[str, Any]:
    seconds, cpus = zip(*(push(case, v) for v in values))
    return {"pushed_to": len(case.up), "push_s": statistics.median(seconds), "push_s_all": list(seconds),
            "push_cpu_s": statistics.median(cpus), "all_report_new_value": True}


def push_form(case: Case) -> dict[str, Any]:
    """The page with every agent up chosen in its push form, which reads each one's knobs: wall seconds."""
    at, _, _ = page(case.prometheus.url)
    start = time.perf_counter()
    at.multiselect(key="fleet-devices").set_value(sorted(case.up)).run()
    wall = time.perf_counter() - start
    rows = at.table[0].value if at.table else None
    if rows is None or len(rows) != len(case.up):
        raise RuntimeError(f"{case.label}: the push form listed {rows}")
    return {"push_form_s": wall}


# -- Chromium -----------------------------------------------------------------------------------------------

ROW_PX = 35                     # the height of a row, and of the header, in Streamlit's data grid


def browser_render(case: Case, root: Path, stack: ExitStack, screenshots: Path | None) -> dict[str, Any]:
    """A dashboard server on this case's Prometheus; /fleet in Chromium until the Devices metric counts every
    agent and the table's grid has rows: seconds, and the device rows the grid's height holds in view."""
    os.environ[fleet.PROMETHEUS_ENV] = case.prometheus.url
    proc, url = start_dashboard(root / "none.db", f"http://127.0.0.1:{free_port()}", root, "dashboard-token-0123")
    stack.callback(stop, proc)
    cpu = cpu_seconds(proc.pid)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        tab = browser.new_context(viewport={"width": 1600, "height": 1100}).new_page()
        start = time.perf_counter()
        tab.goto(f"{url}/fleet")
        tab.get_by_test_id("stMetric").filter(has_text="Devices").filter(
            has_text=str(len(case.agents))).wait_for(timeout=60_000)
        grid = tab.get_by_test_id("stDataFrame").first
        grid.locator("td[role=gridcell]").first.wait_for(state="attached", timeout=60_000)
        wall = time.perf_counter() - start
        height = grid.bounding_box()["height"]
        if screenshots is not None:
            tab.screenshot(path=str(screenshots / f"fleet-{len(case.agents)}.png"), full_page=True)
        browser.close()
    return {"browser_render_s": wall, "grid_height_px": height,
            "rows_in_view": min(len(case.agents), int(height // ROW_PX) - 1),
            "dashboard_cpu_s": cpu_seconds(proc.pid) - cpu}


# -- memory -------------------------------------------------------------------------------------------------

def mem_available() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


def rollup(pid: int) -> dict[str, int]:
    """Rss and Pss of a process, bytes (/proc/PID/smaps_rollup)."""
    lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    return {k: int(v.split()[0]) * 1024 for k, v in (x.split(":", 1) for x in lines) if k in ("Rss", "Pss")}


def memory(agents: dict[str, Agent]) -> dict[str, Any]:
    each = [rollup(a.proc.pid) for a in agents.values()]
    return {"agents": len(each), "rss_bytes": sum(m["Rss"] for m in each), "pss_bytes": sum(m["Pss"] for m in each),
            "rss_bytes_max": max(m["Rss"] for m in each)}


# -- the run ------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, root: Path, stack: ExitStack) -> dict[str, Any]:
    model = small_demo(root / "demo-small")
    names = device_names(args.agents)
    before = mem_available()
    start = time.perf_counter()
    agents = start_agents(model, root, names, stack)
    started_s = time.perf_counter() - start
    cases = [start_case(f"{SMALL} agents", {n: agents[n] for n in names[-SMALL:]}, root, stack),
             start_case(f"{args.agents} agents", agents, root, stack)]
    for case in cases:
        wait_for(lambda: len(case.prometheus.query(f'up{{job="{fleet.AGENT_JOB}"}} == 1')) == len(case.agents), 60,
                 f"{case.label} up")
    traffic(agents)
    for case in cases:
        wait_for(lambda: recorded(case), 60, f"{case.label}: every agent's recorded hit rate")
    mem = memory(agents) | {"mem_available_drop_bytes": before - mem_available()}
    (root / "tokens.json").write_text("{}")
    os.environ |= {fleet.TOKENS_ENV: str(root / "tokens.json"), "FLASHMOE_DB": str(root / "none.db"),
                   "FLASHMOE_AGENT_URL": f"http://127.0.0.1:{free_port()}"}
    watch_down(cases, names[-1])
    low = knob(agents[names[0]])
    for case in cases:
        case.found |= render(case, args.renders)
        case.found |= pushes(case, [low - 1 - i for i in range(args.pushes)])
        case.found |= push_form(case)
        case.found["prometheus_rss_bytes"] = rollup(case.prometheus.proc.pid)["Rss"]
        if args.browser:
            (root / f"dash-{len(case.agents)}").mkdir()
            case.found |= browser_render(case, root / f"dash-{len(case.agents)}", stack, args.screenshots)
    return {"agents": args.agents, "small": SMALL, "victim": names[-1], "start_s": started_s,
            "memory": mem,
            "cases": {c.label: {"agents": len(c.agents), "up": len(c.up), **c.found} for c in cases}}


ROWS = [  # (label, key in a case, format)
    ("agents up / scraped", None, None),
    ("kill -> Prometheus up == 0 (s)", "prometheus_down_s", "{:.1f}"),
    ("kill -> page shows it down (s)", "page_down_s", "{:.1f}"),
    (f"kill -> {ALERT} firing (s)", "prometheus_alert_s", "{:.1f}"),
    (f"kill -> page lists {ALERT} (s)", "page_alert_s", "{:.1f}"),
    ("  resolution of these times (s)", "resolution_s", "{:.1f}"),
    ("page first render, AppTest (s)", "render_s", "{:.2f}"),
    ("  its CPU (s)", "render_cpu_s", "{:.2f}"),
    ("page first render, Chromium (s)", "browser_render_s", "{:.2f}"),
    ("  device rows in view without scrolling", "rows_in_view", "{}"),
    ("  dashboard server CPU (s)", "dashboard_cpu_s", "{:.2f}"),
    ("push to every agent up (s)", "push_s", "{:.3f}"),
    ("  its CPU in the dashboard's process (s)", "push_cpu_s", "{:.3f}"),
    ("push form, every agent up chosen (s)", "push_form_s", "{:.2f}"),
    ("Prometheus CPU while pending (cores)", "prometheus_cpu_cores", "{:.3f}"),
    ("Prometheus RSS (MiB)", "prometheus_rss_bytes", "{:.0f}"),
]
RATIOS = ("render_s", "browser_render_s", "push_s", "push_form_s", "prometheus_cpu_cores")


def cell(case: dict[str, Any], key: str | None, form: str | None) -> str:
    if key is None:
        return f"{case['up']} / {case['agents']}"
    if key not in case:
        return "-"
    value = case[key] / 2**20 if key.endswith("_bytes") else case[key]
    return form.format(value)


def ratios(small: dict[str, Any], large: dict[str, Any]) -> dict[str, float]:
    return {k: large[k] / small[k] for k in RATIOS if k in small and small[k]}


def report(result: dict[str, Any]) -> None:
    small, large = result["cases"].values()
    labels = list(result["cases"])
    print(f"{'':<40} {labels[0]:>10} {labels[1]:>10} {'ratio':>7}")
    for label, key, form in ROWS:
        ratio = result["ratios"].get(key)
        print(f"{label:<40} {cell(small, key, form):>10} {cell(large, key, form):>10} "
              f"{'' if ratio is None else f'{ratio:.2f}':>7}")
    mem = result["memory"]
    print(f"{mem['agents']} agents started in {result['start_s']:.0f} s ({STARTERS} at a time): RSS "
          f"{mem['rss_bytes'] / 2**30:.2f} GiB in all (PSS {mem['pss_bytes'] / 2**30:.2f} GiB, largest "
          f"{mem['rss_bytes_max'] / 2**20:.0f} MiB), MemAvailable down {mem['mem_available_drop_bytes'] / 2**30:.2f}"
          f" GiB; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=count, default=20, help="agents in the large fleet (default 20)")
    parser.add_argument("--renders", type=count, default=5, help="cold renders of the page per fleet (default 5)")
    parser.add_argument("--pushes", type=count, default=3, help="knob pushes per fleet (default 3)")
    parser.add_argument("--screenshots", type=Path, help="save the Fleet page as Chromium shows it, in this folder")
    parser.add_argument("--results", type=results_name, default="fleet",
                        help="write bench/results/NAME.json (default fleet)")
    parser.add_argument("--no-browser", dest="browser", action="store_false", help="leave Chromium out")
    args = parser.parse_args()
    if args.agents <= SMALL:
        parser.error(f"--agents must be more than the {SMALL} of the small fleet")
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp, ExitStack() as stack:
        result = run(args, Path(tmp), stack)
    result["ratios"] = ratios(*result["cases"].values())
    report(result)
    write_results(args.results, {**result, "machine": machine()})


if __name__ == "__main__":
    main()
