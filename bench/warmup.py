"""Cold-start benchmark: expert-cache hit rate of an agent's first requests, with and without warm-up.

    .venv/bin/python bench/warmup.py [--model data/demo] [--requests 8] [--policy lru]

Two fresh agents in one run, same cap (25% of expert bytes), policy and request list. "cold" serves
the requests straight away; "warm" first gets `flashmoe-cli warmup examples/benchmark_input.json`
(hot experts of those prompts preloaded). The measured requests are different prompts from the
warm-up file's, sent one at a time, so each response's own hit and miss counts are exact. The
expert file is dropped from the page cache before each agent (reads are O_DIRECT anyway).
Prints a table, writes bench/results/warmup.json.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repo, so `bench` imports
from bench.common import RESULTS_DIR, count, machine, write_results  # noqa: E402
from agent.experts.layout import drop_page_cache  # noqa: E402
from bench.memory import interrupt_on_sigterm  # noqa: E402
from bench.processes import started  # noqa: E402
from bench.serve import CLI, ROOT, free_port, wait_for_agent  # noqa: E402

WARMUP_FILE = ROOT / "examples" / "benchmark_input.json"
PROMPTS = ["Describe the failure modes of a flash translation layer.", "Write a limerick about a cache miss.",
           "How do I read SMART data from an NVMe drive?", "Give me three tips for writing clear error messages.",
           "Explain continuous batching to a new engineer.", "What does PSI memory pressure measure?",
           "Translate to German: the expert cache is warm.", "Sum the numbers from 1 to 100 and explain how."]


def measure(model: Path, policy: str, requests: int, max_tokens: int, warm: bool, logs: Path) -> dict:
    drop_page_cache(model / "experts.bin")
    log, port = logs / f"warmup-{'warm' if warm else 'cold'}.log", free_port()
    with log.open("w") as out, started([*CLI, "serve", "--model", str(model), "--port", str(port), "--cache-cap", "25%",
                                        "--policy", policy], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT) as proc:
        url = wait_for_agent(proc, port, f"see {log}")
        warmup_s = 0.0
        if warm:
            t = time.perf_counter()
            subprocess.run([*CLI, "warmup", str(WARMUP_FILE), "--agent-url", url, "--json"], check=True,
                           capture_output=True, cwd=ROOT)
            warmup_s = time.perf_counter() - t
        rows = []
        for prompt in PROMPTS[:requests]:
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0}, timeout=1800).json()["flashmoe"]
            rows.append(r)
    hits, misses = sum(r["expert_hits"] for r in rows), sum(r["expert_misses"] for r in rows)
    first = rows[0]["expert_hits"] / (rows[0]["expert_hits"] + rows[0]["expert_misses"])
    return {"config": "warm-up then serve" if warm else "cold start", "requests": len(rows),
            "hit_rate": hits / (hits + misses),
            "first_request_hit_rate": first,
            "per_request_hit_rate": [r["expert_hits"] / (r["expert_hits"] + r["expert_misses"])
                                                                     for r in rows],
            "mean_latency_s": sum(r["latency_s"] for r in rows) / len(rows), "warmup_s": warmup_s,
            "bytes_read": sum(r["bytes_read"] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "data" / "demo")
    ap.add_argument("--requests", type=count, default=8, choices=range(1, len(PROMPTS) + 1),
                    metavar=f"1..{len(PROMPTS)}")
    ap.add_argument("--max-tokens", type=count, default=8)
    ap.add_argument("--policy", default="lru")
    args = ap.parse_args()
    interrupt_on_sigterm()
    logs = RESULTS_DIR / "serve-logs"
    logs.mkdir(parents=True, exist_ok=True)
    results = [measure(args.model, args.policy, args.requests, args.max_tokens, warm, logs) for warm in (False, True)]
    cold, warm = results
    head = (f"{'config':<20} {'req':>4} {'hit rate':>9} {'1st req hit':>11} {'mean lat s':>10} {'GB read':>8} "
            f"{'warm-up s':>9}")
    print(head + "\n" + "-" * len(head))
    for r in results:
        print(f"{r['config']:<20} {r['requests']:>4} {r['hit_rate']:>9.3f} {r['first_request_hit_rate']:>11.3f} "
              f"{r['mean_latency_s']:>10.2f} {r['bytes_read'] / 1e9:>8.2f} {r['warmup_s']:>9.1f}")
    ratio = warm["hit_rate"] / cold["hit_rate"] if cold["hit_rate"] else float("inf")
    print(f"\nhit rate of the first {args.requests} requests: warm / cold = {ratio:.2f}")
    write_results("warmup", {"command": " ".join(sys.argv), "model": str(args.model), "policy": args.policy,
                             "cache_cap": "25%", "max_tokens": args.max_tokens, "machine": machine(args.model),
                             "results": results, "warm_over_cold_hit_rate": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
