"""Tuning: every knob with its value and bounds, applied through the agent's control API."""
from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import components, data, settings, transforms

MIB = 2**20

db, url, token = settings.db_path(), settings.agent_url(), settings.agent_token()


def knob_widget(name: str, spec: dict[str, Any], disabled: bool) -> Any:
    """One input per knob, typed by the agent's description; bounds are shown, the agent enforces them."""
    value, kind = spec["value"], spec["type"]
    if kind == "bool":
        return st.toggle(name, value=bool(value), disabled=disabled)
    if kind == "str":
        choices = spec["choices"]
        return st.selectbox(name, choices, index=choices.index(value) if value in choices else 0, disabled=disabled)
    if kind == "int":
        step = MIB if name.endswith("_bytes") else 1
        return st.number_input(name, value=int(value), step=step, disabled=disabled,
                               help=f"allowed {transforms.bounds_text(spec)}")
    return st.number_input(name, value=float(value), step=0.05, format="%.3f", disabled=disabled,
                           help=f"allowed {transforms.bounds_text(spec)}")


def knob_form(knobs: dict[str, dict[str, Any]], online: bool) -> None:
    with st.form("knobs"):
        cols, edited = st.columns(3), {}
        for i, (name, spec) in enumerate(knobs.items()):
            with cols[i % 3]:
                edited[name] = knob_widget(name, spec, not online)
        if st.form_submit_button("Apply", type="primary", disabled=not online):
            changes = transforms.changed({k: s["value"] for k, s in knobs.items()}, edited)
            st.session_state["tuning-answer"] = (data.agent(url, token).push(changes) if changes
                                                 else "nothing to apply: every knob already has that value")
            data.knob_history.clear()   # show the change just made, not the history cached before it
            st.rerun()


@st.fragment(run_every=settings.REFRESH_S)
def current() -> None:
    knobs, offline = data.knob_state(url, token, db)
    if offline:
        components.agent_offline_notice(offline)
    else:
        st.success(f"Agent online at {url}", icon=":material/check_circle:")
    if knobs:
        st.subheader("Knobs (last stored values, read-only)" if offline else "Knobs")
        st.table(pd.DataFrame(transforms.knob_table(knobs)).set_index("knob"))
    else:
        st.info("No knob values known: the agent is offline and the store holds no knob changes.")


@st.fragment(run_every=settings.REFRESH_S)
def history() -> None:
    st.subheader("History of changes")
    if not components.store_ready(db):
        return
    rows = data.knob_history(db, 200)
    if rows:
        st.dataframe(pd.DataFrame(transforms.knob_history_rows(rows)), hide_index=True, width="stretch")
    else:
        st.caption("No knob changes recorded yet.")


current()
knobs, offline = data.knob_state(url, token, db)
if "tuning-answer" in st.session_state:
    answer = st.session_state["tuning-answer"]
    (st.success if answer.startswith("accepted") else st.error)(f"Agent answer: {answer}")
if knobs:
    knob_form(knobs, online=offline is None)
history()
