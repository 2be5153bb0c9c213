"""How much a replacement policy can still save when requests share decode steps: real routing, batched.

    .venv/bin/python bench/batching.py [--traces ../shared/traces/decode] [--batches 1,2,4,8,16]
        [--names olmoe_math,olmoe_dialogue] [--results batching]

A served step runs every running request's token through each layer at once, so a layer's step
routes the union of the requests' top-k. This builds that union from real routing: each of a
batch's B requests decodes `--tokens` tokens from its own place in a recorded OLMoE decode trace
(by default `olmoe_math`, `olmoe_dialogue`: the report split's, held out from policy training), `--waves` batches one
after the other (new requests at new places, seeded), and replays the steps through every live policy (the
learned one with each of its decision rules) and Belady with the simulator, per layer at capacity
0.25 (16 of OLMoE's 64 experts: the seed-scale benches' cap). Reported per B: the union a layer's step routes, each
policy's hit rate, and the expert reads per generated token (misses summed over layers ÷ tokens: bytes ∝ that), with
what share of LRU's reads Belady — no policy can do better — still saves.
JSON: bench/results/batching.json (or --results NAME).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from agent.policies import live_policies
from agent.simulator import simulate
from agent.traces import Trace, TraceError, from_sets, load

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from bench.common import count, counts, machine, results_name, write_results  # noqa: E402
TRACES = ROOT.parent / "shared" / "traces" / "decode"
NAMES = "olmoe_math,olmoe_dialogue"
CAPACITY = 0.25
ORACLE = "belady"
LEARNED = {"flashmoe score": {"decision": "score"}, "flashmoe lfu/30": {"decision": "lfu"}}  # both decision rules


def batched(source: Trace, batch: int, tokens: int, waves: int, seed: int = 0) -> Trace:
    """`waves` batches of `batch` requests, each `tokens` decode steps from its own random start in
    `source`; a step's per-layer set is the union of its requests' routing at their positions."""
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(waves):
        starts = rng.integers(0, source.n_tokens - tokens, batch)
        for step in range(tokens):
            sets.append([list(dict.fromkeys(e for s in starts for e in source.routed(s + step, layer).tolist()))
                         for layer in range(source.n_layers)])
    return from_sets(sets, f"{source.name} B={batch}", source.n_experts, source.top_k,
                     session_starts=list(range(0, len(sets), tokens)), model=source.model)


def measure(source: Trace, batch: int, tokens: int, waves: int) -> dict:
    trace = batched(source, batch, tokens, waves)
    generated = batch * trace.n_tokens
    runs = {p: (p, {}) for p in live_policies() if p != "flashmoe"} | {k: ("flashmoe", o) for k, o in LEARNED.items()}
    rows = {}
    for label, (policy, options) in (runs | {ORACLE: (ORACLE, {})}).items():
        r = simulate(trace, policy, CAPACITY, "layer", **options)
        rows[label] = {"hit_rate": r.hits / r.accesses, "reads_per_token": (r.accesses - r.hits) / generated}
    lru, best = rows["lru"]["reads_per_token"], rows[ORACLE]["reads_per_token"]
    return {"trace": source.name, "batch": batch, "steps": trace.n_tokens, "tokens": generated,
            "union_per_layer": float(np.mean(np.diff(trace.offsets))), "policies": rows,
            "belady_saves_of_lru_reads": 1 - best / lru}


def table(results: list[dict]) -> str:
    policies = list(results[0]["policies"])
    head = ["trace", "B", "union / layer", *[f"{p} hit" for p in policies], "reads/token LRU",
            "reads/token Belady", "Belady saves"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        p = r["policies"]
        lines.append("| " + " | ".join([r["trace"], str(r["batch"]), f"{r['union_per_layer']:.1f}",
                                        *[f"{p[x]['hit_rate']:.3f}" for x in policies],
                                        f"{p['lru']['reads_per_token']:.1f}", f"{p[ORACLE]['reads_per_token']:.1f}",
                                        f"{r['belady_saves_of_lru_reads']:.0%}"]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=TRACES, help="the shared decode traces directory")
    parser.add_argument("--batches", type=counts, default=[1, 2, 4, 8, 16], help="requests per step, comma-separated")
    parser.add_argument("--tokens", type=count, default=12, help="decode tokens per request (default 12)")
    parser.add_argument("--waves", type=count, default=16, help="batches of requests one after the other (default 16)")
    parser.add_argument("--names", default=NAMES, help=f"decode traces in --traces, comma-separated (default {NAMES})")
    parser.add_argument("--results", type=results_name, default="batching",
                        help="write bench/results/<NAME>.json (default batching)")
    args = parser.parse_args()
    try:
        sources = [load(args.traces / f"{name}.jsonl") for name in args.names.split(",")]
    except TraceError as e:
        parser.error(str(e))
    if args.tokens >= min(s.n_tokens for s in sources):
        parser.error(f"--tokens {args.tokens}: a request must fit in the shortest trace "
                     f"({min(s.n_tokens for s in sources)} tokens)")
    results = []
    for source in sources:
        for batch in args.batches:
            results.append(measure(source, batch, args.tokens, args.waves))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    write_results(args.results, {"machine": machine(), "capacity": CAPACITY, "scope": "layer", "tokens": args.tokens,
                               "waves": args.waves, "results": results})


if __name__ == "__main__":
    main()
