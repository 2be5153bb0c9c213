"""The agent's live knobs: their types, defaults and bounds, and all-or-nothing validation.

One knob is checked by agent.knob.Knob; the policies declare their own knobs in their classes
(agent.policies.policy_knobs). Validation is pure: `Knobs.validate(changes)` returns the new values
or raises KnobError naming the first bad knob and what it accepts, so a request with one bad value
changes nothing. Applying the validated values to the cache, the scheduler and the guard is the
runtime's job (agent.serve.runtime).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.knob import Knob, KnobError, KnobState
from agent.policies import DEFAULT_POLICY, policy_knobs

__all__ = ["SOURCES", "Knob", "KnobError", "Knobs", "Limits", "knob_specs"]

SOURCES = ("api", "dashboard", "guard", "restore", "cli")  # who changed a knob; clients may send the first two


@dataclass(frozen=True)
class Limits:
    """The machine- and model-dependent bounds of the knobs."""
    cap_min: int          # bytes of the working set: top-k experts of every layer
    cap_max: int          # 70% of physical memory or of the cgroup limit
    policies: tuple[str, ...]
    max_prefetch_depth: int  # layers ahead the model can predict (its lookahead is one layer)


def knob_specs(limits: Limits) -> list[Knob]:
    return [
        Knob("cache_cap_bytes", int, limits.cap_min, limits.cap_min, limits.cap_max,
             help="the working set of one token up to 70% of physical memory or the cgroup limit"),
        Knob("policy", str, DEFAULT_POLICY, choices=limits.policies,
             help="the replacement policy that decides which experts stay in the cache"),
        *policy_knobs(),
        Knob("prefetch", bool, True, help="read the next layer's predicted experts while this layer computes"),
        Knob("prefetch_adaptive", bool, True,
             help="issue those reads only while the guesses are right often enough to pay (agent/prefetch_gate.py); "
                  "false: always"),
        Knob("prefetch_depth", int, 1, 0, limits.max_prefetch_depth, help="layers ahead to prefetch; 0 turns it off"),
        Knob("max_batch_size", int, 16, 1, 256, help="most requests stepped together"),
        Knob("auto_shrink", bool, False,
             help="the memory guard shrinks the cache cap by steps while the agent thrashes or the machine "
                  "as a whole is short of memory"),
    ]


class Knobs:
    """Current knob values; `validate` never mutates, `commit` stores values already validated."""

    def __init__(self, limits: Limits, initial: Mapping[str, Any] | None = None) -> None:
        self.limits = limits
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

    def rebound(self, limits: Limits) -> None:
        """New bounds (e.g. the memory limit changed). The values stay, even one now outside its range:
        describe() shows it beside the new range, and the next change must respect that range."""
        self.limits = limits
        self.specs = {k.name: k for k in knob_specs(limits)}

    def commit(self, validated: Mapping[str, Any]) -> None:
        self.values.update(validated)

    def describe(self) -> dict[str, KnobState]:
        return {name: {"value": self.values[name], "default": spec.default, **spec.bounds(),
                       **({"help": spec.help} if spec.help else {})}
                for name, spec in self.specs.items()}

