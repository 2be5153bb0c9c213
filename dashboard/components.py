"""Widgets every page shares: the store notice, the history window, a series chart, the agent state."""
from __future__ import annotations

from collections.abc import Mapping

import streamlit as st

from dashboard import data, figures, settings, transforms


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


def agent_offline_notice(reason: str) -> None:
    st.warning(f"Agent offline: {reason}. Showing stored history; knobs are read-only until it is back.",
               icon=":material/cloud_off:")
