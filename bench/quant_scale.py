"""int8 experts against bf16 at seed scale: decode speed of one checkpoint's two stores in the same memory.

    .venv/bin/python bench/quant_scale.py --plain /work/models/olmoe-1b-7b/store \\
        --int8 /work/models/olmoe-1b-7b-int8 [--rounds 3] [--tokens 32] [--configs a,b,c]

bench/scale.py's measurement on both stores, interleaved: routing from recorded real traces
(--route-trace, by default OLMoE's held-out decode traces), each round the raw O_DIRECT rate of the
expert file at the device's best parallelism and each store's compute-only decode (every expert
resident), then each configuration ((a) learned policy + prefetch, (b) LRU + prefetch, O_DIRECT; (c) mmap of
the store, the page cache decides) as a `flashmoe-cli generate` in its own process from a cold page cache,
bf16 then int8. Both stores get one
cache cap in bytes, 25% of the bf16 store's expert bytes (the edge device's RAM for experts), and one
cgroup memory limit (that cap + the dense weights + working memory): the int8 cache holds twice the
experts. A run's limit is 1 / max(its store's compute s/token, its MB missed per token / raw MB/s).
Reported per store and configuration: decode tokens/s (median over rounds), × its limit, MB read and
hit rate per decode token, peak RSS; and within each round int8 / bf16 tokens/s, and with (c) run, (a)/(c)
on the same store and (a) of each store over (c) of the bf16 store (llama.cpp's way with the weights as
published).
JSON: bench/results/quant_scale.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from agent.experts.cap import parse_cap  # noqa: E402
from agent.experts.layout import EXPERTS, INDEX, Index  # noqa: E402
from agent.experts.reader import IO_THREADS  # noqa: E402
from agent.tokenizer import load_tokenizer  # noqa: E402
from bench.common import count, machine, results_name, write_results  # noqa: E402
from bench.loader import best_raw_read  # noqa: E402
from bench.memory import MemoryCgroup, device_memory  # noqa: E402
from bench.scale import (CHUNK, CONFIGS, DEFAULT_TRACES, PROMPT, compute_bound, limit_tok_s,  # noqa: E402
                         prefill_bound_s, run_config)

STORES = ("bf16", "int8")


def one_round(n: int, stores: dict[str, Path], configs: list, cap: int, cgroup: MemoryCgroup, traces: list[Path],
              prompt_ids: list[int], tokens: int, prefill_tokens: int) -> dict:
    plain = stores["bf16"] / EXPERTS
    raw_s, streams = best_raw_read(plain, CHUNK, IO_THREADS)
    long_prompt = (prompt_ids * prefill_tokens)[:prefill_tokens]
    r = {"round": n, "raw_mb_s": plain.stat().st_size / raw_s / 1e6, "raw_streams": streams,
         "compute_tok_s": {s: compute_bound(stores[s], traces, prompt_ids, tokens) for s in STORES},
         "prefill_s": {s: prefill_bound_s(stores[s], traces, long_prompt) for s in STORES}, "runs": []}
    print(f"round {n + 1}: raw {r['raw_mb_s']:.0f} MB/s ({streams} stream(s)); compute-only "
          + ", ".join(f"{s} {r['compute_tok_s'][s]:.2f} tok/s" for s in STORES) + f"; a {prefill_tokens}-token "
          "batched prefill, every expert resident: " + ", ".join(f"{s} {r['prefill_s'][s]:.2f} s" for s in STORES),
          flush=True)
    for config in configs:
        for s in STORES:
            run = run_config(stores[s], config, n, cgroup, traces, prompt_ids, tokens, 1, cap=str(cap),
                             others=tuple(stores.values()))
            lim, _, _ = limit_tok_s(r["compute_tok_s"][s], run.mb_per_token, r["raw_mb_s"])
            print(f"  {s} {config.name}: {run.decode_tok_s:.2f} tok/s = {run.decode_tok_s / lim:.2f} x its limit "
                  f"{lim:.2f}; {run.mb_per_token:.0f} MB/token, hit rate {run.hit_rate:.3f}, "
                  f"peak RSS {run.peak_rss_bytes / 2**20:.0f} MiB", flush=True)
            r["runs"].append({**asdict(run), "store": s, "limit_tok_s": lim})
    return r


def summarize(rounds: list[dict], configs: list) -> dict:
    """Medians over rounds per configuration and store; tokens/s ratios taken within each round."""
    med = statistics.median
    out = {"configs": {}, "a_over_c": {}}
    for config in configs:
        runs = {s: [run for r in rounds for run in r["runs"] if run["config"] == config.name and run["store"] == s]
                for s in STORES}
        row = out["configs"][config.name] = {
            s: {k: med(run[k] for run in runs[s]) for k in
                ("decode_tok_s", "limit_tok_s", "mb_per_token", "hit_rate", "peak_rss_bytes")} for s in STORES}
        for s in STORES:
            row[s]["of_limit"] = med(run["decode_tok_s"] / run["limit_tok_s"] for run in runs[s])
        ratios = [i["decode_tok_s"] / b["decode_tok_s"] for b, i in zip(runs["bf16"], runs["int8"])]
        row["int8_over_bf16"] = {"median": med(ratios), "per_round": ratios}
    a, c = CONFIGS["a"].name, CONFIGS["c"].name
    if a in out["configs"] and c in out["configs"]:
        for s, mmap_store in (("bf16", "bf16"), ("int8", "int8"), ("int8", "bf16")):
            ratios = [_tok_s(r, a, s) / _tok_s(r, c, mmap_store) for r in rounds]
            out["a_over_c"][f"a {s} / c {mmap_store}"] = {"median": med(ratios), "per_round": ratios}
    return out


def _tok_s(round_: dict, config: str, store: str) -> float:
    return next(run["decode_tok_s"] for run in round_["runs"] if run["config"] == config and run["store"] == store)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plain", type=Path, required=True, help="the checkpoint's store as converted (bf16)")
    ap.add_argument("--int8", type=Path, required=True, help="the same checkpoint converted with --quantize int8")
    ap.add_argument("--route-trace", type=Path, nargs="+", default=DEFAULT_TRACES, metavar="FILE")
    ap.add_argument("--tokens", type=count, default=32, help="new tokens per run (default 32)")
    ap.add_argument("--rounds", type=count, default=3, help="interleaved rounds; medians are reported")
    ap.add_argument("--configs", default="a,b", help="which of bench/scale.py's a,b (O_DIRECT) and c (mmap) to run "
                                                     "('': the compute-only measurements alone)")
    ap.add_argument("--prefill-tokens", type=count, default=256,
                    help="prompt length of the compute-only batched prefill (default 256: 32 tokens per expert)")
    ap.add_argument("--results", type=results_name, default="quant_scale",
                    help="write bench/results/<NAME>.json (default quant_scale)")
    args = ap.parse_args()
    stores = {"bf16": args.plain, "int8": args.int8}
    index = Index.load(args.plain / INDEX)
    if Index.load(args.int8 / INDEX).quant != "int8" or index.quant is not None:
        raise SystemExit(f"{args.int8} must be an int8 store and {args.plain} an unquantized one")
    cap = parse_cap("25%", index.nbytes * len(index.blocks))
    cgroup = MemoryCgroup(device_memory(args.plain, cap))   # the same limit as bench/scale.py's
    print(cgroup.describe())
    prompt_ids = load_tokenizer(args.plain).encode(PROMPT)
    configs = [CONFIGS[c] for c in args.configs.split(",") if c]
    torch.set_num_threads(1)
    rounds = []
    try:
        for n in range(args.rounds):
            rounds.append(one_round(n, stores, configs, cap, cgroup, args.route_trace, prompt_ids, args.tokens,
                                    args.prefill_tokens))
    finally:
        cgroup.remove()
    summary = summarize(rounds, configs)
    print(f"\ncap {cap / 2**30:.2f} GiB for both stores (25% of the bf16 experts); {cgroup.describe()}; "
          f"{args.tokens} tokens; {args.rounds} rounds; routing from "
          f"{', '.join(t.name for t in args.route_trace)}")
    print("| configuration | store | tok/s | limit | × limit | MB/token | hit rate | peak RSS | int8 / bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, c in summary["configs"].items():
        for s in STORES:
            x = c[s]
            ratio = f"{c['int8_over_bf16']['median']:.2f}" if s == "int8" else ""
            print(f"| {name} | {s} | {x['decode_tok_s']:.2f} | {x['limit_tok_s']:.2f} | {x['of_limit']:.2f} | "
                  f"{x['mb_per_token']:.0f} | {x['hit_rate']:.3f} | {x['peak_rss_bytes'] / 2**20:.0f} MiB | {ratio} |")
    prefill = [r["prefill_s"]["int8"] / r["prefill_s"]["bf16"] for r in rounds]
    summary["prefill_int8_over_bf16"] = {"median": statistics.median(prefill), "per_round": prefill}
    print(f"{args.prefill_tokens}-token batched prefill, every expert resident, int8 / bf16 time: "
          f"{summary['prefill_int8_over_bf16']['median']:.2f} (rounds {', '.join(f'{x:.2f}' for x in prefill)})")
    for key, r in summary["a_over_c"].items():
        print(f"tok/s {key}: {r['median']:.2f} (rounds {', '.join(f'{x:.2f}' for x in r['per_round'])})")
    write_results(args.results, {"command": " ".join(sys.argv), "machine": machine(args.plain),
                                  "memory_limit": cgroup.describe(), "cap_bytes": cap, "tokens": args.tokens,
                                  "route_trace": [str(t) for t in args.route_trace], "rounds": rounds,
                                  "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
