"""How a value of each catalogue unit reads to a person: one rendering per quantity everywhere.

Bytes in binary units (KiB, MiB, GiB), fractions as percentages, seconds with the precision their
size needs, rates per second without scientific notation. The dashboard's axes and tooltips, its
tables and the CLI's verdict all go through here, so the same quantity never reads two ways.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BINARY = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
TIME = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))
WHOLE = {"count": "", "bits": "", "degC": "°C", "°C": "°C"}     # counted or read in whole units
MISSING = "–"             # a value not known, in text and in tables


@dataclass(frozen=True)
class Display:
    """A display unit for a set of values: multiply by `factor`, show `decimals` digits, then `label`."""
    label: str
    factor: float = 1.0
    decimals: int = 1

    def text(self, value: float | None) -> str:
        if value is None or not math.isfinite(value):
            return MISSING
        return f"{value * self.factor:,.{self.decimals}f} {self.label}".rstrip()

    def tick_format(self) -> str:
        """The d3 format plotly takes for axes and tooltips: thousands separators, never an exponent."""
        return f",.{self.decimals}f"


def display(unit: str, largest: float) -> Display:
    """The display unit for values of catalogue `unit` whose largest magnitude is `largest`."""
    largest = abs(largest) if math.isfinite(largest) else 0.0
    if unit in ("B", "B/s"):
        suffix = "/s" if unit == "B/s" else ""
        name, scale = next(((n, s) for n, s in BINARY if largest >= s), ("B", 1))
        return Display(name + suffix, 1 / scale, 0 if scale == 1 or largest / scale >= 100 else 1)
    if unit == "fraction":
        return Display("%", 100.0, 1)
    if unit == "%":
        return Display("%", 1.0, 1)
    if unit == "s":
        name, scale = next(((n, s) for n, s in TIME if largest >= s), TIME[-1])
        return Display(name, 1 / scale, 2 if largest / scale < 10 else 1 if largest / scale < 100 else 0)
    if unit == "us":
        seconds = display("s", largest * 1e-6)
        return Display(seconds.label, seconds.factor * 1e-6, seconds.decimals)
    if unit in WHOLE:
        return Display(WHOLE[unit], 1.0, 0)
    label = "/s" if unit == "1/s" else unit
    return Display(label, 1.0, 1 if largest < 100 else 0)


def human(value: float | None, unit: str) -> str:
    """One value as text in the display unit its own size calls for, e.g. 1.5 GiB, 12.5 %, 812 /s."""
    return display(unit, value if value is not None else 0.0).text(value)
