"""Deterministic telemetry written through the real Store, for the page tests and the benchmark.

Every value is a plain function of the sample index, so a test can compute what a page must show
(e.g. the latest tokens/s) instead of hard-coding it. `memory` names the state the memory signals
show, one of store.diagnosis's verdicts (MEMORY holds each state's levels); `smart=False` leaves
the NVMe series out and has the collector's "cannot read" event say why, as on a virtio disk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from store.db import Store

GIB = 1 << 30
DEVICE = "vda"
CONTROLLER = "nvme0"
N_LAYERS, N_EXPERTS = 4, 8
MEM_TOTAL = 8 * GIB
CACHE_CAP = 4 * GIB
CAP_MIN = 512 * 2**20
CAP_MAX = int(0.7 * MEM_TOTAL)
CGROUP_LIMIT = 6 * GIB
PREFETCHES = 4            # per layer and sample, 1 of them used: prefetch accuracy 25%
SMART_REASON = "no NVMe controller on this machine (the disk is virtio)"


@dataclass(frozen=True)
class Spec:
    start: float              # Unix time of the first sample
    seconds: int              # how long the data spans
    step: float = 1.0         # seconds between samples
    memory: str = "healthy"   # a key of MEMORY
    smart: bool = True
    requests_every: int = 10  # one finished request every this many samples


def tokens_per_s(i: int) -> float:
    return 20.0 + 5.0 * math.sin(i / 60.0)


def hit_rate(i: int) -> float:
    return 0.6 + 0.2 * math.sin(i / 300.0)


def latency_s(k: int) -> float:
    """Latency of the k-th request: mostly 0.5-1.4 s, every 20th a 3 s tail."""
    return 3.0 if k % 20 == 19 else 0.5 + (k % 10) / 10


CALM = {"mem.agent.majflt_per_s": 2.0, "cgroup.agent.pgmajfault_per_s": 2.0,
        "cgroup.agent.workingset_refault_file_per_s": 10.0, "cgroup.agent.workingset_refault_anon_per_s": 0.0,
        "vm.pgmajfault_per_s": 3.0, "vm.workingset_refault_file_per_s": 10.0, "vm.workingset_refault_anon_per_s": 0.0,
        "psi.memory.some_avg10": 0.5, "psi.memory.full_avg10": 0.0, "agent.reread_rate": 0.2,
        "mem.available_bytes": 3 * GIB}
MEMORY = {        # the memory signals of each state: the calm levels, with the trouble's own signals over
    "healthy": CALM,
    "agent thrashing": CALM | {"mem.agent.majflt_per_s": 400.0, "cgroup.agent.pgmajfault_per_s": 450.0,
                               "cgroup.agent.workingset_refault_file_per_s": 5000.0, "vm.pgmajfault_per_s": 500.0,
                               "vm.workingset_refault_file_per_s": 5000.0, "psi.memory.some_avg10": 40.0,
                               "psi.memory.full_avg10": 15.0, "mem.available_bytes": 0.5 * GIB},
    "pressure from another process": CALM | {"vm.pgmajfault_per_s": 900.0, "vm.workingset_refault_file_per_s": 50_000.0,
                                             "psi.memory.some_avg10": 25.0, "psi.memory.full_avg10": 3.0,
                                             "mem.available_bytes": 0.3 * GIB},
    "cache thrashing": CALM | {"agent.reread_rate": 0.8},
}


def series_at(i: int, memory: str, smart: bool) -> dict[str, float]:
    """Every series' value at sample i."""
    wave = math.sin(i / 30.0)
    values = {
        "agent.tokens_per_s": tokens_per_s(i), "agent.hit_rate": hit_rate(i),
        "agent.cache_cap_bytes": CACHE_CAP, "agent.cache_bytes": CACHE_CAP * 0.9,
        "agent.cache_cap_min_bytes": CAP_MIN, "agent.cache_cap_max_bytes": CAP_MAX,
        f"block.{DEVICE}.read_bytes_per_s": 200e6 + 50e6 * wave, f"block.{DEVICE}.write_bytes_per_s": 1e6,
        f"block.{DEVICE}.reads_per_s": 800 + 200 * wave, f"block.{DEVICE}.writes_per_s": 10.0,
        f"block.{DEVICE}.util": 0.5 + 0.3 * wave, f"block.{DEVICE}.r_await_s": 0.0004,
        f"block.{DEVICE}.w_await_s": 0.001, f"block.{DEVICE}.queue_depth": 2 + wave,
        "mem.total_bytes": MEM_TOTAL, "mem.agent.rss_bytes": CACHE_CAP + GIB,
        "mem.agent.hwm_bytes": CACHE_CAP + 1.5 * GIB, "mem.agent.rss_file_bytes": 0.3 * GIB,
        "cgroup.agent.usage_bytes": CACHE_CAP + 1.2 * GIB, "cgroup.agent.limit_bytes": CGROUP_LIMIT,
        **MEMORY[memory],
    }
    if smart:
        values |= {f"nvme.{CONTROLLER}.temperature_c": 41.0, f"nvme.{CONTROLLER}.percentage_used": 3.0,
                   f"nvme.{CONTROLLER}.data_read_bytes": 12_345 * 512_000.0 + i,
                   f"nvme.{CONTROLLER}.data_written_bytes": 6_789 * 512_000.0,
                   f"nvme.{CONTROLLER}.media_errors": 0.0, f"nvme.{CONTROLLER}.critical_warning": 0.0}
    return values


def write(path: str, spec: Spec) -> None:
    """Fill the store at `path` with `spec.seconds` of telemetry through the real writer."""
    store = Store(path, autoflush_s=0, max_held_points=10**7)
    try:
        n = int(spec.seconds / spec.step)
        for i in range(n):
            t = spec.start + i * spec.step
            for name, value in series_at(i, spec.memory, spec.smart).items():
                store.append(name, t, value)
            _rows(store, i, t, spec)
            if i % 3600 == 3599:
                store.flush()
        _records(store, spec)
        if not store.flush():
            raise RuntimeError(f"could not write synthetic telemetry to {path}")
    finally:
        store.close()


def _rows(store: Store, i: int, t: float, spec: Spec) -> None:
    if i % spec.requests_every == 0:
        k = i // spec.requests_every
        store.record_request(t, f"req-{k}", 0.1, 0.05, latency_s(k), 12, 16, 48, 16, 16 * 2**20)
    for layer in range(N_LAYERS):
        store.record_cache_stats(t, layer, hits=10 + layer, misses=10 - layer, evictions=layer,
                                 prefetch_hits=1, bytes_read=(10 - layer) * 2**20, read_latency_s=0.0005,
                                 prefetches=PREFETCHES)
    store.record_activations(t, {(layer, (layer + i) % N_EXPERTS): 1 for layer in range(N_LAYERS)})


def _records(store: Store, spec: Spec) -> None:
    end = spec.start + spec.seconds
    store.record_knob_change(spec.start, "cache_cap_bytes", 2 * GIB, CACHE_CAP, "dashboard")
    store.record_knob_change(spec.start + 1, "policy", "lru", "flashmoe", "api")
    for policy, rate in (("lru", 0.55), ("lfu", 0.58), ("flashmoe", 0.71), ("belady", 0.8)):
        store.record_simulation(end, "olmoe-report", policy, 0.25, "layer", rate)
    for cap, tps in ((GIB, 8.0), (2 * GIB, 15.0), (4 * GIB, 21.0)):
        store.record_sweep(end, cap, tps, 0.3 + cap / (8 * GIB))
    if not spec.smart:
        store.record_event(spec.start, "collector.source_unavailable", f"cannot read NVMe SMART: {SMART_REASON}")
