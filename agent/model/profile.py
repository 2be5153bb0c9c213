"""Where a step's time goes, phase by phase, summed over the steps so far.

The model times its own phases on the thread that runs it: attention (with the norms before it),
the router (and the lookahead's guess), route (handing the step's experts to the provider: the
cache's bookkeeping and policy, and starting its reads), wait (blocked in get() until an expert's
read is done), experts (the expert matmuls) and head (embedding, final norm, LM head). The cache adds
what runs elsewhere: CRC checks on its I/O threads and its policy's share of route and get.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("attention", "router", "route", "wait", "experts", "head")


@dataclass
class Profile:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """Seconds per phase since a copy of `seconds` taken earlier."""
        return {k: v - before.get(k, 0.0) for k, v in self.seconds.items()}
