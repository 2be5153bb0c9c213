"""Seed scale driven by a model's own recorded prompt routing: prompt processing and decode of real
prompts against the machine's limit, and the agent's hit rate against the simulator's on the same rows.

    flock /work/wt/bench.lock .venv/bin/python bench/scale_prompts.py --model /work/models/deepseek-v2-lite-14/int8 \\
        [--trace ../shared/traces/prefill/deepseek_v2_lite_puffin_0001-1000.npz] [--prompts 808,816,824] \\
        [--tokens 16] [--rounds 1] [--configs a,b,c,e]

Each prompt (by number; the report split is 801..1000, never trained on) is cut out of the prefill NPZ
with its layers cut to the model's MoE layers (a store written with `--layers N` has N - 1 of
DeepSeek-V2-Lite's 26) into a one-prompt NPZ. Its first L - tokens rows route the prompt, processed
token by token (generate's default `--prefill sequential`; `--prefill batched`: in one step, the cache
in global scope, since a quarter of a layer's experts cannot hold the union a long prompt routes), its
last `tokens` rows route the decode: every token is routed as recorded, in order. The prompt's ids are
chosen so that the route trace places the sequence at its first record (agent/model/route_trace.py
places a sequence by a hash of its first step's tokens); random weights make the ids meaningless.
Per round, as bench/scale.py: the raw O_DIRECT bandwidth; per prompt, compute-only (every expert
resident) and then each configuration, a `flashmoe-cli generate` in the same cgroup limit from a cold
page cache: (a) learned policy + prefetch, (b) LRU + prefetch, (c) mmap, (e), (f) = (a), (b)
without prefetch: what the simulator replays, and (g) = (a) with adaptive prefetch (the agent's
default). Beside them, agent/simulator.py's hit rate on the same one-prompt NPZ (same cap, policy and
scope; no prefetch). With `--contexts`, first: compute-only decode steps at those context lengths
(MLA's attention as the KV cache grows), and the same for each `--reference` store (e.g. OLMoE's
multi-head attention). Writes bench/results/scale-prompts.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from agent.experts.cap import parse_cap  # noqa: E402
from agent.experts.layout import EXPERTS, INDEX, Index  # noqa: E402
from agent.experts.reader import IO_THREADS  # noqa: E402
from agent.model.config import MoEConfig  # noqa: E402
from agent.model.loading import load_model  # noqa: E402
from agent.model.route_trace import RouteTrace  # noqa: E402
from agent.simulator import simulate  # noqa: E402
from agent.traces import read_npz  # noqa: E402
from bench.common import count, machine, results_name, write_results  # noqa: E402
from bench.loader import raw_baseline  # noqa: E402
from bench.memory import MemoryCgroup, device_memory  # noqa: E402
from bench.scale import (CHUNK, CONFIGS, Config, OneLayerResident, compute_run, gate_summary, limit_tok_s,  # noqa: E402
                         own_compute_ms, print_phases, run_config)

TRACE = ROOT.parent / "shared" / "traces" / "prefill" / "deepseek_v2_lite_puffin_0001-1000.npz"
PROMPTS = (808, 816, 824)   # the first three of the report split with at least 90 tokens: 95, 156, 94
CAP = "25%"
CONFIGS = CONFIGS | {"f": Config("f: (b) without prefetch", "lru", "direct", "off")}
SIMULATED = ("flashmoe", "lru")


def prompt_slice(source: Path, number: int, moe_layers: int, out_dir: Path, rows: int | None = None,
                 id_order: bool = False) -> Path:
    """One prompt's rows of a prefill NPZ (its first `rows` if given), its first `moe_layers` layers, as a
    one-prompt NPZ in out_dir; with `id_order` each token's experts in id order, the order the agent takes
    a step's experts in (the NPZ holds them in rank order; LRU breaks ties within a step by the order)."""
    with np.load(source, allow_pickle=False) as z:
        numbers = list(z["prompt_numbers"])
        if number not in numbers:
            raise SystemExit(f"{source} has no prompt numbered {number} (it holds {min(numbers)}..{max(numbers)})")
        if moe_layers > z["expert_ids"].shape[1]:
            raise SystemExit(f"{source} routes {z['expert_ids'].shape[1]} layers, the model has {moe_layers}")
        i = numbers.index(number)
        offsets = z["prompt_offsets"]
        end = offsets[i + 1] if rows is None else min(offsets[i] + rows, offsets[i + 1])
        ids = z["expert_ids"][offsets[i]:end, :moe_layers]
        ids = np.sort(ids, axis=-1) if id_order else ids
        meta = {**json.loads(str(z["meta"])), "layers": moe_layers, "cut_from": source.name}
        path = out_dir / f"{source.stem}-prompt{number}-{len(ids)}rows-{moe_layers}layers{'-sorted' * id_order}.npz"
        np.savez(path, expert_ids=ids, prompt_offsets=np.array([0, len(ids)]),
                 prompt_numbers=np.array([number], np.int32), layers=z["layers"][:moe_layers], meta=json.dumps(meta))
    return path


def placed_at_start(trace: Path, config: MoEConfig, length: int, batched: bool = False) -> list[int]:
    """`length` prompt ids that the route trace places at its first record, so the prompt's token p takes
    the recorded row p. A sequence is placed by its first step's tokens: the first token of a token-by-token
    prefill, the whole prompt of a batched one."""
    routes = RouteTrace.load([trace], config)
    for first in range(config.vocab_size):
        ids = [(first + p) % config.vocab_size for p in range(length)]
        if routes.place(torch.tensor(ids if batched else ids[:1])).start == 0:
            return ids
    raise SystemExit(f"no first token places a sequence at the start of {trace}")


def simulated_hit_rates(trace: Path, slots: int) -> dict[str, float]:
    """The simulator's hit rate on `trace` with the agent's cache of `slots` (cold misses counted, as the
    agent's run hit rate). `--cache-cap 25%` is a quarter of the expert bytes in whole slots, and a
    slot is a block rounded up to the O_DIRECT alignment, so it can hold a slot less than 25% of the blocks."""
    rows = read_npz(trace)
    return {policy: simulate(rows, policy, slots / (rows.n_layers * rows.n_experts), "layer").hit_rate
            for policy in SIMULATED}


def decode_at_contexts(store: Path, contexts: Sequence[int], repeat: int = 5) -> dict[int, dict[str, float]]:
    """Compute-only decode steps (every expert resident, the model's own router, one torch thread) after
    `n` positions of KV cache (random values where a prompt of that length would have left its keys): ms
    per token of the attention phase and of the whole step, and the KV cache's bytes per position."""
    model = load_model(store, OneLayerResident(store), prefetch=False)
    torch.set_num_threads(1)
    out = {}
    warm = 2
    for n in contexts:
        seq = model.new_sequence(n + warm + repeat)
        seq.k.normal_(), seq.v.normal_()
        seq.pos = n
        for _ in range(warm):
            model.step([(seq, torch.tensor([1]))])      # kernels built, not timed
        before, start = dict(model.profile.seconds), time.perf_counter()
        for _ in range(repeat):
            model.step([(seq, torch.tensor([1]))])
        step_s = (time.perf_counter() - start) / repeat
        out[n] = {"attention_ms": model.profile.since(before)["attention"] / repeat * 1000, "step_ms": step_s * 1000,
                  "kv_bytes_per_position": (seq.k.nbytes + seq.v.nbytes) // seq.max_len}
        print(f"  {store}: context {n}: attention {out[n]['attention_ms']:.1f} ms, step {out[n]['step_ms']:.1f} ms, "
              f"KV {out[n]['kv_bytes_per_position']} bytes a position", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="an expert store of the trace's architecture")
    ap.add_argument("--trace", type=Path, default=TRACE, help="a prefill NPZ (default: DeepSeek-V2-Lite's)")
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="prompt numbers, comma separated")
    ap.add_argument("--tokens", type=count, default=16, help="each prompt's last rows decoded (default 16)")
    ap.add_argument("--rounds", type=count, default=1, help="rounds; medians over prompts and rounds")
    ap.add_argument("--configs", default="a,b,c,e", help="which of a,b,c,e,f,g, in this order for every prompt")
    ap.add_argument("--prefill", choices=("sequential", "batched"), default="sequential",
                    help="the prompt token by token (default) or in one step, the cache in global scope")
    ap.add_argument("--contexts", default="",
                    help="context lengths for decode_at_contexts, comma separated (none: skip)")
    ap.add_argument("--reference", type=Path, nargs="*", default=[], help="other stores measured at --contexts too")
    ap.add_argument("--results", type=results_name, default="scale-prompts",
                    help="bench/results/NAME.json to write (default scale-prompts)")
    args = ap.parse_args()
    store = args.model
    index = Index.load(store / INDEX)
    config = MoEConfig.from_file(store / "config.json")
    cgroup = MemoryCgroup(device_memory(store, parse_cap(CAP, index.nbytes * len(index.blocks))))
    print(cgroup.describe())
    chosen = [CONFIGS[c] for c in args.configs.split(",")] if args.configs else []
    contexts = [int(n) for n in args.contexts.split(",") if n]
    at_contexts = {str(s): decode_at_contexts(s, contexts) for s in (store, *args.reference)} if contexts else {}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = {n: prompt_slice(args.trace, n, len(config.moe_layer_ids), Path(tmp))
                   for n in map(int, args.prompts.split(","))}
        try:
            for r in range(args.rounds if chosen else 0):
                raw = raw_baseline(store / EXPERTS, index, CHUNK, IO_THREADS)
                print(f"round {r + 1}: raw {raw['raw_mb_s']:.0f} MB/s", flush=True)
                rounds.append({"round": r, **raw, "prompts": [
                    run_prompt(store, n, path, config, chosen, r, cgroup, args.tokens, raw["raw_mb_s"],
                               args.prefill == "batched")
                    for n, path in prompts.items()]})
        finally:
            cgroup.remove()
    facts = {**machine(store), "memory_limit": cgroup.describe(), "model": str(store),
             "expert_bytes": index.nbytes * len(index.blocks),
             "config": json.loads((store / "config.json").read_text()),
             "trace": str(args.trace), "kv_bytes_per_token_layer": kv_bytes(config)}
    summary = summarize(rounds) if chosen else {}
    if chosen:
        print_table(summary, facts)
    write_results(args.results, {"command": " ".join(sys.argv), "machine": facts, "tokens": args.tokens, "cap": CAP,
                                 "decode_at_contexts": at_contexts, "rounds": rounds, "summary": summary})
    return 0


def run_prompt(store: Path, number: int, trace: Path, config: MoEConfig, chosen: list[Config], round_: int,
               cgroup: MemoryCgroup, tokens: int, raw_mb_s: float, batched: bool = False) -> dict:
    """Compute-only, then every configuration, on one prompt, each with its limits beside it; then the
    simulator on the same rows with the cache the O_DIRECT runs had (token by token only: the simulator
    replays the recorded rows one token a step, not a batched step's union)."""
    length = read_npz(trace).n_tokens
    if length <= tokens:
        raise SystemExit(f"prompt {number} has {length} tokens; --tokens {tokens} leaves none to prefill")
    ids = placed_at_start(trace, config, length - tokens, batched)
    bound = compute_run(store, [trace], ids, tokens, prefill_chunk=None if batched else 1)
    compute = {"prefill_tok_s": len(ids) / bound.prefill_s, "decode_tok_s": bound.decode_tokens_per_s}
    print(f"  prompt {number}: {len(ids)} tokens + {tokens} decoded; compute-only prefill "
          f"{compute['prefill_tok_s']:.2f} tok/s, decode {compute['decode_tok_s']:.2f} tok/s", flush=True)
    out = {"prompt": number, "prompt_tokens": len(ids), "compute": compute, "runs": []}
    reference = None
    for c in chosen:
        run = run_config(store, c, round_, cgroup, [trace], ids, tokens, 1, CAP,
                         extra=("--prefill", "batched", "--scope", "global") if batched else ())
        prefill_limit, _, _ = limit_tok_s(compute["prefill_tok_s"], run.prefill_mb_per_token, raw_mb_s)
        decode_limit, _, _ = limit_tok_s(compute["decode_tok_s"], run.mb_per_token, raw_mb_s)
        reference = reference or run.token_ids
        print(f"    {c.name}: prefill {run.prefill_tok_s:.2f} tok/s = {run.prefill_tok_s / prefill_limit:.2f} x limit, "
              f"{run.prefill_mb_per_token:.0f} MB/token; decode {run.decode_tok_s:.2f} tok/s = "
              f"{run.decode_tok_s / decode_limit:.2f} x limit, {run.mb_per_token:.0f} MB/token; "
              f"hit rate {run.run_hit_rate:.3f} "
              f"(decode {run.hit_rate:.3f}); attention {run.profile_ms.get('attention', 0):.0f} ms/token; "
              f"peak RSS {run.peak_rss_bytes / 2**20:.0f} MiB, "
              f"cgroup peak {(run.cgroup_peak_bytes or 0) / 2**20:.0f} MiB; {gate_summary(run)}; "
              f"same tokens: {run.token_ids == reference}", flush=True)
        out["runs"].append({**asdict(run), "prefill_limit_tok_s": prefill_limit, "decode_limit_tok_s": decode_limit,
                            "same_tokens": run.token_ids == reference})
    slots = next((run["capacity_slots"] for run in out["runs"] if CONFIGS[run["config"][0]].backend == "direct"), None)
    if slots is not None and not batched:
        # the rows the agent ran: the prompt and every decode step but the last token's (sampled, never run)
        ran = prompt_slice(trace, number, len(config.moe_layer_ids), trace.parent, len(ids) + tokens - 1, id_order=True)
        out["simulated"] = simulated_hit_rates(ran, slots)
        print(f"    simulator, {slots} slots: {out['simulated']}", flush=True)
    return out


def kv_bytes(config: MoEConfig) -> dict[str, int]:
    """bfloat16 bytes a KV cache holds per token and layer: as the model caches it, and as every head's
    key and value would take if expanded (MLA's saving)."""
    heads, k, v = config.kv_cache_shape
    expanded = config.n_heads * (config.k_head_dim + config.mla.v_dim) if config.mla else heads * (k + v)
    return {"cached": heads * (k + v) * 2, "expanded": expanded * 2}


def summarize(rounds: list[dict]) -> dict:
    """Per configuration over every prompt and round: tokens over seconds (prefill, decode), medians of the
    rest; the agent's run hit rate against the simulator's on the same prompts."""
    med = statistics.median
    runs = [(p, run) for r in rounds for p in r["prompts"] for run in p["runs"]]
    out: dict = {"raw_mb_s": med(r["raw_mb_s"] for r in rounds), "configs": {}}
    for name in dict.fromkeys(run["config"] for _, run in runs):
        mine = [(p, run) for p, run in runs if run["config"] == name]
        prefill_s = sum(p["prompt_tokens"] / run["prefill_tok_s"] for p, run in mine)
        decode_tokens = sum(len(run["token_ids"]) - 1 for _, run in mine)
        decode_s = sum((len(run["token_ids"]) - 1) / run["decode_tok_s"] for _, run in mine)
        out["configs"][name] = {
            "prefill_tok_s": sum(p["prompt_tokens"] for p, _ in mine) / prefill_s,
            "decode_tok_s": decode_tokens / decode_s,
            **{k: med(run[k] for _, run in mine) for k in (
                "prefill_mb_per_token", "mb_per_token", "run_hit_rate", "hit_rate", "peak_rss_bytes",
                "prefill_limit_tok_s", "decode_limit_tok_s")},
            "prefill_of_limit": med(run["prefill_tok_s"] / run["prefill_limit_tok_s"] for _, run in mine),
            "decode_of_limit": med(run["decode_tok_s"] / run["decode_limit_tok_s"] for _, run in mine),
            "cgroup_peak_bytes": max(run["cgroup_peak_bytes"] or 0 for _, run in mine),
            "profile_ms": {k: med(run["profile_ms"][k] for _, run in mine) for k in mine[0][1]["profile_ms"]},
            "same_tokens": all(run["same_tokens"] for _, run in mine)}
        config = CONFIGS[name[0]]
        if config.backend != "mmap":   # the page cache runs no policy the simulator has
            sims = [p["simulated"][config.policy] for p, _ in mine if "simulated" in p]
            if sims:
                out["configs"][name]["simulated_hit_rate"] = med(sims)
    compute = [p["compute"] for r in rounds for p in r["prompts"]]
    out["compute"] = {k: med(c[k] for c in compute) for k in ("prefill_tok_s", "decode_tok_s")}
    return out


def print_table(summary: dict, facts: dict) -> None:
    c0 = facts["config"]
    print(f"\n{c0.get('model_type')} {c0.get('num_hidden_layers')} layers ({c0.get('flashmoe_cut', 'whole')}), "
          f"{facts['expert_bytes'] / 1e9:.1f} GB of experts; cap {CAP}; raw {summary['raw_mb_s']:.0f} MB/s; "
          f"compute-only "
          f"prefill {summary['compute']['prefill_tok_s']:.2f}, decode {summary['compute']['decode_tok_s']:.2f} tok/s; "
          f"KV bytes per token and layer {facts['kv_bytes_per_token_layer']}; {facts['memory_limit']}")
    print(f"{'configuration':<30} {'prefill':>7} {'x lim':>5} {'MB/tok':>6} {'decode':>6} {'x lim':>5} {'MB/tok':>6} "
          f"{'hit':>5} {'sim':>5} {'dec hit':>7} {'peak RSS':>8} {'cg peak':>8}")
    for name, c in summary["configs"].items():
        sim = c.get("simulated_hit_rate")
        print(f"{name:<30} {c['prefill_tok_s']:>7.2f} {c['prefill_of_limit']:>5.2f} {c['prefill_mb_per_token']:>6.0f} "
              f"{c['decode_tok_s']:>6.2f} {c['decode_of_limit']:>5.2f} {c['mb_per_token']:>6.0f} "
              f"{c['run_hit_rate']:>5.3f} "
              f"{'' if sim is None else f'{sim:.3f}':>5} {c['hit_rate']:>7.3f} {c['peak_rss_bytes'] / 2**20:>6.0f}Mi "
              f"{c['cgroup_peak_bytes'] / 2**20:>6.0f}Mi")
    print_phases(summary["configs"])
    own = ", ".join(f"{name[:1]} {own_compute_ms(c['profile_ms']):.0f} ms" for name, c in summary["configs"].items())
    print(f"(own compute per decode token: {own})")


if __name__ == "__main__":
    sys.exit(main())
