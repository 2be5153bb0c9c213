"""The page's time range and refresh, as Grafana has them: relative presets from 5 min to 7 d, a
custom absolute range (typed, or dragged across any chart), and an auto-refresh that can be paused.

Pure functions of their inputs (no Streamlit), so the sidebar and the charts only wire them up,
and `now()`, the one clock every page reads. Times are Unix seconds; the dashboard shows them in UTC.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import datetime, timezone

PRESETS = {"5 min": 300, "15 min": 900, "1 h": 3600, "6 h": 6 * 3600, "24 h": 24 * 3600, "7 d": 7 * 24 * 3600}
CUSTOM = "Custom"
DEFAULT = "15 min"
REFRESH = {"off": None, "5 s": 5, "10 s": 10, "30 s": 30, "1 min": 60}
DEFAULT_REFRESH = "5 s"
STEP_S = 5                    # `until` of a relative range is rounded up to this, so sessions share cached queries
MIN_SPAN_S = 10.0             # a narrower range holds too few 1 Hz samples to chart


def now() -> float:
    """The dashboard's clock. Pages judge how old the store's latest points are by it (a collector is "up"
    while its last sample is recent), so a test fixes it at the instant its telemetry ends instead of
    depending on how long the page took to render."""
    return time.time()


def relative(seconds: float, now: float, step: float = STEP_S) -> tuple[float, float]:
    """(since, until) covering the last `seconds`, `until` rounded up to `step`."""
    until = math.ceil(now / step) * step
    return until - seconds, until


def absolute(start: datetime, end: datetime) -> tuple[float, float]:
    """A custom range from two UTC wall-clock times (naive ones are read as UTC); ValueError if it is empty."""
    since, until = (_utc(d).timestamp() for d in (start, end))
    if until - since < MIN_SPAN_S:
        raise ValueError(f"the range must end at least {MIN_SPAN_S:.0f} s after it starts")
    return since, until


def from_selection(xs: Sequence[object]) -> tuple[float, float] | None:
    """The range a drag across a time chart selected (plotly's box-selection x values: date strings
    or epoch milliseconds), or None when it is too narrow or unreadable."""
    try:
        ts = sorted(_epoch(x) for x in xs)
    except (TypeError, ValueError):
        return None
    if len(ts) < 2 or ts[-1] - ts[0] < MIN_SPAN_S:
        return None
    return ts[0], ts[-1]


def zoomed_out(since: float, until: float, now: float) -> tuple[float, float]:
    """Twice the span around the same middle, never reaching past now."""
    span = until - since
    until = min(until + span / 2, now)
    return until - 2 * span, until


def _utc(d: datetime) -> datetime:
    return d.replace(tzinfo=timezone.utc) if d.tzinfo is None else d


def _epoch(x: object) -> float:
    if isinstance(x, (int, float)):
        return float(x) / 1000.0           # plotly's date axes count milliseconds
    return _utc(datetime.fromisoformat(str(x).replace(" ", "T"))).timestamp()
