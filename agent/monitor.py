"""The monitoring samples the agent acts on: what the cache's policy sees (expert read latency,
memory pressure, SSD utilisation) and what the memory guard decides on.

One sampler, one fallback order. Signals of this process come from the process itself: read
latency from the cache's own expert reads (the cache reports each one), major faults from
/proc/self/stat. Signals of the machine come from the first of these sources that can be read:
  1. the agent's own reading (machine/: /proc/pressure/memory, /sys/block/<disk>/stat),
  2. the collector's series in the telemetry store, if it has a point from the last FRESH_S,
  3. the cache's own estimate, where there is one (SSD utilisation: the share of the interval
     spent in expert reads, which counts only this agent's reads).
A source that can be read but has no value yet (a rate before its second reading) ends the
search: the sample then says None, and which source it waits for.
"""
from __future__ import annotations

import functools
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from machine.block import BlockStat, block_rates, read_stat
from machine.memory import Faults, available_share, parse_kib_table, parse_proc_stat
from machine.pressure import read_psi
from machine.sources import SourceUnavailable

log = logging.getLogger(__name__)

FRESH_S = 3.0           # a collector point older than this is not the current state
LATENCY_READS = 64      # the read latency is the mean of this many most recent expert reads
INF = float("inf")
UNREADABLE = (OSError, ValueError, KeyError, SourceUnavailable)


@dataclass(frozen=True)
class SystemSample:
    """One reading of every signal; None where no source has a value."""
    t: float = 0.0                          # monotonic time of the reading
    read_latency_s: float | None = None     # mean of the cache's recent expert reads
    mem_pressure: float | None = None       # 0..1: share of the last 10 s some task stalled on memory
    ssd_util: float | None = None           # 0..1: share of time the disk had I/O in flight
    psi_full_avg10: float | None = None     # percent of the last 10 s every task stalled on memory
    major_faults_per_s: float | None = None  # of this process, since the previous reading
    mem_available_share: float | None = None  # 0..1: MemAvailable over MemTotal, the machine's
    sources: dict[str, str] = field(default_factory=dict)  # signal -> where its value came from

    def policy_inputs(self) -> dict[str, float]:
        """What the replacement policy is fed (agent.policies.base.Policy.system)."""
        values = {"read_latency_s": self.read_latency_s, "mem_pressure": self.mem_pressure,
                  "ssd_util": self.ssd_util}
        return {k: v for k, v in values.items() if v is not None}


Candidate = tuple[str, Callable[[], float | None]]   # (source, its reading)


class SystemSampler:
    """Reads every signal at most as often as asked, from one fallback order (module docstring).
    Thread-safe: the cache reports reads from its I/O threads and asks on the decode thread, the
    service's ticker asks every second."""

    def __init__(self, disk: str | None = None, telemetry: Path | None = None,
                 psi_root: Path = Path("/proc/pressure"), stat_path: Path = Path("/proc/self/stat"),
                 sys_block: Path = Path("/sys/block"), meminfo: Path = Path("/proc/meminfo")) -> None:
        self.disk, self.telemetry = disk, telemetry        # the disk holding the experts; the store file
        self.psi_root, self.stat_path, self.sys_block, self.meminfo = psi_root, stat_path, sys_block, meminfo
        self.last = SystemSample(t=-INF)
        self._lock = threading.Lock()                       # one reading at a time
        self._reads_lock = threading.Lock()
        self._latencies: deque[float] = deque(maxlen=LATENCY_READS)
        self._read_time = 0.0                               # seconds in expert reads since the last reading
        self._faults: Faults | None = None
        self._block: BlockStat | None = None

    @classmethod
    def for_experts(cls, store_dir: Path, telemetry: Path | None = None) -> SystemSampler:
        """A sampler for the disk that holds the expert store (none if it is on tmpfs, overlay...)."""
        disk = disk_holding(store_dir)
        log.info("SSD utilisation of %s from %s", store_dir,
                 f"block device {disk}" if disk else "the cache's read-busy time (no block device)")
        return cls(disk, telemetry)

    def read_done(self, seconds: float) -> None:
        """The cache finished an expert read that took `seconds`."""
        with self._reads_lock:
            self._latencies.append(seconds)
            self._read_time += seconds

    def sample(self, max_age_s: float = 0.0) -> SystemSample:
        """A new reading, or the last one if it is younger than `max_age_s`. A caller that accepts an
        older one (max_age_s > 0: the cache, on the decode path) never waits for another thread's
        reading either; it takes the last."""
        if time.monotonic() - self.last.t < max_age_s or not self._lock.acquire(blocking=max_age_s == 0):
            return self.last
        try:
            self.last = self._read()
            return self.last
        finally:
            self._lock.release()

    def _read(self) -> SystemSample:
        now = time.monotonic()
        dt = now - self.last.t
        with self._reads_lock:
            latencies, read_time, self._read_time = list(self._latencies), self._read_time, 0.0
        psi = functools.cache(lambda: read_psi("memory", self.psi_root))  # one read serves both signals
        disk: list[Candidate] = [] if self.disk is None else [
            (f"/sys/block/{self.disk}/stat", lambda: self._own_util(now)),
            (f"collector block.{self.disk}.util", lambda: self._collected(f"block.{self.disk}.util"))]
        signals = {
            "mem_pressure": [("/proc/pressure/memory", lambda: psi()["some"]["avg10"] / 100),
                             ("collector psi.memory.some_avg10",
                              lambda: self._collected("psi.memory.some_avg10") / 100)],
            "psi_full_avg10": [("/proc/pressure/memory", lambda: psi()["full"]["avg10"]),
                               ("collector psi.memory.full_avg10", lambda: self._collected("psi.memory.full_avg10"))],
            "ssd_util": disk + [("expert cache read-busy time",
                                 lambda: min(1.0, read_time / dt) if dt < INF else None)],
            "major_faults_per_s": [(str(self.stat_path), lambda: self._fault_rate(now))],
            "mem_available_share": [(str(self.meminfo),
                                     lambda: available_share(parse_kib_table(self.meminfo.read_text())))],
        }
        values, sources = {}, {}
        for signal, candidates in signals.items():
            values[signal], sources[signal] = _first(candidates)
        latency = sum(latencies) / len(latencies) if latencies else None
        return SystemSample(t=now, read_latency_s=latency, sources=sources, **values)

    def _own_util(self, now: float) -> float | None:
        current = read_stat(self.disk, now, self.sys_block)
        previous, self._block = self._block, current
        return block_rates(previous, current).util if previous is not None and current.t > previous.t else None

    def _fault_rate(self, now: float) -> float | None:
        current = parse_proc_stat(self.stat_path.read_text(), now)
        previous, self._faults = self._faults, current
        if previous is None or current.t <= previous.t:
            return None
        return max(0, current.majflt - previous.majflt) / (current.t - previous.t)

    def _collected(self, name: str) -> float:
        """The collector's latest point of a series, if it is fresh."""
        if self.telemetry is None:
            raise SourceUnavailable("no telemetry store")
        from store.errors import StoreError
        from store.queries import latest
        try:
            point = latest(self.telemetry, name)
        except (StoreError, sqlite3.Error) as e:
            raise SourceUnavailable(str(e)) from None
        if point is None or time.time() - point[0] > FRESH_S:
            raise SourceUnavailable(f"no point of {name} in the last {FRESH_S:g} s")
        return point[1]


def _first(candidates: list[Candidate]) -> tuple[float | None, str]:
    """The value of the first candidate that can be read (None if it has no value yet), and its source."""
    for source, reading in candidates:
        try:
            return reading(), source
        except UNREADABLE:
            continue
    return None, "none"


def disk_holding(path: Path) -> str | None:
    """The whole-disk name (e.g. "vda", "nvme0n1") holding `path`, or None if it is on no block device."""
    import pyudev

    from machine import devices
    try:
        return devices.disk_holding(path, pyudev.Context()).name
    except (ValueError, OSError):
        return None
