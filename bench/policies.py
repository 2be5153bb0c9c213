"""Policies side by side on the report split: hit rate per trace, mean, share of the LRU->Belady gap.

    .venv/bin/python bench/policies.py [--traces ../shared/traces] [--policies lru,lfu,...]

Report split (../shared/traces/README.md): olmoe_math, olmoe_dialogue, qwen_dialogue and prefill
prompts 801..1000; qwen_math is shown on its own row (a period-2 loop: degenerate, out of means).
Configurations: per-layer scope at capacity 0.25, 0.125 and 0.5, and global scope at 0.25. Cold
misses count, the cache starts empty, and the gap closed is computed on the mean hit rates.
FlashMoE runs when its shipped weights exist. The cross-architecture table applies weights trained
on one architecture's traces (agent/policies/weights/flashmoe-<arch>.safetensors, if shipped) to
the other architectures' report traces. Every run is one simulate() call of the same library the
CLI uses; seconds per run are reported only as the simulator's cost. JSON: bench/results/policies.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from agent.policies import policy_names
from agent.simulator import gap_closed, simulate
from agent.traces import Trace, load, parse_prompts

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "policies.json"
WEIGHTS = ROOT / "agent" / "policies" / "weights"
REPORT = ["decode/olmoe_math.jsonl", "decode/olmoe_dialogue.jsonl", "decode/qwen_dialogue.jsonl",
          "prefill/deepseek_v2_lite_puffin_0001-1000.npz"]
DEGENERATE = "decode/qwen_math.jsonl"
PREFILL_PROMPTS = "801..1000"
CONFIGS = [("layer", 0.25), ("layer", 0.125), ("layer", 0.5), ("global", 0.25)]
BASELINES = ["lru", "lfu", "lfu-window", "arc", "least-stale"]
ARCHITECTURES = {"olmoe": "olmoe_", "qwen": "qwen_", "deepseek": "deepseek_"}  # weights name -> trace prefix


@dataclass
class Run:
    trace: str
    policy: str
    scope: str
    capacity: float
    hit_rate: float
    hits: int
    accesses: int
    seconds: float
    weights: str | None = None


def load_traces(root: Path) -> tuple[list[Trace], Trace]:
    prompts = parse_prompts(PREFILL_PROMPTS)
    report = [load(root / p, prompts=prompts if p.endswith(".npz") else None) for p in REPORT]
    return report, load(root / DEGENERATE)


def run(trace: Trace, policy: str, scope: str, capacity: float, weights: Path | None = None) -> Run:
    options = {"model_path": str(weights)} if weights else {}
    start = time.perf_counter()
    r = simulate(trace, policy, capacity, scope, **options)
    return Run(trace.name, policy, scope, capacity, r.hit_rate, r.hits, r.accesses,
               time.perf_counter() - start, weights.name if weights else None)


def default_policies() -> list[str]:
    learned = ["flashmoe"] if "flashmoe" in policy_names() and (WEIGHTS / "flashmoe.safetensors").exists() else []
    return ["lru", *BASELINES[1:], *learned, "belady"]


# -- tables ----------------------------------------------------------------------------------------
def config_table(runs: list[Run], report: list[str], degenerate: str, policies: list[str]) -> tuple[str, dict]:
    rate = {(r.trace, r.policy): r.hit_rate for r in runs}
    mean = {p: sum(rate[t, p] for t in report) / len(report) for p in policies}
    gaps = {p: gap_closed(mean[p], mean["lru"], mean["belady"]) for p in policies}
    per_trace_gap = {t: {p: gap_closed(rate[t, p], rate[t, "lru"], rate[t, "belady"]) for p in policies}
                     for t in report + [degenerate]}
    width = max(len(t) for t in report + [degenerate]) + 16
    lines = ["trace".ljust(width) + "".join(p.rjust(12) for p in policies)]
    for t in report:
        lines.append(t.ljust(width) + "".join(f"{rate[t, p]:12.4f}" for p in policies))
    lines.append("mean (report split)".ljust(width) + "".join(f"{mean[p]:12.4f}" for p in policies))
    lines.append("gap closed (of means)".ljust(width) + "".join(_pct(gaps[p]).rjust(12) for p in policies))
    lines.append(f"{degenerate} (degenerate)".ljust(width) + "".join(f"{rate[degenerate, p]:12.4f}" for p in policies))
    summary = {"mean_hit_rate": mean, "gap_closed": gaps, "gap_closed_per_trace": per_trace_gap}
    if "flashmoe" in policies:
        best = {t: max(rate[t, p] for p in BASELINES if p in policies) for t in report}
        summary["flashmoe_at_least_best_baseline"] = {t: rate[t, "flashmoe"] >= best[t] for t in report}
    return "\n".join(lines), summary


def _pct(g: float | None) -> str:
    return "-" if g is None else f"{g:.1%}"


def cross_architecture(report: list[Trace]) -> tuple[str, list[Run]]:
    """Weights trained on one architecture only, applied to the others' report traces (per layer, 0.25)."""
    runs, lines = [], []
    for arch, prefix in ARCHITECTURES.items():
        weights = WEIGHTS / f"flashmoe-{arch}.safetensors"
        if not weights.exists():
            continue
        for trace in report:
            if trace.name.startswith(prefix):
                continue
            base = {p: run(trace, p, "layer", 0.25) for p in ("lru", "belady")}
            learned = run(trace, "flashmoe", "layer", 0.25, weights)
            runs += [*base.values(), learned]
            gap = gap_closed(learned.hit_rate, base["lru"].hit_rate, base["belady"].hit_rate)
            lines.append(f"{('trained on ' + arch).ljust(22)}{trace.name.ljust(46)}{base['lru'].hit_rate:10.4f}"
                         f"{learned.hit_rate:10.4f}{base['belady'].hit_rate:10.4f}{_pct(gap):>10}")
    if not lines:
        return "(no single-architecture weights shipped: agent/policies/weights/flashmoe-<arch>.safetensors)", runs
    header = "weights".ljust(22) + "trace".ljust(46) + "lru".rjust(10) + "flashmoe".rjust(10) + "belady".rjust(10) + "gap".rjust(10)
    return "\n".join([header, *lines]), runs


def machine() -> dict:
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces",
                        help="the shared traces directory (decode/ and prefill/)")
    parser.add_argument("--policies", help="comma-separated; lru and belady are always added")
    args = parser.parse_args()
    policies = default_policies() if not args.policies else \
        ["lru", *[p for p in args.policies.split(",") if p not in ("lru", "belady")], "belady"]
    report, degenerate = load_traces(args.traces)
    names = [t.name for t in report]
    doc = {"machine": machine(), "cold_misses_counted": True, "prefill_prompts": PREFILL_PROMPTS,
           "report_traces": names, "degenerate_trace": degenerate.name, "configs": []}
    for scope, capacity in CONFIGS:
        runs = [run(t, p, scope, capacity) for t in [*report, degenerate] for p in policies]
        table, summary = config_table(runs, names, degenerate.name, policies)
        print(f"\n== {scope} scope, capacity {capacity:g} of experts, cold misses counted ==\n{table}", flush=True)
        doc["configs"].append({"scope": scope, "capacity": capacity, **summary,
                               "runs": [vars(r) for r in runs]})
    table, cross = cross_architecture(report) if "flashmoe" in policies else ("(flashmoe not run)", [])
    print(f"\n== cross-architecture: per-layer scope, capacity 0.25 ==\n{table}")
    doc["cross_architecture"] = [vars(r) for r in cross]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
