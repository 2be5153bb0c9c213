"""Cached loaders: every input is an argument, so a cache entry is exactly one query's answer.

The live fragments re-run every few seconds; a `ttl` of the same length means each chart reads
the store at most once per refresh however many browser sessions are open. `until` is rounded up
to the refresh step by `window`, so sessions opened within one step share entries.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import streamlit as st

from dashboard import agent_client, settings, sweep, transforms
from store import queries
from store.errors import StoreError

TTL = settings.REFRESH_S


def window(seconds: float, now: float | None = None) -> tuple[float, float]:
    """(since, until) covering the last `seconds`, `until` rounded up to the refresh step."""
    now = time.time() if now is None else now
    until = math.ceil(now / settings.REFRESH_S) * settings.REFRESH_S
    return until - seconds, until


def store_problem(db: str) -> str | None:
    """Why the store cannot be shown (missing, unreadable), or None when it can."""
    if not Path(db).exists():
        return (f"No store at `{db}` yet. Start the agent and the collector (`make demo`, or "
                f"`flashmoe-cli collect --db {db}`), or point FLASHMOE_DB at an existing store.")
    try:
        queries.connect_ro(db).close()
    except StoreError as err:
        return str(err)
    return None


@st.cache_data(ttl=TTL, show_spinner=False)
def series(db: str, name: str, since: float, until: float, buckets: int) -> list[queries.Bucket]:
    return queries.series(db, name, since, until, buckets)


@st.cache_data(ttl=TTL, show_spinner=False)
def series_names(db: str) -> list[str]:
    return queries.series_names(db)


@st.cache_data(ttl=TTL, show_spinner=False)
def latest(db: str, name: str) -> tuple[float, float] | None:
    return queries.latest(db, name)


def latest_value(db: str, name: str) -> float | None:
    point = latest(db, name)
    return point[1] if point else None


@st.cache_data(ttl=TTL, show_spinner=False)
def requests(db: str, since: float, until: float) -> list[dict[str, Any]]:
    return queries.requests(db, since, until)


@st.cache_data(ttl=TTL, show_spinner=False)
def latency_quantiles(db: str, since: float, until: float, buckets: int) -> list[dict[str, Any]]:
    return queries.latency_quantiles(db, since, until, buckets)


_COUNTERS = ("hits", "misses", "evictions", "prefetch_hits", "bytes_read")
_CACHE_STATS_SQL = (
    "SELECT MIN(CAST((t - :since) / :width AS INTEGER), :last) AS bucket, layer, "
    + ", ".join(f"SUM({c}) AS {c}" for c in _COUNTERS)
    + ", SUM(read_latency_s) AS latency_sum, COUNT(read_latency_s) AS latency_n "
    "FROM cache_stats WHERE t >= :since AND t <= :until GROUP BY bucket, layer")


@st.cache_data(ttl=TTL, show_spinner=False)
def cache_stats(db: str, since: float, until: float, buckets: int) -> dict[str, list[dict[str, Any]]]:
    """What store.queries.cache_stats returns, from one pass of SQLite over the window.

    queries.cache_stats sums row by row in Python: 9 s for 24 h of 4 layers at 1 Hz on this
    machine, against the 2 s page budget. This loader stays only until the store aggregates in SQL.
    """
    conn = queries.connect_ro(db)
    if conn is None:
        return {"over_time": [], "per_layer": []}
    width = max((until - since) / buckets, 1e-3)
    try:
        cells = _dicts(conn, _CACHE_STATS_SQL, {"since": since, "until": until, "width": width, "last": buckets - 1})
    finally:
        conn.close()
    over: dict[int, dict[str, Any]] = {}
    layers: dict[int, dict[str, Any]] = {}
    for cell in cells:   # one (bucket, layer) cell each: fold into both views
        slot = over.setdefault(cell["bucket"], {"t": since + cell["bucket"] * width, **dict.fromkeys(_COUNTERS, 0)})
        layer = layers.setdefault(cell["layer"], {"layer": cell["layer"], **dict.fromkeys(_COUNTERS, 0),
                                                  "latency_sum": 0.0, "latency_n": 0})
        for c in _COUNTERS:
            slot[c] += cell[c]
            layer[c] += cell[c]
        layer["latency_sum"] += cell["latency_sum"] or 0.0
        layer["latency_n"] += cell["latency_n"]
    for layer in layers.values():
        total, n = layer.pop("latency_sum"), layer.pop("latency_n")
        layer["read_latency_s"] = total / n if n else None
    for row in [*over.values(), *layers.values()]:
        row["hit_rate"] = row["hits"] / (row["hits"] + row["misses"]) if row["hits"] + row["misses"] else None
    return {"over_time": [over[k] for k in sorted(over)], "per_layer": [layers[k] for k in sorted(layers)]}


def _dicts(conn, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    cur = conn.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


@st.cache_data(ttl=TTL, show_spinner=False)
def activations(db: str, since: float, until: float) -> dict[tuple[int, int], int]:
    return queries.activations(db, since, until)


@st.cache_data(ttl=TTL, show_spinner=False)
def knob_history(db: str, limit: int) -> list[dict[str, Any]]:
    return queries.knob_history(db, limit)


@st.cache_data(ttl=TTL, show_spinner=False)
def latest_knobs(db: str) -> dict[str, Any]:
    return queries.latest_knobs(db)


@st.cache_data(ttl=TTL, show_spinner=False)
def events(db: str, since: float, kind: str | None) -> list[dict[str, Any]]:
    return queries.events(db, since, kind)


@st.cache_data(ttl=TTL, show_spinner=False)
def simulations(db: str) -> list[dict[str, Any]]:
    return queries.simulations(db)


@st.cache_data(ttl=TTL, show_spinner=False)
def sweeps(db: str) -> list[dict[str, Any]]:
    return queries.sweeps(db)


@st.cache_resource
def agent(url: str) -> agent_client.Agent:
    """One client per agent URL for the whole dashboard process, so connections are reused."""
    return agent_client.Agent(url)


def agent_status(url: str) -> dict[str, Any] | str:
    """The agent's /v1/status, or the reason it could not be read (never cached: it is live)."""
    try:
        return agent(url).status()
    except agent_client.AgentError as err:
        return str(err)


def agent_knobs(url: str) -> dict[str, Any] | str:
    """The agent's knobs with bounds, or the reason they could not be read."""
    try:
        return agent(url).knobs()
    except agent_client.AgentError as err:
        return str(err)


def knob_state(url: str, db: str) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(knobs as GET /v1/knobs describes them, None) from a live agent; else the last values the
    store holds, without bounds, and the reason the agent could not be reached."""
    knobs = agent_knobs(url)
    if isinstance(knobs, dict):
        return knobs, None
    stored = latest_knobs(db) if store_problem(db) is None else {}
    return transforms.stored_knobs(stored), knobs


@st.cache_resource
def sweep_runner() -> sweep.SweepRunner:
    """One runner per dashboard process: a sweep moves the shared agent's cap, so never two at once."""
    return sweep.SweepRunner()
