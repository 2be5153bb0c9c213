"""Real processes on loopback for the tests: the small demo model, `flashmoe-cli serve` started and
waited for, Debian's Prometheus, and the spawn / wait / stop that tests/test_browser.py also uses
for the collector and the dashboard.

    agent = start_agent(demo_model(tmp_path_factory), tmp_path, "--cache-cap", "25%")
    agent.complete(prompt="Hello", max_tokens=4)
    assert agent.stop() == 0
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "agent.cli"]
START_TIMEOUT_S = 120
PROMETHEUS = "/usr/bin/prometheus"
STOP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`args` in its own session (so `stop` reaches its children too), output to `log`."""
    return subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    """Wait until `url` answers 200, failing with the process's log if it exits or never answers."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise AssertionError(f"{url} did not answer within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM to the process's session and its exit code; one still running after STOP_TIMEOUT_S is
    killed (its code is then -SIGKILL), so nothing is left behind."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    """Poll `predicate` until it returns something true, and return that; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def fill(disk: Path) -> Path:
    """Take every free byte of the disk (conftest.py's `tmpfs`); returns the filler file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def demo_model(tmp_path_factory) -> Path:
    """The small demo model, written once per test session (init-demo is idempotent)."""
    return small_demo(tmp_path_factory.getbasetemp() / "demo-small")


def small_demo(out: Path) -> Path:
    """The small demo model written to `out` (a model of a test's own: no other test's agent serves it)."""
    subprocess.run([*CLI, "init-demo", "--out", str(out), "--size", "small"], check=True, capture_output=True)
    return out


def agents_serving(under: Path) -> dict[int, str]:
    """Live `flashmoe-cli serve` processes serving a model under `under`: pid -> its state, parent and command
    (a failure says whose it is)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state, parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if b"serve" in argv and any(a.startswith(str(under).encode()) for a in argv) and state != "Z":
            found[int(proc.name)] = f"state {state}, parent {parent}: {b' '.join(argv).decode(errors='replace')[:300]}"
    return found


def kill_agents_serving(under: Path) -> dict[int, str]:
    """SIGKILL every agent serving a model under `under`; returns what they were (agents_serving)."""
    found = agents_serving(under)
    for pid in found:
        os.kill(pid, signal.SIGKILL)
    return found


@dataclass
class Agent:
    proc: subprocess.Popen
    url: str
    db: Path
    pid_file: Path
    log: Path

    def stop(self) -> int:
        """SIGTERM and the exit code; an agent that had to be killed fails the test."""
        code = stop(self.proc)
        assert code != -signal.SIGKILL, f"agent ignored SIGTERM for {STOP_TIMEOUT_S} s:\n{self.log.read_text()[-3000:]}"
        return code

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=60)

    def metric(self, name: str, **labels: str) -> float | None:
        """The /metrics sample `name` with these labels (besides the device_name every sample has), or None."""
        return next((s.value for f in text_string_to_metric_families(self.get("/metrics").text) for s in f.samples
                     if s.name == name and {k: v for k, v in s.labels.items() if k != "device_name"} == labels), None)

    def complete(self, **body) -> dict:
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()


def start_agent(model: Path, workdir: Path, *args: str, env: dict[str, str] | None = None,
                on_spawn: Callable[[int], None] | None = None) -> Agent:
    """`flashmoe-cli serve` on a free loopback port with its store and pid file in `workdir`;
    returns once /v1/status answers. `on_spawn(pid)` runs before the model loads (e.g. to put the
    agent in a memory cgroup, which charges only what is allocated after)."""
    port = free_port()
    db, pid_file, log = workdir / "flashmoe.db", workdir / "agent.pid", workdir / f"agent-{port}.log"
    proc = spawn([*CLI, "serve", "--model", str(model), "--port", str(port), "--db", str(db),
                  "--pid-file", str(pid_file), *args], log, env)
    if on_spawn is not None:
        on_spawn(proc.pid)
    agent = Agent(proc, f"http://127.0.0.1:{port}", db, pid_file, log)
    wait_http(agent.url + "/v1/status", proc, log)
    return agent


@dataclass
class Prometheus:
    proc: subprocess.Popen
    url: str
    log: Path

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "success", r.text
        return r.json()["data"]["result"]

    def stop(self) -> int:
        return stop(self.proc)


def start_prometheus(workdir: Path, config: dict) -> Prometheus:
    """Debian's Prometheus on a free loopback port with `config` (a prometheus.yml as a dict), its data
    in `workdir`; returns once it is ready."""
    assert shutil.which(PROMETHEUS), "Debian's prometheus package is a test dependency (.ci/system-packages)"
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
    port, log = free_port(), workdir / "prometheus.log"
    proc = spawn([PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                  f"--web.listen-address=127.0.0.1:{port}"], log)
    prometheus = Prometheus(proc, f"http://127.0.0.1:{port}", log)
    wait_http(prometheus.url + "/-/ready", proc, log)
    return prometheus


def start_collector(agent: Agent, workdir: Path) -> subprocess.Popen:
    """`flashmoe-cli collect` into the agent's store, sampling the agent by its pid file."""
    return spawn([*CLI, "collect", "--db", str(agent.db), "--pid-file", str(agent.pid_file)], workdir / "collector.log")


def start_dashboard(db: Path, agent_url: str, workdir: Path, token: str) -> tuple[subprocess.Popen, str]:
    """The Streamlit dashboard on a free loopback port over the store `db` and the agent at `agent_url`,
    with its control token; returns once it answers, with its URL."""
    port = free_port()
    log = workdir / f"dashboard-{port}.log"
    proc = spawn([str(Path(sys.executable).with_name("streamlit")), "run", str(ROOT / "dashboard" / "app.py"),
                  "--server.headless", "true", "--server.port", str(port), "--server.address", "127.0.0.1",
                  "--browser.gatherUsageStats", "false"], log,
                 env={"FLASHMOE_DB": str(db), "FLASHMOE_AGENT_URL": agent_url, "FLASHMOE_TOKEN": token})
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/_stcore/health", proc, log)
    return proc, url

