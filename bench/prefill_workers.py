"""A batched prefill's compute on one worker and on two: whole experts handed out to both cores.

    .venv/bin/python bench/prefill_workers.py --model /work/models/olmoe-1b-7b-int8 [--tokens 128,512] [--rounds 2]

One model step of a whole prompt (generate --prefill batched, as serving's admission step) with every
expert resident (bench/scale.py's prefill bound: each layer served by layer 0's blocks held in RAM, so
no read is waited for), its routing from recorded real traces (by default OLMoE's held-out decode
traces): with a prompt of T tokens a layer's union is nearly all its experts, each run on ~T x top-k /
experts tokens. Per prompt length, one worker and two (agent/workers.py) interleaved in rounds, one
torch thread each; reported: prompt tokens/s (the best of two steps per round, median over rounds)
and two workers over one within each round. JSON: bench/results/prefill_workers.json (or --results NAME).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repo, so `bench` imports when run as a script
from agent.tokenizer import load_tokenizer  # noqa: E402
from bench.common import counts, count, machine, results_name, write_results  # noqa: E402
from bench.scale import DEFAULT_TRACES, PROMPT, prefill_bound_s  # noqa: E402

WORKERS = (1, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="an expert store of a real-shaped model")
    ap.add_argument("--route-trace", type=Path, nargs="*", default=DEFAULT_TRACES, metavar="FILE")
    ap.add_argument("--tokens", type=counts, default=[128, 512], help="prompt lengths, comma separated")
    ap.add_argument("--rounds", type=count, default=2)
    ap.add_argument("--results", type=results_name, default="prefill_workers")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ids = load_tokenizer(args.model).encode(PROMPT)
    load = [os.getloadavg()[0]]
    seconds = {t: {w: [] for w in WORKERS} for t in args.tokens}
    for n in range(args.rounds):
        for t in args.tokens:
            for w in WORKERS:
                seconds[t][w].append(prefill_bound_s(args.model, args.route_trace, (ids * t)[:t], w))
            took = ", ".join(f"{w} worker(s) {seconds[t][w][-1]:.2f} s" for w in WORKERS)
            print(f"round {n + 1}, {t} tokens: {took}", flush=True)
        load.append(os.getloadavg()[0])
    rows = {t: {"tok_s": {w: t / statistics.median(s) for w, s in by.items()},
                "two_over_one": statistics.median(a / b for a, b in zip(by[1], by[2]))} for t, by in seconds.items()}
    print(f"{'prompt tokens':>13} " + " ".join(f"{f'{w} worker(s) tok/s':>18}" for w in WORKERS) + f" {'2 / 1':>6}")
    for t, r in rows.items():
        print(f"{t:>13} " + " ".join(f"{r['tok_s'][w]:>18.1f}" for w in WORKERS) + f" {r['two_over_one']:>6.2f}")
    print(f"load average (1 min) through the run: {', '.join(f'{x:.2f}' for x in load)}")
    write_results(args.results, {"command": " ".join(sys.argv), "machine": machine(args.model),
                                 "route_trace": [str(p) for p in args.route_trace], "seconds": seconds, "rows": rows,
                                 "load_avg": load})
    return 0


if __name__ == "__main__":
    sys.exit(main())
