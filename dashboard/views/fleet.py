"""Fleet: every device Prometheus scrapes with its figures, memory verdict and alerts; one knob pushed to several."""
from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import auth, components, data, fleet, timerange, transforms
from store.units import MISSING

prometheus_url, tokens_file, default_token = fleet.settings()


@st.cache_data(ttl=timerange.STEP_S, show_spinner=False)
def snapshot(url: str) -> fleet.Snapshot:
    return fleet.Prometheus(url).snapshot()


def table(rows: list[fleet.Device]) -> pd.DataFrame:
    return pd.DataFrame([{
        "device": d.name, "agent": "up" if d.up else "down", "hit rate": d.hit_rate, "tokens/s": d.tokens_per_s,
        "P99 latency (s)": d.p99_s,
        "SSD MB/s": None if d.ssd_read_bytes_per_s is None else d.ssd_read_bytes_per_s / 1e6,
        "SSD utilisation": d.ssd_util, "memory": d.memory, "firing alerts": ", ".join(a.name for a in d.alerts),
        "dashboard": d.dashboard_url} for d in rows])


COLUMNS = {
    "hit rate": st.column_config.NumberColumn(format="percent", help="expert cache hit rate, last 5 min"),
    "tokens/s": st.column_config.NumberColumn(format="%.1f", help="generated tokens per second, last 5 min"),
    "P99 latency (s)": st.column_config.NumberColumn(format="%.2f", help="request latency P99, last 5 min"),
    "SSD MB/s": st.column_config.NumberColumn(format="%.1f", help="expert bytes read from the SSD, last 5 min"),
    "SSD utilisation": st.column_config.NumberColumn(format="percent", help="busiest disk (collector), last 5 min"),
    "memory": st.column_config.TextColumn(help="agent thrashing (FlashMoEAgentThrashing), pressure from another "
                                               "process (FlashMoEMemoryPressure), either pending, ok, or no "
                                               "collector reporting"),
    "dashboard": st.column_config.LinkColumn(display_text="open", help="the device's own dashboard"),
}

ALERT_COLUMNS = {
    "severity": st.column_config.TextColumn(help="the rule's severity label (examples/alerts.yml): critical first"),
    "summary": st.column_config.TextColumn(help="the rule's summary annotation, filled in by Prometheus"),
    "value": st.column_config.TextColumn(help="the rule's expression at its last evaluation"),
    "active since": st.column_config.TextColumn(help="when the condition began to hold (pending, then firing)"),
    "description": st.column_config.TextColumn(help="the rule's description annotation: what it means and what to do"),
}


@components.live
def overview(url: str) -> None:
    try:
        rows = fleet.devices(snapshot(url))
    except fleet.FleetError as err:
        st.error(str(err), icon=":material/cloud_off:")
        return
    if not rows:
        st.info(f"Prometheus at {url} scrapes no agent yet: add each device's agent to the job "
                f"`{fleet.AGENT_JOB}` (examples/prometheus.yml).")
        return
    firing = fleet.alert_rows(rows)
    c1, c2, c3 = st.columns(3)
    c1.metric("Devices", len(rows))
    c2.metric("Agents up", sum(d.up for d in rows))
    c3.metric("Firing alerts", len(firing))
    for name in fleet.duplicate_names(rows):
        st.warning(f"Two agents call themselves {transforms.literal(name)}: their figures are summed; give each its "
                   f"own `serve --device-name`.", icon=":material/warning:")
    st.dataframe(table(fleet.trouble_first(rows)), hide_index=True, width="stretch", height="content",
                 column_config=COLUMNS, placeholder=MISSING)      # every row: "auto" holds ten
    if firing:
        st.markdown("**Firing alerts**")
        st.dataframe(pd.DataFrame(firing), hide_index=True, width="stretch", column_config=ALERT_COLUMNS)
    if all(d.hit_rate is None for d in rows if d.up):
        st.caption("No recorded figures yet: they appear a few scrapes after traffic starts, once Prometheus "
                   "evaluates examples/alerts.yml (its `rule_files`).")


def push_form(rows: list[fleet.Device], tokens: dict[str, str]) -> None:
    """Choose devices, a knob and a value; each device's current value and bounds are shown before the push."""
    online, shared = fleet.pushable(rows)
    for name in shared:
        st.caption(f"{transforms.literal(name)} is not offered: two agents that are up call themselves that, and its "
                   f"token is for one device; give each its own `serve --device-name`.")
    chosen = st.multiselect("Devices", list(online), key="fleet-devices",
                            help="agents Prometheus reaches now; each gets the change with its own token")
    if not chosen:
        st.caption("Select one or more devices to push a knob change to.")
        return
    targets = [online[name] for name in chosen]
    described = dict(zip(chosen, fleet.each(targets, lambda d: data.agent_knobs(d.agent_url, None))))
    first = described[targets[0].name]
    if isinstance(first, str):
        st.error(f"{transforms.literal(targets[0].name)}: {first}")
        return
    name = st.selectbox("Knob", list(first), key="fleet-knob")
    value = components.knob_widget(name, first[name], disabled=False)
    st.table(pd.DataFrame([current(device, knobs, name) for device, knobs in described.items()]).set_index("device"))
    lock = auth.control_lock()
    if lock:
        st.info(lock, icon=":material/lock:")
    chosen_value = transforms.literal(transforms.value_text(name, value))      # a target's choice: shown as it is
    if st.button(f"Push {name} = {chosen_value} to {len(targets)} device(s)", type="primary", disabled=bool(lock)):
        lock = auth.control_lock()      # again at send time: a browser can click a disabled button
        st.session_state["fleet-push"] = ([fleet.PushResult(d.name, f"not sent: {lock}") for d in targets] if lock
                                          else fleet.push(targets, {name: value}, tokens, default_token))
        st.rerun()


def current(device: str, knobs: dict[str, Any] | str, name: str) -> dict[str, str]:
    if isinstance(knobs, str):
        return {"device": device, "now": "unknown", "allowed": knobs}
    spec = knobs.get(name)
    if spec is None:
        return {"device": device, "now": "no such knob", "allowed": MISSING}
    return {"device": device, "now": transforms.value_text(name, spec["value"]),
            "allowed": transforms.bounds_text(spec)}


def answers(results: list[fleet.PushResult]) -> None:
    accepted = sum(r.accepted for r in results)
    (st.success if accepted == len(results) else st.warning)(
        f"{accepted} of {len(results)} agents accepted the change; a refusing agent applied nothing.")
    st.table(pd.DataFrame([{"device": r.device, "answer": r.answer} for r in results]).set_index("device"))


if prometheus_url is None:
    st.info(f"The Fleet page shows every device Prometheus scrapes. Set `{fleet.PROMETHEUS_ENV}` to its address "
            f"(e.g. http://prometheus.lan:9090) when starting the dashboard; scrape each agent and collector with "
            f"examples/prometheus.yml and load examples/alerts.yml as its rule file.", icon=":material/lan:")
    st.stop()

overview(prometheus_url)
st.subheader("Push a knob change")
try:
    fleet_tokens = fleet.load_tokens(tokens_file)
except fleet.FleetError as err:
    st.error(str(err))
else:
    try:
        fleet_rows = fleet.devices(snapshot(prometheus_url))
    except fleet.FleetError:     # the overview above says why
        st.caption("No device to push to while Prometheus cannot be asked which agents are up.")
    else:
        if "fleet-push" in st.session_state:
            answers(st.session_state["fleet-push"])
        push_form(fleet_rows, fleet_tokens)
