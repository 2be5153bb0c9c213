"""Serving benchmark: 16 concurrent clients, a fixed request mix, three agent configurations side by side.

    .venv/bin/python bench/serve.py [--model data/demo] [--clients 16] [--requests-per-client 2]

(a) the learned flashmoe policy with lookahead prefetch, O_DIRECT slots;
(b) LRU with the same prefetch and slots;
(c) the mmap backend, no prefetch: the page cache decides what stays (llama.cpp's way).
Each runs `flashmoe-cli serve` as its own process with the cache cap at 25% of expert bytes,
inside a cgroup memory limit when the machine allows one (the same limit for all three), after the
expert file's pages are dropped from the page cache (posix_fadvise DONTNEED), so every config
starts cold. Clients measure request latency (send to last byte); tokens/s is all completion
tokens over the wall time of the whole load. Prints a table, writes bench/results/serve.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "serve.json"
CLI = [sys.executable, "-m", "agent.cli"]
CAP = "25%"
HEADROOM = 768 * 2**20   # memory limit = cache cap + this (python, torch, dense weights, KV caches)
TOPICS = ["the pump log", "SSD latency", "a French translation", "Python code", "the weather", "expert caches",
          "a meeting reply", "unit conversion", "MoE routing", "memory pressure", "a haiku", "SQL queries"]


@dataclass(frozen=True)
class Config:
    name: str
    policy: str
    backend: str
    prefetch: bool

    def args(self) -> list[str]:
        return ["--policy", self.policy, "--backend", self.backend] + ([] if self.prefetch else ["--no-prefetch"])


CONFIGS = [Config("a: flashmoe + prefetch", "flashmoe", "direct", True),
           Config("b: lru + prefetch", "lru", "direct", True),
           Config("c: mmap (page cache)", "lru", "mmap", False)]


@dataclass
class Result:
    config: str
    requests: int
    completion_tokens: int
    wall_s: float
    latencies_s: list[float] = field(repr=False)
    hit_rate: float
    bytes_read: int
    peak_rss_bytes: int
    cgroup_peak_bytes: int | None
    load_avg_1m: tuple[float, float] = (0.0, 0.0)   # at start and end: the machine is shared

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s

    def p(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q))


def request_mix(clients: int, per_client: int, seed: int = 0) -> list[list[dict]]:
    """The same prompts and lengths for every config: one list of requests per client."""
    rng = random.Random(seed)
    mix = []
    for c in range(clients):
        mix.append([{"prompt": f"Client {c} asks about {rng.choice(TOPICS)} and {rng.choice(TOPICS)}.",
                     "max_tokens": rng.choice((4, 8, 12)), "temperature": 0} for _ in range(per_client)])
    return mix


# -- memory limit ---------------------------------------------------------------------------------------
class MemoryCgroup:
    """A child memory cgroup of this process's own (v2 memory.max, else v1 memory.limit_in_bytes)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.path, self.kind, self.why_not = limit, None, None, ""
        for kind, base, limit_file in self._candidates():
            path = base / f"flashmoe-bench-{os.getpid()}"
            try:
                path.mkdir()
                (path / limit_file).write_text(str(limit))
            except OSError as exc:
                self.why_not += f"{kind} at {base}: {exc.strerror}; "
                if path.exists():
                    path.rmdir()
                continue
            self.path, self.kind = path, kind
            return

    @staticmethod
    def _candidates():
        """(kind, our own cgroup directory, limit file): v2 where it has the memory controller, then v1."""
        own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
        root = Path("/sys/fs/cgroup")
        for v2 in (root, root / "unified"):
            controllers = v2 / own.get("", "/").lstrip("/") / "cgroup.controllers"
            if controllers.exists() and "memory" in controllers.read_text().split():
                yield "v2", controllers.parent, "memory.max"
        if "memory" in own:
            yield "v1", root / "memory" / own["memory"].lstrip("/"), "memory.limit_in_bytes"

    def add(self, pid: int) -> None:
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(pid))

    def peak(self) -> int | None:
        if self.path is None:
            return None
        name = "memory.peak" if self.kind == "v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except OSError:
            return None

    def reset_peak(self) -> None:
        if self.kind == "v1":
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def remove(self) -> None:
        if self.path is not None:
            self.path.rmdir()

    def describe(self) -> str:
        if self.path is None:
            return f"no cgroup memory limit ({self.why_not.strip('; ') or 'no memory controller'})"
        return f"cgroup {self.kind} memory limit {self.limit / 2**20:.0f} MiB at {self.path}"


# -- one configuration ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def start(model: Path, config: Config, cgroup: MemoryCgroup, workdir: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (workdir / f"{config.policy}-{config.backend}.log").open("w")
    proc = subprocess.Popen([*CLI, "serve", "--model", str(model), "--port", str(port), "--cache-cap", CAP,
                             "--max-batch-size", str(max_batch), *config.args()],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    cgroup.add(proc.pid)  # before the model loads: every allocation and page-cache page is charged to it
    return proc, wait_for_agent(proc, port, f"{config.name}: see {log.name}")


def wait_for_agent(proc: subprocess.Popen, port: int, where: str, timeout_s: float = 300) -> str:
    """The agent's URL once /v1/status answers; SystemExit (naming `where` to look) if it dies or stalls."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited with {proc.returncode}; {where}")
        try:
            httpx.get(url + "/v1/status", timeout=5).raise_for_status()
            return url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the agent did not start within {timeout_s:.0f} s; {where}")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def drive(url: str, mix: list[list[dict]]) -> tuple[list[float], int, float]:
    """Every client sends its requests one after another; returns latencies, tokens and wall time."""
    def client(requests: list[dict]) -> list[tuple[float, int]]:
        out = []
        with httpx.Client(timeout=1800) as http:
            for body in requests:
                start = time.perf_counter()
                r = http.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                out.append((time.perf_counter() - start, r.json()["usage"]["completion_tokens"]))
        return out

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(mix)) as pool:
        done = [row for rows in pool.map(client, mix) for row in rows]
    return [d[0] for d in done], sum(d[1] for d in done), time.perf_counter() - start


def run_config(model: Path, config: Config, mix, cgroup: MemoryCgroup, workdir: Path, max_batch: int) -> Result:
    drop_page_cache(model / "experts.bin")
    if cgroup.path is not None:
        cgroup.reset_peak()
    proc, url = start(model, config, cgroup, workdir, max_batch)
    load_start = os.getloadavg()[0]
    try:
        latencies, tokens, wall = drive(url, mix)
        status = httpx.get(url + "/v1/status", timeout=30).json()
        rss = peak_rss(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    cache = status["cache"]
    return Result(config.name, len(latencies), tokens, wall, latencies, cache["hit_rate"], cache["bytes_read"],
                  rss, cgroup.peak(), (load_start, os.getloadavg()[0]))


# -- report ---------------------------------------------------------------------------------------------
def machine(model: Path, cgroup: MemoryCgroup) -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "kernel": platform.release(), "load_avg_at_start": os.getloadavg(), "memory_limit": cgroup.describe(),
            "model": str(model), "expert_bytes": (model / "experts.bin").stat().st_size}


def table(results: list[Result]) -> str:
    ref = results[-1]
    head = (f"{'config':<26} {'req':>4} {'P50 s':>7} {'P95 s':>7} {'P99 s':>7} {'tok/s':>7} {'hit':>6} "
            f"{'GB read':>8} {'P99/P99(c)':>10} {'tok/s / (c)':>11} {'peak RSS MiB':>12}")
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{r.config:<26} {r.requests:>4} {r.p(50):>7.2f} {r.p(95):>7.2f} {r.p(99):>7.2f} "
                    f"{r.tokens_per_s:>7.2f} {r.hit_rate:>6.3f} {r.bytes_read / 1e9:>8.2f} {r.p(99) / ref.p(99):>10.2f} "
                    f"{r.tokens_per_s / ref.tokens_per_s:>11.2f} {r.peak_rss_bytes / 2**20:>12.0f}")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "data" / "demo")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--configs", default="a,b,c",
                    help="which of a,b,c to run, in this order (the table's reference is the last one run)")
    args = ap.parse_args()
    if not (args.model / "experts.index.json").exists():
        subprocess.run([*CLI, "init-demo", "--out", str(args.model)], check=True, cwd=ROOT)
    from agent.experts.cache import parse_cap
    from agent.experts.layout import INDEX, Index
    index = Index.load(args.model / INDEX)
    cap = parse_cap(CAP, index.nbytes * len(index.blocks))
    cgroup = MemoryCgroup(cap + HEADROOM)
    print(cgroup.describe())
    facts = machine(args.model, cgroup)  # now: its load average is the one at the start
    mix = request_mix(args.clients, args.requests_per_client)
    by_letter = {c.name[0]: c for c in CONFIGS}
    chosen = [by_letter[x] for x in args.configs.split(",")]  # in the order given: the disk may throttle later runs
    results, failed = [], {}
    try:
        logs = RESULTS.parent / "serve-logs"
        logs.mkdir(parents=True, exist_ok=True)
        for config in chosen:
            print(f"running {config.name} ... (agent log in {logs})", flush=True)
            try:
                results.append(run_config(args.model, config, mix, cgroup, logs, args.max_batch_size))
            except (httpx.HTTPError, SystemExit) as exc:  # report it and measure the others
                failed[config.name] = f"{type(exc).__name__}: {exc}"
                print(f"  FAILED: {failed[config.name]} (see the agent log)", flush=True)
                continue
            r = results[-1]
            print(f"  {r.requests} requests, P99 {r.p(99):.2f} s, {r.tokens_per_s:.2f} tok/s, hit {r.hit_rate:.3f}",
                  flush=True)
    finally:
        cgroup.remove()
    print()
    if results:
        print(table(results))
    for name, error in failed.items():
        print(f"{name}: failed: {error}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(sys.argv), "cache_cap": CAP, "failed": failed, "clients": args.clients,
              "requests_per_client": args.requests_per_client, "max_batch_size": args.max_batch_size,
              "machine": facts,
              "results": [{**{k: v for k, v in asdict(r).items() if k != "latencies_s"}, "p50_s": r.p(50),
                           "p95_s": r.p(95), "p99_s": r.p(99), "tokens_per_s": r.tokens_per_s,
                           "latencies_s": r.latencies_s} for r in results]}
    if len(results) == 3:
        a, b, c = (next(r for r in results if r.config[0] == x) for x in "abc")
        report["ratios"] = {"p99_a_over_c": a.p(99) / c.p(99), "goal_p99_a_over_c": 0.37,
                            "p99_a_over_b": a.p(99) / b.p(99), "tokens_per_s_a_over_b": a.tokens_per_s / b.tokens_per_s}
        print(f"\nP99(a)/P99(c) = {a.p(99) / c.p(99):.2f} (goal <= 0.37); P99(a)/P99(b) = {a.p(99) / b.p(99):.2f}; "
              f"tok/s (a)/(b) = {a.tokens_per_s / b.tokens_per_s:.2f}")
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
