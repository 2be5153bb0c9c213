"""The agent's live knobs: their types, defaults and bounds, and all-or-nothing validation.

Validation is pure: `Knobs.validate(changes)` returns the new values or raises KnobError naming the
first bad knob and what it accepts, so a request with one bad value changes nothing. Applying the
validated values to the cache, the scheduler and the guard is the runtime's job (agent.serve.runtime).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.policies import DEFAULT_POLICY

SOURCES = ("api", "dashboard", "guard", "restore", "cli")  # who changed a knob; clients may send the first two


class KnobError(ValueError):
    """A knob change was refused; `knob` names it and the message says what is allowed."""

    def __init__(self, knob: str, message: str) -> None:
        super().__init__(message)
        self.knob = knob


@dataclass(frozen=True)
class Knob:
    name: str
    kind: type                      # bool, int, float or str
    default: Any
    lo: float | None = None         # inclusive bounds for numbers
    hi: float | None = None
    choices: tuple[str, ...] = ()   # allowed strings
    help: str = ""

    def bounds(self) -> dict[str, Any]:
        if self.kind is bool:
            return {"type": "bool"}
        if self.kind is str:
            return {"type": "str", "choices": list(self.choices)}
        return {"type": self.kind.__name__, "min": self.lo, "max": self.hi}

    def check(self, value: Any) -> Any:
        """The value converted to the knob's type, or KnobError naming the knob and its range."""
        if self.kind is bool:
            if not isinstance(value, bool):
                raise KnobError(self.name, f"{self.name} must be true or false, got {value!r}")
            return value
        if self.kind is str:
            if value not in self.choices:
                raise KnobError(self.name, f"{self.name} must be one of {', '.join(self.choices)}; got {value!r}")
            return value
        number = _number(self, value)
        if (self.lo is not None and number < self.lo) or (self.hi is not None and number > self.hi):
            raise KnobError(self.name, f"{self.name} must be between {_fmt(self.lo)} and {_fmt(self.hi)}"
                                       f"{' (' + self.help + ')' if self.help else ''}; got {_fmt(number)}")
        return number


def _number(knob: Knob, value: Any) -> int | float:
    # JSON has no int/float distinction a client can rely on: accept 3.0 for an int knob, refuse 3.5.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KnobError(knob.name, f"{knob.name} must be a number between {_fmt(knob.lo)} and {_fmt(knob.hi)}; "
                                   f"got {value!r}")
    if knob.kind is int:
        if value != int(value):
            raise KnobError(knob.name, f"{knob.name} must be a whole number; got {value!r}")
        return int(value)
    return float(value)


def _fmt(x: float | None) -> str:
    if x is None:
        return "unbounded"
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Limits:
    """The machine- and model-dependent bounds of the knobs."""
    cap_min: int          # bytes of the working set: top-k experts of every layer
    cap_max: int          # 70% of physical memory or of the cgroup limit
    policies: tuple[str, ...]
    max_prefetch_depth: int  # layers ahead the model can predict (its lookahead is one layer)
    keep_percentile: float = 30.0      # defaults of the learned policy's options: its own, where it is installed
    recompute_threshold: float = 0.0


def knob_specs(limits: Limits) -> list[Knob]:
    return [
        Knob("cache_cap_bytes", int, limits.cap_min, limits.cap_min, limits.cap_max,
             help="the working set of one token up to 70% of physical memory or the cgroup limit"),
        Knob("policy", str, DEFAULT_POLICY, choices=limits.policies),
        Knob("keep_percentile", float, limits.keep_percentile, 0.0, 100.0, help="learned policy: keep experts scoring at or above it"),
        Knob("recompute_threshold", float, limits.recompute_threshold, 0.0, 1.0,
             help="learned policy: activation-distribution shift that triggers rescoring"),
        Knob("ssd_util_threshold", float, 0.9, 0.0, 1.0, help="SSD utilisation above which the batch limit shrinks"),
        Knob("prefetch", bool, True),
        Knob("prefetch_depth", int, 1, 0, limits.max_prefetch_depth, help="layers ahead to prefetch; 0 turns it off"),
        Knob("max_batch_size", int, 16, 1, 256),
        Knob("auto_shrink", bool, False),
    ]


class Knobs:
    """Current knob values; `validate` never mutates, `commit` stores values already validated."""

    def __init__(self, limits: Limits, initial: Mapping[str, Any] | None = None) -> None:
        self.specs = {k.name: k for k in knob_specs(limits)}
        self.values = {k.name: k.default for k in self.specs.values()}
        if initial:
            self.values.update(self.validate(initial))

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def validate(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """The changes converted and checked, or KnobError for the first bad one (nothing is applied)."""
        if not isinstance(changes, Mapping) or not changes:
            raise KnobError("", f"send a JSON object of knob -> value; knobs: {', '.join(self.specs)}")
        unknown = [name for name in changes if name not in self.specs]
        if unknown:
            raise KnobError(unknown[0], f"unknown knob {unknown[0]!r}; knobs: {', '.join(self.specs)}")
        return {name: self.specs[name].check(value) for name, value in changes.items()}

    def diff(self, validated: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """knob -> (old, new) for the values that actually change."""
        return {k: (self.values[k], v) for k, v in validated.items() if self.values[k] != v}

    def commit(self, validated: Mapping[str, Any]) -> None:
        self.values.update(validated)

    def describe(self) -> dict[str, dict[str, Any]]:
        return {name: {"value": self.values[name], "default": spec.default, **spec.bounds(),
                       **({"help": spec.help} if spec.help else {})}
                for name, spec in self.specs.items()}

