"""Cache: hit rates over time and per layer, expert activations, evictions, prefetch, online learning,
policies, sweep."""
from __future__ import annotations

import streamlit as st

from dashboard import auth, components, data, figures, settings, sweep, timerange, transforms
from store.units import MISSING, human

TIME_BUCKETS = 60

db, url, token = settings.db_path(), settings.agent_url(), settings.agent_token()


@components.live
def live() -> None:
    since, until = components.page_range()
    if not components.store_ready(db):
        return
    stats = data.cache_stats(db, since, until, TIME_BUCKETS)
    status = data.agent_status(url, token)
    total = stats["total"] or {}
    c1, c2, c3, c4, c5 = st.columns(5)
    c1.metric(components.HIT_RATE_NOW, human(data.hit_rate_now(db, timerange.now()), "fraction"),
              help=components.HIT_RATE_NOW_HELP)
    c2.metric("Hit rate (time range)", human(total.get("hit_rate"), "fraction"),
              help="hits over lookups in the time range shown")
    # Five to a row: a label longer than "Hit rate (time range)" is cut at 1400 px; where a figure
    # comes from (the range shown, or the agent) is in its help.
    c3.metric("Reads per lookup", human(total.get("reads_per_lookup"), "fraction"),
              help="in the time range shown: misses and prefetches over lookups, what the SSD did for each lookup. "
                   "A hit on a block a prefetch brought in counts as a hit, but it was read too, ahead of time")
    c4.metric("Evictions", f"{total.get('evictions', 0):,}", help="in the time range shown")
    if isinstance(status, dict):
        c5.metric("Prefetch accuracy", human(status["cache"]["prefetch_accuracy"], "fraction"),
                  help="from the agent: prefetched experts later used, over experts prefetched, since it started")
        if gate := status["cache"].get("prefetch"):   # an agent before adaptive prefetch has none
            st.caption(transforms.prefetch_state(gate))
    else:
        c5.metric("Prefetch accuracy", human(total.get("prefetch_accuracy"), "fraction"),
                  help="from the store while the agent is offline: prefetched experts later used, over "
                       "experts prefetched, in the time range shown (– when none were prefetched)")

    left, right = st.columns(2)
    with left:
        components.series_chart(db, {"agent.hit_rate": "hit rate"}, since, until, "Hit rate over time", "fraction")
    with right:
        if stats["per_layer"]:
            layers = stats["per_layer"]
            st.plotly_chart(figures.bar_chart([str(r["layer"]) for r in layers],
                                              [r["hit_rate"] or 0.0 for r in layers],
                                              "Hit rate per layer", "fraction", "layer"), key="per-layer")
        else:
            st.caption("**Hit rate per layer**: no cache statistics in this range.")
    left, right = st.columns(2)
    with left:
        matrix = transforms.heatmap_matrix(data.activations(db, since, until))
        if matrix:
            st.plotly_chart(figures.activation_heatmap(matrix, "Expert activations (layer × expert)"),
                            key="heatmap")
        else:
            st.caption("**Expert activations**: none recorded in this range.")
    with right:
        over = stats["over_time"]
        if over:
            components.time_chart(figures.time_bars([r["t"] for r in over], [r["evictions"] for r in over],
                                                    "Evictions per interval", "evictions", since, until,
                                                    (until - since) / TIME_BUCKETS, data.markers(db, since, until)),
                                  "evictions")
        else:
            st.caption("**Evictions**: no cache statistics in this range.")


@components.live
def online_learning() -> None:
    st.subheader("Online learning")
    status = data.agent_status(url, token)
    learning = status.get("online_learning") if isinstance(status, dict) else None
    if not learning or not learning["enabled"]:
        st.caption("Off. With the learned policy's `online_learning` knob on (Tuning page) it keeps learning from "
                   "this device's own routing, in a background process at most "
                   "5% of one core; each update is listed here.")
        return
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("Updates", f"{learning['updates']:,}")
    c2.metric("Rolled back", f"{learning['rollbacks']:,}", help="updates that did worse in hindsight, on the steps "
              "since they took effect, than the weights before them")
    c3.metric("Decisions learned from", f"{learning['decisions']:,}")
    c4.metric("Worker CPU", f"{learning['cpu_s']:.0f} s", help=f"limit: {learning['cpu_share_limit']:.0%} of one core")
    if learning["recent"]:
        st.caption("Each update also judges the one before it in hindsight: the steps routed since it took "
                   "effect, replayed with its weights and with the weights it was made from.")
        st.dataframe([{"update": u["number"], "at step": u["step"], "decisions": u["decisions"],
                       "CPU s": round(u["cpu_s"], 1), "judged": u["number"] - 1 if u["judged_steps"] else None,
                       "its hit rate": u["new_hit_rate"], "without it": u["old_hit_rate"],
                       "rolled back": u["rolled_back"]} for u in reversed(learning["recent"])], key="online-updates",
                     placeholder=MISSING)


@components.live
def policies() -> None:
    st.subheader("Policy comparison (simulator)")
    rows = data.simulations(db) if data.store_problem(db) is None else []
    if rows:
        st.plotly_chart(figures.policy_comparison(rows, "Hit rate by policy on recorded traces"), key="policies")
    else:
        st.caption("No simulator runs in this store yet. Results of `flashmoe-cli simulate` recorded here "
                   "(Store.record_simulation) compare the policies on recorded traces.")


@components.live
def cap_sweep() -> None:
    st.subheader("Tokens/s against cache cap")
    runner = data.sweep_runner()
    knobs = data.agent_knobs(url, token)
    status = data.agent_status(url, token)
    online = isinstance(knobs, dict) and isinstance(status, dict)
    left, right = st.columns(2)
    n_requests = left.number_input("Requests per cap", 1, 20, 2, disabled=runner.running, key="sweep-requests")
    max_tokens = right.number_input("Tokens per request", 1, 256, 8, disabled=runner.running, key="sweep-tokens")
    if online:
        cap = knobs["cache_cap_bytes"]
        caps = sweep.default_caps(status["cache"]["expert_bytes"], cap["min"], cap["max"])
        st.caption("Caps: " + ", ".join(human(c, "B") for c in caps))
        lock = auth.control_lock()
        if st.button("Start sweep", disabled=runner.running or bool(lock), help=lock, key="start-sweep") and not lock:
            runner.start(data.agent(url, token), db, caps, int(n_requests), int(max_tokens))
    else:      # why: an agent down, or another service at its address
        st.caption(f"The sweep needs the agent: {status if isinstance(status, str) else knobs}. Stored sweeps are "
                   f"shown below.")
    progress = runner.progress
    if runner.running:
        st.info(f"Sweep running: {len(progress.points)} of {progress.total} caps, {progress.status}",
                icon=":material/hourglass_top:")
    elif progress.error:
        st.error(f"Sweep failed: {progress.error}")
    elif progress.points:
        st.success(f"Last sweep {progress.status}")
    points = transforms.latest_per_cap(data.sweeps(db)) if data.store_problem(db) is None else []
    if points:
        st.plotly_chart(figures.sweep_curve(points, "Tokens/s by cache cap (latest per cap)"), key="sweep")


live()
online_learning()
policies()
cap_sweep()
