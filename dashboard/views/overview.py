"""Overview: throughput, hit rate, latency tails, requests, and which processes are up."""
from __future__ import annotations

import streamlit as st

from dashboard import components, data, figures, settings, timerange, transforms
from store.schema import TOKEN_PHASES
from store.units import human

LIVE_S = 15               # agent and collector write every second: an older latest point is not "now"
COLLECTOR_HEARTBEAT = "mem.available_bytes"
TIME_BUCKETS = 60         # latency and request-count buckets: quantiles need a few requests each
TOKENS_NOW_S = 10         # the agent samples tokens/s every second: a step longer than that left it 0 or double


def now_metric(column, label: str, point: tuple[float, float] | None, now: float, unit: str, help_: str) -> None:
    """A metric of now: the latest point while it is live, else "–" and how old the last one is."""
    live = transforms.live_value(point, now, LIVE_S)
    note = (f"last {human(point[1], unit)}, {transforms.age_text(point[0], now)}"
            if point is not None and live is None else None)
    column.metric(label, human(live, unit), note, delta_color="off", delta_arrow="off", help=help_)


@components.live
def live() -> None:
    since, until = components.page_range()
    db, url = settings.db_path(), settings.agent_url()
    status = data.agent_status(url, settings.agent_token())
    ready = data.store_problem(db) is None
    heartbeat = data.latest(db, COLLECTOR_HEARTBEAT) if ready else None
    now = timerange.now()

    agent_col, collector_col = st.columns(2)
    if isinstance(status, dict):
        agent_col.success(f"Agent up at {url}: policy {status['policy']}, up {status['uptime_s'] / 60:.0f} min",
                          icon=":material/check_circle:")
    elif status.busy:
        agent_col.warning(f"Agent busy: {status}", icon=":material/hourglass_top:")
    elif status.misaddressed:
        agent_col.error(f"Agent address wrong: {status}", icon=":material/link_off:")
    else:
        agent_col.error(f"Agent down: {status}", icon=":material/cancel:")
    seen = heartbeat[0] if heartbeat else None
    if transforms.live_value(heartbeat, now, LIVE_S) is not None:
        collector_col.success(f"Collector up: last sample {transforms.age_text(seen, now)}",
                              icon=":material/check_circle:")
    else:
        collector_col.error(f"Collector down: last sample {transforms.age_text(seen, now)}",
                            icon=":material/cancel:")

    if not components.store_ready(db):
        return
    components.lost_notice(db, since, until)
    unserved = data.unserved(db, since, until)
    if any(unserved.values()):
        st.warning(f"Requests unanswered in this range: {unserved['failed']:,} failed (an error in their step, "
                   f"e.g. a damaged expert block: the agent's log names it), {unserved['refused']:,} refused "
                   f"(the queue full: raise serve --max-waiting, or add capacity) and {unserved['abandoned']:,} "
                   f"abandoned (the client went away first: a client timeout shorter than the latency?)",
                   icon=":material/report:")
    rows = data.requests(db, since, until)
    quantiles = data.latency_quantiles(db, since, until, TIME_BUCKETS)
    whole = data.latency_quantiles(db, since, until, 1)     # one bucket: the range's own quantiles
    c1, c2, c3, c4 = st.columns(4)
    now_metric(c1, f"Tokens/s (last {TOKENS_NOW_S} s)", data.recent_mean(db, "agent.tokens_per_s", TOKENS_NOW_S),
               now, "tokens/s", f"the mean of the agent's per-second samples in the {TOKENS_NOW_S} s up to its latest")
    c2.metric(components.HIT_RATE_NOW, human(data.hit_rate_now(db, now), "fraction"),
              help=components.HIT_RATE_NOW_HELP)
    c3.metric("Requests", f"{len(rows):,}", help="finished in the time range shown")
    c4.metric("P99 latency", human(whole[0]["latency_s"][0.99] if whole else None, "s"),
              help="of the requests finished in the time range shown")

    markers = data.markers(db, since, until)
    left, right = st.columns(2)
    with left:
        components.series_chart(db, {"agent.tokens_per_s": "tokens/s"}, since, until, "Tokens per second", "tokens/s")
    with right:
        components.series_chart(db, {"agent.hit_rate": "hit rate"}, since, until, "Expert cache hit rate", "fraction")
    components.series_chart(db, {f"agent.token_ms.{p}": p for p in TOKEN_PHASES}, since, until,
                            "Where a generated token's time goes", "ms")
    if quantiles:
        t, lines = transforms.latency_lines(quantiles)
        left, right = st.columns(2)
        with left:
            components.time_chart(figures.quantile_chart(t, lines, "Request latency", "s", since, until, markers),
                                  "latency")
        with right:
            components.time_chart(figures.time_bars(t, [q["n"] for q in quantiles], "Requests per interval",
                                                    "requests", since, until, (until - since) / TIME_BUCKETS, markers),
                                  "requests")
        st.dataframe(transforms.request_rows(rows[-20:][::-1]), hide_index=True, width="stretch")
    else:
        st.caption("No requests in this range: send one to the agent's /v1/completions.")


live()
