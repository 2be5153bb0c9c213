"""Online learning in the running agent: the worker's share of one core, its updates, and what the steps pay.

    flock /work/wt/bench.lock .venv/bin/python bench/online_agent.py [--model data/demo] [--minutes 10] [--rounds 2]

The agent (`flashmoe-cli serve`, the learned policy, cap 25%, the demo model) serves the same steady
traffic with online learning off and on (the `online_learning` knob, set through the control API
right after start), interleaved off, on, off, on... for `--rounds`. Each run lasts `--minutes`;
`--clients` clients each send one completion after another. Reported per run: the learning
worker's CPU time over the run as a share of one core (the worker's utime+stime from /proc, as the
agent's /v1/status reports it, start-up and imports included), the updates swapped in and rolled
back, the jobs that failed, each judged update's hindsight hit rate with the weights before it (old)
and with its own (new) on the steps since it took effect, the agent process's own CPU share, tokens/s and the
per-request latency percentiles. The on/off ratios of tokens/s and latency show what the steps pay; the machine is
shared, so compare within a round. JSON: bench/results/online_agent.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from agent.learned.background import cpu_seconds  # noqa: E402
from bench.common import count, machine, write_results  # noqa: E402
from bench.memory import interrupt_on_sigterm  # noqa: E402
from bench.processes import started  # noqa: E402
from bench.serve import free_port, wait_for_agent  # noqa: E402

CLI = [sys.executable, "-m", "agent.cli"]
CAP = "25%"
PROMPTS = ["Tell me about the history of the printing press.", "Write a short poem about the sea.",
           "Explain how a hash map works.", "What should I pack for a week of hiking?",
           "Summarise the plot of a detective novel.", "How do vaccines train the immune system?"]


def drive(url: str, clients: int, seconds: float, max_tokens: int) -> tuple[list[float], int]:
    """`clients` clients, each sending one completion after another until `seconds` have passed."""
    stop = time.monotonic() + seconds
    lock, latencies, tokens = threading.Lock(), [], [0]

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            n = i
            while time.monotonic() < stop:
                body = {"prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
                start = time.perf_counter()
                r = http.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - start)
                    tokens[0] += r.json()["usage"]["completion_tokens"]
                n += clients

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return latencies, tokens[0]


def run(model: Path, online: bool, args: argparse.Namespace, log_path: Path) -> dict:
    port = free_port()
    with log_path.open("w") as log, started([*CLI, "serve", "--model", str(model), "--port", str(port), "--cache-cap",
                                             CAP, "--policy", "flashmoe"], stdout=log, stderr=subprocess.STDOUT,
                                            cwd=ROOT) as proc:
        url = wait_for_agent(proc, port, f"see {log_path}")
        httpx.put(url + "/v1/knobs", json={"online_learning": online}, timeout=60).raise_for_status()
        agent_cpu, start = cpu_seconds(proc.pid), time.perf_counter()
        latencies, tokens = drive(url, args.clients, args.minutes * 60, args.max_tokens)
        wall = time.perf_counter() - start
        status = httpx.get(url + "/v1/status", timeout=60).json()
        agent_cpu = cpu_seconds(proc.pid) - agent_cpu
    learning = status["online_learning"]
    judged = [u for u in learning.get("recent", []) if u["judged_steps"]]
    return {"online": online, "wall_s": wall, "requests": len(latencies), "tokens": tokens,
            "tokens_per_s": tokens / wall, "p50_s": float(np.percentile(latencies, 50)),
            "p99_s": float(np.percentile(latencies, 99)), "agent_cpu_share": agent_cpu / wall,
            "worker_cpu_s": learning.get("cpu_s", 0.0), "worker_cpu_share": learning.get("cpu_s", 0.0) / wall,
            "updates": learning.get("updates", 0), "rollbacks": learning.get("rollbacks", 0),
            "decisions": learning.get("decisions", 0), "worker_failures": learning.get("worker_failures", 0),
            "judged": judged, "hindsight_old": _mean(u["old_hit_rate"] for u in judged),
            "hindsight_new": _mean(u["new_hit_rate"] for u in judged), "hit_rate": status["cache"]["hit_rate"],
            "load_avg": os.getloadavg()}


def _fmt(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.4f}"


def _mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "data" / "demo", help="the demo model (init-demo)")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of each run")
    parser.add_argument("--rounds", type=count, default=2, help="off/on pairs")
    parser.add_argument("--clients", type=count, default=4)
    parser.add_argument("--max-tokens", type=count, default=32)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/flashmoe-online-agent"))
    args = parser.parse_args()
    interrupt_on_sigterm()
    args.logs.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_ in range(args.rounds):
        for online in (False, True):
            r = run(args.model, online, args, args.logs / f"agent-{round_}-{'on' if online else 'off'}.log")
            runs.append(r | {"round": round_})
            print(f"round {round_} online {'on ' if online else 'off'}: {r['tokens_per_s']:.2f} tokens/s, "
                  f"P50 {r['p50_s']:.2f} s, P99 {r['p99_s']:.2f} s, hit rate {r['hit_rate']:.4f}, agent CPU "
                  f"{r['agent_cpu_share']:.1%}, worker CPU {r['worker_cpu_share']:.2%} of one core, "
                  f"{r['updates']} updates ({r['rollbacks']} rolled back, {r['worker_failures']} failed; hindsight "
                  f"old {_fmt(r['hindsight_old'])} new {_fmt(r['hindsight_new'])} over {len(r['judged'])}), "
                  f"load {r['load_avg'][0]:.1f}", flush=True)
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    ratios = {k: statistics.median(on[k] / off[k] for off, on in pairs) for k in ("tokens_per_s", "p50_s", "p99_s")}
    print(f"median on/off within rounds: tokens/s {ratios['tokens_per_s']:.3f}, P50 {ratios['p50_s']:.3f}, "
          f"P99 {ratios['p99_s']:.3f}; worker CPU "
          f"{max(r['worker_cpu_share'] for r in runs if r['online']):.2%} of one core at most (limit 5%)")
    write_results("online_agent", {"machine": machine(), "minutes": args.minutes, "clients": args.clients,
                                   "max_tokens": args.max_tokens, "cap": CAP, "runs": runs, "ratios_on_off": ratios})


if __name__ == "__main__":
    main()
