"""Pure plotly figure builders: plain data in, a go.Figure out, no Streamlit and no I/O."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone

import plotly.graph_objects as go

MIB = 1 << 20
BandRow = tuple[float, float, float, float]   # (t, min, avg, max) per downsampling bucket
HEIGHT = 300


def to_datetimes(ts: Sequence[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t, tz=timezone.utc) for t in ts]


def _layout(fig: go.Figure, title: str, y_title: str, x_title: str = "") -> go.Figure:
    fig.update_layout(title=title, height=HEIGHT, margin=dict(l=10, r=10, t=40, b=10),
                      yaxis_title=y_title, xaxis_title=x_title,
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=1.0, xanchor="right"))
    return fig


def band_chart(series: Mapping[str, Sequence[BandRow]], title: str, unit: str) -> go.Figure:
    """One line per series (bucket average) over a shaded min–max band."""
    fig = go.Figure()
    for name, rows in series.items():
        t = to_datetimes([r[0] for r in rows])
        fig.add_trace(go.Scatter(x=t + t[::-1], y=[r[3] for r in rows] + [r[1] for r in rows][::-1],
                                 fill="toself", line=dict(width=0), opacity=0.2, hoverinfo="skip",
                                 showlegend=False, legendgroup=name, name=f"{name} min–max"))
        fig.add_trace(go.Scatter(x=t, y=[r[2] for r in rows], mode="lines", name=name, legendgroup=name))
    return _layout(fig, title, unit)


def _until(fig: go.Figure, t: Sequence[float], until: float) -> go.Figure:
    # Bucketed data may fill one bucket only: run the axis from the first bucket to now so time reads true.
    fig.update_xaxes(range=to_datetimes([min(t), until]))
    return fig


def lines_chart(t: Sequence[float], lines: Mapping[str, Sequence[float | None]], title: str,
                unit: str, until: float) -> go.Figure:
    """Several lines over one shared time axis, e.g. latency P50/P95/P99 per bucket."""
    x = to_datetimes(t)
    fig = go.Figure([go.Scatter(x=x, y=list(ys), mode="lines+markers", name=name)
                     for name, ys in lines.items()])
    return _until(_layout(fig, title, unit), t, until)


def time_bars(t: Sequence[float], values: Sequence[float], title: str, y_title: str,
              until: float, bucket_s: float) -> go.Figure:
    """Counts per time bucket (bucket start times `t`), e.g. requests or evictions per interval."""
    fig = go.Figure(go.Bar(x=to_datetimes(t), y=list(values), name=y_title, width=bucket_s * 1000,
                           offset=0))
    return _until(_layout(fig, title, y_title), t, until)


def bar_chart(labels: Sequence[str], values: Sequence[float], title: str, y_title: str,
              x_title: str) -> go.Figure:
    fig = go.Figure(go.Bar(x=list(labels), y=list(values), text=[f"{v:.2f}" for v in values]))
    fig.update_xaxes(type="category")
    return _layout(fig, title, y_title, x_title)


def activation_heatmap(counts: Sequence[Sequence[float]], title: str) -> go.Figure:
    """Layer × expert activation counts; row i is layer i, column j is expert j."""
    fig = go.Figure(go.Heatmap(z=[list(row) for row in counts], colorscale="Viridis",
                               colorbar=dict(title="activations"),
                               hovertemplate="layer %{y}, expert %{x}: %{z}<extra></extra>"))
    fig.update_yaxes(dtick=1)
    return _layout(fig, title, "layer", "expert")


def policy_comparison(rows: Sequence[Mapping[str, object]], title: str) -> go.Figure:
    """Hit rate per policy, one bar group per (trace, capacity) as `simulate --json` reports it
    (capacity a fraction of all experts)."""
    groups = sorted({(str(r["trace"]), float(r["capacity"])) for r in rows})
    fig = go.Figure()
    for trace, capacity in groups:
        sel = [r for r in rows if (str(r["trace"]), float(r["capacity"])) == (trace, capacity)]
        fig.add_trace(go.Bar(x=[str(r["policy"]) for r in sel], y=[float(r["hit_rate"]) for r in sel],
                             name=f"{trace} @ {capacity * 100:g}% of experts"))
    fig.update_layout(barmode="group")
    return _layout(fig, title, "hit rate", "policy")


def sweep_curve(points: Sequence[tuple[float, float]], title: str) -> go.Figure:
    """Tokens/s against the cache cap, from a sweep's (cap bytes, tokens/s) points."""
    points = sorted(points)
    fig = go.Figure(go.Scatter(x=[p[0] / MIB for p in points], y=[p[1] for p in points],
                               mode="lines+markers", name="tokens/s"))
    return _layout(fig, title, "tokens/s", "cache cap (MiB)")
