"""Replacement policies by name. A new policy is one module here that subclasses Policy."""
from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

from agent.knob import Knob
from agent.policies.base import REGISTRY, Key, Policy

# What serve and generate run unless told otherwise: the learned policy, ahead of LRU in every round
# of the serving benchmark and on every report trace (BENCHMARKS.md).
DEFAULT_POLICY = "flashmoe"

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def policy_names() -> list[str]:
    return sorted(REGISTRY)


def policy_factory(name: str, **options) -> Callable[[], Policy]:
    """A zero-argument constructor for policy `name`, one instance per cache partition."""
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(policy_names())}") from None
    return functools.partial(cls, **options)


def policy_knobs() -> list[Knob]:
    """Every installed policy's knobs, once each by name (policies that share a knob declare it alike)."""
    knobs: dict[str, Knob] = {}
    for name in policy_names():
        for knob in REGISTRY[name].knobs:
            if knobs.setdefault(knob.name, knob) != knob:
                raise TypeError(f"policy {name!r} declares knob {knob.name!r} unlike another policy does")
    return list(knobs.values())


def policy_options(name: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the knobs policy `name` takes (LRU takes none, flashmoe its own)."""
    return {k.name: values[k.name] for k in REGISTRY[name].knobs}


def live_policies() -> tuple[str, ...]:
    """Policies the agent can run: built from their knobs alone (Belady needs the future trace)."""
    def buildable(cls: type[Policy]) -> bool:
        own = {k.name for k in cls.knobs}
        return all(p.default is not p.empty or p.name in own or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                   for p in inspect.signature(cls).parameters.values())
    return tuple(name for name in policy_names() if buildable(REGISTRY[name]))


def check_live(name: str) -> None:
    """ValueError unless a running cache can use policy `name`, naming the ones it can."""
    live = live_policies()
    if name not in live:
        what = (f"policy {name!r} needs the future of a whole trace, so only flashmoe-cli simulate runs it"
                if name in REGISTRY else f"unknown policy {name!r}")
        raise ValueError(f"{what}; choose one of {', '.join(live)}")


__all__ = ["DEFAULT_POLICY", "Key", "Policy", "check_live", "live_policies", "policy_factory", "policy_knobs",
           "policy_names", "policy_options"]
