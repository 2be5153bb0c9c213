"""Decode speed and SSD traffic per token at several cache caps, O_DIRECT vs mmap, beside all experts in RAM.

    .venv/bin/python bench/decode.py [--model DIR] [--size default|small] [--tokens 48] [--repeat 2] [--results NAME]
        [--workers 1,2]

Every configuration runs `run_generate` (what `flashmoe-cli generate` runs) on the same prompt,
greedy, from a cold cache, and must produce the same tokens as the all-in-RAM run (InMemoryExperts,
the reference). Reported per configuration: decode tokens/s (prefill excluded), the decode steps'
hit rate and MB read from the SSD per token, and the ratio of its tokens/s to the in-RAM figure.
`--workers 1,2` runs every configuration on one worker and on two (generate --workers, agent/workers.py).
Rounds interleave the configurations (the machine is shared) and the median of each is reported.

The mmap rows start with experts.bin dropped from the page cache (posix_fadvise DONTNEED); after
that the kernel keeps whatever pages it likes, so their cap bounds only the cache's bookkeeping,
not the RAM used: that unbounded page cache is what the mmap design trades for. A cap below one
token's working set (top-k experts per layer) is refused by the cache; such a row runs at that
minimum and says so.

--model defaults to a private copy of the demo model in data/decode-demo-SIZE (written by init-demo if
absent): another process mapping data/demo (a running agent) would keep its pages cached.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from agent.demo import init_demo
from agent.experts.cap import cap_bounds
from agent.experts.layout import INDEX, Index
from agent.experts.provider import InMemoryExperts
from agent.generate import run_generate
from agent.model.generation import generate
from agent.model.loading import load_model
from agent.prefetch_gate import MODES
from agent.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import count, counts, machine, results_name, write_results  # noqa: E402
from bench.loader import drop_from_page_cache  # noqa: E402

PROMPT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"


@dataclass
class Row:
    config: str
    backend: str
    cap_pct: float | None          # of all expert bytes, as run (None: everything in RAM)
    note: str
    decode_tok_s: float            # median over rounds
    ratio: float                   # decode_tok_s / the in-RAM decode_tok_s
    hit_rate: float                # decode steps only
    mb_per_token: float            # read from the SSD per decode step, MB = 10^6 bytes
    prefetch_accuracy: float | None
    same_tokens: bool
    rounds_tok_s: list[float] = field(default_factory=list)


def in_ram(store: Path, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
    model = load_model(store, InMemoryExperts(store))
    gen = generate(model, prompt_ids, tokens, greedy=True)
    return gen.decode_tokens_per_s, gen.token_ids


def cached(store: Path, prompt_ids: list[int], tokens: int, cap_bytes: int, backend: str, prefetch: str,
           scope: str, policy: str, workers: int = 1) -> dict:
    drop_from_page_cache(store, Index.load(store / INDEX))
    result = run_generate(store, prompt_ids=prompt_ids, max_new_tokens=tokens, greedy=True,
                          cache_cap=str(cap_bytes), policy=policy, backend=backend, prefetch=prefetch, scope=scope,
                          workers=workers)
    return {**result.stats, "token_ids": result.token_ids}


def cap_for(store: Path, pct: float, scope: str) -> tuple[int, float, str]:
    """Cap bytes for pct% of expert bytes, raised to the cache's floor (one layer's working set) if below."""
    index = Index.load(store / INDEX)
    total = index.nbytes * len(index.blocks)
    top_k = json.loads((store / "config.json").read_text())["num_experts_per_tok"]
    floor, _ = cap_bounds(index, top_k, scope)
    want = int(total * pct / 100)
    if want >= floor:
        return want, pct, ""
    return floor, 100 * floor / total, f"{pct:g}% is below the {scope}-scope floor; ran at the minimum"


def run(store: Path, caps: list[float], backends: list[str], prefetch: list[str], tokens: int,
        repeat: int, scope: str, policy: str, workers: tuple[int, ...] = (1,)) -> list[Row]:
    prompt_ids = load_tokenizer(store).encode(PROMPT)
    configs = [(b, *cap_for(store, pct, scope), pct, p, w) for pct in caps for b in backends for p in prefetch
               for w in workers]
    ram_speeds, samples = [], {i: [] for i in range(len(configs))}
    in_ram(store, prompt_ids, 4)  # warm-up, not measured: the process's first forward passes are slower
    for _ in range(repeat):
        speed, reference = in_ram(store, prompt_ids, tokens)
        ram_speeds.append(speed)
        for i, (backend, cap_bytes, _, _, pct, pf, w) in enumerate(configs):
            samples[i].append(cached(store, prompt_ids, tokens, cap_bytes, backend, pf, scope, policy, w))
            print(f"  {_name(backend, pct, pf, w)}: {samples[i][-1]['decode_tokens_per_s']:.2f} tok/s", flush=True)
    ram = statistics.median(ram_speeds)
    rows = [Row("all experts in RAM", "in-memory", None, "", ram, 1.0, 1.0, 0.0, None, True, ram_speeds)]
    for i, (backend, _, pct_run, note, pct, pf, w) in enumerate(configs):
        runs = samples[i]
        speed = statistics.median(r["decode_tokens_per_s"] for r in runs)
        rows.append(Row(_name(backend, pct, pf, w), backend, round(pct_run, 2), note, speed, speed / ram,
                        statistics.median(r["decode_hit_rate"] for r in runs),
                        statistics.median(r["decode_mb_read_per_token"] for r in runs),
                        runs[-1]["prefetch_accuracy"], all(r["token_ids"] == reference for r in runs),
                        [round(r["decode_tokens_per_s"], 3) for r in runs]))
    return rows


def _name(backend: str, pct: float, prefetch: str, workers: int = 1) -> str:
    return (f"{backend} {pct:g}%" + {"on": "", "off": " no-pf", "auto": " pf-auto"}[prefetch]
            + (f" {workers} workers" if workers > 1 else ""))


def print_table(rows: list[Row]) -> None:
    print(f"\n{'configuration':<22} {'cap %':>6} {'tok/s':>7} {'x RAM':>6} {'hit rate':>8} {'MB/token':>9} "
          f"{'prefetch acc':>12} {'same tokens':>11}")
    for r in rows:
        cap = "-" if r.cap_pct is None else f"{r.cap_pct:g}"
        acc = "-" if r.prefetch_accuracy is None else f"{r.prefetch_accuracy:.2f}"
        print(f"{r.config:<22} {cap:>6} {r.decode_tok_s:>7.2f} {r.ratio:>6.2f} {r.hit_rate:>8.3f} "
              f"{r.mb_per_token:>9.1f} {acc:>12} {str(r.same_tokens):>11}")
    for r in rows:
        if r.note:
            print(f"note: {r.config}: {r.note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an expert store (default: a private demo copy in data/)")
    parser.add_argument("--size", choices=("default", "small"), default="default",
                        help="demo size if --model is absent")
    parser.add_argument("--tokens", type=count, default=48, help="new tokens per run (default 48)")
    parser.add_argument("--repeat", type=count, default=2, help="interleaved rounds; the median is reported")
    parser.add_argument("--caps", default="10,25,50,100", help="cache caps in %% of expert bytes")
    parser.add_argument("--backends", default="direct,mmap")
    parser.add_argument("--prefetch", choices=(*MODES, "both", "all"), default="on",
                        help="lookahead prefetch: on, off, auto (agent/prefetch_gate.py), both (on and off) or "
                             "all three")
    parser.add_argument("--threads", type=count, default=1, help="torch intra-op threads (as flashmoe-cli generate)")
    parser.add_argument("--workers", type=counts, default=[1],
                        help="threads a decode step computes on, each configuration with each: e.g. 1,2 (default 1)")
    parser.add_argument("--scope", choices=("layer", "global"), default="layer",
                        help="cache scope (global lets a cap below top-k per layer run)")
    parser.add_argument("--policy", default="lru", help="replacement policy (default lru, as BENCHMARKS.md's table)")
    parser.add_argument("--results", type=results_name, default="decode",
                        help="write bench/results/<NAME>.json (default decode)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    store = args.model or init_demo(ROOT / "data" / f"decode-demo-{args.size}", args.size)
    index = Index.load(store / INDEX)
    start = time.monotonic()
    prefetch = {"both": ["on", "off"], "all": list(MODES)}.get(args.prefetch, [args.prefetch])
    rows = run(store, [float(c) for c in args.caps.split(",")], args.backends.split(","), prefetch, args.tokens,
               args.repeat, args.scope, args.policy, tuple(args.workers))
    facts = machine(store)
    print(f"\nstore {store}: {index.n_layers} layers x {index.n_experts} experts, blocks of "
          f"{index.nbytes / 2**20:.2f} MiB ({index.nbytes * len(index.blocks) / 2**30:.2f} GiB); prompt "
          f"{len(load_tokenizer(store).encode(PROMPT))} tokens, {args.tokens} new tokens, greedy, {args.policy}, "
          f"{args.scope} scope, prefetch {args.prefetch}; {args.threads} torch thread(s); median of {args.repeat}; "
          f"{time.monotonic() - start:.0f} s")
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, {facts['ram_bytes'] / 2**30:.1f} GiB RAM, "
          f"{facts['filesystem']}, kernel {facts['kernel']}")
    print_table(rows)
    print()
    write_results(args.results, {"command": " ".join(sys.argv), "store": str(store), "layers": index.n_layers,
                                 "experts": index.n_experts, "block_bytes": index.nbytes, "tokens": args.tokens,
                                 "repeat": args.repeat, "threads": args.threads, "workers": args.workers,
                                 "prefetch": args.prefetch,
                                 "scope": args.scope, "policy": args.policy, "prompt": PROMPT, "machine": facts,
                                 "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
