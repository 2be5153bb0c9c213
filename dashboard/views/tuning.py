"""Tuning: every knob with its value, bounds and help, applied through the agent's control API."""
from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import auth, components, data, settings, transforms

CAP = components.CAP
ANSWER = "tuning-answer"

db, url, token = settings.db_path(), settings.agent_url(), settings.agent_token()


def knob_form(knobs: dict[str, dict[str, Any]], expert_bytes: int | None) -> None:
    lock = auth.control_lock()
    if lock:
        st.info(lock, icon=":material/lock:")
    cap = knobs.get(CAP)
    if cap is not None:
        components.cap_unit(expert_bytes)
        if cap["value"] > cap["max"]:
            st.warning(f"The cache cap ({transforms.value_text(CAP, cap['value'])}) is above the most the agent now "
                       f"allows ({transforms.value_text(CAP, cap['max'])}): its memory limit fell. Apply a cap within "
                       f"the range.")
    with st.form("knobs"):
        cols, edited = st.columns(3), {}
        for i, (name, spec) in enumerate(knobs.items()):
            with cols[i % 3]:
                edited[name] = components.knob_widget(name, spec, bool(lock), expert_bytes)
        if st.form_submit_button("Apply", type="primary", disabled=bool(lock)):
            changes = transforms.changed({k: s["value"] for k, s in knobs.items()}, edited)
            st.session_state[ANSWER] = (data.apply_knobs(url, token, changes) if changes else
                                        (True, "nothing to apply: every knob already has that value"))
            data.knob_history.clear()   # show the change just made, not the history cached before it
            st.rerun()


@components.live
def current() -> None:
    components.page_range()
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


@components.live
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
if ANSWER in st.session_state:
    accepted, text = st.session_state[ANSWER]
    (st.success if accepted else st.error)(f"Agent answer: {text}")
if knobs and offline is None:
    status = data.agent_status(url, token)
    knob_form(knobs, status["cache"]["expert_bytes"] if isinstance(status, dict) else None)
history()
