"""Widgets every page shares: the store notice, the history window, a series chart, the agent state, a knob input."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import streamlit as st

from dashboard import data, figures, settings, transforms

MIB = 2**20


def store_ready(db: str) -> bool:
    """Say plainly why there is nothing to show when the store is missing or unreadable."""
    problem = data.store_problem(db)
    if problem:
        st.info(problem, icon=":material/database:")
    return problem is None


def window() -> tuple[float, float]:
    label = st.session_state.get("window", settings.DEFAULT_WINDOW)
    return data.window(settings.WINDOWS[label])


def series_chart(db: str, names: Mapping[str, str], since: float, until: float, title: str,
                 unit: str, factor: float = 1.0) -> None:
    """Chart the series `names` (store name -> legend label); a caption instead when none has data."""
    loaded = {label: transforms.scaled(data.series(db, name, since, until, settings.BUCKETS), factor)
              for name, label in names.items()}
    loaded = {label: rows for label, rows in loaded.items() if rows}
    if not loaded:
        st.caption(f"**{title}**: no data in this window ({', '.join(names)}).")
        return
    st.plotly_chart(figures.band_chart(loaded, title, unit), key=f"chart-{title}")


def lost_notice(db: str) -> None:
    """Telemetry the agent and the collector could not write (a full or failing disk), if any."""
    lost = data.lost(db)
    if lost["points"] or lost["rows"]:
        st.warning(f"Telemetry lost to store write failures: {lost['points']:,} points and {lost['rows']:,} "
                   f"rows (the events say when and why)", icon=":material/report:")


def agent_offline_notice(reason: str) -> None:
    st.warning(f"Agent offline: {reason}. Showing stored history; knobs are read-only until it is back.",
               icon=":material/cloud_off:")


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
