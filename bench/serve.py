"""Serving benchmark: 16 concurrent clients, a fixed request mix, three agent configurations side by side.

    .venv/bin/python bench/serve.py --configs b,a,c --rounds 5 [--model data/demo] [--clients 16]
                                    [--requests-per-client 2] [--admit-window-ms MS] [--route-trace FILE ...]
                                    [--neighbour FILE] [--results NAME] [--reference STORE --configs b,a,c,A,C]

(a) the learned flashmoe policy with lookahead prefetch always on (as measured before it became adaptive),
    O_DIRECT slots;
(b) LRU with the same prefetch and slots;
(c) the mmap backend, no prefetch: the page cache decides what stays (llama.cpp's way);
(g) (a) with adaptive prefetch, the agent's default (agent/prefetch_gate.py);
(p) (a) with the steps that admit prompts on every core (serve --prefill-threads N, N = os.cpu_count(); the
    agent's default is one thread, as for decode): the A/B of the prefill threads;
(q) (c) with its admission steps on every core too, what (p) is to be compared with;
(w) (a) with every step's experts on two workers (serve --workers 2: whole experts at once, agent/workers.py);
(x) (c) on two workers too, what (w) is to be compared with;
(A), (B), (C) with --reference (the same checkpoint's unquantized store, when --model is its int8 twin):
    (a), (b), (c) on that store, the weights as published.
Each run starts `flashmoe-cli serve` as its own process with the cache cap at 25% of expert bytes,
inside a cgroup memory limit when the machine allows one (the same limit for all three: the cap,
the model's dense weights and KV budget, and working memory; bench/memory.py), after the expert
files and dense weights of every store in the run are dropped from the page cache (posix_fadvise
DONTNEED), so every run starts cold. The clients are set up first and start together, so their first
requests arrive as a burst; each measures request latency (send to last byte); tokens/s is all
completion tokens over the wall time of the whole load, and tokens/step those tokens over the model's steps
(how many requests shared a step, on average). With --neighbour FILE another process reads FILE with
O_DIRECT, over and over, during every run's load: a disk that is busy with someone else's reads.
A warm-up run of the first configuration comes before the rounds and is not measured (`--no-warm-up`
leaves it out): the first run of an invocation can be slower than the same configuration's later ones (P99 1.3x in one
run of BENCHMARKS.md's "The final runs", none in the next, started right after; 2-3x seen before), for what the per-run
drop leaves warm across invocations; the JSON keeps it under "warm_up", apart from the rounds.
Where (a)'s time goes: every run's model steps are profiled by the agent
(agent/serve/engine.py's StepProfile, from /v1/status), summed apart for admission steps (they prefill
prompts) and decode steps: the model's phases (attention, router, route, wait for reads, expert
matmuls, head; `other` is the rest of the step's wall time), CRC and policy, bytes read and the read
bandwidth over the step's wall time and over the time a read ran, the disk's idle time, the reads in
flight while it was busy, and the step's I/O bound (its bytes at the raw O_DIRECT bandwidth, which
each round measures after its runs on --model's expert file, as bench/scale.py does). With --reference the cache cap is
25% of the reference's expert bytes and the memory limit is the reference's, for every configuration (an int8 cache then
holds twice the experts).

One run of a configuration is noisy: which requests share a step depends on when each client's
next request lands, and a step that admits a prompt reads far more than a decode step; with 32
requests, a run's P99 is its slowest request or nearly. So the configurations run in rounds,
interleaved in the order given (b,a,c, b,a,c, ...: the runs of one round see much the same machine
load), and the table gives per configuration the median over rounds of each run's P50/P95/P99,
tokens/s and GB read, with min–max. Ratios to (c) and (b) are taken within each round and their
median reported. Prints the table; writes every run's detail, the summary and the percentiles of
all rounds' requests pooled to bench/results/serve.json (or --results NAME).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from agent.model.profile import PHASES  # noqa: E402
from bench.common import count, machine, results_name, write_results  # noqa: E402
from bench.memory import MemoryCgroup, device_memory, drop_stores_pages, peak_rss  # noqa: E402
from bench.processes import started  # noqa: E402

CLI = [sys.executable, "-m", "agent.cli"]
CAP = "25%"
TOPICS = ["the pump log", "SSD latency", "a French translation", "Python code", "the weather", "expert caches",
          "a meeting reply", "unit conversion", "MoE routing", "memory pressure", "a haiku", "SQL queries"]
GOAL_P99_A_OVER_C = 0.37
WARM_UP = -1  # the round number of the warm-up run


@dataclass(frozen=True)
class Config:
    name: str
    policy: str
    backend: str
    prefetch: str             # on, off or auto; (a) and (b) "on", as measured before adaptive prefetch
    reference: bool = False   # runs on --reference instead of --model
    extra: tuple[str, ...] = ()  # more serve arguments

    def on_reference(self) -> "Config":
        """The same configuration on --reference, named by its capital letter."""
        return Config(f"{self.name[0].upper()}{self.name[1:]}, --reference", self.policy, self.backend, self.prefetch,
                      reference=True, extra=self.extra)

    def args(self) -> list[str]:
        return ["--policy", self.policy, "--backend", self.backend, "--prefetch", self.prefetch, *self.extra]


EVERY_CORE = ("--prefill-threads", str(os.cpu_count()))
TWO_WORKERS = ("--workers", "2")
CONFIGS = [Config("a: flashmoe + prefetch", "flashmoe", "direct", "on"),
           Config("b: lru + prefetch", "lru", "direct", "on"),
           Config("c: mmap (page cache)", "lru", "mmap", "off"),
           Config("g: a, adaptive prefetch", "flashmoe", "direct", "auto"),
           Config("p: a, prefill on every core", "flashmoe", "direct", "on", extra=EVERY_CORE),
           Config("q: c, prefill on every core", "lru", "mmap", "off", extra=EVERY_CORE),
           Config("w: a, two workers", "flashmoe", "direct", "on", extra=TWO_WORKERS),
           Config("x: c, two workers", "lru", "mmap", "off", extra=TWO_WORKERS)]
CONFIGS += [c.on_reference() for c in CONFIGS]


@dataclass
class Result:
    """One run of one configuration."""
    config: str
    round: int
    requests: int
    completion_tokens: int
    wall_s: float
    latencies_s: list[float] = field(repr=False)
    hit_rate: float
    bytes_read: int
    model_steps: int
    peak_rss_bytes: int
    cgroup_peak_bytes: int | None
    load_avg_1m: tuple[float, float] = (0.0, 0.0)   # at start and end: the machine is shared
    steps: list[dict] = field(default_factory=list, repr=False)  # the agent's StepProfile of every model step

    @property
    def letter(self) -> str:
        return self.config[0]

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s

    def p(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q))

    def metrics(self) -> dict[str, float]:
        """What the summary takes the median of."""
        return {"p50_s": self.p(50), "p95_s": self.p(95), "p99_s": self.p(99), "tokens_per_s": self.tokens_per_s,
                "gb_read": self.bytes_read / 1e9, "hit_rate": self.hit_rate, "model_steps": self.model_steps,
                "tokens_per_step": self.completion_tokens / self.model_steps,
                "peak_rss_mib": self.peak_rss_bytes / 2**20}


def request_mix(clients: int, per_client: int, seed: int = 0) -> list[list[dict]]:
    """The same prompts and lengths for every config and round: one list of requests per client."""
    rng = random.Random(seed)
    mix = []
    for c in range(clients):
        mix.append([{"prompt": f"Client {c} asks about {rng.choice(TOPICS)} and {rng.choice(TOPICS)}.",
                     "max_tokens": rng.choice((4, 8, 12)), "temperature": 0} for _ in range(per_client)])
    return mix


# -- one run of one configuration ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    raise SystemExit(f"the agent did not start within {timeout_s:.0f} s; {where}")


def drive(url: str, mix: list[list[dict]]) -> tuple[list[float], int, float]:
    """Every client sends its requests one after another; returns latencies, tokens and wall time.

    The clients are set up before any sends (an httpx.Client takes ~50 ms of CPU to create, so
    creating them in turn would spread the first requests over ~0.5 s): the first wave is a burst."""
    ready = threading.Barrier(len(mix) + 1)

    def client(requests: list[dict]) -> list[tuple[float, int]]:
        out = []
        with httpx.Client(timeout=1800) as http:
            ready.wait()
            for body in requests:
                start = time.perf_counter()
                r = http.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                out.append((time.perf_counter() - start, r.json()["usage"]["completion_tokens"]))
        return out

    pool = concurrent.futures.ThreadPoolExecutor(len(mix))
    try:
        runs = [pool.submit(client, requests) for requests in mix]
        ready.wait()
        start = time.perf_counter()
        done = [row for run in runs for row in run.result()]
    finally:  # interrupted (SIGTERM): not waiting for the clients lets the caller stop the agent, which ends them
        ready.abort()  # releases clients still at the barrier; after it has passed, changes nothing
        pool.shutdown(wait=False, cancel_futures=True)
    return [d[0] for d in done], sum(d[1] for d in done), time.perf_counter() - start


NEIGHBOUR_MIN_BYTES = 256 * 2**20   # each pass a stream of reads, not a loop of dd starts on the CPU


def neighbour_refused(path: Path, stores: tuple[Path, ...]) -> str | None:
    """Why `path` cannot be the disk neighbour's file, or None: it must be a file of some size, outside the
    run's stores (reading those would warm what the agent reads, not compete with it)."""
    if not path.is_file():
        return "not a file"
    if path.stat().st_size < NEIGHBOUR_MIN_BYTES:
        return f"{path.stat().st_size} bytes; give a file of at least {NEIGHBOUR_MIN_BYTES >> 20} MiB"
    if any(path.resolve().is_relative_to(store.resolve()) for store in stores):
        return "a file of a store this run serves; give another file on the same disk"
    return None


@contextlib.contextmanager
def disk_neighbour(path: Path | None):
    """While the block runs, another process (yielded) reads `path` over and over with O_DIRECT (bench
    --neighbour): the disk is busy with reads that are not the agent's. None: no neighbour. A neighbour that
    stopped meanwhile (its dd failed: the file gone, no O_DIRECT there) is a SystemExit at the end, so the run
    is reported failed, not measured as one beside a neighbour."""
    if path is None:
        yield None
        return
    with started(["sh", "-c", f"while :; do dd if={shlex.quote(str(path))} of=/dev/null bs=1M "
                              "iflag=direct 2>/dev/null || exit 1; done"], start_new_session=True) as proc:
        yield proc
        stopped = proc.poll()
    if stopped is not None:
        raise SystemExit(f"the disk neighbour stopped during the run: dd could not read {path} with O_DIRECT "
                         f"(`dd if={shlex.quote(str(path))} of=/dev/null bs=1M iflag=direct` says why)")


def run_config(model: Path, config: Config, round_: int, mix, cgroup: MemoryCgroup, logs: Path,
               serve_args: list[str], others: tuple[Path, ...] = (), neighbour: Path | None = None) -> Result:
    """One run of `config` on `model`, cold: its pages and those of the `others` stores the same cgroup
    runs are dropped first. With `neighbour`, that file is read with O_DIRECT beside the clients' load."""
    drop_stores_pages(model, *others)
    if cgroup.path is not None:
        cgroup.reset_peak()
    log = logs / f"{config.name[0]}-{config.policy}-{config.backend}-{_round_name(round_)}.log"
    port = free_port()
    with log.open("w") as out, started([*CLI, "serve", "--model", str(model), "--port", str(port), *serve_args,
                                        *config.args()], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT) as proc:
        cgroup.add(proc.pid)  # before the model loads: every allocation and page-cache page is charged to it
        url = wait_for_agent(proc, port, f"{config.name}: see {log}")
        load_start = os.getloadavg()[0]
        with disk_neighbour(neighbour):
            latencies, tokens, wall = drive(url, mix)
        status = httpx.get(url + "/v1/status", timeout=30).json()
        rss = peak_rss(proc.pid)
    cache = status["cache"]
    return Result(config.name, round_, len(latencies), tokens, wall, latencies, cache["hit_rate"], cache["bytes_read"],
                  status["model_steps"], rss, cgroup.peak(), (load_start, os.getloadavg()[0]), status["step_profiles"])


def _round_name(round_: int) -> str:
    return "warm-up" if round_ == WARM_UP else f"round{round_}"


# -- where the steps' time went ------------------------------------------------------------------------------
def step_profile(steps: list[dict], raw_mb_s: float | None) -> dict[str, dict]:
    """Admission steps (with prompt tokens) and decode steps apart: their steps' sums of wall time, phases
    and reads, and what follows from them (see the module's docstring)."""
    out = {}
    for kind, chosen in (("admission", [s for s in steps if s["prompt_tokens"]]),
                         ("decode", [s for s in steps if not s["prompt_tokens"]])):
        if not chosen:
            continue
        wall, busy = sum(s["wall_s"] for s in chosen), sum(s["io_busy_s"] for s in chosen)
        gb = sum(s["bytes_read"] for s in chosen) / 1e9
        phases = {p: sum(s["phases_s"].get(p, 0.0) for s in chosen) for p in chosen[0]["phases_s"]}
        out[kind] = {"steps": len(chosen), "tokens": sum(s["tokens"] for s in chosen), "wall_s": wall,
                     "phases_s": phases, "other_s": wall - sum(phases.get(p, 0.0) for p in PHASES),
                     "gb_read": gb, "reads": sum(s["reads"] for s in chosen), "io_busy_s": busy,
                     "disk_idle_s": wall - busy, "gb_s": gb / wall if wall else None,
                     "gb_s_busy": gb / busy if busy else None,
                     "reads_in_flight": sum(s["read_s"] for s in chosen) / busy if busy else None,
                     "io_bound_s": gb * 1e3 / raw_mb_s if raw_mb_s else None}
    return out


def profile_table(profiles: dict[str, dict[str, dict]], raw_mb_s: float | None) -> str:
    """One row per configuration and kind of step, seconds summed over its steps."""
    head = (f"{'config, steps':<36} {'n':>3} {'wall':>6} " + " ".join(f"{p[:7]:>7}" for p in (*PHASES, "other", "crc",
                                                                                                "policy"))
            + f" {'GB':>6} {'GB/s':>5} {'busy':>5} {'idle s':>6} {'flight':>6} {'I/O s':>6}")
    rows = [f"where the steps' time went (s, summed over every round's steps; raw O_DIRECT "
            f"{raw_mb_s or 0:.0f} MB/s; GB/s over the wall time and while a read ran)", head, "-" * len(head)]
    for name, kinds in profiles.items():
        for kind, k in kinds.items():
            cells = [k["phases_s"].get(p, 0.0) for p in PHASES] + [k["other_s"], k["phases_s"].get("crc", 0.0),
                                                                   k["phases_s"].get("policy", 0.0)]
            rows.append(f"{name[:26] + ', ' + kind:<36} {k['steps']:>3} {k['wall_s']:>6.1f} "
                        + " ".join(f"{c:>7.2f}" for c in cells)
                        + f" {k['gb_read']:>6.2f} {k['gb_s'] or 0:>5.2f} {k['gb_s_busy'] or 0:>5.2f} "
                        f"{k['disk_idle_s']:>6.2f} {k['reads_in_flight'] or 0:>6.2f} {k['io_bound_s'] or 0:>6.2f}")
    return "\n".join(rows)


# -- summary over rounds ------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(results: list[Result]) -> dict[str, dict]:
    """Per configuration: median, min and max over its rounds of each run's metrics, and the P50/P95/P99
    of all its requests pooled over the rounds."""
    out = {}
    for name in dict.fromkeys(r.config for r in results):
        runs = [r for r in results if r.config == name]
        pooled = [t for r in runs for t in r.latencies_s]
        out[name] = {"rounds": len(runs),
                     **{k: spread([r.metrics()[k] for r in runs]) for k in runs[0].metrics()},
                     "pooled": {f"p{q}_s": float(np.percentile(pooled, q)) for q in (50, 95, 99)}}
    return out


# P99 ratios reported when a round ran both: (a) against the others; (p) against (q), the same
# configurations with admission on every core, and against (c); (w) against (x), both on two workers,
# against (c) on one, and each on two workers against itself on one
P99_PAIRS = ("ac", "ab", "aA", "aC", "pq", "pc", "wx", "wc", "wa", "xc")


def round_ratios(results: list[Result]) -> dict[str, dict[str, float]]:
    """Ratios between configurations within each round that ran all of (a), (b), (c) the run had,
    then their spread; a ratio missing from one of those rounds has none."""
    base = set("abc") & {r.letter for r in results}
    per_round = []
    for n in sorted({r.round for r in results}):
        got = {r.letter: r for r in results if r.round == n}
        if not base <= set(got):
            continue
        ratios = {f"p99_{x}_over_{y}": got[x].p(99) / got[y].p(99) for x, y in P99_PAIRS if x in got and y in got}
        if "a" in got and "b" in got:
            ratios["tokens_per_s_a_over_b"] = got["a"].tokens_per_s / got["b"].tokens_per_s
        per_round.append(ratios)
    return {k: {**spread([x[k] for x in per_round]), "per_round": [x[k] for x in per_round]}
            for k in per_round[0] if all(k in x for x in per_round)} if per_round else {}


def table(summary: dict[str, dict]) -> str:
    cols = [("P50 s", "p50_s", ".2f"), ("P95 s", "p95_s", ".2f"), ("P99 s", "p99_s", ".2f"),
            ("tok/s", "tokens_per_s", ".2f"), ("GB read", "gb_read", ".2f"), ("hit", "hit_rate", ".3f"),
            ("tokens/step", "tokens_per_step", ".1f"),
            ("peak RSS MiB", "peak_rss_mib", ".0f")]
    head = f"{'config (median [min-max])':<36} {'runs':>4} " + " ".join(f"{h:>19}" for h, _, _ in cols)
    rows = [head, "-" * len(head)]
    for name, s in summary.items():
        cells = [f"{s[k]['median']:{f}} [{s[k]['min']:{f}}-{s[k]['max']:{f}}]" for _, k, f in cols]
        rows.append(f"{name:<36} {s['rounds']:>4} " + " ".join(f"{c:>19}" for c in cells))
    return "\n".join(rows)


def describe_ratios(ratios: dict[str, dict]) -> str:
    def name(key: str) -> str:          # p99_a_over_c -> P99(a)/P99(c); tokens_per_s_a_over_b -> tok/s (a)/(b)
        x, y = key.split("_")[-3::2]
        return f"tok/s ({x})/({y})" if key.startswith("tokens") else f"P99({x})/P99({y})"
    return "within-round medians [min-max]: " + "; ".join(
        f"{name(k)} = {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]" for k, r in ratios.items()) + \
        f" (goal: P99(a)/P99(c) <= {GOAL_P99_A_OVER_C})"


# -- main -------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "data" / "demo")
    ap.add_argument("--clients", type=count, default=16)
    ap.add_argument("--requests-per-client", type=count, default=2)
    ap.add_argument("--max-batch-size", type=count, default=16)
    ap.add_argument("--rounds", type=count, default=5, help="runs of every configuration, interleaved (default 5)")
    ap.add_argument("--admit-window-ms", type=float,
                    help="the agent's admission window (serve --admit-window-ms); default: the agent's own")
    ap.add_argument("--configs", default="b,a,c", help="which of a,b,c,g,p,q,w,x (capitals: on --reference) to run, "
                                                       "in this order within every round")
    ap.add_argument("--reference", type=Path, help="the unquantized store of --model's checkpoint: the cap and memory "
                                                    "limit come from it, and configs A,B,C run on it")
    ap.add_argument("--route-trace", type=Path, nargs="+", default=[], metavar="FILE",
                    help="serve --route-trace: recorded real routing for a random-weight model of real shape")
    ap.add_argument("--neighbour", type=Path, metavar="FILE",
                    help="during every run, another process reads FILE over and over with O_DIRECT (a disk neighbour; "
                         "FILE on the store's disk, not a store of the run)")
    ap.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                    help="run the first configuration once before the rounds, not measured (default: on)")
    ap.add_argument("--results", type=results_name, default="serve",
                    help="write bench/results/<NAME>.json (default serve)")
    args = ap.parse_args()
    letters = args.configs.split(",")
    stores = (args.model, args.reference) if args.reference else (args.model,)
    if not set(letters) <= {c.name[0] for c in CONFIGS}:
        ap.error(f"--configs {args.configs!r}: give letters among a,b,c,g,p,q,w,x and A,B,C,G,P,Q,W,X, comma separated")
    if args.neighbour is not None and (why := neighbour_refused(args.neighbour, stores)):
        ap.error(f"--neighbour {args.neighbour}: {why}")
    if any(x.isupper() for x in letters) != (args.reference is not None):
        ap.error("configs A,B,C and --reference go together")
    if not (args.model / "experts.index.json").exists():
        subprocess.run([*CLI, "init-demo", "--out", str(args.model)], check=True, cwd=ROOT)
    from agent.experts.cap import parse_cap
    from agent.experts.layout import EXPERTS, INDEX, Index
    from agent.experts.reader import IO_THREADS
    from bench.loader import raw_baseline
    from bench.scale import CHUNK
    sized = args.reference or args.model        # the store whose expert bytes and dense weights size the device
    index = Index.load(sized / INDEX)
    cap = parse_cap(CAP, index.nbytes * len(index.blocks))
    cgroup = MemoryCgroup(device_memory(sized, cap))
    print(cgroup.describe())
    facts = {**machine(args.model), "load_avg_at_start": os.getloadavg(), "memory_limit": cgroup.describe(),
             "model": str(args.model), "reference": str(args.reference or ""), "cache_cap_bytes": cap,
             "expert_bytes": (args.model / "experts.bin").stat().st_size,
             "memory_limit_bytes": cgroup.limit, "routing": [str(t) for t in args.route_trace] or "the model's router"}
    serve_args = ["--cache-cap", str(cap), "--max-batch-size", str(args.max_batch_size)]
    if args.admit_window_ms is not None:
        serve_args += ["--admit-window-ms", str(args.admit_window_ms)]
    if args.route_trace:
        serve_args += ["--route-trace", *map(str, args.route_trace)]
    mix = request_mix(args.clients, args.requests_per_client)
    by_letter = {c.name[0]: c for c in CONFIGS}
    chosen = [by_letter[x] for x in letters]
    results, failed, raws, warm_up = [], [], [], None
    logs = ROOT / "bench" / "results" / "serve-logs"
    logs.mkdir(parents=True, exist_ok=True)

    def measure(n: int, config: Config) -> Result | None:
        """One run, or None when it failed (reported, and the others measured)."""
        print(f"{'warm-up, not measured' if n == WARM_UP else f'round {n + 1}/{args.rounds}'}: {config.name} ... "
              f"(agent logs in {logs})", flush=True)
        try:
            r = run_config(args.reference if config.reference else args.model, config, n, mix, cgroup, logs,
                           serve_args, others=stores, neighbour=args.neighbour)
        except (httpx.HTTPError, SystemExit) as exc:
            failed.append({"config": config.name, "round": n, "error": f"{type(exc).__name__}: {exc}"})
            print(f"  FAILED: {failed[-1]['error']} (see the agent log)", flush=True)
            return None
        print(f"  P50 {r.p(50):.2f} s, P99 {r.p(99):.2f} s, {r.tokens_per_s:.2f} tok/s, "
              f"{r.bytes_read / 1e9:.2f} GB read, {r.model_steps} steps, load {r.load_avg_1m[0]:.1f}", flush=True)
        return r

    try:
        if args.warm_up:
            warm_up = measure(WARM_UP, chosen[0])
        for n in range(args.rounds):
            results += filter(None, (measure(n, config) for config in chosen))
            raws.append(raw_baseline(args.model / EXPERTS, Index.load(args.model / INDEX), CHUNK, IO_THREADS))
            print(f"round {n + 1}: raw O_DIRECT {raws[-1]['raw_file_mb_s']:.0f} MB/s in file order "
                  f"({raws[-1]['raw_streams']} stream(s)), {raws[-1]['raw_blocks_mb_s']:.0f} MB/s as the cache reads",
                  flush=True)
    finally:
        cgroup.remove()
    report = results_json(results, warm_up, failed, raws)
    print()
    if report["summary"]:
        print(table(report["summary"]))
    if len(report["ratios"]) > 1:
        print("\n" + describe_ratios({k: v for k, v in report["ratios"].items() if k != "goal_p99_a_over_c"}))
    if report["profile"]:
        print("\n" + profile_table(report["profile"], report["raw_mb_s"]))
    for f in failed:
        print(f"{f['config']} {_round_name(f['round'])}: failed: {f['error']}")
    write_results(args.results, {
        "command": " ".join(sys.argv), "cache_cap": CAP, "clients": args.clients,
        "requests_per_client": args.requests_per_client, "max_batch_size": args.max_batch_size,
        "admit_window_ms": args.admit_window_ms, "neighbour": str(args.neighbour or ""), "rounds": args.rounds,
        "order": args.configs, "machine": facts,
        **report})
    return 0


def results_json(results: list[Result], warm_up: Result | None, failed: list[dict], raws: list[dict]) -> dict:
    """What the rounds measured, the warm-up run apart (in none of the summary, ratios or profiles)."""
    raw_mb_s = statistics.median(r["raw_mb_s"] for r in raws) if raws else None
    profiles = {name: step_profile([s for r in results if r.config == name for s in r.steps], raw_mb_s)
                for name in dict.fromkeys(r.config for r in results)}
    summary, ratios = (summarize(results), round_ratios(results)) if results else ({}, {})

    def detail(r: Result, raw: dict | None) -> dict:
        return {**asdict(r), **r.metrics(), "profile": step_profile(r.steps, raw["raw_mb_s"] if raw else None)}

    return {"summary": summary, "ratios": {**ratios, "goal_p99_a_over_c": GOAL_P99_A_OVER_C}, "failed": failed,
            "raw": raws, "raw_mb_s": raw_mb_s, "profile": profiles,
            "warm_up": None if warm_up is None else {**detail(warm_up, None), "measured": False},
            "runs": [detail(r, raws[r.round] if r.round < len(raws) else None) for r in results]}


if __name__ == "__main__":
    sys.exit(main())
