"""Does the learned policy's system tower earn its place? Real traces recorded on this machine under
SSD contention and memory pressure, the tower trained on their monitoring samples, and the ablation.

    flock /work/wt/bench.lock .venv/bin/python bench/system_tower.py [--model data/demo] [--runs 4]

1. Record: `flashmoe-cli generate --record-trace` on the demo model (cap 25%, O_DIRECT, LRU, no
   prefetch, greedy, one prompt per run), its experts following real OLMoE routing (`--route-trace`:
   the train and validation split's olmoe_prose and olmoe_code cut to the demo's 8 layers; the demo's
   random router alone routes nothing a policy could learn), under three conditions: quiet; SSD contention (two
   O_DIRECT readers of a scratch file on the same disk, in a loop); memory pressure (the generate
   process in a cgroup memory limit a little above its own need, so that it reclaims and stalls).
   Every recorded step carries the monitoring samples the cache fed its policy (mean expert read
   latency, memory pressure from /proc/pressure/memory): the tower's inputs, as the agent sees them.
2. Train: the shipped weights fine-tuned on the first half of every condition's runs (Belady,
   windowed LFU and LRU deciding), twice: once with each decision's real monitoring series in the
   system tower, once with random series (how the shipped weights were trained: the ablation).
3. Evaluate on the other half: hit rate, and miss time (each miss costed at the read latency the
   cache measured at that step), with the shipped weights, each fine-tuning, and the real-series
   fine-tuning fed a constant series instead; and the share of eviction decisions the real series
   changes against the constant one.
JSON: bench/results/system_tower.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from agent.learned.online import to_net, to_weights
from agent.learned.scorer import SharedNet, shared_net, system_input
from agent.learned.train import Decisions, collect, fit
from agent.policies.base import Key, Policy
from agent.policies.flashmoe import DEFAULT_WEIGHTS, FlashMoE
from agent.residency import Residency
from agent.simulator import SystemReplay, capacity_slots, replay
from agent.learned.splits import TRACES_DIR
from agent.traces import Trace, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from bench.common import count, machine, write_results  # noqa: E402
from bench.memory import MemoryCgroup  # noqa: E402
from bench.processes import started  # noqa: E402

CLI = [sys.executable, "-m", "agent.cli"]
CAP = 0.25
CONDITIONS = ("quiet", "ssd", "memory")
PROMPTS = ["The history of the printing press begins", "A recipe for bread needs flour, water and",
           "def merge_sort(values):\n    if len(values) <= 1:", "Dear committee, I am writing to ask",
           "The proof proceeds by induction on n. For n = 1", "Q: Why is the sky blue?\nA:",
           "Once upon a time, in a village by the sea,", "SELECT name, count(*) FROM orders WHERE"]
ROUTES = ("olmoe_prose", "olmoe_code")  # the train and validation split's routing; the report split stays untouched
SCRATCH_BYTES = 2 << 30  # the file the SSD-contention readers read, on the model's filesystem
READERS = 2
MEMORY_HEADROOM = 24 << 20  # the memory limit: the quiet runs' peak anonymous memory and this, so that the
                            # library and page-cache pages it needs keep being reclaimed and faulted back


# -- conditions ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def ssd_contention(scratch: Path) -> Iterator[Callable[[int], None]]:
    """READERS O_DIRECT readers of `scratch` in a loop while the body runs."""
    if not scratch.exists() or scratch.stat().st_size < SCRATCH_BYTES:
        subprocess.run(["dd", "if=/dev/zero", f"of={scratch}", "bs=4M", f"count={SCRATCH_BYTES >> 22}", "oflag=direct",
                        "status=none"], check=True)
    loop = f"while :; do dd if={scratch} of=/dev/null bs=1M iflag=direct status=none; done"
    with contextlib.ExitStack() as readers:
        for _ in range(READERS):
            readers.enter_context(started(["sh", "-c", loop], start_new_session=True))
        yield lambda pid: None


@contextlib.contextmanager
def memory_pressure(limit: int) -> Iterator[Callable[[int], None]]:
    """A cgroup memory limit the generate process is put in as it starts."""
    cgroup = MemoryCgroup(limit)
    if cgroup.path is None:
        raise SystemExit(f"memory pressure needs a memory cgroup: {cgroup.describe()}")
    try:
        yield cgroup.add
    finally:
        cgroup.remove()


@contextlib.contextmanager
def quiet() -> Iterator[Callable[[int], None]]:
    yield lambda pid: None


def route_files(model: Path, workdir: Path) -> list[Path]:
    """ROUTES cut to the model's MoE layers (the first ones), for generate --route-trace."""
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    out = []
    for name in ROUTES:
        lines = (TRACES_DIR / "decode" / f"{name}.jsonl").read_text().splitlines()
        head = json.loads(lines[0])
        head["meta"] |= {"layers": layers, "source": f"{name}, its first {layers} layers"}
        records = [json.loads(line) for line in lines[1:]]
        for r in records:
            r["routed"] = {k: v for k, v in r["routed"].items() if int(k) < layers}
        path = workdir / f"route-{name}.jsonl"
        path.write_text("\n".join(json.dumps(x) for x in [head, *records]) + "\n")
        out.append(path)
    return out


def record(model: Path, routes: list[Path], prompt: str, tokens: int, out: Path, attach: Callable[[int], None]) -> dict:
    """One generate run recording its routing and monitoring samples; its stats, with its peak anonymous memory."""
    cmd = [*CLI, "generate", "--model", str(model), "--prompt", prompt, "--max-new-tokens", str(tokens), "--greedy",
           "--cache-cap", f"{CAP:.0%}", "--policy", "lru", "--backend", "direct", "--no-prefetch",
           "--route-trace", *map(str, routes), "--record-trace", str(out), "--json"]
    with started(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as proc:
        attach(proc.pid)
        anon = [0]
        watcher = threading.Thread(target=_watch_anon, args=(proc, anon), daemon=True)
        watcher.start()
        stdout, stderr = proc.communicate()
        watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"generate failed ({proc.returncode}): {stderr[-2000:]}")
    return {**json.loads(stdout)["stats"], "peak_anon_bytes": anon[0]}


def _watch_anon(proc: subprocess.Popen, peak: list[int]) -> None:
    """The process's largest RssAnon, polled until it exits."""
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            line = next(x for x in status.read_text().splitlines() if x.startswith("RssAnon:"))
            peak[0] = max(peak[0], int(line.split()[1]) << 10)
        except (OSError, StopIteration):
            pass
        time.sleep(0.2)


def record_all(model: Path, workdir: Path, runs: int, tokens: int) -> dict[str, list[Path]]:
    """`runs` traces per condition (quiet first: its peak RSS sets the memory limit)."""
    traces: dict[str, list[Path]] = {}
    routes = route_files(model, workdir)
    peak = 0
    for name in CONDITIONS:
        setting = {"quiet": quiet, "ssd": lambda: ssd_contention(workdir / "scratch"),
                   "memory": lambda: memory_pressure(peak + MEMORY_HEADROOM)}[name]
        traces[name] = []
        with setting() as attach:
            for i in range(runs):
                out = workdir / f"{name}-{i}.jsonl"
                stats = record(model, routes, PROMPTS[i % len(PROMPTS)], tokens, out, attach)
                peak = max(peak, stats["peak_anon_bytes"]) if name == "quiet" else peak
                print(f"{name} run {i}: {stats['hit_rate']:.3f} hit rate, {stats['tokens_per_s']:.2f} tokens/s",
                      flush=True)
                traces[name].append(out)
    return traces


# -- training and evaluation -----------------------------------------------------------------------------------
CONSTANT = {"read_latency_s": 80e-6, "mem_pressure": 0.0}  # a quiet machine: what the ablation feeds instead


class Probe(Policy):
    """Decides as `primary`, fed each recorded sample (`feed="real"`) or CONSTANT in its place. Adds each
    miss's cost (the read latency recorded last) to `tally["miss_s"]`; with a `shadow` (the same kind of
    policy, fed CONSTANT) counts the decisions it would have made differently from the same state."""

    def __init__(self, primary: Policy, tally: dict, feed: str, shadow: Policy | None = None) -> None:
        self.primary, self.shadow, self.tally, self.feed = primary, shadow, tally, feed
        self.latency = CONSTANT["read_latency_s"]

    def _both(self, hook: str, *args) -> None:
        getattr(self.primary, hook)(*args)
        if self.shadow is not None:
            getattr(self.shadow, hook)(*args)

    def session(self) -> None:
        self._both("session")

    def route(self, layer: int, experts) -> None:
        self._both("route", layer, experts)

    def hit(self, key: Key) -> None:
        self._both("hit", key)

    def insert(self, key: Key) -> None:  # no prefetch in a replay: every insert is a demand miss
        self.tally["miss_s"] += self.latency
        self._both("insert", key)

    def remove(self, key: Key) -> None:
        self._both("remove", key)

    def system(self, sample) -> None:
        self.latency = sample.get("read_latency_s", self.latency)
        self.primary.system(sample if self.feed == "real" else CONSTANT)
        if self.shadow is not None:
            self.shadow.system(CONSTANT)

    def victim(self, resident, pinned) -> Key:
        choice = self.primary.victim(resident, pinned)
        if self.shadow is not None:
            self.tally["decisions"] += 1
            self.tally["changed"] += self.shadow.victim(resident, pinned) != choice
        return choice


def evaluate(trace: Trace, net: SharedNet, feed: str) -> dict:
    """Replay `trace` with `net` deciding, fed the recorded samples ("real") or CONSTANT ("constant"); with
    "real", a shadow fed CONSTANT counts the decisions the samples change."""
    tally = {"miss_s": 0.0, "decisions": 0, "changed": 0}
    shadowed = feed == "real"
    cache = Residency(capacity_slots(trace, CAP, "layer"), trace.n_layers,
                      lambda: Probe(FlashMoE(net=net), tally, feed, FlashMoE(net=net) if shadowed else None),
                      "layer", trace.top_k)
    replay(trace, cache, SystemReplay.synthetic())
    hits = sum(s.hits for s in cache.stats)
    out = {"hit_rate": hits / trace.n_accesses, "miss_s": tally["miss_s"]}
    return out | ({"decisions": tally["decisions"], "changed": tally["changed"]} if shadowed else {})


def fine_tune(traces: list[Trace], system: str, seed: int = 0) -> SharedNet:
    """The shipped weights fine-tuned on `traces` (Belady, windowed LFU and LRU deciding); the system tower
    sees each decision's recorded series ("recorded") or random ones ("random")."""
    rng = np.random.default_rng(seed)
    data = Decisions.concat([collect(t, capacity_slots(t, CAP, "layer"), driver, 4000, rng)
                             for t in traces for driver in ("belady", "lfu-window", "lru")])
    net = fit(data, epochs=3, seed=seed, lr=1e-3, net=to_net(to_weights(shared_net(str(DEFAULT_WEIGHTS)).net)),
              system=system)
    return SharedNet(net)


def series_spread(traces: list[Trace]) -> dict:
    """What the tower was shown: the range of its two inputs over the recorded samples."""
    inputs = np.array([system_input(s) for t in traces for s in t.system.values()] or [(math.nan, math.nan)])
    return {"samples": len(inputs), "latency_input": [float(inputs[:, 0].min()), float(inputs[:, 0].max())],
            "pressure_input": [float(inputs[:, 1].min()), float(inputs[:, 1].max())]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "data" / "demo", help="the demo model (init-demo)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/flashmoe-system-tower"),
                        help="recorded traces and the SSD-contention scratch file")
    parser.add_argument("--runs", type=count, default=4, help="generate runs per condition: half train, half test")
    parser.add_argument("--tokens", type=count, default=192, help="tokens per run")
    parser.add_argument("--recorded", action="store_true", help="reuse the traces already in --workdir")
    args = parser.parse_args()
    if args.runs < 2 or args.runs % 2:
        raise SystemExit("--runs must be an even number of at least 2: half train, half test")
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    paths = ({c: [args.workdir / f"{c}-{i}.jsonl" for i in range(args.runs)] for c in CONDITIONS} if args.recorded
             else record_all(args.model, args.workdir, args.runs, args.tokens))
    traces = {c: [read_jsonl(p) for p in ps] for c, ps in paths.items()}
    half = args.runs // 2
    train = [t for ts in traces.values() for t in ts[:half]]
    nets = {"shipped (random series)": shared_net(str(DEFAULT_WEIGHTS)),
            "tuned, real series": fine_tune(train, "recorded"),
            "tuned, random series": fine_tune(train, "random")}
    results = {}
    for condition, ts in traces.items():
        for label, net in nets.items():
            for feed in ("real", "constant") if label == "tuned, real series" else ("real",):
                runs = [evaluate(t, net, feed) for t in ts[half:]]
                results[f"{condition} | {label} | fed {feed}"] = {
                    "hit_rate": float(np.mean([r["hit_rate"] for r in runs])),
                    "miss_s": float(sum(r["miss_s"] for r in runs)),
                    **({"changed_share": sum(r["changed"] for r in runs) / max(1, sum(r["decisions"] for r in runs))}
                       if feed == "real" and label == "tuned, real series" else {})}
    print(f"{'condition | weights | series fed':<62}{'hit rate':>10}{'miss time s':>13}{'decisions changed':>19}")
    for key, r in results.items():
        changed = f"{r['changed_share']:.2%}" if "changed_share" in r else ""
        print(f"{key:<62}{r['hit_rate']:10.4f}{r['miss_s']:13.3f}{changed:>19}")
    spread = {c: series_spread(ts) for c, ts in traces.items()}
    print("tower inputs seen:", json.dumps(spread))
    write_results("system_tower", {"machine": machine(), "runs": args.runs, "tokens": args.tokens, "capacity": CAP,
                                   "inputs": spread, "results": results, "wall_seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
