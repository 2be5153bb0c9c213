"""One rendering per quantity (store.units): binary sizes, percentages, seconds, rates; never an exponent."""
import math

import pytest

from store.units import display, human


@pytest.mark.parametrize("value, unit, text", [
    (512, "B", "512 B"), (393216, "B", "384 KiB"), (1.5 * 2**20, "B", "1.5 MiB"), (2 * 2**30, "B", "2.0 GiB"),
    (300 * 2**20, "B", "300 MiB"), (200e6, "B/s", "191 MiB/s"),
    (0.25, "fraction", "25.0 %"), (1 / 3, "fraction", "33.3 %"), (12.34, "%", "12.3 %"),
    (2.5, "s", "2.50 s"), (0.0456, "s", "45.6 ms"), (0.0004, "s", "400 µs"), (5e6, "us", "5.00 s"),
    (812.3, "1/s", "812 /s"), (0.5, "1/s", "0.5 /s"), (123456, "1/s", "123,456 /s"),
    (1e12, "faults/s", "1,000,000,000,000 faults/s"),
    (41, "degC", "41 °C"), (3, "count", "3"),
    (None, "B", "–"), (math.nan, "s", "–"), (math.inf, "1/s", "–"),
])
def test_human(value, unit, text):
    assert human(value, unit) == text


def test_one_display_unit_for_a_whole_axis_picked_by_its_largest_value():
    shown = display("B", 3 * 2**30)
    assert (shown.label, shown.factor, shown.tick_format()) == ("GiB", 1 / 2**30, ",.1f")
    assert shown.text(512 * 2**20) == "0.5 GiB"      # a small value on a GiB axis stays in GiB
