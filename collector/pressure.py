"""Pressure stall information: /proc/pressure/{memory,io} (kernel >= 4.20 with CONFIG_PSI)."""
from __future__ import annotations

from pathlib import Path

RESOURCES = ("memory", "io")


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """`some avg10=0.00 avg60=0.00 avg300=0.00 total=0` lines as {"some": {"avg10": 0.0, ...}}."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        out[kind] = {key: float(value) for key, value in (p.split("=") for p in pairs)}
    return out


def psi_series(resource: str, psi: dict[str, dict[str, float]]) -> dict[str, float]:
    """The store series psi.{res}.{some,full}_{avg10,total_us} present in one reading."""
    series = {}
    for kind in ("some", "full"):
        if kind in psi:
            series[f"psi.{resource}.{kind}_avg10"] = psi[kind]["avg10"]
            series[f"psi.{resource}.{kind}_total_us"] = int(psi[kind]["total"])
    return series


def read_psi(resource: str, root: Path = Path("/proc/pressure")) -> dict[str, dict[str, float]]:
    return parse_psi((root / resource).read_text())
