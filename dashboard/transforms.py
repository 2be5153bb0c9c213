"""Pure shaping of query results into what the figures and metrics take (no Streamlit, no I/O)."""
from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dashboard.figures import Marker
from store.units import human

QUANTILES = {"P50": 0.5, "P95": 0.95, "P99": 0.99}
CAP_UNITS = ("MiB", "GiB", "% of experts")          # how the Tuning page takes the cache cap
CAP_STEPS = {"MiB": 1.0, "GiB": 0.01, "% of experts": 0.5}   # the cap slider's coarsest step in each unit
CAP_STEPS_PER_RANGE = 100   # a range with fewer of them gets a finer step (the demo's 1.5 MiB of experts)
SHOWN_DIGITS = 3            # significant digits of the cap the slider shows


def latency_lines(rows: Sequence[Mapping[str, Any]], column: str = "latency_s"
                  ) -> tuple[list[float], dict[str, list[float | None]]]:
    """latency_quantiles rows -> (bucket times, {"P50": [...], "P95": [...], "P99": [...]})."""
    t = [r["t"] for r in rows]
    return t, {label: [r[column].get(q) for r in rows] for label, q in QUANTILES.items()}


def live_value(point: tuple[float, float] | None, now: float, max_age_s: float) -> float | None:
    """A series' latest (t, value) read as "now": its value while at most `max_age_s` old, else None."""
    return point[1] if point is not None and now - point[0] <= max_age_s else None


def heatmap_matrix(counts: Mapping[tuple[int, int], int]) -> list[list[int]]:
    """{(layer, expert): n} -> rows of layers, columns of experts, zeros where never routed."""
    if not counts:
        return []
    n_layers = max(layer for layer, _ in counts) + 1
    n_experts = max(expert for _, expert in counts) + 1
    matrix = [[0] * n_experts for _ in range(n_layers)]
    for (layer, expert), n in counts.items():
        matrix[layer][expert] = n
    return matrix


def latest_per_cap(rows: Iterable[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """Sweep rows (oldest first) -> the most recent tokens/s measured at each cap, by cap."""
    latest = {int(r["cache_cap_bytes"]): float(r["tokens_per_s"]) for r in rows}
    return sorted(latest.items())


def devices(names: Iterable[str], prefix: str) -> list[str]:
    """Device names in series like `block.<dev>.util` (prefix "block") or `nvme.<ctrl>.*`."""
    pattern = re.compile(rf"{re.escape(prefix)}\.([^.]+)\.")
    return sorted({m.group(1) for n in names if (m := pattern.match(n))})


def age_text(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    age = max(now - t, 0.0)
    return f"{age:.0f} s ago" if age < 120 else f"{age / 60:.0f} min ago" if age < 7200 else f"{age / 3600:.1f} h ago"


def literal(text: str) -> str:
    """`text` as Markdown shows it as it is: a code span, fenced by one backtick more than its longest run.
    A name another server reports (a Fleet target's device name) rendered as a link, bold or an icon; escaping
    with backslashes still let Streamlit turn its URL into a link."""
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}"


def knob_table(described: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """GET /v1/knobs -> one row per knob: value, allowed range, default, help."""
    return [{"knob": name, "value": value_text(name, spec["value"]), "allowed": bounds_text(spec, name),
             "default": value_text(name, spec.get("default", "")), "help": spec.get("help", "")}
            for name, spec in described.items()]


def value_text(name: str, value: Any) -> str:
    """A knob value as text; byte counts as a binary size, e.g. `768 KiB`; a flag as JSON spells it, as
    its bounds ("true or false") and the API do."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if name.endswith("_bytes") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return human(value, "B")
    return str(value)


def bounds_text(spec: Mapping[str, Any], name: str = "") -> str:
    if spec.get("type") == "bool":
        return "true or false"
    if "choices" in spec:
        return ", ".join(spec["choices"])
    if "min" not in spec:
        return "unknown while the agent is offline"
    return f"{value_text(name, spec['min'])} … {value_text(name, spec['max'])}"


def stored_knobs(latest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """latest_knobs from the store, shaped like GET /v1/knobs (bounds unknown while the agent is away)."""
    return {name: {"value": value, "type": "str" if isinstance(value, str) else
                   "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "float",
                   **({"choices": [value]} if isinstance(value, str) else {})}
            for name, value in latest.items()}


def cap_unit_bytes(unit: str, expert_bytes: int | None) -> float:
    """Bytes in one `unit` of the cache cap (a percentage is of all expert bytes)."""
    if unit == "% of experts":
        if not expert_bytes:
            raise ValueError("a cap in % needs the model's expert bytes, which only a running agent reports")
        return expert_bytes / 100
    return {"MiB": 1 << 20, "GiB": 1 << 30}[unit]


def cap_range(spec: Mapping[str, Any], expert_bytes: int | None) -> tuple[int, int]:
    """The cap slider's ends in bytes: the knob's bounds, the top lowered to all the model's expert
    bytes (a cap above them holds nothing more) unless the cap is above them already. The demo's
    1.5 GiB of experts took the left tenth of a slider up to 70% of RAM (16 GiB)."""
    top = spec["max"] if not expert_bytes else min(spec["max"], max(expert_bytes, spec["value"], spec["min"]))
    return spec["min"], top


def cap_bytes(chosen: float, shown: float, scale: float, spec: Mapping[str, Any]) -> int:
    """The cap slider's value in bytes, within the knob's bounds. An untouched slider (still at
    `shown`) keeps the agent's exact value, so unit rounding never turns into a change."""
    if chosen == shown:
        return spec["value"]
    return int(min(max(round(chosen * scale), spec["min"]), spec["max"]))


def cap_step(unit: str, lo: float, hi: float, shown: float) -> tuple[float, int]:
    """(step, decimals) of the cap slider over lo..hi in `unit`, showing `shown`: the unit's step, or
    the power of ten that makes CAP_STEPS_PER_RANGE steps of a narrower range; decimals enough for
    the step and for the value to SHOWN_DIGITS significant digits (768 KiB is 0.75 MiB, not "1 MiB")."""
    step = CAP_STEPS[unit]
    if 0 < (hi - lo) / step < CAP_STEPS_PER_RANGE:
        step = 10.0 ** math.floor(math.log10((hi - lo) / CAP_STEPS_PER_RANGE))
    return step, max(decimals(step), decimals(shown))


def decimals(x: float) -> int:
    """The fewest decimals that write x to SHOWN_DIGITS significant digits (0.75 -> 2, 4096.3 -> 0)."""
    if x == 0:
        return 0
    most = max(0, SHOWN_DIGITS - 1 - math.floor(math.log10(abs(x))))
    return next(d for d in range(most + 1) if round(x, d) == round(x, most))


def float_step(lo: float, hi: float) -> tuple[float, int]:
    """(step, decimals) for a float knob: whole steps over a wide range, hundredths over 0..1."""
    return (1.0, 0) if hi - lo > 10 else (0.01, 2)


def changed(current: Mapping[str, Any], edited: Mapping[str, Any]) -> dict[str, Any]:
    """The edited knobs whose value differs from the agent's current one."""
    return {k: v for k, v in edited.items() if current.get(k) != v}


def clock(t: float) -> str:
    """A Unix time as UTC wall-clock text, the way every page shows times."""
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def request_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Request rows for display: wall-clock time, latencies, cache traffic, each in its unit."""
    return [{"time": clock(r["t"]), "id": r["request_id"], "latency": human(r["latency_s"], "s"),
             "TTFT": human(r["ttft_s"], "s"), "TPOT": human(r["tpot_s"], "s"), "tokens": r["completion_tokens"],
             "expert hits": r["hits"], "misses": r["misses"], "read": human(r["bytes_read"] or 0, "B")}
            for r in rows]


def knob_history_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """knob_history rows -> display rows with a readable time and values in their units."""
    return [{"time": clock(r["t"]), "knob": r["knob"], "old": value_text(r["knob"], r["old"]),
             "new": value_text(r["knob"], r["new"]), "source": r["source"]} for r in rows]


def markers(knob_rows: Iterable[Mapping[str, Any]], sweep_rows: Iterable[Mapping[str, Any]],
            since: float, until: float) -> list[Marker]:
    """Knob changes and sweep points in [since, until] as chart annotations, oldest first."""
    out = [Marker(r["t"], f"{r['knob']}: {value_text(r['knob'], r['old'])} → {value_text(r['knob'], r['new'])} "
                          f"({r['source']})") for r in knob_rows if since <= r["t"] <= until]
    out += [Marker(r["t"], f"sweep: {r['tokens_per_s']:,.1f} tokens/s at cache cap {human(r['cache_cap_bytes'], 'B')}")
            for r in sweep_rows if since <= r["t"] <= until]
    return sorted(out, key=lambda m: m.t)


def unavailable_sources(events: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Sources the collector currently cannot read -> why, replaying its events oldest first.

    The collector says "cannot read <source>: <reason>" once when a source goes away and
    "<source> is readable again" when it comes back (collector.status).
    """
    down: dict[str, str] = {}
    for e in events:
        if e["kind"] == "collector.source_unavailable":
            source, _, reason = e["message"].removeprefix("cannot read ").partition(": ")
            down[source] = reason
        elif e["kind"] == "collector.source_available":
            down.pop(e["message"].removesuffix(" is readable again"), None)
    return down


def prefetch_state(gate: dict) -> str:
    """One line on the agent's adaptive prefetch (agent/prefetch_gate.py): are its reads issued, and why."""
    if gate["mode"] == "off":
        return "Prefetch: off"
    state = "issuing reads" if gate["issuing"] else "reads held back: they cost more than they save"
    if gate["accuracy"] is None:
        return f"Prefetch ({gate['mode']}): {state}; no guess scored yet"
    return (f"Prefetch ({gate['mode']}): {state}; of its last {gate['scored']} guessed reads "
            f"{gate['accuracy']:.0%} were used, break-even {gate['break_even']:.0%}")
