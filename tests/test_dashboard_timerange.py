"""The dashboard's time range: relative presets, custom ranges, a drag's selection, zoom out."""
from datetime import datetime, timezone

import pytest

from dashboard import timerange

T = 1_700_000_000.0


def test_relative_ranges_end_at_now_rounded_up_to_the_step():
    assert timerange.relative(300, T + 1) == (T + 5 - 300, T + 5)
    assert list(timerange.PRESETS)[0] == "5 min" and timerange.PRESETS["7 d"] == 7 * 86400


def test_a_custom_range_is_read_in_utc_and_must_not_be_empty():
    start, end = datetime(2026, 1, 31, 12, 0), datetime(2026, 1, 31, 13, 0)
    since, until = timerange.absolute(start, end)
    assert until - since == 3600 and since == datetime(2026, 1, 31, 12, tzinfo=timezone.utc).timestamp()
    with pytest.raises(ValueError, match="at least 10 s after"):
        timerange.absolute(end, start)


def test_a_drag_selection_becomes_a_range_in_either_form_plotly_sends():
    assert timerange.from_selection(["2026-01-31 12:00:30.5", "2026-01-31 12:00:00"]) == (
        datetime(2026, 1, 31, 12, tzinfo=timezone.utc).timestamp(),
        datetime(2026, 1, 31, 12, 0, 30, 500000, tzinfo=timezone.utc).timestamp())
    assert timerange.from_selection([T * 1000, (T + 60) * 1000]) == (T, T + 60)


@pytest.mark.parametrize("xs", [[], ["2026-01-31 12:00:00"], ["soon", "later"], [T * 1000, T * 1000 + 5], [None, 3]])
def test_an_unreadable_or_too_narrow_selection_is_ignored(xs):
    assert timerange.from_selection(xs) is None


def test_zoom_out_doubles_the_span_and_never_passes_now():
    assert timerange.zoomed_out(T, T + 100, now=T + 1000) == (T - 50, T + 150)
    assert timerange.zoomed_out(T, T + 100, now=T + 120) == (T - 80, T + 120)
