"""Cached loaders: every input is an argument, so a cache entry is exactly one query's answer.

The live fragments re-run every few seconds; a `ttl` of one refresh step means each chart reads
the store at most once per step however many browser sessions are open. `until` of a relative
range is rounded up to that step (timerange.relative), so sessions opened within one step share
entries.
"""
from __future__ import annotations

from typing import Any

import streamlit as st

from dashboard import agent_client, auth, figures, settings, sweep, timerange, transforms
from store import diagnosis as thrash
from store import queries
from store.errors import StoreError

TTL = timerange.STEP_S
HIT_RATE_NOW_S = 60           # "hit rate now" on every page: the last minute of cache statistics
MARKERS = 500                 # knob changes drawn at most (the newest)


def store_problem(db: str) -> str | None:
    """Why the store cannot be shown (missing, not yet created, unreadable), or None when it can."""
    try:
        conn = queries.connect_ro(db, settings.DB_ENV)
    except StoreError as err:
        return str(err)
    if conn is None:
        return (f"No store at `{db}` yet. Start the agent and the collector (`make demo`, or "
                f"`flashmoe-cli collect --db {db}`), or point {settings.DB_ENV} at an existing store.")
    conn.close()
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


def recent_mean(db: str, name: str, seconds: float) -> tuple[float, float] | None:
    """(t, mean) of a series' points in the `seconds` up to its latest point t, or None without points."""
    last = latest(db, name)
    if last is None:
        return None
    window = series(db, name, last[0] - seconds, last[0], 1)
    return (last[0], window[0][2]) if window else last


@st.cache_data(ttl=TTL, show_spinner=False)
def requests(db: str, since: float, until: float) -> list[dict[str, Any]]:
    return queries.requests(db, since, until)


@st.cache_data(ttl=TTL, show_spinner=False)
def latency_quantiles(db: str, since: float, until: float, buckets: int) -> list[dict[str, Any]]:
    return queries.latency_quantiles(db, since, until, buckets)


@st.cache_data(ttl=TTL, show_spinner=False)
def cache_stats(db: str, since: float, until: float, buckets: int) -> dict[str, Any]:
    return queries.cache_stats(db, since, until, buckets)


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
def markers(db: str, since: float, until: float) -> list[figures.Marker]:
    """Knob changes and sweep points in [since, until]: the annotations of every time chart."""
    return transforms.markers(queries.knob_history(db, MARKERS), queries.sweeps(db), since, until)


def hit_rate_now(db: str, until: float) -> float | None:
    """Hits over lookups in the last HIT_RATE_NOW_S before `until`: what every page calls the hit rate now."""
    total = cache_stats(db, until - HIT_RATE_NOW_S, until, 1)["total"]
    return total["hit_rate"] if total else None


@st.cache_data(ttl=TTL, show_spinner=False)
def diagnosis(db: str, since: float, until: float, knobs: dict[str, Any] | None, buckets: int) -> thrash.Diagnosis:
    return thrash.diagnose(db, until - since, until, knobs, buckets)


@st.cache_data(ttl=TTL, show_spinner=False)
def events(db: str, since: float, kind: str | None) -> list[dict[str, Any]]:
    return queries.events(db, since, kind)


@st.cache_data(ttl=TTL, show_spinner=False)
def lost(db: str) -> dict[str, int]:
    return queries.lost(db)


@st.cache_data(ttl=TTL, show_spinner=False)
def missed_samples(db: str, since: float, until: float) -> int:
    return queries.missed_samples(db, since, until)


@st.cache_data(ttl=TTL, show_spinner=False)
def unserved(db: str, since: float, until: float) -> dict[str, int]:
    return queries.unserved(db, since, until)


@st.cache_data(ttl=TTL, show_spinner=False)
def simulations(db: str) -> list[dict[str, Any]]:
    return queries.simulations(db)


@st.cache_data(ttl=TTL, show_spinner=False)
def sweeps(db: str) -> list[dict[str, Any]]:
    return queries.sweeps(db)


@st.cache_resource
def agent(url: str, token: str | None) -> agent_client.Agent:
    """One client per agent URL and token for the whole dashboard process, so connections are reused."""
    return agent_client.Agent(url, token)


class Unanswered(str):
    """Why the agent's answer is missing, as the text pages show; `busy`: the agent runs but did not
    answer in time (agent_client.AgentBusy); `misaddressed`: FLASHMOE_AGENT_URL is no address at all."""
    busy: bool
    misaddressed: bool

    def __new__(cls, err: agent_client.AgentError) -> "Unanswered":
        reason = super().__new__(cls, str(err))
        reason.busy = isinstance(err, agent_client.AgentBusy)
        reason.misaddressed = isinstance(err, agent_client.AgentMisaddressed)
        return reason


def agent_status(url: str, token: str | None) -> dict[str, Any] | Unanswered:
    """The agent's /v1/status, or the reason it could not be read (never cached: it is live)."""
    try:
        return agent(url, token).status()
    except agent_client.AgentError as err:
        return Unanswered(err)


def agent_knobs(url: str, token: str | None) -> dict[str, Any] | Unanswered:
    """The agent's knobs with bounds, or the reason they could not be read."""
    try:
        return agent(url, token).knobs()
    except agent_client.AgentError as err:
        return Unanswered(err)


APPLYING = ("Applying: the agent changes the cache cap at once and other knobs between two model steps, "
            "which memory thrash can make slow (it gives up after 60 s)")


def apply_knobs(url: str, token: str | None, changes: dict[str, Any]) -> tuple[bool, str]:
    """Send knob changes if this session may (dashboard.auth): (accepted, the agent's answer in one line),
    an unreachable agent included."""
    lock = auth.control_lock()
    if lock:
        return False, f"not sent: {lock}"
    try:
        with st.spinner(APPLYING):
            answer = agent(url, token).put_knobs(changes)
    except agent_client.AgentError as err:
        return False, agent_client.unsent(err)
    if not answer.accepted:
        return False, answer.message()
    return True, "accepted: " + ", ".join(f"{k} = {transforms.value_text(k, answer.knobs[k]['value'])}"
                                          for k in changes if k in answer.knobs)


def knob_state(url: str, token: str | None, db: str) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(knobs as GET /v1/knobs describes them, None) from a live agent; else the last values the
    store holds, without bounds, and the reason the agent could not be reached."""
    knobs = agent_knobs(url, token)
    if isinstance(knobs, dict):
        return knobs, None
    stored = latest_knobs(db) if store_problem(db) is None else {}
    return transforms.stored_knobs(stored), knobs


@st.cache_resource
def sweep_runner() -> sweep.SweepRunner:
    """One runner per dashboard process: a sweep moves the shared agent's cap, so never two at once."""
    return sweep.SweepRunner()
