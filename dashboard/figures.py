"""Pure plotly figure builders: plain data in, a go.Figure out, no Streamlit and no I/O.

Every time chart shares one shape, so a page reads like one dashboard: the x axis spans exactly
the page's time range (charts line up, and a drag across any of them selects a new range for all),
y starts at zero, values are shown in the display unit store.units picks for their size (axis,
ticks and tooltips alike), knob changes and sweeps are marked as vertical annotations, and the
thresholds a verdict used are drawn as dashed lines.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import plotly.graph_objects as go

from store.units import Display, display

BandRow = tuple[float, float, float, float]   # (t, min, avg, max) per downsampling bucket
HEIGHT = 300
DASHES = ("solid", "dash", "dot", "dashdot")   # P50, P95, P99...: told apart without colour too
MARKER_COLOUR = "rgba(120, 120, 120, 0.6)"
THRESHOLD_COLOUR = "#d62728"


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


def _layout(fig: go.Figure, title: str, y_title: str, x_title: str = "") -> go.Figure:
    fig.update_layout(title=title, height=HEIGHT, margin=dict(l=10, r=10, t=40, b=10),
                      yaxis_title=y_title, xaxis_title=x_title,
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=1.0, xanchor="right"))
    return fig


def _time_axes(fig: go.Figure, since: float, until: float, shown: Display, markers: Sequence[Marker]) -> go.Figure:
    """The shape every time chart shares: the page's range, y from zero in `shown` units, a drag
    selects a time range (the page turns it into its new range), knob changes marked."""
    fig.update_xaxes(range=to_datetimes([since, until]), type="date")
    fig.update_yaxes(rangemode="tozero", tickformat=shown.tick_format(), ticksuffix=f" {shown.label}",
                     title=None)
    fig.update_layout(hovermode="x unified", dragmode="select", selectdirection="h")
    inside = [m for m in markers if since <= m.t <= until]
    for m in inside:
        fig.add_vline(x=to_datetimes([m.t])[0], line=dict(color=MARKER_COLOUR, width=1, dash="dot"))
    if inside:       # hover targets at the top of the plot, on a hidden 0..1 axis of their own
        fig.add_trace(go.Scatter(x=to_datetimes([m.t for m in inside]), y=[1.0] * len(inside), yaxis="y2",
                                 mode="markers", name="knob changes", hovertext=[m.text for m in inside],
                                 hoverinfo="text", marker=dict(symbol="triangle-down", size=9, color=MARKER_COLOUR)))
        fig.update_layout(yaxis2=dict(overlaying="y", range=[0, 1.05], visible=False, fixedrange=True))
    return fig


def time_chart(series: Mapping[str, Sequence[BandRow]], title: str, unit: str, since: float, until: float,
               markers: Sequence[Marker] = (), thresholds: Sequence[Threshold] = (),
               dashes: Mapping[str, str] | None = None, bands: bool = True, mode: str = "lines") -> go.Figure:
    """One line per series (bucket averages), values in store `unit`. Each series' min–max band is a
    legend entry, off until clicked; `dashes` sets a line style per series name (default: by order,
    solid first); every threshold is a dashed line."""
    largest = max([r[3] for rows in series.values() for r in rows] + [th.value for th in thresholds], default=0.0)
    shown = display(unit, largest)
    hover = f"%{{y:{shown.tick_format()}}} {shown.label}"
    fig = go.Figure()
    for i, (name, rows) in enumerate(series.items()):
        t = to_datetimes([r[0] for r in rows])
        if bands:
            fig.add_trace(go.Scatter(x=t + t[::-1], y=[r[3] * shown.factor for r in rows]
                                     + [r[1] * shown.factor for r in rows][::-1],
                                     fill="toself", line=dict(width=0), opacity=0.2, hoverinfo="skip",
                                     legendgroup=name, name=f"{name} min–max per point", visible="legendonly"))
        dash = (dashes or {}).get(name, "solid")
        fig.add_trace(go.Scatter(x=t, y=[r[2] * shown.factor for r in rows], mode=mode, name=name,
                                 legendgroup=name, line=dict(dash=dash), hovertemplate=hover))
    same: dict[float, list[str]] = {}          # one line, one label, for thresholds at the same value
    for th in thresholds:
        same.setdefault(th.value, []).append(th.text)
    for value, texts in same.items():
        fig.add_hline(y=value * shown.factor, line=dict(color=THRESHOLD_COLOUR, width=1, dash="dash"),
                      annotation=dict(text=f"threshold {shown.text(value)}: {', '.join(texts)}",
                                      font=dict(color=THRESHOLD_COLOUR, size=11)),
                      annotation_position="top left")
    return _time_axes(_layout(fig, title, shown.label), since, until, shown, markers)


def quantile_chart(t: Sequence[float], lines: Mapping[str, Sequence[float | None]], title: str, unit: str,
                   since: float, until: float, markers: Sequence[Marker] = ()) -> go.Figure:
    """Several quantiles over one time axis (P50/P95/P99 per bucket): solid, dashed, dotted."""
    rows = {name: [(ti, v, v, v) for ti, v in zip(t, ys) if v is not None] for name, ys in lines.items()}
    styles = {name: DASHES[i % len(DASHES)] for i, name in enumerate(lines)}
    return time_chart(rows, title, unit, since, until, markers, dashes=styles, bands=False, mode="lines+markers")


def time_bars(t: Sequence[float], values: Sequence[float], title: str, unit: str, since: float, until: float,
              bucket_s: float, markers: Sequence[Marker] = ()) -> go.Figure:
    """Counts per time bucket (bucket start times `t`), e.g. requests or evictions per interval."""
    shown = display(unit, max(values, default=0.0))
    fig = go.Figure(go.Bar(x=to_datetimes(t), y=[v * shown.factor for v in values], name=title,
                           width=bucket_s * 1000, offset=0,
                           hovertemplate=f"%{{y:{shown.tick_format()}}} {shown.label}<extra></extra>"))
    return _time_axes(_layout(fig, title, shown.label), since, until, shown, markers)


def bar_chart(labels: Sequence[str], values: Sequence[float], title: str, unit: str, x_title: str) -> go.Figure:
    shown = display(unit, max(values, default=0.0))
    fig = go.Figure(go.Bar(x=list(labels), y=[v * shown.factor for v in values],
                           text=[shown.text(v) for v in values],
                           hovertemplate=f"{x_title} %{{x}}: %{{y:{shown.tick_format()}}} {shown.label}<extra></extra>"))
    fig.update_xaxes(type="category")
    fig.update_yaxes(rangemode="tozero", tickformat=shown.tick_format(), ticksuffix=f" {shown.label}")
    return _layout(fig, title, "", x_title)


def activation_heatmap(counts: Sequence[Sequence[float]], title: str) -> go.Figure:
    """Layer × expert activation counts; row i is layer i, column j is expert j."""
    fig = go.Figure(go.Heatmap(z=[list(row) for row in counts], colorscale="Viridis",
                               colorbar=dict(title="activations", tickformat=",d"),
                               hovertemplate="layer %{y}, expert %{x}: %{z:,d} activations<extra></extra>"))
    fig.update_yaxes(dtick=1)
    return _layout(fig, title, "layer", "expert")


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
    return _layout(fig, title, "hit rate", "policy")


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
    return _layout(fig, title, "", f"cache cap ({shown.label})")
