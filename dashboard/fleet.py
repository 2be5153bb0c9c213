"""The fleet as Prometheus sees it, for the dashboard's Fleet page: one row per agent, and one knob
change pushed to several agents.

Prometheus scrapes every device's agent (job "flashmoe") and collector (job "flashmoe-collector") and
evaluates examples/alerts.yml. This module reads it through Prometheus's HTTP API with
prometheus-api-client; each figure is one of those rules' recorded series, so the page, the alerts
and any other board show the same numbers. A push goes to each agent's own control API with that
device's token: the file FLASHMOE_FLEET_TOKENS names maps device names to tokens, and a device
without an entry gets FLASHMOE_TOKEN. Tokens travel only in Authorization headers.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from access.address import url_problem
from dashboard.agent_client import TOKEN_ENV, Agent
from dashboard.transforms import clock
from store.units import MISSING

PROMETHEUS_ENV = "FLASHMOE_PROMETHEUS_URL"
TOKENS_ENV = "FLASHMOE_FLEET_TOKENS"
AGENT_JOB = "flashmoe"
DASHBOARD_PORT = 8501           # where a device's own dashboard is, unless its target has a `dashboard` label
TIMEOUT_S = 5
AT_ONCE = 8                     # agents asked at the same time (a push, the push form's reading of knobs)
NAME_LOOKBACK = "1d"            # a device that went down keeps its name on the page this long
FIGURES = {                     # Device field -> the series examples/alerts.yml records
    "hit_rate": "device_name:flashmoe_expert_cache_hit_ratio:rate5m",
    "tokens_per_s": "device_name:flashmoe_generated_tokens:rate5m",
    "p99_s": "device_name:flashmoe_request_latency_seconds:p99_rate5m",
    "ssd_read_bytes_per_s": "device_name:flashmoe_expert_read_bytes:rate5m",
    "ssd_util": "device_name:node_disk_io_time_seconds:max_rate5m",
}
MEMORY_ALERTS = {"FlashMoEAgentThrashing": "agent thrashing",         # examples/alerts.yml's verdicts, the
                 "FlashMoEMemoryPressure": "pressure from another process"}  # Memory page's words, graver first
SEVERITIES = ("critical", "warning", "info")          # examples/alerts.yml's, most urgent first
COLLECTOR_SERIES = "node_memory_MemAvailable_bytes"   # any series the collector always exports


class FleetError(RuntimeError):
    """Prometheus or the tokens file cannot be read; the message says what to check."""


@dataclass(frozen=True)
class Alert:
    """A firing alert as Prometheus's /api/v1/alerts gives it: its rule's labels and templated annotations."""
    name: str
    severity: str | None
    summary: str | None
    description: str | None
    value: float | None          # the rule's expression when it was last evaluated
    active_since: float | None   # Unix seconds: when it began pending

    @property
    def urgency(self) -> int:
        return SEVERITIES.index(self.severity) if self.severity in SEVERITIES else len(SEVERITIES)


@dataclass
class Device:
    name: str
    instance: str                # the agent's scrape address
    agent_url: str
    dashboard_url: str
    up: bool
    hit_rate: float | None = None
    tokens_per_s: float | None = None
    p99_s: float | None = None
    ssd_read_bytes_per_s: float | None = None
    ssd_util: float | None = None
    memory: str = "no collector"
    alerts: list[Alert] = field(default_factory=list)     # firing


@dataclass(frozen=True)
class Snapshot:
    """One read of Prometheus, as its API returned it."""
    targets: list[dict[str, Any]]            # the agent job's active targets (/api/v1/targets)
    names: list[dict[str, Any]]              # flashmoe_agent_info results: instance -> device_name
    figures: list[dict[str, Any]]            # the recorded series, every device
    alerts: list[dict[str, Any]]             # /api/v1/alerts: firing and pending, with annotations
    collected: list[dict[str, Any]]          # COLLECTOR_SERIES results: devices whose collector reports


@dataclass(frozen=True)
class PushResult:
    device: str
    answer: str                  # the agent's answer in one line (agent_client.Agent.push)

    @property
    def accepted(self) -> bool:
        return self.answer.startswith("accepted")


class Prometheus:
    """Reads a Snapshot from the Prometheus server at `url`; no retries, so a down server fails fast."""

    def __init__(self, url: str) -> None:
        if problem := url_problem(url):
            raise FleetError(f"{PROMETHEUS_ENV} {url!r} is not a Prometheus server's address: {problem}; set it to "
                             f"one such as http://prometheus.lan:9090")
        self.url = url.rstrip("/")
        self._session = requests.Session()
        self._api = PrometheusConnect(self.url, retry=Retry(total=0), timeout=TIMEOUT_S, session=self._session)

    def _alerts(self) -> list[dict[str, Any]]:
        """Active alerts with their annotations (the ALERTS series carries labels only); the client has
        no call for this endpoint, so it is read on the client's session."""
        response = self._session.get(f"{self.url}/api/v1/alerts", timeout=TIMEOUT_S)
        if response.status_code != 200:
            raise PrometheusApiClientException(f"HTTP Status Code {response.status_code} from /api/v1/alerts")
        return response.json()["data"]["alerts"]

    def snapshot(self) -> Snapshot:
        figures = "|".join(FIGURES.values())
        try:
            targets = self._api.get_targets(state="active")["activeTargets"]
            return Snapshot(
                targets=[t for t in targets if t["labels"].get("job") == AGENT_JOB],
                names=self._api.custom_query(f"last_over_time(flashmoe_agent_info[{NAME_LOOKBACK}])"),
                figures=self._api.custom_query(f'{{__name__=~"{figures}"}}'),
                alerts=self._alerts(),
                collected=self._api.custom_query(f"count by (device_name) ({COLLECTOR_SERIES})"))
        except requests.JSONDecodeError:     # a RequestException too, but the server did answer: a wrong port
            raise FleetError(f"{self.url} is not a Prometheus API: it answered with something other than JSON; "
                             f"set {PROMETHEUS_ENV} to the Prometheus server's address (e.g. "
                             f"http://prometheus.lan:9090)") from None
        except requests.RequestException as err:
            raise FleetError(f"Prometheus at {self.url} did not answer ({type(err).__name__}); check "
                             f"{PROMETHEUS_ENV}") from None
        except (PrometheusApiClientException, KeyError, ValueError) as err:
            raise FleetError(f"Prometheus at {self.url} gave no usable answer ({err}); is {PROMETHEUS_ENV} "
                             f"the address of a Prometheus server?") from None


def devices(snap: Snapshot) -> list[Device]:
    """One Device per agent target, with its recorded figures, memory verdict and active alerts."""
    names = {r["metric"]["instance"]: r["metric"]["device_name"] for r in snap.names
             if "instance" in r["metric"] and "device_name" in r["metric"]}
    rows = [_device(t, names.get(t["labels"]["instance"])) for t in snap.targets]
    by_name = {d.name: d for d in rows}
    by_instance = {d.instance: d for d in rows}
    for r in snap.figures:
        labels = r["metric"]
        field_name = next(k for k, v in FIGURES.items() if v == labels["__name__"])
        if labels.get("device_name") in by_name:
            setattr(by_name[labels["device_name"]], field_name, _number(r["value"][1]))
    for r in snap.collected:
        if r["metric"].get("device_name") in by_name:
            by_name[r["metric"]["device_name"]].memory = "ok"
    for active in snap.alerts:
        labels = active["labels"]
        row = by_name.get(labels.get("device_name")) or by_instance.get(labels.get("instance"))
        if row is None:
            continue
        if labels["alertname"] in MEMORY_ALERTS:
            row.memory = _graver(row.memory, MEMORY_ALERTS[labels["alertname"]]
                                 + ("" if active["state"] == "firing" else " (pending)"))
        if active["state"] == "firing":
            row.alerts.append(_alert(active))
    for row in rows:
        row.alerts.sort(key=lambda a: (a.urgency, a.name))
    return sorted(rows, key=lambda d: d.name)


def _graver(shown: str, verdict: str) -> str:
    """Of two memory verdicts, the one to show: firing before pending, the agent's before another's."""
    order = [v + state for state in ("", " (pending)") for v in MEMORY_ALERTS.values()]
    return min((shown, verdict), key=lambda v: order.index(v) if v in order else len(order))


def _alert(active: Mapping[str, Any]) -> Alert:
    notes = active.get("annotations", {})
    return Alert(active["labels"]["alertname"], active["labels"].get("severity"), notes.get("summary"),
                 notes.get("description"), _number(active.get("value", "NaN")), _instant(active.get("activeAt")))


def _instant(text: str | None) -> float | None:
    """Unix seconds of Prometheus's RFC 3339 time, e.g. 2026-12-01T10:00:00.123456789Z (nanoseconds cut to
    the microseconds Python reads)."""
    match = re.fullmatch(r"([^.]+?)(\.\d{1,6})?\d*(Z|[+-]\d\d:\d\d)", text or "")
    if match is None:
        return None
    head, fraction, zone = match.groups()
    return datetime.fromisoformat(head + (fraction or "") + ("+00:00" if zone == "Z" else zone)).timestamp()


def alert_rows(rows: Iterable[Device]) -> list[dict[str, str]]:
    """Every firing alert as the page lists it, most urgent first: what fired where, how bad, what it
    says, the rule's value and since when."""
    firing = sorted(((d.name, a) for d in rows for a in d.alerts), key=lambda p: (p[1].urgency, p[1].name, p[0]))
    return [{"severity": a.severity or MISSING, "device": name, "alert": a.name, "summary": a.summary or MISSING,
             "value": (MISSING if a.value is None
                       else np.format_float_positional(a.value, 4, fractional=False, trim="-")),
             "active since": MISSING if a.active_since is None else clock(a.active_since),
             "description": a.description or MISSING} for name, a in firing]


def trouble_first(rows: Iterable[Device]) -> list[Device]:
    """The devices as the page lists them, trouble on top: those down, then those up; in each, by their most
    urgent firing alert (critical first, none last), then by name."""
    return sorted(rows, key=lambda d: (d.up, min((a.urgency for a in d.alerts), default=len(SEVERITIES) + 1),
                                       d.name))


def duplicate_names(rows: Iterable[Device]) -> list[str]:
    """Device names two agents share: their figures are summed together, so each needs its own."""
    counts = Counter(d.name for d in rows)
    return sorted(name for name, n in counts.items() if n > 1)


def pushable(rows: Iterable[Device]) -> tuple[dict[str, Device], list[str]]:
    """(name -> agent, for each agent up that a knob change may go to; the names left out). A push goes with the
    token of the name an agent reports, so a name that two agents up report is left out: it reached whichever
    was listed last, maybe not the device the token is for (a cloned box, or another target claiming it)."""
    online = [d for d in rows if d.up]
    shared = duplicate_names(online)
    return {d.name: d for d in online if d.name not in shared}, shared


def _device(target: Mapping[str, Any], name: str | None) -> Device:
    labels = target["labels"]
    scrape = urlsplit(target["scrapeUrl"])
    host = scrape.hostname or ""
    dashboard = labels.get("dashboard") or f"http://{f'[{host}]' if ':' in host else host}:{DASHBOARD_PORT}"
    return Device(name=name or labels["instance"], instance=labels["instance"],
                  agent_url=f"{scrape.scheme}://{scrape.netloc}", dashboard_url=dashboard,
                  up=target["health"] == "up")


def _number(text: str) -> float | None:
    """Prometheus sends numbers as strings, NaN among them (e.g. a hit rate with no look-ups)."""
    value = float(text)
    return None if value != value or value in (float("inf"), float("-inf")) else value


def load_tokens(path: str | None) -> dict[str, str]:
    """Device name -> bearer token from a JSON object file ({"edge-01": "..."}); {} when no file is set."""
    if not path:
        return {}
    try:
        tokens = json.loads(Path(path).read_text())
    except OSError as err:
        raise FleetError(f"cannot read the tokens file {path} ({TOKENS_ENV}): {err.strerror}") from None
    except ValueError:
        raise FleetError(f"the tokens file {path} ({TOKENS_ENV}) is not JSON; write "
                         f'{{"device-name": "token", ...}}') from None
    if not isinstance(tokens, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                               for k, v in tokens.items()):
        raise FleetError(f"the tokens file {path} ({TOKENS_ENV}) must hold one JSON object of device names "
                         f"to non-empty token strings")
    return tokens


def push(targets: list[Device], changes: dict[str, Any], tokens: Mapping[str, str],
         default_token: str | None) -> list[PushResult]:
    """Send `changes` to every target's agent at once, each with its device's token, and collect each
    answer. An agent validates a change all or nothing, so a device that refuses is left as it was."""
    def one(device: Device) -> PushResult:
        with Agent(device.agent_url, tokens.get(device.name, default_token)) as agent:
            return PushResult(device.name, agent.push(changes))
    return each(targets, one)


T = TypeVar("T")


def each(targets: list[Device], call: Callable[[Device], T]) -> list[T]:
    """`call` on every target, AT_ONCE at a time: the answers in the targets' order."""
    with ThreadPoolExecutor(max_workers=min(AT_ONCE, len(targets)) or 1) as pool:
        return list(pool.map(call, targets))


def settings() -> tuple[str | None, str | None, str | None]:
    """(Prometheus URL, tokens file, fallback token) from the environment."""
    return (os.environ.get(PROMETHEUS_ENV) or None, os.environ.get(TOKENS_ENV) or None,
            os.environ.get(TOKEN_ENV) or None)
