"""Figure builders are pure: the data passed in is the data drawn."""
from dashboard import figures

ROWS = [(1_700_000_000.0, 1.0, 2.0, 3.0), (1_700_000_060.0, 4.0, 5.0, 9.0)]


def test_band_chart_draws_average_line_over_min_max_band():
    fig = figures.band_chart({"read MB/s": ROWS}, "SSD", "MB/s")
    band, line = fig.data
    assert list(line.y) == [2.0, 5.0]
    assert list(band.y) == [3.0, 9.0, 4.0, 1.0]   # max forward, min backward: a closed polygon
    assert line.x[0].timestamp() == 1_700_000_000.0
    assert fig.layout.yaxis.title.text == "MB/s"


def test_lines_chart_one_trace_per_line():
    fig = figures.lines_chart([0.0, 60.0], {"P50": [0.1, 0.2], "P99": [0.5, None]}, "latency", "s", 120.0)
    assert [d.name for d in fig.data] == ["P50", "P99"]
    assert list(fig.data[1].y) == [0.5, None]
    assert [x.timestamp() for x in fig.layout.xaxis.range] == [0.0, 120.0]


def test_time_bars_are_one_bucket_wide_and_run_from_the_first_bucket_to_now():
    fig = figures.time_bars([60.0], [7], "requests", "requests", 600.0, bucket_s=60.0)
    assert list(fig.data[0].y) == [7]
    assert fig.data[0].width == 60_000      # ms on a date axis
    assert [x.timestamp() for x in fig.layout.xaxis.range] == [60.0, 600.0]


def test_heatmap_rows_are_layers():
    fig = figures.activation_heatmap([[1, 0, 3], [0, 2, 0]], "activations")
    assert [list(r) for r in fig.data[0].z] == [[1, 0, 3], [0, 2, 0]]


def test_policy_comparison_groups_by_trace_and_capacity():
    rows = [{"trace": "a", "capacity": 0.125, "policy": "lru", "hit_rate": 0.5},
            {"trace": "a", "capacity": 0.125, "policy": "flashmoe", "hit_rate": 0.7},
            {"trace": "a", "capacity": 0.5, "policy": "lru", "hit_rate": 0.8}]
    fig = figures.policy_comparison(rows, "policies")
    assert [d.name for d in fig.data] == ["a @ 12.5% of experts", "a @ 50% of experts"]
    assert list(fig.data[0].y) == [0.5, 0.7]


def test_sweep_curve_sorted_by_cap_in_mib():
    fig = figures.sweep_curve([(2 << 20, 30.0), (1 << 20, 10.0)], "sweep")
    assert list(fig.data[0].x) == [1.0, 2.0]
    assert list(fig.data[0].y) == [10.0, 30.0]
