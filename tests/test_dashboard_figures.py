"""Figure builders are pure: the data passed in is the data drawn, in the unit its size calls for."""
import numpy as np
import pytest

from dashboard import figures

T = 1_700_000_000.0
ROWS = [(T, 1.0, 2.0, 3.0), (T + 60, 4.0, 5.0, 9.0)]
MIB = 1 << 20


def seconds(x) -> float:
    """A plotly x value (datetime64 or datetime) as Unix seconds."""
    return np.datetime64(x, "ms").astype(np.int64) / 1000 if isinstance(x, np.datetime64) else x.timestamp()


def test_time_chart_draws_the_average_with_its_min_max_band_off_until_asked():
    fig = figures.time_chart({"read": ROWS, "write": ROWS}, "SSD", "IO/s", T - 60, T + 120)
    read_band, write_band, read, write = fig.data
    assert list(read.y) == [2.0, 5.0] and [seconds(x) for x in read.x] == [T, T + 60]
    assert list(read_band.y) == [3.0, 9.0, 4.0, 1.0]   # max forward, min backward: a closed polygon
    assert [seconds(x) for x in read_band.x] == [T, T + 60, T + 60, T]
    assert read_band.visible == write_band.visible == "legendonly"
    # one legend entry shows or hides every band; each band is in its own line's colour
    assert read_band.legendgroup == write_band.legendgroup == read_band.name == "min–max band"
    assert (read_band.showlegend, write_band.showlegend) == (True, False)
    assert read_band.fillcolor == read.line.color != write.line.color == write_band.fillcolor
    assert [seconds(x) for x in fig.layout.xaxis.range] == [T - 60, T + 120]     # the page's range


def test_a_legend_of_several_rows_goes_under_the_chart_which_grows_by_its_rows():
    names = ["system, some", "system, full", "cgroup, some", "cgroup, full"]
    fig = figures.time_chart({n: ROWS for n in names}, "Memory pressure stall (PSI avg10)", "%", T, T + 60)
    legend = fig.layout.legend
    assert (legend.yref, legend.y, legend.yanchor) == ("container", 0, "bottom")   # away from the title
    # 4 lines and the bands' entry, 2 a row: 3 rows more than a chart without a legend
    assert fig.layout.height == figures.HEIGHT + 3 * figures.LEGEND_ROW_PX and legend.entrywidth == 0.45
    alone = figures.time_chart({"read": ROWS}, "SSD", "IO/s", T, T + 60, bands=False)
    assert alone.layout.height == figures.HEIGHT and alone.layout.showlegend is False


def test_a_name_too_long_for_half_the_narrowest_plot_gets_a_legend_row_of_its_own():
    """At 1280 px, "agent cgroup, anon" beside a 10,000 pages/s axis was cut to "agent cgroup, an"."""
    names = ["agent cgroup, file", "agent cgroup, anon", "system, file", "system, anon"]
    fig = figures.time_chart({n: [(T, 0, 5000, 10_000)] for n in names}, "Workingset refaults", "pages/s", T, T + 60)
    assert fig.layout.legend.entrywidth == 0.9 and fig.layout.height == figures.HEIGHT + 5 * figures.LEGEND_ROW_PX
    assert figures.legend_columns(["agent cgroup"], "1.0 %") == 2       # a short axis leaves it room
    assert figures.legend_columns(["agent cgroup"], "10,000,000 pages/s") == 1


def test_time_chart_shows_bytes_in_one_binary_unit_with_units_in_ticks_and_tooltips():
    fig = figures.time_chart({"RSS": [(T, 0, 512 * MIB, 2048 * MIB)]}, "memory", "B", T, T + 60)
    line = fig.data[1]
    assert list(line.y) == [0.5]                                  # GiB: the largest value is 2 GiB
    assert fig.layout.yaxis.ticksuffix == " GiB" and fig.layout.yaxis.tickformat == ",.1f"
    assert line.hovertemplate == "%{y:,.1f} GiB"
    assert fig.layout.yaxis.rangemode == "tozero"                 # PSI, faults, bytes: never below zero


def test_time_chart_draws_thresholds_and_marks_knob_changes_in_range():
    markers = [figures.Marker(T + 30, "cache_cap_bytes: 4.0 GiB → 3.0 GiB (dashboard)"),
               figures.Marker(T - 99, "old")]
    fig = figures.time_chart({"agent": ROWS}, "faults", "faults/s", T, T + 60, markers,
                             [figures.Threshold(50.0, "agent major faults"),
                              figures.Threshold(50.0, "cgroup major faults"),
                              figures.Threshold(80.0, "other")], bands=False)
    line, notes = fig.data
    assert notes.name == "knob changes" and list(notes.hovertext) == [markers[0].text]
    shapes = {(s.type, s.line.dash) for s in fig.layout.shapes}
    assert ("line", "dash") in shapes and ("line", "dot") in shapes    # the threshold and the knob change
    thresholds = [s for s in fig.layout.shapes if s.line.dash == "dash"]
    assert [(s.y0, s.y1) for s in thresholds] == [(50.0, 50.0), (80.0, 80.0)]   # one line per value, labels joined
    labels = [a for a in fig.layout.annotations if a.text.startswith("threshold")]
    assert [a.hovertext for a in labels] == [
        "threshold 50.0 faults/s: agent major faults, cgroup major faults", "threshold 80.0 faults/s: other"]
    # what the narrowest plot cannot hold is told on hover: it was cut at the plot's edge
    assert [a.text for a in labels] == ["threshold 50.0 faults/s", "threshold 80.0 faults/s: other"]


def test_quantiles_are_told_apart_by_line_style():
    fig = figures.quantile_chart([0.0, 60.0], {"P50": [0.1, 0.2], "P95": [0.3, 0.4], "P99": [0.5, None]},
                                 "latency", "s", 0.0, 120.0)
    assert [(d.name, d.line.dash) for d in fig.data] == [("P50", "solid"), ("P95", "dash"), ("P99", "dot")]
    assert list(fig.data[2].y) == [500.0]                         # ms, the missing bucket left out
    assert fig.layout.yaxis.ticksuffix == " ms"


def test_time_bars_are_one_bucket_wide_over_the_pages_range():
    fig = figures.time_bars([60.0], [7], "requests", "requests", 0.0, 600.0, bucket_s=60.0)
    assert list(fig.data[0].y) == [7]
    assert fig.data[0].width == 60_000      # ms on a date axis
    assert fig.layout.yaxis.tickformat == ",.0f" and fig.data[0].hovertemplate.startswith("%{y:,.0f} requests")
    assert [seconds(x) for x in fig.layout.xaxis.range] == [0.0, 600.0]


def test_heatmap_rows_are_layers():
    fig = figures.activation_heatmap([[1, 0, 3], [0, 2, 0]], "activations")
    assert [list(r) for r in fig.data[0].z] == [[1, 0, 3], [0, 2, 0]]


def test_policy_comparison_groups_by_trace_and_capacity():
    rows = [{"trace": "a", "capacity": 0.125, "policy": "lru", "hit_rate": 0.5},
            {"trace": "a", "capacity": 0.125, "policy": "flashmoe", "hit_rate": 0.7},
            {"trace": "a", "capacity": 0.5, "policy": "lru", "hit_rate": 0.8}]
    fig = figures.policy_comparison(rows, "policies")
    assert [d.name for d in fig.data] == ["a @ 12.5% of experts", "a @ 50% of experts"]
    assert list(fig.data[0].y) == [50.0, 70.0]                    # percent


def test_sweep_curve_sorted_by_cap_in_binary_units():
    fig = figures.sweep_curve([(2 << 20, 30.0), (1 << 20, 10.0)], "sweep")
    assert list(fig.data[0].x) == [1.0, 2.0] and fig.layout.xaxis.ticksuffix == " MiB"
    assert list(fig.data[0].y) == [10.0, 30.0]


def test_threshold_labels_close_on_the_axis_are_lifted_apart_and_far_ones_stay_on_their_line():
    # 100, 500 and 1,000 /s on an axis to 15,000 /s are a few pixels apart; 10,000 /s is far above
    fig = figures.time_chart({"refaults": [(T, 0, 0, 15_000)]}, "refaults", "1/s", T, T + 60,
                             thresholds=[figures.Threshold(v, str(v)) for v in (10_000, 500, 100, 1_000)])
    lifts = {a.text.split(": ")[1]: a.yshift for a in fig.layout.annotations}
    assert lifts["100"] == 0 and lifts["10000"] == 0
    assert 0 < lifts["500"] < lifts["1000"]
    # each label clears the one below it by a label's height
    px = figures.PLOT_PX / (15_000 * figures.AXIS_HEADROOM)
    assert 500 * px + lifts["500"] == pytest.approx(100 * px + figures.LABEL_PX)
    assert 1_000 * px + lifts["1000"] == pytest.approx(500 * px + lifts["500"] + figures.LABEL_PX)
