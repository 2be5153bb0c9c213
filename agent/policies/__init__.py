"""Replacement policies by name. A new policy is one module here that subclasses Policy."""
from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable

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


__all__ = ["DEFAULT_POLICY", "Key", "Policy", "policy_factory", "policy_names"]
