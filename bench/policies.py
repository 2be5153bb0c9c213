"""Policies side by side on the report split: hit rate per trace, mean, share of the LRU->Belady gap.

    .venv/bin/python bench/policies.py [--traces ../shared/traces] [--policies lru,lfu,...] [--jobs N]

Report split (../shared/traces/README.md): olmoe_math, olmoe_dialogue, qwen_dialogue and prefill
prompts 801..1000; qwen_math is shown on its own row (a period-2 loop: degenerate, out of means).
Configurations: per-layer scope at capacity 0.25, 0.125 and 0.5, and global scope at 0.25. Cold
misses count, the cache starts empty, and the gap closed is computed on the mean hit rates.
FlashMoE runs when its shipped weights exist. The cross-architecture table applies weights trained
on one architecture's traces (agent/policies/weights/flashmoe-<arch>.safetensors, if shipped) to
the other architectures' report traces. Every run is one simulate() call of the same library the
CLI uses; seconds per run are reported only as the simulator's cost. `--jobs N` spreads the runs
over N processes (results are identical: every run is deterministic and independent).
JSON: bench/results/policies.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agent.policies import policy_names
from agent.simulator import gap_closed, simulate
from agent.traces import Trace, load, parse_prompts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from bench.common import machine, write_results  # noqa: E402
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


def load_traces(root: Path) -> dict[str, Trace]:
    """The report traces, then the degenerate one, by name (in that order)."""
    prompts = parse_prompts(PREFILL_PROMPTS)
    traces = [load(root / p, prompts=prompts if p.endswith(".npz") else None) for p in REPORT + [DEGENERATE]]
    return {t.name: t for t in traces}


@dataclass(frozen=True)
class Task:
    trace: str
    policy: str
    scope: str
    capacity: float
    weights: Path | None = None


_TRACES: dict[str, Trace] = {}  # per worker process, loaded once by _init


def _init(root: Path) -> None:
    _TRACES.update(load_traces(root))


def run(task: Task) -> Run:
    options = {"model_path": str(task.weights)} if task.weights else {}
    start = time.perf_counter()
    r = simulate(_TRACES[task.trace], task.policy, task.capacity, task.scope, **options)
    return Run(task.trace, task.policy, task.scope, task.capacity, r.hit_rate, r.hits, r.accesses,
               time.perf_counter() - start, task.weights.name if task.weights else None)


def run_all(tasks: list[Task], root: Path, jobs: int) -> dict[Task, Run]:
    """Every task, the longest (prefill) first so that the pool drains evenly."""
    order = sorted(tasks, key=lambda t: not t.trace.startswith("deepseek"))
    if jobs <= 1:
        _init(root)
        return {t: run(t) for t in order}
    with ProcessPoolExecutor(jobs, initializer=_init, initargs=(root,)) as pool:
        return dict(zip(order, pool.map(run, order)))


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


def cross_tasks(report: list[str]) -> list[Task]:
    """Weights trained on one architecture only, on the other architectures' report traces (per layer, 0.25)."""
    return [Task(t, "flashmoe", "layer", 0.25, WEIGHTS / f"flashmoe-{arch}.safetensors")
            for arch, prefix in ARCHITECTURES.items() if (WEIGHTS / f"flashmoe-{arch}.safetensors").exists()
            for t in report if not t.startswith(prefix)]


def cross_table(runs: dict[Task, Run]) -> tuple[str, list[Run]]:
    cross = [r for t, r in runs.items() if t.weights is not None]
    if not cross:
        return "(no single-architecture weights shipped: agent/policies/weights/flashmoe-<arch>.safetensors)", []
    base = {(r.trace, r.policy): r.hit_rate for t, r in runs.items()
            if t.weights is None and (t.scope, t.capacity) == ("layer", 0.25)}
    lines = ["weights".ljust(28) + "trace".ljust(46) + "lru".rjust(10) + "flashmoe".rjust(10)
             + "belady".rjust(10) + "gap".rjust(10)]
    for r in cross:
        lru, belady = base[r.trace, "lru"], base[r.trace, "belady"]
        lines.append(f"{r.weights.ljust(28)}{r.trace.ljust(46)}{lru:10.4f}{r.hit_rate:10.4f}{belady:10.4f}"
                     f"{_pct(gap_closed(r.hit_rate, lru, belady)):>10}")
    return "\n".join(lines), cross


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces",
                        help="the shared traces directory (decode/ and prefill/)")
    parser.add_argument("--policies", help="comma-separated; lru and belady are always added")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    args = parser.parse_args()
    policies = default_policies() if not args.policies else \
        ["lru", *[p for p in args.policies.split(",") if p not in ("lru", "belady")], "belady"]
    names = list(load_traces(args.traces))
    report, degenerate = names[:-1], names[-1]
    tasks = [Task(t, p, scope, capacity) for scope, capacity in CONFIGS for t in names for p in policies]
    tasks += cross_tasks(report) if "flashmoe" in policies else []
    start = time.perf_counter()
    runs = run_all(tasks, args.traces, args.jobs)
    doc = {"machine": machine(), "jobs": args.jobs, "wall_seconds": time.perf_counter() - start,
           "cold_misses_counted": True, "prefill_prompts": PREFILL_PROMPTS,
           "report_traces": report, "degenerate_trace": degenerate, "configs": []}
    for scope, capacity in CONFIGS:
        config_runs = [runs[Task(t, p, scope, capacity)] for t in names for p in policies]
        table, summary = config_table(config_runs, report, degenerate, policies)
        print(f"\n== {scope} scope, capacity {capacity:g} of experts, cold misses counted ==\n{table}")
        doc["configs"].append({"scope": scope, "capacity": capacity, **summary,
                               "runs": [vars(r) for r in config_runs]})
    table, cross = cross_table(runs)
    print(f"\n== cross-architecture: per-layer scope, capacity 0.25 ==\n{table}")
    doc["cross_architecture"] = [vars(r) for r in cross]
    write_results("policies", doc)


if __name__ == "__main__":
    main()
