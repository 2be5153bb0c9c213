"""Widgets every page shares: the time range and refresh controls, the store notice, time charts
(zoom shared across the page, knob changes marked), the agent-offline notice and knob inputs."""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import plotly.graph_objects as go
import streamlit as st

from dashboard import data, figures, settings, timerange, transforms
from store.errors import StoreError

HIT_RATE_NOW = f"Hit rate (last {data.HIT_RATE_NOW_S // 60} min)"
HIT_RATE_NOW_HELP = ("expert-cache hits over lookups in the last minute, from the agent's cache statistics; a hit "
                     "on a block a prefetch brought in counts (the Cache page's reads per lookup counts its read)")
CAP = "cache_cap_bytes"
RANGE = "range"               # session state: the custom (since, until)
ZOOMED = "zoomed"             # session state: a drag picked a new range; the whole page must follow


def store_ready(db: str) -> bool:
    """Say plainly why there is nothing to show when the store is missing or unreadable."""
    problem = data.store_problem(db)
    if problem:
        st.info(problem, icon=":material/database:")
    return problem is None


def live(section: Callable[..., None]) -> Callable[..., None]:
    """A page section re-run at the refresh rate (st.fragment). A store it cannot read, found only as the
    section reads it (a damaged chunk of one series), is said there in one line: it was an exception box."""
    @functools.wraps(section)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            section(*args, **kwargs)
        except StoreError as err:
            st.error(str(err), icon=":material/database:")
    return st.fragment(run_every=refresh_every())(guarded)


# -- time range and refresh ----------------------------------------------------------------------------
def time_range() -> tuple[float, float]:
    """The page's (since, until): the custom range, or the preset's last seconds up to now."""
    label = st.session_state.get("window", timerange.DEFAULT)
    if label == timerange.CUSTOM and RANGE in st.session_state:
        return st.session_state[RANGE]
    return timerange.relative(timerange.PRESETS.get(label, timerange.PRESETS[timerange.DEFAULT]), timerange.now())


def refresh_every() -> int | None:
    """Seconds between live re-runs of the page's fragments, or None while refresh is paused."""
    return timerange.REFRESH.get(st.session_state.get("refresh", timerange.DEFAULT_REFRESH))


def _choose_custom() -> None:
    """Switching to "Custom" starts from the range the page showed last."""
    if st.session_state["window"] == timerange.CUSTOM and RANGE not in st.session_state:
        st.session_state[RANGE] = st.session_state.get("shown", time_range())


def _type_range() -> None:
    try:
        st.session_state[RANGE] = timerange.absolute(st.session_state["range-from"], st.session_state["range-to"])
        st.session_state.pop("range-error", None)
    except ValueError as err:
        st.session_state["range-error"] = str(err)


def _zoom_out() -> None:
    since, until = st.session_state[RANGE]
    st.session_state[RANGE] = timerange.zoomed_out(since, until, timerange.now())
    _forget_typed()


def _forget_typed() -> None:
    for key in ("range-from", "range-to"):
        st.session_state.pop(key, None)


def sidebar() -> None:
    """Time range (presets, custom, zoom out) and refresh (interval or off), shared by every page."""
    st.session_state.setdefault("window", timerange.DEFAULT)    # set here, not as a default: a drag sets it too
    st.session_state.setdefault("refresh", timerange.DEFAULT_REFRESH)
    st.selectbox("Time range", [*timerange.PRESETS, timerange.CUSTOM], key="window", on_change=_choose_custom,
                 help="Relative ranges end now. Drag across any time chart to zoom every chart to that range.")
    if st.session_state.get("window") == timerange.CUSTOM and RANGE in st.session_state:
        since, until = st.session_state[RANGE]
        as_utc = lambda t: datetime.fromtimestamp(t, tz=timezone.utc).replace(tzinfo=None)   # noqa: E731
        st.datetime_input("From (UTC)", as_utc(since), key="range-from", on_change=_type_range, step=60)
        st.datetime_input("To (UTC)", as_utc(until), key="range-to", on_change=_type_range, step=60)
        if "range-error" in st.session_state:
            st.error(st.session_state["range-error"])
        st.button("Zoom out", on_click=_zoom_out, key="zoom-out", icon=":material/zoom_out:")
    st.selectbox("Refresh", list(timerange.REFRESH), key="refresh",
                 help="How often live pages re-read the store and the agent; \"off\" pauses them.")


def _zoom(key: str) -> None:
    """A drag across a time chart selected a range: it becomes every chart's custom range."""
    box = st.session_state[key].selection.get("box", [])
    chosen = timerange.from_selection(box[0].get("x", [])) if box else None
    if chosen is None:
        return
    st.session_state["window"] = timerange.CUSTOM
    st.session_state[RANGE] = chosen
    st.session_state[ZOOMED] = True
    _forget_typed()


def page_range() -> tuple[float, float]:
    """The range a live fragment shows, called first in each. A zoom chosen by a drag inside one
    fragment re-runs the whole page, so every chart and the sidebar follow, not only the chart
    dragged on."""
    if st.session_state.pop(ZOOMED, False):
        st.rerun(scope="app")
    since, until = time_range()
    st.session_state["shown"] = (since, until)
    return since, until


# plotly's own zoom and pan would move one chart alone: on a time chart a drag selects the page's range
TIME_CHART_CONFIG = {"displaylogo": False, "modeBarButtonsToRemove": [
    "zoom2d", "pan2d", "lasso2d", "zoomIn2d", "zoomOut2d", "autoScale2d", "resetScale2d"]}


def time_chart(fig: go.Figure, key: str) -> None:
    """Show a time chart; dragging across it zooms the whole page."""
    st.plotly_chart(fig, key=key, on_select=lambda: _zoom(key), selection_mode="box", config=TIME_CHART_CONFIG)


# -- charts ----------------------------------------------------------------------------------------------
def series_chart(db: str, names: Mapping[str, str], since: float, until: float, title: str, unit: str,
                 thresholds: Sequence[figures.Threshold] = (), dashes: Mapping[str, str] | None = None,
                 loaded: Mapping[str, Sequence[Any]] | None = None) -> None:
    """Chart the series `names` (store name -> legend label) in store `unit`, with knob changes and
    `thresholds` drawn; rows already in `loaded` (store name -> buckets) are not read again. A
    caption instead when none has data."""
    loaded = loaded or {}
    rows = {label: loaded.get(name) or data.series(db, name, since, until, settings.BUCKETS)
            for name, label in names.items()}
    rows = {label: r for label, r in rows.items() if r}
    if not rows:
        st.caption(f"**{title}**: no data in this range ({', '.join(names)}).")
        return
    fig = figures.time_chart(rows, title, unit, since, until, data.markers(db, since, until), thresholds, dashes)
    time_chart(fig, f"chart-{title}")


def lost_notice(db: str, since: float, until: float) -> None:
    """Telemetry the agent and the collector could not write (a full or failing disk), if any, and
    the collector's samples in the range that it was too late to take."""
    lost = data.lost(db)
    if lost["points"] or lost["rows"]:
        st.warning(f"Telemetry lost to store write failures: {lost['points']:,} points and {lost['rows']:,} "
                   f"rows (the events say when and why)", icon=":material/report:")
    missed = data.missed_samples(db, since, until)
    if missed:
        st.warning(f"The collector fell behind and missed {missed:,} of its one-per-interval samples in this range "
                   f"(e.g. while the disk served a memory thrash): a rate across a gap is its average",
                   icon=":material/report:")


def agent_offline_notice(reason: str) -> None:
    st.warning(f"Agent offline: {reason}. Showing stored history; knobs are read-only until it is back.",
               icon=":material/cloud_off:")


# -- knobs -------------------------------------------------------------------------------------------------
def help_text(spec: dict[str, Any], name: str) -> str:
    described = spec.get("help", "")
    return f"{described}{'; ' if described else ''}allowed {transforms.bounds_text(spec, name)}"


def cap_unit(expert_bytes: int | None) -> None:
    """The unit the cache cap's slider works in (outside any form, so changing it re-draws the slider)."""
    units = transforms.CAP_UNITS if expert_bytes else transforms.CAP_UNITS[:2]
    st.segmented_control("Cache cap in", units, key="cap-unit", default=units[0])


def cap_widget(spec: dict[str, Any], expert_bytes: int | None, disabled: bool = False) -> int:
    """The cache cap as a slider over the allowed range up to the model's expert bytes
    (transforms.cap_range), in the unit cap_unit chose (MiB by default); bytes out."""
    unit = st.session_state.get("cap-unit") or transforms.CAP_UNITS[0]
    if unit not in transforms.CAP_UNITS[:2] and not expert_bytes:
        unit = transforms.CAP_UNITS[0]
    scale = transforms.cap_unit_bytes(unit, expert_bytes)
    lo, hi = (end / scale for end in transforms.cap_range(spec, expert_bytes))
    shown = min(max(spec["value"] / scale, lo), hi)
    step, digits = transforms.cap_step(unit, lo, hi, shown)
    label = "%%" if unit == "% of experts" else unit     # printf-style: a literal percent sign
    chosen = st.slider(CAP, lo, hi, shown, step, format=f"%.{digits}f {label}", help=help_text(spec, CAP),
                       disabled=disabled)
    return transforms.cap_bytes(chosen, shown, scale, spec)


def knob_widget(name: str, spec: dict[str, Any], disabled: bool = False, expert_bytes: int | None = None) -> Any:
    """One input per knob, typed and bounded by the agent's description (the agent enforces the bounds
    too), with the knob's help; the cache cap on a slider."""
    value, kind, help_ = spec["value"], spec["type"], help_text(spec, name)
    if name == CAP:
        return cap_widget(spec, expert_bytes, disabled)
    if kind == "bool":
        return st.toggle(name, value=bool(value), help=help_, disabled=disabled)
    if kind == "str":
        choices = spec["choices"]
        return st.selectbox(name, choices, index=choices.index(value) if value in choices else 0, help=help_,
                            disabled=disabled)
    if kind == "int":
        return st.number_input(name, int(spec["min"]), int(spec["max"]), int(value), 1, help=help_, disabled=disabled)
    step, digits = transforms.float_step(spec["min"], spec["max"])
    return st.number_input(name, float(spec["min"]), float(spec["max"]), float(value), step,
                           f"%.{max(digits, transforms.decimals(value))}f", help=help_, disabled=disabled)
