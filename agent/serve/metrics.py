"""The agent's instruments: measured once, exported twice.

Every second `Metrics.tick` turns the cumulative counters of the cache and the scheduler into one
`Tick` of per-interval deltas; the same Tick increments the Prometheus instruments (`/metrics`)
and is what the recorder writes to the store, so the two outputs cannot disagree. Finished
requests go through `Metrics.request` the same way. Registry passed in: tests use a fresh one.
/metrics shows the registry through `DeviceLabelled`, which names the device on every sample.
"""
from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from agent.experts.cache import READ_LATENCY_BOUNDS, CacheStats
from agent.residency import LayerStats
from agent.serve.scheduler import UNSERVED, RequestStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8)
RECENT_TICKS = 30  # window of "recent" hit rate: the last 30 one-second ticks
DEVICE_LABEL = "device_name"  # not "device": node_exporter and smartctl_exporter use that for a disk


@dataclass(frozen=True)
class LayerDelta:
    layer: int
    hits: int
    misses: int
    evictions: int
    prefetch_hits: int
    prefetches: int           # blocks prefetch brought in
    bytes_read: int           # this layer's share of the interval's bytes, by its block reads
    read_latency_s: float | None  # mean of the interval's reads (all layers: the cache keeps one series)
    rereads: int = 0          # misses on blocks the cache held and evicted (agent.residency.LayerStats.rereads)


@dataclass(frozen=True)
class Tick:
    t: float
    interval_s: float
    layers: list[LayerDelta]
    bytes_read: int
    reads: int                # expert block reads completed in the interval
    read_s: float             # their latencies, summed
    batch_size: int
    batch_limit: int
    queue_depth: int
    tokens: int
    cache_bytes: int
    cap_bytes: int
    activations: dict[tuple[int, int], int]
    cap_min_bytes: int | None = None   # the cap's bounds now (they follow the memory limit)
    cap_max_bytes: int | None = None
    phase_s: dict[str, float] = field(default_factory=dict)  # seconds of the interval's steps by phase (model, cache)
    unserved: dict[str, int] = field(default_factory=dict)   # requests that ended unanswered, by reason (UNSERVED)

    @property
    def requests_failed(self) -> int:
        return self.unserved.get("failed", 0)

    @property
    def requests_refused(self) -> int:
        return self.unserved.get("refused", 0)

    @property
    def requests_abandoned(self) -> int:
        return self.unserved.get("abandoned", 0)

    @property
    def token_ms(self) -> dict[str, float]:
        """ms of a generated token spent in each phase (token_ms_<phase>); empty in an idle second."""
        return {f"token_ms_{p}": 1000 * s / self.tokens for p, s in self.phase_s.items()} if self.tokens else {}

    def __getattr__(self, name: str) -> float | None:
        """token_ms_<phase> as an attribute, as the catalogue's tick fields are (None in an idle second)."""
        if name.startswith("token_ms_"):
            return self.token_ms.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def hits(self) -> int:
        return sum(d.hits for d in self.layers)

    @property
    def misses(self) -> int:
        return sum(d.misses for d in self.layers)

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    @property
    def reread_rate(self) -> float | None:
        """Share of the interval's lookups that missed on a block the cache held and evicted (None without
        lookups). Of lookups, not of misses: at a hit rate of 0.95 nearly every miss is a re-read, and one
        miss in twenty is no thrash; first reads (a cold start) are not re-reads."""
        lookups = self.hits + self.misses
        return sum(d.rereads for d in self.layers) / lookups if lookups else None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.interval_s if self.interval_s > 0 else 0.0

    @property
    def read_bytes_per_s(self) -> float:
        return self.bytes_read / self.interval_s if self.interval_s > 0 else 0.0

    @property
    def read_latency_s(self) -> float | None:
        """Mean of the interval's expert reads."""
        return self.read_s / self.reads if self.reads else None


@dataclass
class _Previous:
    t: float
    layers: list[LayerStats]
    bytes_read: int = 0
    reads: int = 0
    read_s: float = 0.0
    tokens: int = 0
    phases: Mapping[str, float] = field(default_factory=dict)
    unserved: Mapping[str, int] = field(default_factory=dict)


class Metrics:
    def __init__(self, registry: CollectorRegistry, n_layers: int) -> None:
        self.registry = registry
        layer = ["layer"]
        self.hits = Counter("flashmoe_expert_cache_hits", "expert cache hits", layer, registry=registry)
        self.misses = Counter("flashmoe_expert_cache_misses", "expert cache misses", layer, registry=registry)
        self.evictions = Counter("flashmoe_expert_cache_evictions", "experts evicted", layer, registry=registry)
        self.prefetch_hits = Counter("flashmoe_expert_cache_prefetch_hits",
                                     "demand hits on experts that prefetch brought in", layer, registry=registry)
        self.prefetches = Counter("flashmoe_expert_cache_prefetches", "experts that lookahead prefetch brought in",
                                  layer, registry=registry)
        self.rereads = Counter("flashmoe_expert_cache_rereads", "misses on experts the cache held and "
                               "evicted (not first reads)", layer, registry=registry)
        self.bytes_read = Counter("flashmoe_expert_read_bytes", "expert bytes read from the SSD", registry=registry)
        self.read_latency = ReadLatency(registry)
        self.ttft = Histogram("flashmoe_request_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.tpot = Histogram("flashmoe_request_tpot_seconds", "mean time per output token after the first",
                              buckets=TOKEN_BUCKETS, registry=registry)
        self.latency = Histogram("flashmoe_request_latency_seconds", "request latency, arrival to last token",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = Counter("flashmoe_requests", "answered requests (those that ended without an answer: "
                                "flashmoe_requests_unserved)", registry=registry)
        self.unserved = Counter("flashmoe_requests_unserved", "requests that ended without an answer: failed (an "
                                "error in their step, answered 500), refused (the queue full, 429; the agent "
                                "stopping, 503) or abandoned (the client went away first)", ["reason"],
                                registry=registry)
        self.tokens = Counter("flashmoe_generated_tokens", "generated tokens", registry=registry)
        self.batch_size = Gauge("flashmoe_batch_size", "requests in the running batch", registry=registry)
        self.batch_limit = Gauge("flashmoe_batch_limit", "most requests stepped together (the knob max_batch_size)",
                                 registry=registry)
        self.queue_depth = Gauge("flashmoe_queue_depth", "requests waiting to join the batch", registry=registry)
        self.cache_bytes = Gauge("flashmoe_cache_bytes", "bytes of experts resident in the cache", registry=registry)
        self.cap_bytes = Gauge("flashmoe_cache_cap_bytes", "expert cache cap", registry=registry)
        self.cap_min_bytes = Gauge("flashmoe_cache_cap_min_bytes", "smallest cache cap the agent accepts now",
                                   registry=registry)
        self.cap_max_bytes = Gauge("flashmoe_cache_cap_max_bytes", "largest cache cap the agent accepts now (70% "
                                   "of its memory limit)", registry=registry)
        self.hit_ratio = Gauge("flashmoe_expert_cache_hit_ratio",
                               f"expert cache hit ratio over the last {RECENT_TICKS} s", registry=registry)
        self.prefetch_issuing = Gauge("flashmoe_prefetch_issuing", "1 while lookahead prefetch reads are issued, "
                                      "0 while adaptive prefetch holds them back (or prefetch is off)",
                                      registry=registry)
        self.prefetch_guess_accuracy = Gauge("flashmoe_prefetch_guess_accuracy", "share of the lookahead's recent "
                                             "guessed reads its layer then used, issued or not: what adaptive "
                                             "prefetch judges", registry=registry)
        self.prefetch_break_even = Gauge("flashmoe_prefetch_break_even", "the guess accuracy above which adaptive "
                                         "prefetch judges its reads to pay", registry=registry)
        self.knob_changes = Counter("flashmoe_knob_changes", "knob values changed, by any source",
                                    registry=registry)
        self.phase_seconds = Counter("flashmoe_step_phase_seconds", "time the model's steps spent in each phase "
                                     "(attention, router, route, wait, experts, head; the cache's crc, policy)",
                                     ["phase"], registry=registry)
        for reason in UNSERVED:
            self.unserved.labels(reason=reason)
        for i in range(n_layers):  # export every layer from the start, so rate() has a zero to start from
            for counter in (self.hits, self.misses, self.evictions, self.prefetch_hits, self.prefetches, self.rereads):
                counter.labels(layer=str(i))
        self._prev: _Previous | None = None
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=RECENT_TICKS)
        self._pending: list[RequestStats] = []
        self._lock = threading.Lock()

    # -- requests -------------------------------------------------------------------------------
    def request(self, r: RequestStats) -> None:
        """A request finished (called on the scheduler thread); the recorder drains the rows."""
        self.ttft.observe(r.ttft_s)
        self.latency.observe(r.latency_s)
        if r.completion_tokens > 1:
            self.tpot.observe(r.tpot_s)
        self.requests.inc()
        with self._lock:
            self._pending.append(r)

    def drain_requests(self) -> list[RequestStats]:
        with self._lock:
            rows, self._pending = self._pending, []
        return rows

    # -- the one-second tick --------------------------------------------------------------------------
    def tick(self, t: float, cache: CacheStats, batch_size: int, queue_depth: int, batch_limit: int,
             tokens_total: int, activations: dict[tuple[int, int], int],
             cap_bounds: tuple[int, int] | None = None, profile: Mapping[str, float] | None = None,
             unserved: Mapping[str, int] | None = None) -> Tick:
        """`profile`: the model's cumulative seconds by phase (agent/model/profile.py), if it keeps one;
        `unserved`: the scheduler's cumulative count of requests that ended unanswered, by reason."""
        prev = self._prev or _Previous(t, [LayerStats() for _ in cache.layers])
        new_reads, read_s = cache.reads - prev.reads, cache.read_s - prev.read_s
        mean_latency = read_s / new_reads if new_reads > 0 else None
        bytes_read = cache.bytes_read - prev.bytes_read
        loads = [(c.misses - p.misses) + (c.prefetches - p.prefetches) for c, p in zip(cache.layers, prev.layers)]
        total_loads = sum(loads) or 1
        layers = [LayerDelta(i, c.hits - p.hits, c.misses - p.misses, c.evictions - p.evictions,
                             c.prefetch_hits - p.prefetch_hits, c.prefetches - p.prefetches,
                             bytes_read * n // total_loads, mean_latency, c.rereads - p.rereads)
                  for i, (c, p, n) in enumerate(zip(cache.layers, prev.layers, loads))]
        phases = {**(profile or {}), "crc": cache.crc_s, "policy": cache.policy_s}
        unserved = dict(unserved or {})
        tick = Tick(t, t - prev.t, layers, bytes_read, new_reads, read_s, batch_size, batch_limit, queue_depth,
                    tokens_total - prev.tokens, cache.resident * cache.slot_bytes, cache.cap_bytes, activations,
                    *(cap_bounds or (None, None)), {p: s - prev.phases.get(p, 0.0) for p, s in phases.items()},
                    {r: n - prev.unserved.get(r, 0) for r, n in unserved.items()})
        self._export(tick)
        self._export_prefetch(cache.prefetch)
        self.read_latency.latest = (cache.read_latency_counts, cache.read_s)
        self._prev = _Previous(t, cache.layers, cache.bytes_read, cache.reads, cache.read_s, tokens_total, phases,
                               unserved)
        return tick

    def _export(self, tick: Tick) -> None:
        for d in tick.layers:
            label = str(d.layer)
            self.hits.labels(layer=label).inc(d.hits)
            self.misses.labels(layer=label).inc(d.misses)
            self.evictions.labels(layer=label).inc(d.evictions)
            self.prefetch_hits.labels(layer=label).inc(d.prefetch_hits)
            self.prefetches.labels(layer=label).inc(d.prefetches)
            self.rereads.labels(layer=label).inc(d.rereads)
        self.bytes_read.inc(tick.bytes_read)
        for phase, seconds in tick.phase_s.items():
            self.phase_seconds.labels(phase=phase).inc(max(seconds, 0.0))
        self.tokens.inc(tick.tokens)
        for reason, n in tick.unserved.items():
            self.unserved.labels(reason=reason).inc(n)
        self.batch_size.set(tick.batch_size)
        self.batch_limit.set(tick.batch_limit)
        self.queue_depth.set(tick.queue_depth)
        self.cache_bytes.set(tick.cache_bytes)
        self.cap_bytes.set(tick.cap_bytes)
        if tick.cap_max_bytes is not None:
            self.cap_min_bytes.set(tick.cap_min_bytes)
            self.cap_max_bytes.set(tick.cap_max_bytes)
        self._recent.append((tick.hits, tick.misses))
        rate = self.recent_hit_rate()
        if rate is not None:
            self.hit_ratio.set(rate)

    def _export_prefetch(self, gate: Mapping) -> None:
        """The adaptive prefetch's state (PrefetchGate.state)."""
        if not gate:
            return
        self.prefetch_issuing.set(int(gate["issuing"]))
        self.prefetch_break_even.set(gate["break_even"])
        if gate["accuracy"] is not None:
            self.prefetch_guess_accuracy.set(gate["accuracy"])

    def recent_hit_rate(self) -> float | None:
        hits = sum(h for h, _ in self._recent)
        total = hits + sum(m for _, m in self._recent)
        return hits / total if total else None


class ReadLatency:
    """flashmoe_expert_read_latency_seconds, a histogram of the cache's own cumulative counts by bucket
    (agent/experts/cache.py): exact however many reads come between two ticks, where observing a bounded
    sample of the latest ones lost the rest."""
    NAME, HELP = "flashmoe_expert_read_latency_seconds", "latency of one expert block read"

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latest: tuple[list[int], float] = ([0] * (len(READ_LATENCY_BOUNDS) + 1), 0.0)  # counts, sum of s
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.NAME, self.HELP)

    def collect(self) -> Iterator[Metric]:
        counts, sum_s = self.latest     # one assignment: a scrape sees the counts and the sum of one tick
        bounds = [floatToGoString(b) for b in READ_LATENCY_BOUNDS] + ["+Inf"]
        yield HistogramMetricFamily(self.NAME, self.HELP, buckets=list(zip(bounds, itertools.accumulate(counts))),
                                    sum_value=sum_s)


class DeviceLabelled:
    """`registry` as a fleet's Prometheus sees it: every sample carries device_name=NAME, and
    flashmoe_agent_info{device_name=NAME} 1 says which device answers at this address even while
    the agent has nothing else to report. Pass it to generate_latest in place of the registry."""

    def __init__(self, registry: CollectorRegistry, device_name: str) -> None:
        self.registry, self.device_name = registry, device_name

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("flashmoe_agent_info", "the FlashMoE agent of this device", labels=[DEVICE_LABEL])
        info.add_metric([self.device_name], 1)
        yield info
        for family in self.registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={DEVICE_LABEL: self.device_name, **s.labels}) for s in family.samples]
            yield labelled
