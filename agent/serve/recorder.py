"""Writes the agent's one-second ticks and finished requests to the store, and reads back its knobs."""
from __future__ import annotations

import logging
from typing import Any

from agent.serve.metrics import Tick
from agent.serve.scheduler import RequestStats

log = logging.getLogger(__name__)


class Recorder:
    """The store side of Metrics: the same Tick that fed /metrics becomes rows and series points."""

    def __init__(self, store) -> None:
        self.store = store
        store.declare("agent.batch_limit", "requests", "gauge", 1.0, "dynamic batch limit (follows SSD utilisation)")

    def write(self, tick: Tick, requests: list[RequestStats]) -> None:
        s, t = self.store, tick.t
        for d in tick.layers:
            if d.hits or d.misses or d.evictions or d.bytes_read or d.prefetches:
                s.record_cache_stats(t, d.layer, d.hits, d.misses, d.evictions, d.prefetch_hits, d.bytes_read,
                                     d.read_latency_s, prefetches=d.prefetches)
        if tick.activations:
            s.record_activations(t, tick.activations)
        for r in requests:
            s.record_request(r.submitted + r.latency_s, r.request_id, r.ttft_s, r.tpot_s, r.latency_s,
                             r.prompt_tokens, r.completion_tokens, round(r.hits), round(r.misses),
                             round(r.bytes_read))
        for name, value in self.series(tick).items():
            s.append(name, t, value)
        s.flush()

    @staticmethod
    def series(tick: Tick) -> dict[str, float]:
        out = {"agent.tokens_per_s": tick.tokens_per_s, "agent.batch_size": tick.batch_size,
               "agent.batch_limit": tick.batch_limit,
               "agent.queue_depth": tick.queue_depth, "agent.cache_bytes": tick.cache_bytes,
               "agent.cache_cap_bytes": tick.cap_bytes,
               "agent.read_bytes_per_s": tick.bytes_read / tick.interval_s if tick.interval_s > 0 else 0.0}
        if tick.hit_rate is not None:
            out["agent.hit_rate"] = tick.hit_rate
        if tick.read_latencies:
            out["agent.read_latency_s"] = sum(tick.read_latencies) / len(tick.read_latencies)
        return out

    def knob_change(self, t: float, knob: str, old: Any, new: Any, source: str) -> None:
        self.store.record_knob_change(t, knob, old, new, source)  # written through, kept as JSON

    def event(self, t: float, kind: str, message: str) -> None:
        self.store.record_event(t, kind, message)  # written through

