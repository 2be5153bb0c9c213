"""Writes the agent's one-second ticks and finished requests to the store, and reads back its knobs."""
from __future__ import annotations

import logging
from typing import Any

from agent.serve.metrics import Tick
from agent.serve.scheduler import RequestStats
from store.schema import fields_of, series_of

log = logging.getLogger(__name__)


class Recorder:
    """The store side of Metrics: the same Tick that fed /metrics becomes rows and series points
    (the agent.* series of store.schema's catalogue, each an attribute of the Tick)."""

    def __init__(self, store) -> None:
        self.store = store

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
        """The tick's series points (None, e.g. no hit rate in an idle second, is not written)."""
        return series_of("tick", {name: getattr(tick, name) for name in fields_of("tick")})

    def knob_change(self, t: float, knob: str, old: Any, new: Any, source: str) -> None:
        self.store.record_knob_change(t, knob, old, new, source)  # written through, kept as JSON

    def event(self, t: float, kind: str, message: str) -> None:
        self.store.record_event(t, kind, message)  # written through

