"""Tuning: every knob with its value and bounds, applied through the agent's control API."""
from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import auth, components, data, settings, transforms

db, url, token = settings.db_path(), settings.agent_url(), settings.agent_token()


def knob_form(knobs: dict[str, dict[str, Any]], online: bool) -> None:
    lock = auth.control_lock()
    if lock and online:
        st.info(lock, icon=":material/lock:")
    with st.form("knobs"):
        cols, edited = st.columns(3), {}
        for i, (name, spec) in enumerate(knobs.items()):
            with cols[i % 3]:
                edited[name] = components.knob_widget(name, spec, not online or bool(lock))
        if st.form_submit_button("Apply", type="primary", disabled=not online or bool(lock)):
            changes = transforms.changed({k: s["value"] for k, s in knobs.items()}, edited)
            st.session_state["tuning-answer"] = (data.push(url, token, changes) if changes
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
