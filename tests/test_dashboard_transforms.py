"""Pure shaping of query results, the cap slider's arithmetic and the sweep's cap choice."""
from __future__ import annotations

import pytest

from dashboard import sweep, transforms

MIB, GIB = 1 << 20, 1 << 30


def test_latency_lines_pick_each_quantile_per_bucket():
    rows = [{"t": 0.0, "latency_s": {0.5: 1.0, 0.95: 2.0, 0.99: 3.0}},
            {"t": 60.0, "latency_s": {0.5: 1.5, 0.95: None, 0.99: None}}]
    t, lines = transforms.latency_lines(rows)
    assert t == [0.0, 60.0]
    assert lines == {"P50": [1.0, 1.5], "P95": [2.0, None], "P99": [3.0, None]}


def test_live_value_only_while_the_latest_point_is_recent():
    assert transforms.live_value((100.0, 0.5), now=110.0, max_age_s=15) == 0.5
    assert transforms.live_value((100.0, 0.5), now=116.0, max_age_s=15) is None
    assert transforms.live_value(None, now=100.0, max_age_s=15) is None


def test_heatmap_matrix_fills_unrouted_experts_with_zero():
    assert transforms.heatmap_matrix({(0, 2): 5, (1, 0): 1}) == [[0, 0, 5], [1, 0, 0]]
    assert transforms.heatmap_matrix({}) == []


def test_latest_per_cap_keeps_the_newest_measurement():
    rows = [{"cache_cap_bytes": 2, "tokens_per_s": 1.0}, {"cache_cap_bytes": 1, "tokens_per_s": 5.0},
            {"cache_cap_bytes": 2, "tokens_per_s": 3.0}]
    assert transforms.latest_per_cap(rows) == [(1, 5.0), (2, 3.0)]


def test_devices_from_series_names():
    names = ["block.vda.util", "block.nvme0n1.util", "block.vda.queue_depth", "nvme.nvme0.temperature_c",
             "mem.total_bytes"]
    assert transforms.devices(names, "block") == ["nvme0n1", "vda"]
    assert transforms.devices(names, "nvme") == ["nvme0"]


def test_unavailable_sources_replays_down_and_up_events():
    events = [{"kind": "collector.source_unavailable", "message": "cannot read NVMe SMART: no controller"},
              {"kind": "collector.source_unavailable", "message": "cannot read agent memory: no pid file"},
              {"kind": "collector.source_available", "message": "agent memory is readable again"}]
    assert transforms.unavailable_sources(events) == {"NVMe SMART": "no controller"}


def test_knob_table_states_bounds_by_type():
    described = {"cap": {"value": 3, "default": 1, "type": "int", "min": 1, "max": 9, "help": "bytes"},
                 "policy": {"value": "lru", "default": "lru", "type": "str", "choices": ["lru", "arc"]},
                 "prefetch": {"value": True, "default": True, "type": "bool"}}
    assert [r["allowed"] for r in transforms.knob_table(described)] == ["1 … 9", "lru, arc", "true or false"]
    cap = transforms.knob_table({"cache_cap_bytes": {"value": 3 << 20, "type": "int", "min": 1024, "max": 1 << 30}})[0]
    assert cap["value"] == "3.0 MiB"
    assert cap["allowed"] == "1.0 KiB … 1.0 GiB"


def test_stored_knobs_have_no_bounds_while_the_agent_is_away():
    shaped = transforms.stored_knobs({"cache_cap_bytes": 5, "policy": "arc", "prefetch": False, "x": 0.5})
    assert [s["type"] for s in shaped.values()] == ["int", "str", "bool", "float"]
    assert transforms.bounds_text(shaped["cache_cap_bytes"]) == "unknown while the agent is offline"


def test_changed_keeps_only_differences():
    assert transforms.changed({"a": 1, "b": "lru"}, {"a": 1, "b": "arc"}) == {"b": "arc"}


def test_default_caps_span_the_expert_bytes_within_bounds():
    assert sweep.default_caps(800, cap_min=150, cap_max=10_000) == [150, 200, 400, 800]
    assert sweep.default_caps(800, cap_min=10, cap_max=300) == [100, 200, 300]


def test_the_cap_slider_works_in_mib_gib_or_percent_of_expert_bytes():
    assert transforms.cap_unit_bytes("MiB", None) == MIB and transforms.cap_unit_bytes("GiB", None) == GIB
    assert transforms.cap_unit_bytes("% of experts", 1000 * MIB) == 10 * MIB
    with pytest.raises(ValueError, match="running agent"):
        transforms.cap_unit_bytes("% of experts", None)


def test_a_moved_cap_slider_gives_bytes_within_the_bounds_and_an_untouched_one_the_exact_value():
    spec = {"value": 1000 * MIB + 12345, "min": 192 * MIB, "max": 2 * GIB + 7}
    shown = spec["value"] / MIB
    assert transforms.cap_bytes(shown, shown, MIB, spec) == spec["value"]        # not rounded to a MiB
    assert transforms.cap_bytes(512.0, shown, MIB, spec) == 512 * MIB
    assert transforms.cap_bytes(2.01, 1.0, GIB, spec) == spec["max"]              # the slider's top, in bounds
    assert transforms.cap_bytes(0.1, 1.0, GIB, spec) == spec["min"]


def test_the_cap_slider_ends_at_the_models_expert_bytes_unless_the_cap_is_above_them():
    spec = {"value": 384 * MIB, "min": 192 * MIB, "max": 16 * GIB}
    assert transforms.cap_range(spec, 1536 * MIB) == (192 * MIB, 1536 * MIB)   # the demo: not 16 GiB
    assert transforms.cap_range(spec, None) == (192 * MIB, 16 * GIB)            # agent offline: its bounds
    assert transforms.cap_range(spec | {"value": 2 * GIB}, 1536 * MIB) == (192 * MIB, 2 * GIB)
    assert transforms.cap_range(spec, 64 * GIB) == (192 * MIB, 16 * GIB)
    assert transforms.cap_range(spec, 100 * MIB) == (192 * MIB, 384 * MIB)


def test_flags_read_as_their_bounds_spell_them():
    row = transforms.knob_table({"prefetch": {"value": True, "default": False, "type": "bool"}})[0]
    assert (row["value"], row["default"], row["allowed"]) == ("true", "false", "true or false")


def test_markers_are_the_knob_changes_and_sweeps_in_the_range_oldest_first():
    knobs = [{"t": 30.0, "knob": "cache_cap_bytes", "old": 4 * GIB, "new": 3 * GIB, "source": "dashboard"},
             {"t": 5.0, "knob": "policy", "old": "lru", "new": "arc", "source": "api"}]
    sweeps = [{"t": 20.0, "cache_cap_bytes": GIB, "tokens_per_s": 12.34}]
    assert [(m.t, m.text) for m in transforms.markers(knobs, sweeps, 10.0, 40.0)] == [
        (20.0, "sweep: 12.3 tokens/s at cache cap 1.0 GiB"),
        (30.0, "cache_cap_bytes: 4.0 GiB → 3.0 GiB (dashboard)")]


def test_request_rows_state_each_quantity_in_its_unit():
    row = {"t": 0.0, "request_id": "r", "latency_s": 1.234, "ttft_s": 0.0456, "tpot_s": None,
           "completion_tokens": 8, "hits": 3, "misses": 1, "bytes_read": 3 * MIB + 1}
    shown = transforms.request_rows([row])[0]
    assert (shown["latency"], shown["TTFT"], shown["TPOT"], shown["read"]) == ("1.23 s", "45.6 ms", "–", "3.0 MiB")


@pytest.mark.parametrize("unit, lo, hi, shown, step, text", [
    ("MiB", 0.375, 3.0, 0.75, 0.01, "0.75"),           # a small model: finer steps, the value as it is
    ("MiB", 0.375, 3.0, 1000 / 1024, 0.01, "0.977"),   # to three significant digits
    ("MiB", 1.0, 16384.0, 4096.3, 1.0, "4096"),
    ("MiB", 1.0, 16384.0, 0.75, 1.0, "0.75"),          # a cap below the unit on a wide range
    ("GiB", 0.001, 16.0, 4.0, 0.01, "4.00"),
    ("% of experts", 1.5, 100.0, 50.0, 0.5, "50.0"),
])
def test_the_cap_slider_steps_and_shows_its_value_to_three_digits(unit, lo, hi, shown, step, text):
    got_step, digits = transforms.cap_step(unit, lo, hi, shown)
    assert got_step == step and f"{shown:.{digits}f}" == text


def test_prefetch_state_says_whether_reads_are_issued_and_on_what_evidence():
    held = {"mode": "auto", "issuing": False, "accuracy": 0.43, "scored": 256, "break_even": 0.55}
    assert transforms.prefetch_state(held) == ("Prefetch (auto): reads held back: they cost more than they save; "
                                               "of its last 256 guessed reads 43% were used, break-even 55%")
    fresh = {"mode": "on", "issuing": True, "accuracy": None, "scored": 0, "break_even": 0.5}
    assert transforms.prefetch_state(fresh) == "Prefetch (on): issuing reads; no guess scored yet"
    assert transforms.prefetch_state({**fresh, "mode": "off", "issuing": False}) == "Prefetch: off"
