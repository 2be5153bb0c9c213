"""Bounded work per request: GET /v1/status latency while maximal prompts are refused or served.

    .venv/bin/python bench/prompt_bound.py [--model data/demo] [--seconds 15] [--clients 2]

One agent (`flashmoe-cli serve --policy lru`, default --max-prompt-bytes) on loopback. Scenarios,
side by side in one run, each `--seconds` long: `--clients` threads send one kind of heavy request
back to back while the main thread probes GET /v1/status every PROBE_S and times each answer.

  idle        no load: the machine's own floor for a status answer in this run
  over cap    a text prompt one byte over --max-prompt-bytes: refused (413) before tokenizing
  at cap      a text prompt of exactly --max-prompt-bytes: tokenized (on a worker thread, the
              GIL released), then refused (400) because it exceeds the model's context
  body        a 1 MB body (token ids): refused (413) before it is read whole
  served      the longest prompt the context serves (context - 16 tokens of text), 16 new tokens

The goal (issue 11, outcome 3): status under 100 ms while a maximal prompt is refused or served;
the table gives P50/P99/max of the probes and P99 over idle P99. Prints the table; writes
bench/results/prompt_bound.json. Without --model it writes the small demo model to a temporary
directory (the status path does not depend on model size).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from agent.serve.limits import MAX_PROMPT_BYTES  # noqa: E402
from bench.common import count, machine, write_results  # noqa: E402
from bench.processes import started  # noqa: E402
from bench.serve import CLI, free_port, wait_for_agent  # noqa: E402

PROBE_S = 0.05
GOAL_S = 0.100
NEW_TOKENS = 16


def scenarios(context: int) -> dict[str, dict | None]:
    """Scenario -> the completion body its clients send (None: no load)."""
    return {"idle": None,
            "over cap": {"prompt": "x" * (MAX_PROMPT_BYTES + 1), "max_tokens": 1},
            "at cap": {"prompt": "x" * MAX_PROMPT_BYTES, "max_tokens": 1},
            "body": {"prompt": [1] * 200_000, "max_tokens": 1},
            "served": {"prompt": "x" * (context - NEW_TOKENS), "max_tokens": NEW_TOKENS, "temperature": 0}}


def load(url: str, body: dict, stop: threading.Event, codes: list[int]) -> None:
    raw = json.dumps(body).encode()
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            codes.append(http.post(url + "/v1/completions", content=raw,
                                   headers={"Content-Type": "application/json"}).status_code)


def run_scenario(url: str, body: dict | None, seconds: float, clients: int) -> dict:
    stop, codes = threading.Event(), []
    threads = [threading.Thread(target=load, args=(url, body, stop, codes)) for _ in range(clients if body else 0)]
    for t in threads:
        t.start()
    latencies = []
    with httpx.Client(timeout=30) as http:
        time.sleep(0.5 if body else 0)  # the load is under way before the first probe
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            http.get(url + "/v1/status").raise_for_status()
            latencies.append(time.perf_counter() - start)
            time.sleep(PROBE_S)
    stop.set()
    for t in threads:
        t.join()
    p = np.percentile(latencies, [50, 99])
    return {"probes": len(latencies), "heavy_requests": len(codes), "codes": sorted(set(codes)),
            "p50_s": float(p[0]), "p99_s": float(p[1]), "max_s": max(latencies)}


def table(rows: dict[str, dict]) -> str:
    idle = rows["idle"]["p99_s"]
    lines = ["| scenario | heavy requests (codes) | status probes | P50 ms | P99 ms | max ms | P99 / idle P99 |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        codes = ",".join(map(str, r["codes"])) or "-"
        lines.append(f"| {name} | {r['heavy_requests']} ({codes}) | {r['probes']} | {r['p50_s'] * 1e3:.1f} | "
                     f"{r['p99_s'] * 1e3:.1f} | {r['max_s'] * 1e3:.1f} | {r['p99_s'] / idle:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="prompt_bound.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="expert store (default: the small demo in a temporary dir)")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each scenario (default 15)")
    parser.add_argument("--clients", type=count, default=2, help="threads sending the heavy requests (default 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "demo-small"
            subprocess.run([*CLI, "init-demo", "--out", str(model), "--size", "small"], check=True, capture_output=True)
        context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
        port, log = free_port(), Path(tmp) / "agent.log"
        with log.open("w") as out, started([*CLI, "serve", "--model", str(model), "--port", str(port), "--policy",
                                            "lru"], stop_s=60, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT) as proc:
            url = wait_for_agent(proc, port, f"see {log}")
            rows = {name: run_scenario(url, body, args.seconds, args.clients)
                    for name, body in scenarios(context).items()}
    print(table(rows))
    worst = max(r["p99_s"] for r in rows.values())
    print(f"worst status P99 {worst * 1e3:.1f} ms (goal under {GOAL_S * 1e3:.0f} ms)")
    write_results("prompt_bound", {"rows": rows, "max_prompt_bytes": MAX_PROMPT_BYTES, "context": context,
                                   "seconds": args.seconds, "clients": args.clients, "probe_s": PROBE_S,
                                   "model": str(args.model or "demo-small"), "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
