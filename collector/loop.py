"""`flashmoe-cli collect`: sample the SSD, block devices, memory and pressure into the store, and
with --listen export them to Prometheus (collector.export).

Each tick (default 1 s) every sampler is read; a sampler whose source is missing (no NVMe, no
PSI, agent not running, no permission) is reported once per change, as a log line and a store
event, and the others go on. Ticks are stamped with their scheduled wall-clock time (a drift-free
grid), so the codec's time deltas-of-deltas are zero. A tick the loop was too late for (e.g. its
flush waited seconds for a disk that serves a memory thrash's refaults) is not taken: each is
counted in `collector.missed_samples` at the next tick and logged, and the dashboard says how many
samples its range lacks. SIGTERM, SIGINT or SIGHUP (its terminal closed; not under nohup): flush and exit 0.
"""
from __future__ import annotations

import argparse
import fcntl
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import pyudev
from prometheus_client import CollectorRegistry

from collector.export import MachineExport, serve_metrics
from collector.samplers import (AgentSampler, BlockSampler, CgroupSampler, DiskReadersSampler, NvmeSampler,
                                PressureSampler, Sampler, SelfSampler, SystemMemorySampler)
from collector.series import loop_series
from collector.status import SourceStatus
from machine import pressure
from machine.devices import BlockDevice, HotplugWatcher, NvmeController, block_devices, disk_holding, nvme_controllers
from machine.identity import add_device_name
from machine.sources import SourceUnavailable
from machine.stop_signals import stop_signals
from store.cli import positive
from store.db import Store
from store.errors import StoreError
from store.schema import DEFAULT_RETENTION_DAYS

log = logging.getLogger(__name__)
COMPACT_EVERY_S = 3600.0
MIN_INTERVAL_S = 0.01   # 1e-300 overflowed the tick grid (ceil(now / interval)) into a traceback


@dataclass
class Collector:
    """The samplers, the devices they cover, and the store they write to."""
    store: Store
    pid_file: Path | None = None
    store_path: Path | None = None
    context: pyudev.Context = field(default_factory=pyudev.Context)
    samplers: list[Sampler] = field(default_factory=list)
    disks: list[str] = field(default_factory=list, init=False)              # what discover() found: the
    controllers: list[NvmeController] = field(default_factory=list, init=False)  # export reads them at scrape
    hotplug: HotplugWatcher | None = None

    def __post_init__(self) -> None:
        self.status = SourceStatus(self._event)
        self.readers = DiskReadersSampler(self.pid_file)
        self.fixed = [SystemMemorySampler(), AgentSampler(self.pid_file), CgroupSampler(self.pid_file), self.readers,
                      *(PressureSampler(r) for r in pressure.RESOURCES), SelfSampler()]
        self.discover()
        try:
            self.hotplug = HotplugWatcher(self.context)
        except OSError as e:
            self.status.unavailable("device hot-plug (udev netlink monitor)", str(e))

    def _event(self, kind: str, message: str) -> None:
        self.store.record_event(time.time(), kind, message)

    def discover(self) -> None:
        """(Re)build the device samplers from what pyudev sees now, and say what was found."""
        disks = block_devices(self.context)
        controllers = nvme_controllers(self.context)
        held = self._expert_store_disk()
        if held is not None and held.name not in {d.name for d in disks}:
            disks.append(held)      # e.g. the store on a dm or loop device
        self.samplers = [*self.fixed, *(BlockSampler(d.name) for d in disks),
                         *(NvmeSampler(c, self.status) for c in controllers)]
        self.disks, self.controllers = [d.name for d in disks], controllers
        description = ", ".join(d.describe() for d in disks) or "none"
        log.info("block devices: %s; NVMe controllers: %s", description,
                 ", ".join(f"{c.name} ({c.model}, serial {c.serial})" for c in controllers) or "none")
        self._event("collector.devices", f"block devices: {description}; NVMe controllers: "
                    f"{', '.join(c.name for c in controllers) or 'none'}")
        if not controllers:
            self.status.unavailable("NVMe SMART / Health log and temperature",
                                    f"this machine has no NVMe controller (disks: {description}); "
                                    f"block statistics are still sampled")

    def _expert_store_disk(self) -> BlockDevice | None:
        if self.store_path is None:
            return None
        try:
            disk = disk_holding(self.store_path, self.context)
        except (OSError, ValueError) as e:
            self.status.unavailable(f"the disk holding the expert store {self.store_path}", str(e))
            return None
        self._event("collector.expert_store", f"expert store {self.store_path} is on {disk.describe()}")
        return disk

    def tick(self, t_wall: float, t_mono: float, missed: int = 0) -> int:
        """Sample everything once and hand the points to the store, with the count of ticks `missed`
        since the last one (ticks()); returns the point count."""
        if missed:
            log.warning("the collector was %d tick(s) late: their samples are lost (counted in "
                        "collector.missed_samples)", missed)
        n = 0
        for name, value in loop_series(missed).items():
            self.store.append(name, t_wall, value)
            n += 1
        for sampler in self.samplers:
            try:
                values = sampler.sample(t_mono)
            except (SourceUnavailable, OSError, ValueError) as e:
                self.status.unavailable(sampler.source, str(e))
                continue
            self.status.available(sampler.source)
            for name, value in values.items():
                self.store.append(name, t_wall, value)
            n += len(values)
        if self.readers.top:
            self.store.record_disk_readers(t_wall, self.readers.disk, self.readers.top)
        self.store.flush()
        self._poll_hotplug()
        return n

    def _poll_hotplug(self) -> None:
        if self.hotplug is None:
            return
        changes = self.hotplug.poll()
        for change in changes:
            log.info("hot-plug: %s %s %s", change.action, change.subsystem, change.name)
            self._event("device.hotplug", f"{change.action} {change.subsystem} device {change.name}")
        if changes:
            self.discover()


def ticks(interval: float, stop: threading.Event, duration: float | None):
    """Yield (scheduled wall time, monotonic time, ticks missed since the last one) on a drift-free
    grid of whole intervals, skipping (and counting) ticks the loop was too late for, until stop is
    set or duration has passed. The grid follows the monotonic clock; if the wall clock is stepped
    (NTP, suspend) by more than an interval, the grid is re-anchored to it (no tick is missed then)."""
    wall0, mono0 = time.time(), time.monotonic()
    end = None if duration is None else mono0 + duration
    k = math.ceil(wall0 / interval)
    missed = 0
    while not stop.is_set():
        t_wall = round(k * interval, 3)
        deadline = mono0 + (t_wall - wall0)
        if end is not None and deadline > end:
            return
        if stop.wait(max(0.0, deadline - time.monotonic())):
            return
        step = time.time() - (wall0 + time.monotonic() - mono0)
        if abs(step) > max(1.0, interval):
            log.warning("the wall clock moved by %+.1f s; re-anchoring the sampling grid", step)
            wall0, mono0 = time.time(), time.monotonic()
            k = math.ceil(wall0 / interval)
            missed = 0
            continue
        yield t_wall, time.monotonic(), missed
        due = math.ceil((wall0 + time.monotonic() - mono0) / interval)
        missed = max(0, due - (k + 1))
        k = max(k + 1, due)


def collect(collector: Collector, interval: float, stop: threading.Event, duration: float | None,
            retention_days: float = DEFAULT_RETENTION_DAYS) -> None:
    """The sampling loop, with compaction at start and every hour."""
    next_compaction = time.monotonic()
    for t_wall, t_mono, missed in ticks(interval, stop, duration):
        collector.tick(t_wall, t_mono, missed)
        if t_mono >= next_compaction:
            next_compaction = t_mono + COMPACT_EVERY_S
            try:
                collector.store.compact(retention_days)
            except StoreError as e:
                log.error("%s", e)


def open_store(path: Path, stop: threading.Event, device_name: str | None = None,
               retry_s: float = 1.0) -> Store | None:
    """Open the store, waiting while another process holds its write lock (a busy agent must not
    make the collector exit, which would stop the whole Procfile). None if stopped meanwhile."""
    logged = False
    while True:
        try:
            return Store(path, device_name=device_name)
        except StoreError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            if not logged:
                log.error("%s; retrying every %.0f s", e, retry_s)
                logged = True
        if stop.wait(retry_s):
            return None


def hold_sole_collector_lock(path: Path) -> int:
    """Take the store's collector lock (flock, which SQLite's fcntl locks do not touch) and return its
    descriptor: two collectors on one store write every series twice over. The kernel frees it when
    the process dies; close it only after the store, as closing any descriptor of the file drops
    this process's SQLite locks on it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreError(f"another collector is already writing {path}: one collector per store; stop it "
                         f"(`fuser {path}` lists the processes that have the file open) or give this one "
                         f"its own --db") from None
    return fd


def listen_address(text: str) -> tuple[str, int]:
    """--listen HOST:PORT (an IPv6 address in brackets); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if (not sep or not host or not port.isdigit() or int(port) > 65535 or "[" in host or "]" in host
            or ":" in host and not bracketed):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9600 or [::1]:9600)")
    return host, int(port)


def start_export(collector: Collector, device_name: str, pid_file: Path | None,
                 address: tuple[str, int]) -> WSGIServer:
    """Serve collector.export's families on http://HOST:PORT/metrics; returns the server (shutdown() stops it)."""
    registry = CollectorRegistry()
    registry.register(MachineExport(device_name, lambda: collector.disks, lambda: collector.controllers, pid_file))
    server = serve_metrics(registry, *address)
    log.info("exporting to Prometheus on http://%s:%d/metrics as device %s", address[0],
             server.server_address[1], device_name)
    return server


def interval(text: str) -> float:
    """--interval: a positive finite number of seconds, no shorter than MIN_INTERVAL_S."""
    seconds = positive(text)
    if seconds < MIN_INTERVAL_S:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_INTERVAL_S} s, not {text}: ticks are kept to the "
                                         f"millisecond, and a tick's reading of /proc and /sys takes longer")
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("example:\n  flashmoe-cli collect --db data/flashmoe.db --pid-file data/agent.pid "
                     "--store-path data/demo --duration 60\n"
                     "  flashmoe-cli collect --db data/flashmoe.db --device-name edge-01 --listen 0.0.0.0:9600")
    parser.add_argument("--db", required=True, type=Path, help="the store file (created if missing)")
    parser.add_argument("--interval", type=interval, default=1.0,
                        help=f"seconds between samples, at least {MIN_INTERVAL_S} (default 1)")
    parser.add_argument("--duration", type=positive, default=None, help="stop after this many seconds "
                        "(default: run until SIGTERM)")
    parser.add_argument("--pid-file", type=Path, default=None, help="the agent's pid file, for its memory")
    parser.add_argument("--store-path", type=Path, default=None,
                        help="the expert store: its disk is always sampled and named in an event")
    add_device_name(parser, "every series --listen exports")
    parser.add_argument("--listen", type=listen_address, default=None, metavar="HOST:PORT",
                        help="also export the readings to Prometheus at http://HOST:PORT/metrics (no control "
                             "calls there, so no token; node_exporter / smartctl_exporter names)")
    parser.add_argument("--retention-days", type=positive, default=DEFAULT_RETENTION_DAYS,
                        help="delete data older than this (default 7)")


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for signum in stop_signals():
        signal.signal(signum, lambda *_: stop.set())
    try:
        store = open_store(args.db, stop, args.device_name)
    except StoreError as e:
        log.error("%s", e)
        return 1
    if store is None:
        return 0
    try:
        lock = hold_sole_collector_lock(args.db)
    except StoreError as e:
        store.close()
        log.error("%s", e)
        return 1
    export = None
    try:
        collector = Collector(store, args.pid_file, args.store_path)
        if args.listen:
            try:
                export = start_export(collector, args.device_name, args.pid_file, args.listen)
            except OSError as e:
                log.error("cannot export on %s:%d: %s; pass another --listen", *args.listen, e.strerror)
                return 2
        log.info("collecting every %.3g s into %s", args.interval, args.db)
        collect(collector, args.interval, stop, args.duration, args.retention_days)
    finally:
        if export is not None:
            export.shutdown()
        ok = store.close()
        os.close(lock)
    log.info("collector stopped; store %s", "flushed" if ok else "NOT fully written (see errors above)")
    return 0 if ok else 1
