"""The cache-cap sweep the Cache page can start: tokens/s and hit rate at a few cache caps.

For each cap the sweep sets `cache_cap_bytes` through the knobs API, sends a few completions
through /v1/completions, and records (cap, tokens/s, hit rate) with `Store.record_sweep`. It runs
in a background thread so the page stays live, and always puts the original cap back.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dashboard.agent_client import Agent, AgentError
from store.units import human
from store.db import Store

log = logging.getLogger(__name__)

FRACTIONS = (0.125, 0.25, 0.5, 1.0)    # of all expert bytes: from thrashing to everything resident
PROMPT = "The expert cache decides the speed of a mixture-of-experts model because"


@dataclass(frozen=True)
class SweepPoint:
    cache_cap_bytes: int
    tokens_per_s: float
    hit_rate: float


def default_caps(expert_bytes: int, cap_min: int, cap_max: int,
                 fractions: Sequence[float] = FRACTIONS) -> list[int]:
    """Caps at `fractions` of all expert bytes, kept within the knob's bounds, without repeats."""
    return sorted({min(max(int(expert_bytes * f), cap_min), cap_max) for f in fractions})


def measure(agent: Agent, cap: int, n_requests: int, max_tokens: int) -> SweepPoint:
    """Set the cap, then time `n_requests` completions one after another."""
    answer = agent.put_knobs({"cache_cap_bytes": cap})
    if not answer.accepted:
        raise AgentError(f"the agent refused cache_cap_bytes={cap}: {answer.detail}")
    tokens = hits = misses = 0
    start = time.perf_counter()
    for _ in range(n_requests):
        reply = agent.complete(PROMPT, max_tokens)
        tokens += reply["usage"]["completion_tokens"]
        hits += reply["flashmoe"]["expert_hits"]
        misses += reply["flashmoe"]["expert_misses"]
    elapsed = time.perf_counter() - start
    return SweepPoint(cap, tokens / elapsed, hits / (hits + misses) if hits + misses else 0.0)


def run_sweep(agent: Agent, db: str, caps: Sequence[int], n_requests: int, max_tokens: int,
              progress: "SweepProgress") -> None:
    """Measure every cap, record each point as it comes, restore the original cap at the end."""
    original = agent.knobs()["cache_cap_bytes"]["value"]
    store = Store(db, autoflush_s=0)
    try:
        for cap in caps:
            progress.note(f"measuring at {human(cap, 'B')}")
            point = measure(agent, cap, n_requests, max_tokens)
            store.record_sweep(time.time(), point.cache_cap_bytes, point.tokens_per_s, point.hit_rate)
            progress.add(point)
    finally:
        store.close()
        agent.put_knobs({"cache_cap_bytes": original})


@dataclass
class SweepProgress:
    """What a running (or the last) sweep is doing; shared by the thread and the page."""
    total: int = 0
    points: list[SweepPoint] = field(default_factory=list)
    status: str = "idle"
    error: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note(self, status: str) -> None:
        with self._lock:
            self.status = status

    def add(self, point: SweepPoint) -> None:
        with self._lock:
            self.points.append(point)


class SweepRunner:
    """At most one sweep at a time per dashboard process (it changes the shared agent's cap)."""

    def __init__(self) -> None:
        self.progress = SweepProgress()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, agent: Agent, db: str, caps: Sequence[int], n_requests: int, max_tokens: int) -> bool:
        """Start a sweep in the background; False if one is already running."""
        if self.running:
            return False
        self.progress = SweepProgress(total=len(caps), status="starting")
        self._thread = threading.Thread(target=self._run, args=(agent, db, list(caps), n_requests, max_tokens),
                                        name="cache-cap-sweep", daemon=True)
        self._thread.start()
        return True

    def _run(self, agent: Agent, db: str, caps: list[int], n_requests: int, max_tokens: int) -> None:
        progress = self.progress
        try:
            run_sweep(agent, db, caps, n_requests, max_tokens, progress)
            progress.note(f"done: {len(progress.points)} caps measured, original cap restored")
        except Exception as err:   # the thread's only reporter is the page: keep the reason for it
            log.exception("cache-cap sweep failed")
            progress.error = f"{type(err).__name__}: {err}"
            progress.note("failed")

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
