"""Seed scale: decode speed of a real-shaped model against the machine's limit, measured in the same run.

    .venv/bin/python bench/scale.py --model /work/models/olmoe-1b-7b/store [--rounds 2] [--tokens 32]
        [--route-trace ../shared/traces/decode/olmoe_math.jsonl ../shared/traces/decode/olmoe_dialogue.jsonl]

The model is a random-weight checkpoint with real shapes (`flashmoe-cli init-demo --shape ...`);
its routing follows recorded real routing traces (`--route-trace`, by default OLMoE's held-out decode
traces, which the learned policy never saw; `--route-trace` with no file: the random router's own
routing, for a shape no recorded trace fits). Each round measures, interleaved:
- raw: the expert file read whole with O_DIRECT at the device's best parallelism (the faster of one
  stream and as many streams as the cache has I/O threads, in file order), and as the cache reads
  it (every block whole, in a shuffled order, as many in flight as it has I/O threads); the faster
  is the raw bandwidth, measured before and again after the round's runs, the better kept; and one
  region read twice to see whether the (virtual) disk's host serves repeated reads from its own RAM;
- compute: the same greedy decode with every expert resident (each layer served by one layer's
  blocks held in RAM: the same shapes, dtype and matmuls, no SSD), in this process, with one torch
  thread and with --threads, and on one worker and on as many as the configurations use (generate
  --workers, agent/workers.py); the fastest is the compute bound; and with one thread and torch's own
  F.linear for every linear (the A/B of agent/bf16_matvec.py's one-token matvec);
- (a) the learned policy + lookahead prefetch, O_DIRECT; (b) LRU + prefetch, O_DIRECT; (c) mmap of
  the store, the page cache decides, no prefetch; (d) = (a) with --threads torch threads for the
  matmuls (the reads wait in the kernel meanwhile); (e) = (a) without prefetch and (g) = (a) with
  adaptive prefetch (issued while it pays, agent/prefetch_gate.py; the agent's default); (s) = (a) with
  one cache partition for every layer (generate --scope global); a2, b2, c2, e2, g2, s2: the same on two
  workers (a token's experts on two threads at once, its large matvecs split between them; mmap's page
  faults then come from two threads at once too, as llama.cpp's do): each `flashmoe-cli generate` in its
  own process inside the same cgroup memory limit (cap + dense weights + working memory), from a cold
  page cache.
A configuration's limit is 1 / max(compute s/token, its MB missed per token / raw MB/s): perfect
overlap of reads and compute. Reported: decode tokens/s, its fraction of the limit, MB read and hit
rate per decode token, where a token's time went, the share of it with a read running, peak RSS and
the cgroup's peak against the limit, and one layer's experts computed in the stored dtype (the model's
matvec and torch's F.linear) and in float32 (the slot dtype choice).
Writes bench/results/scale.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
import agent.experts.provider  # noqa: E402
import agent.model.model  # noqa: E402
from agent.experts.cap import parse_cap  # noqa: E402
from agent.experts.layout import EXPERTS, INDEX, Index, crc32  # noqa: E402
from agent.experts.provider import ExpertWeights, block_views  # noqa: E402
from agent.experts.reader import IO_THREADS  # noqa: E402
from agent.model.generation import Generation, generate  # noqa: E402
from agent.model.loading import load_model  # noqa: E402
from agent.tokenizer import load_tokenizer  # noqa: E402
from bench.common import count, machine, results_name, write_results  # noqa: E402
from bench.loader import host_cache_check, raw_baseline  # noqa: E402
from bench.memory import MemoryCgroup, device_memory, drop_stores_pages  # noqa: E402
from bench.processes import started  # noqa: E402

CLI = [sys.executable, "-m", "agent.cli"]
TRACES = ROOT.parent / "shared" / "traces" / "decode"
DEFAULT_TRACES = [TRACES / "olmoe_math.jsonl", TRACES / "olmoe_dialogue.jsonl"]  # held out from policy training
PROMPT = "The expert cache keeps"
CHUNK = 16 * 2**20


@dataclass(frozen=True)
class Config:
    name: str
    policy: str
    backend: str
    prefetch: str                 # on, off or auto (agent/prefetch_gate.py)
    more_threads: bool = False    # --threads torch threads instead of one
    workers: int = 1              # generate --workers: threads a decode step computes on (agent/workers.py)
    dense: str = "stored"         # generate --dense: the dense linears as stored or int8 (agent/model/dense_int8.py)
    scope: str = "layer"          # generate --scope: a cache partition per layer, or one for all

    def args(self, threads: int) -> list[str]:
        return ["--policy", self.policy, "--backend", self.backend, "--threads",
                str(threads if self.more_threads else 1), "--prefetch", self.prefetch, "--dense", self.dense,
                "--workers", str(self.workers), "--scope", self.scope]


CONFIGS = {"a": Config("a: flashmoe + prefetch, O_DIRECT", "flashmoe", "direct", "on"),
           "b": Config("b: lru + prefetch, O_DIRECT", "lru", "direct", "on"),
           "c": Config("c: mmap, page cache decides", "lru", "mmap", "off"),
           "d": Config("d: (a) with --threads threads", "flashmoe", "direct", "on", more_threads=True),
           "e": Config("e: (a) without prefetch", "flashmoe", "direct", "off"),
           "g": Config("g: (a) with adaptive prefetch", "flashmoe", "direct", "auto"),
           "s": Config("s: (a) in global scope", "flashmoe", "direct", "on", scope="global")}
# Each on two workers: the two cores the machine has, used by explicit parallelism rather than torch's threads
CONFIGS |= {f"{key}2": replace(c, name=f"{key}2: {c.name.split(': ', 1)[1]}, 2 workers", workers=2)
            for key, c in CONFIGS.items() if not c.more_threads}
# Each with its dense linears in int8 (ai, a2i, c2i, ...); its limit is the compute bound with int8 dense weights
CONFIGS |= {f"{key}i": replace(c, name=f"{key}i: ({key}) with int8 dense", dense="int8") for key, c in CONFIGS.items()}
RATIOS = (("a", "c"), ("a", "b"), ("a2", "c2"), ("a2", "b2"), ("a2", "c"), ("g", "c"), ("g2", "c2"), ("s2", "c2"),
          ("s2", "a2"), ("a2", "a"), ("g2", "g"),
          ("c2", "c"), ("ai", "a"), ("a2i", "a2"), ("ci", "c"), ("c2i", "c2"), ("a2i", "c2i"), ("a2i", "c2"))


class OneLayerResident:
    """Every expert resident for the compute bound: layer L's expert e is served by layer 0's block e
    (the same shape and dtype, so the same matmuls), held in RAM; nothing is read during decode."""

    def __init__(self, store: Path) -> None:
        index = Index.load(store / INDEX)
        self._blocks = []
        for block in index.blocks[:index.n_experts]:  # layer 0, experts in order
            raw = np.fromfile(store / EXPERTS, dtype=np.uint8, count=index.nbytes, offset=block.offset)
            assert crc32(raw) == block.crc32, f"layer 0 expert {block.expert} fails its CRC"
            self._blocks.append(block_views(torch.from_numpy(raw), index))

    def route(self, layer: int, experts: list[int]) -> None:
        pass

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self._blocks[expert]

    def done(self, layer: int, expert: int) -> None:
        pass

    def prefetch(self, layer: int, experts: list[int]) -> None:
        pass


@dataclass
class Run:
    config: str
    round: int
    decode_tok_s: float
    mb_per_token: float           # read from the SSD per decode token, MB = 10^6 bytes
    hit_rate: float               # decode steps
    prefetch_accuracy: float | None
    peak_rss_bytes: int
    cgroup_peak_bytes: int | None
    token_ids: list[int]
    load_avg: float
    profile_ms: dict[str, float]  # where a decode token's time went, by phase (agent/model/profile.py)
    io_busy: float | None         # share of decode time with a block being read or checked (the rest, the device idled)
    prefill_tok_s: float          # prompt tokens per second of the prefill (token by token unless --prefill batched)
    prefill_mb_per_token: float   # read from the SSD per prompt token
    run_hit_rate: float           # prefill and decode, cold misses included (what the simulator counts)
    capacity_slots: int           # the cap in whole slots (a slot is a block rounded up to the O_DIRECT alignment)
    prefetch_gate: dict           # adaptive prefetch at the run's end: issuing, the accuracy it judged
                                  # (prefetch_gate.py)


def compute_bound(store: Path, traces: list[Path], prompt_ids: list[int], tokens: int, threads: int = 1,
                  workers: int = 1, dense: str = "stored") -> float:
    """Decode tokens/s with every expert resident (compute_run)."""
    return compute_run(store, traces, prompt_ids, tokens, threads, workers=workers, dense=dense).decode_tokens_per_s


def compute_run(store: Path, traces: list[Path], prompt_ids: list[int], tokens: int, threads: int = 1,
                prefill_chunk: int | None = 1, workers: int = 1, dense: str = "stored") -> Generation:
    """The prompt token by token (or in chunks of `prefill_chunk`; None: one step) and `tokens` greedy
    decode tokens with every expert resident, on `workers` (agent/workers.py), the dense linears `dense`.
    The routing follows the same trace records as the cached runs (placed by the same first step), so
    every step multiplies the same shapes."""
    model = load_model(store, OneLayerResident(store), prefetch=False, route_trace=traces, workers=workers,
                       dense=dense)
    torch.set_num_threads(threads)
    try:
        generate(model, prompt_ids[:4], 3, greedy=True, prefill_chunk=1)  # kernels built once, not timed
        return generate(model, prompt_ids, tokens, greedy=True, prefill_chunk=prefill_chunk)
    finally:
        torch.set_num_threads(1)


def prefill_bound_s(store: Path, traces: list[Path], prompt_ids: list[int], workers: int = 1) -> float:
    """Seconds of one batched prefill step of the whole prompt with every expert resident (its compute
    alone; the best of two, after a short one builds the kernels), on `workers` (agent/workers.py)."""
    model = load_model(store, OneLayerResident(store), prefetch=False, route_trace=traces, workers=workers)
    generate(model, prompt_ids[:16], 1, greedy=True)
    return min(generate(model, prompt_ids, 1, greedy=True).prefill_s for _ in range(2))


@contextmanager
def torch_linears() -> Iterator[None]:
    """The model computes every linear with torch's F.linear, as before agent/bf16_matvec.py (the A/B)."""
    modules = (agent.model.model, agent.experts.provider)
    saved = [m.linear for m in modules]
    for m in modules:
        m.linear = F.linear
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.linear = f


def slot_dtype_ms(store: Path, repeat: int = 20) -> dict[str, float]:
    """One token through one layer's top-k experts, one thread: ms in the stored dtype (as the model
    computes it, and with torch's own F.linear: agent/bf16_matvec.py's choice), in float32, and the ms
    a float32 conversion of one block would add to each miss (the slot dtype choice)."""
    experts = OneLayerResident(store)._blocks[:json.loads((store / "config.json").read_text())["num_experts_per_tok"]]
    if not isinstance(experts[0], ExpertWeights):
        return {}             # an int8 store: its blocks are computed as stored (the kernels bench)
    wide = [ExpertWeights(*(w.float() for w in e)) for e in experts]
    x = torch.randn(1, experts[0].gate.shape[1])

    def ms(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start) / repeat * 1000
    stored = experts[0].gate.dtype
    name = f"{stored}".removeprefix("torch.")
    return {name: ms(lambda: [e(x.to(stored)) for e in experts]),
            f"{name}_torch": ms(lambda: [torch_swiglu(e, x.to(stored)) for e in experts]),
            "float32": ms(lambda: [e(x) for e in wide]),
            "convert_one_block": ms(lambda: [w.float() for w in experts[0]])}


def torch_swiglu(e: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """An expert's SwiGLU with torch's F.linear throughout (what ExpertWeights did before its matvec)."""
    return F.linear(F.silu(F.linear(x, e.gate)) * F.linear(x, e.up), e.down)


def run_config(store: Path, config: Config, round_: int, cgroup: MemoryCgroup, traces: list[Path],
               prompt_ids: list[int], tokens: int, threads: int, cap: str = "25%",
               others: tuple[Path, ...] = (), extra: tuple[str, ...] = ()) -> Run:
    """One `flashmoe-cli generate` of `config` (and `extra` arguments) on `store`, cold: its pages and those
    of the `others` stores the same cgroup runs are dropped first."""
    drop_stores_pages(store, *others)
    if cgroup.path is not None:
        cgroup.reset_peak()
    cmd = [*CLI, "generate", "--model", str(store), "--prompt-ids", ",".join(map(str, prompt_ids)),
           "--max-new-tokens", str(tokens), "--greedy", "--cache-cap", cap,
           *(["--route-trace", *map(str, traces)] if traces else []), "--json", *config.args(threads), *extra]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        with started(cmd, stdout=out, stderr=err, cwd=ROOT) as proc:
            cgroup.add(proc.pid)   # before the model loads: its pages and page cache are charged to the limit
            _, status, usage = os.wait4(proc.pid, 0)   # wait4: this child's own peak RSS
            proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{config.name}: generate failed ({proc.returncode}): {err.read().strip()[-500:]}")
        result = json.load(out)
    stats = result["stats"]
    decode_bytes = stats["decode_mb_read_per_token"] * 1e6 * max(len(result["token_ids"]) - 1, 1)
    return Run(config.name, round_, stats["decode_tokens_per_s"], stats["decode_mb_read_per_token"],
               stats["decode_hit_rate"], stats["prefetch_accuracy"], usage.ru_maxrss * 1024, cgroup.peak(),
               result["token_ids"], os.getloadavg()[0], stats["decode_profile_ms_per_token"], stats["decode_io_busy"],
               len(prompt_ids) / stats["prefill_s"], (stats["bytes_read"] - decode_bytes) / 1e6 / len(prompt_ids),
               stats["hit_rate"], stats["capacity_slots"], stats["prefetch_gate"])


def gate_summary(run: Run) -> str:
    """How the run's prefetch ended: reads issued or not, the accuracy of its guessed reads, against what."""
    gate = run.prefetch_gate
    if gate["accuracy"] is None:
        return f"prefetch {gate['mode']}"
    return (f"prefetch {gate['mode']} ({'issuing' if gate['issuing'] else 'held back'}; guessed reads "
            f"{gate['accuracy']:.2f} right, break-even {gate['break_even']:.2f})")


def print_phases(configs: dict) -> None:
    """Where a decode token's time went, ms by phase, one row a configuration."""
    phases = next(iter(configs.values()))["profile_ms"]
    print(f"\nms per decode token by phase: {'configuration':<34} " + " ".join(f"{p:>9}" for p in phases))
    for name, c in configs.items():
        print(f"{'':<29}{name:<34} " + " ".join(f"{c['profile_ms'][p]:>9.1f}" for p in phases))


def own_compute_ms(profile_ms: dict[str, float]) -> float:
    """A run's own compute per token: the model thread's time outside waiting for reads (a cross-check
    of the compute bound under the run's own load; CRC runs on the I/O threads)."""
    return sum(ms for phase, ms in profile_ms.items() if phase not in ("wait", "crc", "policy"))


def best_raw(*measured: dict) -> dict:
    """The raw baseline of the better of the measurements taken around a round's runs, with all of them: the
    host's other tenants pull any one down (1170 against 1560-1889 MB/s between rounds here), and a limit
    from a low one would flatter every run of the round."""
    return {**max(measured, key=lambda m: m["raw_mb_s"]), "raw_mb_s_measured": [m["raw_mb_s"] for m in measured]}


def limit_tok_s(compute_tok_s: float, mb_per_token: float, raw_mb_s: float) -> tuple[float, float, float]:
    """(limit tokens/s, compute s/token, I/O s/token): perfect overlap of reads and compute."""
    compute_s, io_s = 1 / compute_tok_s, mb_per_token / raw_mb_s
    return 1 / max(compute_s, io_s), compute_s, io_s


def config_list(text: str) -> list[Config]:
    """--configs: comma-separated keys of CONFIGS."""
    keys = text.split(",")
    if unknown := [key for key in keys if key not in CONFIGS]:
        raise argparse.ArgumentTypeError(f"unknown configuration {', '.join(map(repr, unknown))}; "
                                         f"known: {', '.join(CONFIGS)}")
    return [CONFIGS[key] for key in keys]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="an expert store of a real-shaped model")
    ap.add_argument("--route-trace", type=Path, nargs="*", default=DEFAULT_TRACES, metavar="FILE",
                    help="routing traces (default: OLMoE's held-out decode traces); none: the model's own router")
    ap.add_argument("--tokens", type=count, default=32, help="new tokens per run (default 32)")
    ap.add_argument("--rounds", type=count, default=2, help="interleaved rounds; medians are reported")
    ap.add_argument("--threads", type=count, default=2, help="torch intra-op threads of (d) (default 2)")
    ap.add_argument("--configs", type=config_list, default="a,b,c,d",
                    help="which of a,b,c,d,e,g,s and a2,b2,c2,e2,g2,s2 (the same on two workers), each also with an "
                         "i for int8 dense weights (ai, a2i, c2i, ...), in this order within every round")
    ap.add_argument("--results", type=results_name, default="scale",
                    help="bench/results/NAME.json to write (default scale)")
    args = ap.parse_args()
    store, traces = args.model, args.route_trace
    index = Index.load(store / INDEX)
    expert_bytes = index.nbytes * len(index.blocks)
    cap = parse_cap("25%", expert_bytes)
    cgroup = MemoryCgroup(device_memory(store, cap))
    print(cgroup.describe())
    prompt_ids = load_tokenizer(store).encode(PROMPT)
    facts = {**machine(store), "memory_limit": cgroup.describe(), "model": str(store), "expert_bytes": expert_bytes,
             "config": json.loads((store / "config.json").read_text()), "route_trace": [str(t) for t in traces]}
    chosen = args.configs
    rounds, reference = [], {}
    int8_workers = sorted({1} | {c.workers for c in chosen if c.dense == "int8"}) if any(
        c.dense == "int8" for c in chosen) else []
    try:
        for n in range(args.rounds):
            before = raw_baseline(store / EXPERTS, index, CHUNK, IO_THREADS)
            host = host_cache_check(store / EXPERTS, CHUNK)
            by_threads = {t: compute_bound(store, traces, prompt_ids, args.tokens, t)
                          for t in dict.fromkeys((1, args.threads))}
            by_workers = {w: compute_bound(store, traces, prompt_ids, args.tokens, workers=w)
                          for w in sorted({1} | {c.workers for c in chosen})}
            compute_tok_s = max(*by_threads.values(), *by_workers.values())
            int8_by_workers = {w: compute_bound(store, traces, prompt_ids, args.tokens, workers=w, dense="int8")
                               for w in int8_workers}
            bound = {"stored": compute_tok_s, "int8": max(int8_by_workers.values(), default=None)}
            with torch_linears():
                torch_tok_s = compute_bound(store, traces, prompt_ids, args.tokens)
            r = {"round": n, "host_cache_mb_s": host, "compute_tok_s": compute_tok_s,
                 "compute_tok_s_by_threads": by_threads, "compute_tok_s_by_workers": by_workers,
                 "compute_tok_s_torch_linear": torch_tok_s, "compute_tok_s_int8_dense_by_workers": int8_by_workers,
                 "slot_dtype_ms": slot_dtype_ms(store), "runs": []}
            print(f"round {n + 1}: raw {before['raw_file_mb_s']:.0f} MB/s in file order ({before['raw_streams']} "
                  f"stream(s)), {before['raw_blocks_mb_s']:.0f} MB/s "
                  f"as shuffled whole blocks ({IO_THREADS} in flight); the same region twice "
                  f"{host[0]:.0f} / {host[1]:.0f} MB/s; compute-only tok/s by threads {by_threads}, "
                  f"by workers {by_workers} (int8 dense: {int8_by_workers}), "
                  f"{torch_tok_s:.2f} with torch's F.linear for every linear; "
                  f"one layer's experts for a token, ms: {r['slot_dtype_ms']}", flush=True)
            runs = []
            for config in chosen:
                run = run_config(store, config, n, cgroup, traces, prompt_ids, args.tokens, args.threads)
                # every configuration must produce the same tokens as the first of its dense mode
                same = run.token_ids == reference.setdefault(config.dense, run.token_ids)
                print(f"  {config.name}: {run.decode_tok_s:.2f} tok/s; {run.mb_per_token:.0f} MB/token, hit rate "
                      f"{run.hit_rate:.3f}, own compute {own_compute_ms(run.profile_ms):.0f} ms/token, reads running "
                      f"{run.io_busy or 0:.0%} of the time, peak RSS {run.peak_rss_bytes / 2**20:.0f} MiB; "
                      f"{gate_summary(run)}; same tokens: {same}", flush=True)
                runs.append((config, run, same))
            r |= best_raw(before, raw_baseline(store / EXPERTS, index, CHUNK, IO_THREADS))
            before_after = " and ".join(f"{m:.0f}" for m in r["raw_mb_s_measured"])
            print(f"  raw {r['raw_mb_s']:.0f} MB/s, the better of {before_after} before and after the runs:",
                  flush=True)
            for config, run, same in runs:
                lim, _, _ = limit_tok_s(bound[config.dense], run.mb_per_token, r["raw_mb_s"])
                print(f"  {config.name}: {run.decode_tok_s / lim:.2f} x its limit {lim:.2f}", flush=True)
                r["runs"].append({**asdict(run), "limit_tok_s": lim, "same_tokens": same})
            rounds.append(r)
    finally:
        cgroup.remove()
    summary = summarize(rounds)
    print_table(summary, cgroup, facts, args)
    write_results(args.results, {"command": " ".join(sys.argv), "machine": facts, "tokens": args.tokens,
                            "prompt": PROMPT, "cap": "25%", "rounds": rounds, "summary": summary})
    return 0


def summarize(rounds: list[dict]) -> dict:
    """Per configuration: medians over rounds; ratios (a)/(c) and (a)/(b) of tokens/s within rounds."""
    med = statistics.median
    out = {"raw_mb_s": med(r["raw_mb_s"] for r in rounds), "compute_tok_s": med(r["compute_tok_s"] for r in rounds),
           "compute_tok_s_torch_linear": med(r["compute_tok_s_torch_linear"] for r in rounds),
           "compute_tok_s_by_workers": {w: med(r["compute_tok_s_by_workers"][w] for r in rounds)
                                        for w in rounds[0]["compute_tok_s_by_workers"]},
           "compute_tok_s_int8_dense_by_workers": {w: med(r["compute_tok_s_int8_dense_by_workers"][w] for r in rounds)
                                                   for w in rounds[0].get("compute_tok_s_int8_dense_by_workers", {})},
           "configs": {}}
    names = [run["config"] for run in rounds[0]["runs"]]
    for name in names:
        runs = [run for r in rounds for run in r["runs"] if run["config"] == name]
        out["configs"][name] = {k: med(run[k] for run in runs) for k in
                                ("decode_tok_s", "limit_tok_s", "mb_per_token", "hit_rate", "peak_rss_bytes")}
        out["configs"][name]["io_busy"] = med(run["io_busy"] or 0 for run in runs)
        out["configs"][name]["profile_ms"] = {k: med(run["profile_ms"][k] for run in runs)
                                              for k in runs[0]["profile_ms"]}
        out["configs"][name]["of_limit"] = med(run["decode_tok_s"] / run["limit_tok_s"] for run in runs)
        out["configs"][name]["cgroup_peak_bytes"] = max((run["cgroup_peak_bytes"] or 0) for run in runs)
    by = {name.split(":")[0]: name for name in names}
    for x, y in RATIOS:
        if x in by and y in by:
            ratios = [_tok(r, by[x]) / _tok(r, by[y]) for r in rounds]
            out[f"tok_s_{x}_over_{y}"] = {"median": med(ratios), "per_round": ratios}
    return out


def _routing(traces: list[Path]) -> str:
    return f"routing from {', '.join(Path(t).name for t in traces)}" if traces else "the random router's own routing"


def _tok(round_: dict, name: str) -> float:
    return next(run["decode_tok_s"] for run in round_["runs"] if run["config"] == name)


def print_table(summary: dict, cgroup: MemoryCgroup, facts: dict, args: argparse.Namespace) -> None:
    print(f"\n{facts['config'].get('model_type')} {facts['config'].get('num_hidden_layers')} layers, "
          f"{facts['expert_bytes'] / 1e9:.1f} GB of experts; cap 25%; {args.tokens} tokens; {args.rounds} rounds; "
          f"{_routing(args.route_trace)}; raw {summary['raw_mb_s']:.0f} MB/s; "
          f"compute-only {summary['compute_tok_s']:.2f} tok/s (by workers {summary['compute_tok_s_by_workers']}; "
          f"int8 dense by workers {summary['compute_tok_s_int8_dense_by_workers']}; "
          f"{summary['compute_tok_s_torch_linear']:.2f} with torch's F.linear); {cgroup.describe()}")
    print(f"{'configuration':<34} {'tok/s':>6} {'limit':>6} {'x limit':>7} {'MB/tok':>7} {'hit':>6} {'own ms':>7} "
          f"{'io busy':>7} {'peak RSS':>9} {'cgroup peak':>11} {'of memory':>9}")
    for name, c in summary["configs"].items():
        print(f"{name:<34} {c['decode_tok_s']:>6.2f} {c['limit_tok_s']:>6.2f} {c['of_limit']:>7.2f} "
              f"{c['mb_per_token']:>7.0f} {c['hit_rate']:>6.3f} {own_compute_ms(c['profile_ms']):>7.0f} "
              f"{c['io_busy']:>7.2f} {c['peak_rss_bytes'] / 2**20:>7.0f}Mi "
              f"{c['cgroup_peak_bytes'] / 2**20:>9.0f}Mi {c['cgroup_peak_bytes'] / cgroup.limit:>9.2f}")
    print_phases(summary["configs"])
    for key in (f"tok_s_{x}_over_{y}" for x, y in RATIOS):
        if key in summary:
            rounds = ", ".join(f"{x:.2f}" for x in summary[key]["per_round"])
            print(f"{key}: {summary[key]['median']:.2f} (rounds {rounds})")


if __name__ == "__main__":
    sys.exit(main())
