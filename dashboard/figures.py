"""Pure plotly figure builders: plain data in, a go.Figure out, no Streamlit and no I/O.

Every time chart shares one shape, so a page reads like one dashboard: the x axis spans exactly
the page's time range (charts line up, and a drag across any of them selects a new range for all),
y starts at zero, values are shown in the display unit store.units picks for their size (axis,
ticks and tooltips alike), knob changes and sweeps are marked as vertical annotations, and the
thresholds a verdict used are drawn as dashed lines.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import numpy as np
import plotly.graph_objects as go

from store.units import Display, display

BandRow = tuple[float, float, float, float]   # (t, min, avg, max) per downsampling bucket
HEIGHT = 300              # of the plot and its axes; a legend's rows add to it
LEGEND_ROW_PX = 29         # a legend row at plotly's default font, as Chromium draws it
LEGEND_COLUMNS = 2         # when every entry fits its column in the narrowest chart (legend_columns)
NARROWEST_PX = 400         # a half-width chart in a 1280 px window, the narrowest the pages lay one out
LEGEND_CHAR_PX = 5.6       # a legend character at plotly's default font, as Chromium draws it (5.4-5.6)
TICK_CHAR_PX = 5.5         # a y tick label character, its unit included (5.3)
ENTRY_SYMBOL_PX = 44       # a legend entry's symbol and gap before its text (40), and a little slack
LABEL_CHAR_PX = 5.0        # a threshold label character at its font size (4.6)
PLOT_PX = 180             # about the plot area's height (HEIGHT less title, ticks and legend), to place threshold
                          # labels
LABEL_PX = 15             # a threshold label's height at its font size
AXIS_HEADROOM = 1.06      # plotly's autorange reaches a little over the largest value
DASHES = ("solid", "dash", "dot", "dashdot")   # P50, P95, P99...: told apart without colour too
# Streamlit's palette, strongest first: neighbouring lines differ, and each band takes its line's colour
PALETTE = ("#0068c9", "#ff2b2b", "#29b09d", "#ff8700", "#6d3fc0", "#83c9ff", "#ffabab", "#7defa1", "#ffd16a",
           "#d5dae5")
MARKER_COLOUR = "rgba(120, 120, 120, 0.6)"
THRESHOLD_COLOUR = "#d62728"
LABEL_BACKGROUND = "rgba(255, 255, 255, 0.85)"   # a lifted label stays legible over the lines below it
BANDS = "min–max band"        # one legend entry shows or hides every line's band (the range each point averages)
LAST = 2000                   # legendrank after the lines (plotly's default is 1000)


@dataclass(frozen=True)
class Marker:
    """An annotation on the time axis: a knob change or a sweep."""
    t: float
    text: str


@dataclass(frozen=True)
class Threshold:
    """A dashed horizontal line at `value` (in the series' stored unit) for `text`, what it bounds."""
    value: float
    text: str


def to_datetimes(ts: Sequence[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t, tz=timezone.utc) for t in ts]


def _times(ts: Sequence[float] | np.ndarray) -> np.ndarray:
    """UTC instants as datetime64[ms]: plotly checks and writes an array at once, where a list of
    datetimes costs it a call per point (most of a 24 h page's render, bench/dashboard.py)."""
    return (np.asarray(ts, dtype=np.float64) * 1000).astype("datetime64[ms]")


def _narrowest_plot_px(tick: str) -> float:
    """The plot's width in the narrowest chart: less the margins and y tick labels about as long as `tick`."""
    return NARROWEST_PX - 63 - TICK_CHAR_PX * len(tick)    # 63: the margins and the ticks' padding


def legend_columns(names: Sequence[str], tick: str) -> int:
    """Entries a legend row holds: LEGEND_COLUMNS if the longest name fits its share of the plot in the
    narrowest chart, whose plot the y tick labels (about as long as `tick`) narrow; else one. Plotly
    gives each entry a fixed share of the plot's width and cuts a longer name ("agent cgroup, an")."""
    room_px = _narrowest_plot_px(tick) * 0.9 / LEGEND_COLUMNS - ENTRY_SYMBOL_PX   # entries take 0.9 of the plot
    return LEGEND_COLUMNS if max(map(len, names), default=0) * LEGEND_CHAR_PX <= room_px else 1


def _layout(title: str, y_title: str, x_title: str = "", names: Sequence[str] = (), tick: str = "") -> dict[str, Any]:
    """The layout every chart shares. The legend of `names` sits under the chart, legend_columns()
    entries a row, and the figure grows by its rows so the plot keeps its height (above the plot, a
    legend of several rows ran into the title)."""
    columns = legend_columns(names, tick)
    rows = -(-len(names) // columns) if len(names) > 1 else 0
    return dict(title=title, height=HEIGHT + rows * LEGEND_ROW_PX, margin=dict(l=10, r=10, t=40, b=10),
                xaxis=dict(title=dict(text=x_title)), yaxis=dict(title=dict(text=y_title)), showlegend=len(names) > 1,
                legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0, xanchor="left",
                            entrywidth=0.9 / columns, entrywidthmode="fraction"))


def _time_figure(traces: list[dict[str, Any]], title: str, since: float, until: float, shown: Display, top: float,
                 markers: Sequence[Marker], shapes: Sequence[dict[str, Any]] = (),
                 notes: Sequence[dict[str, Any]] = ()) -> go.Figure:
    """The shape every time chart shares: the page's range, y from zero in `shown` units, a drag
    selects a time range (the page turns it into its new range), knob changes marked. Built in one
    go: each add_trace, add_vline or update_layout would check the whole figure again."""
    inside = [m for m in markers if since <= m.t <= until]
    names = [tr["name"] for tr in traces if tr.get("showlegend", True)] + ["knob changes"] * bool(inside)
    layout = _layout(title, "", names=names, tick=shown.text(top * AXIS_HEADROOM))
    layout["xaxis"] |= dict(range=to_datetimes([since, until]), type="date")
    layout["yaxis"] |= dict(rangemode="tozero", tickformat=shown.tick_format(), ticksuffix=f" {shown.label}")
    layout |= dict(hovermode="x unified", dragmode="select", selectdirection="h", annotations=list(notes),
                   shapes=list(shapes) + [dict(type="line", xref="x", x0=t, x1=t, yref="y domain", y0=0, y1=1,
                                               line=dict(color=MARKER_COLOUR, width=1, dash="dot"))
                                          for t in _times([m.t for m in inside])])
    if inside:       # hover targets at the top of the plot, on a hidden 0..1 axis of their own
        traces = traces + [dict(type="scatter", x=_times([m.t for m in inside]), y=[1.0] * len(inside), yaxis="y2",
                                mode="markers", name="knob changes", hovertext=[m.text for m in inside],
                                hoverinfo="text", marker=dict(symbol="triangle-down", size=9, color=MARKER_COLOUR))]
        layout["yaxis2"] = dict(overlaying="y", range=[0, 1.05], visible=False, fixedrange=True)
    return go.Figure(data=traces, layout=layout)


def _threshold_lines(thresholds: Sequence[Threshold], shown: Display,
                     top: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(shapes, annotations): a dashed line across the plot per value, labelled at its left end with
    what it bounds, or with its value alone (what it bounds on hover) where that would not fit the
    narrowest plot; thresholds at one value share the line and the label. On an axis up to about `top`
    (stored unit), a label that would print over the one below it is lifted just clear of it."""
    same: dict[float, list[str]] = {}
    for th in sorted(thresholds, key=lambda th: th.value):
        same.setdefault(th.value, []).append(th.text)
    px_per_unit = PLOT_PX / top if top > 0 else 0.0
    fits = _narrowest_plot_px(shown.text(top)) / LABEL_CHAR_PX
    shapes, notes, clear_from = [], [], -math.inf       # the pixel height the next label may start at
    for v, texts in same.items():
        lift = max(0.0, clear_from - v * px_per_unit)
        clear_from = v * px_per_unit + lift + LABEL_PX
        whole = f"threshold {shown.text(v)}: {', '.join(texts)}"
        shapes.append(dict(type="line", xref="x domain", x0=0, x1=1, yref="y", y0=v * shown.factor,
                           y1=v * shown.factor, line=dict(color=THRESHOLD_COLOUR, width=1, dash="dash")))
        notes.append(dict(xref="x domain", x=0, xanchor="left", yref="y", y=v * shown.factor, yanchor="bottom",
                          yshift=lift, showarrow=False, hovertext=whole,
                          text=whole if len(whole) <= fits else f"threshold {shown.text(v)}",
                          font=dict(color=THRESHOLD_COLOUR, size=11), bgcolor=LABEL_BACKGROUND))
    return shapes, notes


def time_chart(series: Mapping[str, Sequence[BandRow]], title: str, unit: str, since: float, until: float,
               markers: Sequence[Marker] = (), thresholds: Sequence[Threshold] = (),
               dashes: Mapping[str, str] | None = None, bands: bool = True, mode: str = "lines") -> go.Figure:
    """One line per series (bucket averages), values in store `unit`. The min–max bands of all series
    are one legend entry, off until clicked, each band in its line's colour; `dashes` sets a line style
    per series name (default solid); every threshold is a dashed line."""
    largest = max([r[3] for rows in series.values() for r in rows] + [th.value for th in thresholds], default=0.0)
    shown = display(unit, largest)
    hover = f"%{{y:{shown.tick_format()}}} {shown.label}"
    lines, shades = [], []
    for i, (name, rows) in enumerate(series.items()):
        a = np.asarray(rows, dtype=np.float64).reshape(-1, 4)        # [bucket, (t, min, avg, max)]
        t, colour = _times(a[:, 0]), PALETTE[i % len(PALETTE)]
        lines.append(dict(type="scatter", x=t, y=(a[:, 2] * shown.factor).tolist(), mode=mode, name=name,
                          line=dict(dash=(dashes or {}).get(name, "solid"), color=colour), marker=dict(color=colour),
                          hovertemplate=hover))
        if bands:
            shades.append(dict(type="scatter", x=np.concatenate([t, t[::-1]]),
                               y=(np.concatenate([a[:, 3], a[::-1, 1]]) * shown.factor).tolist(), fill="toself",
                               fillcolor=colour, line=dict(width=0, color=colour), opacity=0.2, hoverinfo="skip",
                               name=BANDS, legendgroup=BANDS, showlegend=not shades, legendrank=LAST,
                               visible="legendonly"))
    return _time_figure(shades + lines, title, since, until, shown, largest, markers,
                        *_threshold_lines(thresholds, shown, largest * AXIS_HEADROOM))


def quantile_chart(t: Sequence[float], lines: Mapping[str, Sequence[float | None]], title: str, unit: str,
                   since: float, until: float, markers: Sequence[Marker] = ()) -> go.Figure:
    """Several quantiles over one time axis (P50/P95/P99 per bucket): solid, dashed, dotted."""
    rows = {name: [(ti, v, v, v) for ti, v in zip(t, ys) if v is not None] for name, ys in lines.items()}
    styles = {name: DASHES[i % len(DASHES)] for i, name in enumerate(lines)}
    return time_chart(rows, title, unit, since, until, markers, dashes=styles, bands=False, mode="lines+markers")


def time_bars(t: Sequence[float], values: Sequence[float], title: str, unit: str, since: float, until: float,
              bucket_s: float, markers: Sequence[Marker] = ()) -> go.Figure:
    """Counts per time bucket (bucket start times `t`), e.g. requests or evictions per interval: whole
    numbers, on the axis and in the tooltip."""
    shown = replace(display(unit, max(values, default=0.0)), decimals=0)
    bars = dict(type="bar", x=_times(t), y=[v * shown.factor for v in values], name=title, width=bucket_s * 1000,
                offset=0, marker=dict(color=PALETTE[0]),
                hovertemplate=f"%{{y:{shown.tick_format()}}} {shown.label}<extra></extra>")
    return _time_figure([bars], title, since, until, shown, max(values, default=0.0), markers)


def bar_chart(labels: Sequence[str], values: Sequence[float], title: str, unit: str, x_title: str) -> go.Figure:
    shown = display(unit, max(values, default=0.0))
    fig = go.Figure(go.Bar(x=list(labels), y=[v * shown.factor for v in values],
                           text=[shown.text(v) for v in values],
                           hovertemplate=f"{x_title} %{{x}}: %{{y:{shown.tick_format()}}} {shown.label}"
                                         "<extra></extra>"))
    fig.update_xaxes(type="category")
    fig.update_yaxes(rangemode="tozero", tickformat=shown.tick_format(), ticksuffix=f" {shown.label}")
    return fig.update_layout(_layout(title, "", x_title))


def activation_heatmap(counts: Sequence[Sequence[float]], title: str) -> go.Figure:
    """Layer × expert activation counts; row i is layer i, column j is expert j."""
    fig = go.Figure(go.Heatmap(z=[list(row) for row in counts], colorscale="Viridis",
                               colorbar=dict(title="activations", tickformat=",d"),
                               hovertemplate="layer %{y}, expert %{x}: %{z:,d} activations<extra></extra>"))
    fig.update_yaxes(dtick=1)
    return fig.update_layout(_layout(title, "layer", "expert"))


def policy_comparison(rows: Sequence[Mapping[str, object]], title: str) -> go.Figure:
    """Hit rate per policy, one bar group per (trace, capacity) as `simulate --json` reports it
    (capacity a fraction of all experts)."""
    shown = display("fraction", 1.0)
    groups = sorted({(str(r["trace"]), float(r["capacity"])) for r in rows})
    fig = go.Figure()
    for trace, capacity in groups:
        sel = [r for r in rows if (str(r["trace"]), float(r["capacity"])) == (trace, capacity)]
        fig.add_trace(go.Bar(x=[str(r["policy"]) for r in sel], y=[float(r["hit_rate"]) * shown.factor for r in sel],
                             name=f"{trace} @ {capacity * 100:g}% of experts",
                             hovertemplate=f"%{{x}}: %{{y:{shown.tick_format()}}} %<extra>%{{fullData.name}}</extra>"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(rangemode="tozero", tickformat=shown.tick_format(), ticksuffix=" %")
    names = [trace.name for trace in fig.data]
    return fig.update_layout(_layout(title, "hit rate", "policy", names=names, tick="100.0 %"))


def sweep_curve(points: Sequence[tuple[float, float]], title: str) -> go.Figure:
    """Tokens/s against the cache cap, from a sweep's (cap bytes, tokens/s) points."""
    points = sorted(points)
    shown = display("B", max((p[0] for p in points), default=0.0))
    fig = go.Figure(go.Scatter(x=[p[0] * shown.factor for p in points], y=[p[1] for p in points],
                               mode="lines+markers", name="tokens/s",
                               hovertemplate=f"cap %{{x:{shown.tick_format()}}} {shown.label}: "
                                             f"%{{y:,.1f}} tokens/s<extra></extra>"))
    fig.update_xaxes(tickformat=shown.tick_format(), ticksuffix=f" {shown.label}")
    fig.update_yaxes(rangemode="tozero", tickformat=",.1f", ticksuffix=" tokens/s")
    return fig.update_layout(_layout(title, "", f"cache cap ({shown.label})"))
