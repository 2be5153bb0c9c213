"""`flashmoe-cli collect --listen ADDR:PORT`: the machine's disks, SSD health, memory and pressure in
Prometheus form, every sample labelled device_name=NAME.

Read at scrape time with the machine/ readers, as node_exporter does: counters stay cumulative, so
rate() works over any window, and nothing is kept between scrapes. Names are node_exporter's
(node_disk_*, node_memory_*, node_vmstat_*, node_pressure_*) and smartctl_exporter's
(smartctl_device_*), so existing boards and rules read them; their own `device` label is the disk
or controller. Only the agent process has no counterpart: flashmoe_agent_*. A source that cannot be
read now (no PSI, no NVMe, agent not running) is left out of that scrape; the collector's log and
store events say why.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily, Metric,
                                            UnknownMetricFamily)
from prometheus_client.registry import Collector

from machine import memory, nvme, pressure
from machine.block import SECTOR, read_stat
from machine.devices import NvmeController
from machine.sources import SourceUnavailable

log = logging.getLogger(__name__)

DEVICE_LABEL = "device_name"
VMSTAT = ("pgfault", "pgmajfault", "pswpin", "pswpout", "oom_kill", "workingset_refault_anon",
          "workingset_refault_file")      # node_exporter's default vmstat fields, and the thrash signal
PSI_TOTALS = {"some": "waiting", "full": "stalled"}   # node_exporter's names for the two lines
SMART_GAUGES = {                          # smartctl_exporter name -> SmartLog field
    "smartctl_device_available_spare": "available_spare_pct",
    "smartctl_device_available_spare_threshold": "available_spare_threshold_pct",
    "smartctl_device_percentage_used": "percentage_used",
    "smartctl_device_critical_warning": "critical_warning",
}
SMART_COUNTERS = {                        # exported untyped under smartctl_exporter's names (no _total)
    "smartctl_device_media_errors": "media_errors",
    "smartctl_device_num_err_log_entries": "error_log_entries",
    "smartctl_device_bytes_read": "data_read_bytes",
    "smartctl_device_bytes_written": "data_written_bytes",
}


class MachineExport(Collector):
    """A prometheus_client collector of this machine's readings; register it in a fresh registry."""

    def __init__(self, device_name: str, disks: Callable[[], list[str]],
                 controllers: Callable[[], list[NvmeController]], pid_file: Path | None,
                 proc: Path = Path("/proc"), sys_block: Path = Path("/sys/block")) -> None:
        self.device_name, self.disks, self.controllers, self.pid_file = device_name, disks, controllers, pid_file
        self.proc, self.sys_block = proc, sys_block

    def collect(self) -> Iterator[Metric]:
        for part in (self._memory, self._vmstat, self._pressure, self._disks, self._smart, self._agent):
            try:
                yield from (family for family in part() if family.samples)
            except (SourceUnavailable, OSError, ValueError) as err:
                log.debug("export: %s left out of this scrape: %s", part.__name__.lstrip("_"), err)

    # -- each part yields whole families: one that fails half-way yields none ----------------------------
    def _memory(self) -> list[Metric]:
        meminfo = memory.parse_kib_table((self.proc / "meminfo").read_text())
        return [self._gauge(f"node_memory_{_meminfo_name(key)}_bytes", f"/proc/meminfo {key}", value)
                for key, value in meminfo.items()]

    def _vmstat(self) -> list[Metric]:
        vmstat = memory.parse_vmstat((self.proc / "vmstat").read_text())
        families = []
        for key in VMSTAT:
            if key in vmstat:
                family = UnknownMetricFamily(f"node_vmstat_{key}", f"/proc/vmstat {key}", labels=[DEVICE_LABEL])
                family.add_metric([self.device_name], vmstat[key])
                families.append(family)
        return families

    def _pressure(self) -> list[Metric]:
        families = []
        for resource in pressure.RESOURCES:
            psi = pressure.read_psi(resource, self.proc / "pressure")
            for line, word in PSI_TOTALS.items():
                if line in psi:
                    family = CounterMetricFamily(f"node_pressure_{resource}_{word}_seconds",
                                                 f"time {'some' if line == 'some' else 'all'} tasks were stalled "
                                                 f"on {resource} (/proc/pressure/{resource} {line} total)",
                                                 labels=[DEVICE_LABEL])
                    family.add_metric([self.device_name], psi[line]["total"] / 1e6)
                    families.append(family)
        return families

    def _disks(self) -> list[Metric]:
        labels = [DEVICE_LABEL, "device"]
        counters = {name: CounterMetricFamily(name, doc, labels=labels) for name, doc in (
            ("node_disk_reads_completed", "reads completed"), ("node_disk_writes_completed", "writes completed"),
            ("node_disk_read_bytes", "bytes read"), ("node_disk_written_bytes", "bytes written"),
            ("node_disk_read_time_seconds", "time spent reading"),
            ("node_disk_write_time_seconds", "time spent writing"),
            ("node_disk_io_time_seconds", "time with I/O in flight (utilisation = its rate)"),
            ("node_disk_io_time_weighted_seconds", "time in queue, weighted by requests in flight"))}
        in_flight = GaugeMetricFamily("node_disk_io_now", "requests in flight", labels=labels)
        for disk in self.disks():
            s = read_stat(disk, 0.0, self.sys_block)
            values = {"node_disk_reads_completed": s.reads, "node_disk_writes_completed": s.writes,
                      "node_disk_read_bytes": s.sectors_read * SECTOR,
                      "node_disk_written_bytes": s.sectors_written * SECTOR,
                      "node_disk_read_time_seconds": s.read_ms / 1000,
                      "node_disk_write_time_seconds": s.write_ms / 1000,
                      "node_disk_io_time_seconds": s.io_ticks_ms / 1000,
                      "node_disk_io_time_weighted_seconds": s.time_in_queue_ms / 1000}
            for name, value in values.items():
                counters[name].add_metric([self.device_name, disk], value)
            in_flight.add_metric([self.device_name, disk], s.in_flight)
        return [*counters.values(), in_flight]

    def _smart(self) -> list[Metric]:
        labels = [DEVICE_LABEL, "device"]
        gauges = {name: GaugeMetricFamily(name, f"NVMe SMART log {field}", labels=labels)
                  for name, field in SMART_GAUGES.items()}
        counters = {name: UnknownMetricFamily(name, f"NVMe SMART log {field} (cumulative)", labels=labels)
                    for name, field in SMART_COUNTERS.items()}
        temperature = GaugeMetricFamily("smartctl_device_temperature", "composite temperature (degrees Celsius)",
                                        labels=[*labels, "temperature_type"])
        for controller in self.controllers():
            try:
                smart = nvme.read_smart_log(controller.devnode)
            except (SourceUnavailable, OSError):
                continue            # no admin passthrough here: the collector's events say so
            key = [self.device_name, controller.name]
            for name, field in {**SMART_GAUGES, **SMART_COUNTERS}.items():
                (gauges.get(name) or counters[name]).add_metric(key, getattr(smart, field))
            temperature.add_metric([*key, "current"], smart.composite_temperature_c)
        return [*gauges.values(), *counters.values(), temperature]

    def _agent(self) -> list[Metric]:
        pid = memory.read_pid_file(self.pid_file) if self.pid_file is not None else None
        if pid is None:
            return []
        status = memory.parse_kib_table((self.proc / str(pid) / "status").read_text())
        faults = memory.parse_proc_stat((self.proc / str(pid) / "stat").read_text(), 0.0)
        families: list[Metric] = [self._gauge("flashmoe_agent_resident_memory_bytes", "the agent's VmRSS",
                                              status.get("VmRSS", 0))]
        for kind, value in (("major", faults.majflt), ("minor", faults.minflt)):
            family = CounterMetricFamily(f"flashmoe_agent_{kind}_page_faults", f"{kind} page faults of the agent",
                                         labels=[DEVICE_LABEL])
            family.add_metric([self.device_name], value)
            families.append(family)
        return families

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=[DEVICE_LABEL])
        family.add_metric([self.device_name], value)
        return family


METHODS = "GET, HEAD, OPTIONS"


def metrics_app(registry: Collector) -> Callable[[dict, Callable], Iterable[bytes]]:
    """prometheus_client's WSGI app at /metrics only, HEAD answered as GET without the body: its own
    answers every path with the metrics (a mistyped scrape path looks right), 405s HEAD (curl -I) and
    leaves HEAD out of its Allow header."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        text = [("Content-Type", "text/plain; charset=utf-8")]
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", text)
            return [b"not found: this collector serves /metrics only\n"]
        method = environ["REQUEST_METHOD"]
        if method == "OPTIONS":
            start_response("200 OK", [("Allow", METHODS)])
            return []
        if method not in METHODS.split(", "):
            start_response("405 Method Not Allowed", [*text, ("Allow", METHODS)])
            return [f"method {method} not allowed: use {METHODS}\n".encode()]
        if method != "HEAD":
            return metrics(environ, start_response)
        answer: list = []
        body = b"".join(metrics({**environ, "REQUEST_METHOD": "GET"}, lambda *head: answer.extend(head)))
        status, headers = answer[0], answer[1]
        start_response(status, [*headers, ("Content-Length", str(len(body)))])
        return []

    return app


MAX_SCRAPES = 32        # connections served at once; Prometheus scrapes one at a time
READ_TIMEOUT_S = 10.0   # a client silent this long in the middle of its request is dropped


class ScrapeServer(ThreadingWSGIServer):
    """prometheus_client's server (a thread per connection, kept for as long as the client takes to
    send its request), bounded: at most MAX_SCRAPES connections at once, a newer one closed unread,
    and each dropped after READ_TIMEOUT_S of silence. Unbounded, 15,000 connections that sent half a
    request gave the collector 4,000 threads and 150 MB, and it missed ticks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slots = threading.BoundedSemaphore(MAX_SCRAPES)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        log.debug("scrape from %s dropped", client_address, exc_info=True)  # a timed-out or vanished client


class ScrapeHandler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S

    def log_message(self, format: str, *args) -> None:
        pass     # a line per scrape would drown the collector's own


def serve_metrics(registry: Collector, host: str, port: int) -> ScrapeServer:
    """metrics_app on http://HOST:PORT/metrics in a daemon thread; shutdown() stops it."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("ScrapeServer", (ScrapeServer,), {"address_family": family})
    server = make_server(host, port, metrics_app(registry), server_class, handler_class=ScrapeHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def _meminfo_name(key: str) -> str:
    """node_exporter's spelling of a meminfo key: Active(anon) -> Active_anon."""
    return re.sub(r"\((\w+)\)", r"_\1", key)
