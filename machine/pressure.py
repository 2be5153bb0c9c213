"""Pressure stall information: /proc/pressure/{memory,io} (kernel >= 4.20 with CONFIG_PSI)."""
from __future__ import annotations

from pathlib import Path

from machine.sources import SourceUnavailable

RESOURCES = ("memory", "io")


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """`some avg10=0.00 avg60=0.00 avg300=0.00 total=0` lines as {"some": {"avg10": 0.0, ...}}."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        out[kind] = {key: float(value) for key, value in (p.split("=") for p in pairs)}
    return out


def read_psi(resource: str, root: Path = Path("/proc/pressure")) -> dict[str, dict[str, float]]:
    """One reading of /proc/pressure/<resource>; SourceUnavailable if the kernel keeps none."""
    try:
        return parse_psi((root / resource).read_text())
    except FileNotFoundError:
        raise SourceUnavailable("the kernel has no pressure stall information (needs Linux >= 4.20 "
                                "with CONFIG_PSI=y, and psi=1 on the command line if it is off)") from None
