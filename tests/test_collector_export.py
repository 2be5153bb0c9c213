"""collector/export.py: the machine's readings under node_exporter's and smartctl_exporter's names.

Exact values from a written /proc and /sys tree; the real machine's own files through a real
`collect --listen` are scraped by Prometheus in tests/test_prometheus.py.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agents import CLI, ROOT, free_port, spawn, stop, wait_http
from collector import export
from collector.export import MachineExport
from collector.loop import listen_address

MEMINFO = "MemTotal:       16000000 kB\nMemAvailable:    4000000 kB\nActive(anon):     123 kB\nHugePages_Total:  0\n"
VMSTAT = "pgfault 1000\npgmajfault 42\nworkingset_refault_file 7\nnr_free_pages 5\n"
PSI = "some avg10=1.00 avg60=0.50 avg300=0.10 total=2500000\nfull avg10=0.50 avg60=0.20 avg300=0.05 total=1500000\n"
# reads, merged, sectors read, ms reading, writes, merged, sectors written, ms writing, in flight, io ms, queue ms
STAT = "100 0 2048 300 50 0 1024 200 2 4000 6000 0 0 0 0\n"


def machine(tmp_path: Path, psi: bool = True) -> tuple[Path, Path, Path]:
    proc, sys_block = tmp_path / "proc", tmp_path / "sys" / "block"
    (proc / "pressure").mkdir(parents=True)
    (proc / "meminfo").write_text(MEMINFO)
    (proc / "vmstat").write_text(VMSTAT)
    if psi:
        for resource in ("memory", "io"):
            (proc / "pressure" / resource).write_text(PSI)
    pid = proc / str(os.getpid())      # the "agent" is this test process (its pid is alive)
    pid.mkdir()
    (pid / "status").write_text("Name:\tpython\nVmRSS:\t  2048 kB\n")
    (pid / "stat").write_text(f"{os.getpid()} (py thon) S 1 1 1 0 -1 0 11 0 22 0 0 0\n")
    (sys_block / "vdz").mkdir(parents=True)
    (sys_block / "vdz" / "stat").write_text(STAT)
    pid_file = tmp_path / "agent.pid"
    pid_file.write_text(f"{os.getpid()}\n")
    return proc, sys_block, pid_file


def registry(proc: Path, sys_block: Path, pid_file: Path | None) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(MachineExport("edge-01", lambda: ["vdz"], lambda: [], pid_file, proc, sys_block))
    return reg


def test_readings_are_exported_under_node_exporter_names_with_the_device_name(tmp_path):
    reg = registry(*machine(tmp_path))
    value = lambda name, **labels: reg.get_sample_value(name, {"device_name": "edge-01", **labels})  # noqa: E731
    assert value("node_memory_MemAvailable_bytes") == 4_000_000 * 1024
    assert value("node_memory_Active_anon_bytes") == 123 * 1024
    assert value("node_vmstat_pgmajfault") == 42 and value("node_vmstat_workingset_refault_file") == 7
    assert value("node_vmstat_nr_free_pages") is None                     # only the listed fields
    assert value("node_pressure_memory_stalled_seconds_total") == 1.5    # "full" total, µs -> s
    assert value("node_pressure_io_waiting_seconds_total") == 2.5        # "some"
    assert value("node_disk_read_bytes_total", device="vdz") == 2048 * 512
    assert value("node_disk_written_bytes_total", device="vdz") == 1024 * 512
    assert value("node_disk_io_time_seconds_total", device="vdz") == 4.0
    assert value("node_disk_reads_completed_total", device="vdz") == 100
    assert value("node_disk_io_now", device="vdz") == 2
    assert value("flashmoe_agent_resident_memory_bytes") == 2048 * 1024
    assert value("flashmoe_agent_major_page_faults_total") == 22
    assert value("flashmoe_agent_minor_page_faults_total") == 11
    text = generate_latest(reg).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert samples and all(s.labels["device_name"] == "edge-01" for s in samples)
    assert "smartctl_" not in text                                       # no controller: no empty families


def test_a_missing_source_leaves_out_only_its_own_series(tmp_path):
    proc, sys_block, pid_file = machine(tmp_path, psi=False)
    pid_file.write_text("999999999\n")                                   # the agent is not running
    (sys_block / "vdz" / "stat").write_text("garbage\n")
    reg = registry(proc, sys_block, pid_file)
    names = {f.name for f in reg.collect()}
    assert "node_memory_MemAvailable_bytes" in names and "node_vmstat_pgmajfault" in names
    assert not {n for n in names if n.startswith(("node_pressure", "node_disk", "flashmoe_agent"))}


def test_a_busy_listen_port_is_one_line_and_the_store_is_closed(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run([*CLI, "collect", "--db", str(tmp_path / "s.db"), "--listen", f"127.0.0.1:{port}",
                                 "--duration", "5"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"cannot export on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


def test_listen_serves_metrics_at_metrics_only_and_answers_head_without_a_body(tmp_path):
    """prometheus_client's server answered every path with the metrics, HEAD with 405, and named only GET
    and OPTIONS in a 405."""
    port = free_port()
    log = tmp_path / "collect.log"
    proc = spawn([*CLI, "collect", "--db", str(tmp_path / "s.db"), "--listen", f"127.0.0.1:{port}"], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/metrics", proc, log)
        got = httpx.get(url + "/metrics", timeout=10)
        assert got.status_code == 200 and "node_memory_MemTotal_bytes" in got.text
        head = httpx.head(url + "/metrics", timeout=10)
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == got.headers["content-type"]
        assert int(head.headers["content-length"]) > 0
        for path in ("/", "/metric", "/metrics/x", "/favicon.ico"):
            missing = httpx.get(url + path, timeout=10)
            assert missing.status_code == 404 and "/metrics only" in missing.text, path
        assert httpx.options(url + "/metrics", timeout=10).headers["allow"] == "GET, HEAD, OPTIONS"
        for method in ("POST", "PUT", "DELETE"):
            refused = httpx.request(method, url + "/metrics", timeout=10)
            assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD, OPTIONS", method
            assert f"method {method} not allowed" in refused.text
    finally:
        assert stop(proc) == 0, log.read_text()


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_metrics_server_bounds_its_threads_and_drops_silent_clients(monkeypatch):
    """prometheus_client's server gave every connection a thread for as long as it took to send its
    request: 15,000 half-sent requests, 4,000 threads and 150 MB in the collector."""
    monkeypatch.setattr(export.ScrapeHandler, "timeout", 1.0)
    registry = CollectorRegistry()
    server = export.serve_metrics(registry, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    threads = threading.active_count()
    flood = [socket.create_connection(server.server_address, timeout=30) for _ in range(export.MAX_SCRAPES + 8)]
    try:
        for conn in flood:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x")
        assert all(_closed(conn) for conn in flood[export.MAX_SCRAPES:])   # over the bound: closed unread
        assert threading.active_count() <= threads + export.MAX_SCRAPES
        assert all(_closed(conn) for conn in flood[:export.MAX_SCRAPES])   # silent past the timeout: dropped
        assert httpx.get(url, timeout=30).status_code == 200
    finally:
        for conn in flood:
            conn.close()
        server.shutdown()


@pytest.mark.parametrize("text, address", [("127.0.0.1:9600", ("127.0.0.1", 9600)), ("[::1]:0", ("::1", 0)),
                                           ("localhost:80", ("localhost", 80))])
def test_listen_takes_host_and_port_with_ipv6_in_brackets(text, address):
    assert listen_address(text) == address


@pytest.mark.parametrize("text", ["[::1:9", "::1:9600", "[::1]]:9", "127.0.0.1", "127.0.0.1:70000", ":9600"])
def test_a_listen_address_that_is_not_host_port_is_refused(text):
    """"[::1:9" was taken as ::1 port 9: an unclosed bracket, or an IPv6 address outside brackets, is ambiguous."""
    with pytest.raises(argparse.ArgumentTypeError, match="is not HOST:PORT"):
        listen_address(text)
