"""Replay routing traces through the runtime's cache core (agent.residency.Residency) and a policy.

This is the runtime cache with the I/O taken out: per token and layer, route() pins the chosen
experts, then each is accessed in order; a session start calls session(). A batched step of a
recorded trace larger than its partition (the union of a batch's experts) is taken the way the
runtime takes it: resident experts first, a sliding window of them pinned (Residency.take).
Capacity is a fraction of all experts, floored, and never below top-k per layer. Cold misses
count: the cache starts empty.

Monitoring samples for policies that use them (the learned policy reads "read_latency_s" and
"mem_pressure") come from a SystemReplay: a deterministic synthetic series by default, or a
series recorded by the collector and saved as JSON (`--system-series FILE`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING
from pathlib import Path

from agent.argtypes import count
from agent.policies import policy_factory, policy_names
from agent.policies.belady import BeladyOracle
from agent.policies.lfu import DEFAULT_WINDOW
from agent.experts.reader import IO_THREADS
from agent.residency import SCOPES, Residency
from agent.traces import (Trace, TraceError, access_sequence, checked_signals, is_count, load, parse_json,
                          parse_prompts, read_text, walk)

if TYPE_CHECKING:
    from agent.learned.online import OnlineConfig, OnlineLearner
    from store.db import Store
    from agent.model.lookahead import Lookahead

SSD_READ_S = 80e-6  # one random NVMe read (DESIGN.md), the synthetic series' floor


@dataclass(frozen=True)
class SystemReplay:
    """Monitoring samples fed to the policies: sample i at token i * every (the series cycles)."""
    samples: tuple[dict[str, float], ...]
    every: int = 32

    @classmethod
    def synthetic(cls, every: int = 32, period: int = 64) -> SystemReplay:
        """A deterministic series: read latency and memory pressure drifting on slow waves."""
        wave = [math.sin(2 * math.pi * i / period) for i in range(period)]
        return cls(tuple({"read_latency_s": SSD_READ_S * (6 + 3 * w), "mem_pressure": 0.5 + 0.3 * w}
                         for w in wave), every)

    @classmethod
    def load(cls, path: str | Path) -> SystemReplay:
        """Read {"every": N, "samples": [{"read_latency_s": ..., "mem_pressure": ...}, ...]}."""
        path = Path(path)
        doc = parse_json(str(path), read_text(path, "system series file"))
        samples, every = (doc.get("samples"), doc.get("every", 32)) if isinstance(doc, dict) else (None, None)
        if not isinstance(samples, list) or not samples or not is_count(every):
            raise ValueError(f'{path}: expected {{"every": N, "samples": [{{"read_latency_s": x, "mem_pressure": y}}, '
                             f'...]}} with at least one sample and N a positive integer')
        return cls(tuple(checked_signals(f"{path}: sample {i}", s) for i, s in enumerate(samples)), every)

    def at(self, token: int) -> dict[str, float] | None:
        if token % self.every:
            return None
        return self.samples[(token // self.every) % len(self.samples)]


@dataclass(frozen=True)
class SimResult:
    trace: str
    policy: str
    capacity: float
    scope: str
    hits: int
    accesses: int
    slots: int
    experts: int  # all experts of the trace, every layer's
    online: dict | None = None  # the online learner's summary (updates, rollbacks, ...) when it ran

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def capacity_used(self) -> float:
        """The fraction the cache held: `capacity`, or more when that was below one step's top-k per layer."""
        return max(self.capacity, self.slots / self.experts)

    @property
    def label(self) -> str:
        return f"{self.policy} online" if self.online is not None else self.policy

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "capacity_used": self.capacity_used}


def capacity_slots(trace: Trace, fraction: float, scope: str) -> int:
    """Slots for `fraction` of all experts: per layer in layer scope, at least one sequence's top-k."""
    if not 0 < fraction <= 1:
        raise ValueError(f"capacity must be a fraction of all experts in (0, 1], got {fraction}")
    floor = trace.top_k
    if scope == "layer":
        return max(floor, math.floor(round(fraction * trace.n_experts, 9))) * trace.n_layers
    total = trace.n_layers * trace.n_experts
    return max(floor * trace.n_layers, math.floor(round(fraction * total, 9)))


def simulate(trace: Trace, policy: str, capacity: float, scope: str = "layer",
             system: SystemReplay | None = None, online: OnlineConfig | None = None, **options) -> SimResult:
    """Replay `trace` through a cache of `capacity` (a fraction of all experts) run by `policy`;
    with `online`, the learned policy keeps learning from the replayed past (agent.learned.online)."""
    residency, learner = cache_for(trace, policy, capacity, scope, online, **options)
    replay(trace, residency, system or SystemReplay.synthetic())
    hits = sum(s.hits for s in residency.stats)
    accesses = hits + sum(s.misses for s in residency.stats)
    return SimResult(trace.name, policy, capacity, scope, hits, accesses, residency.capacity,
                     trace.n_layers * trace.n_experts, dict(learner.summary()) if learner is not None else None)


def cache_for(trace: Trace, policy: str, capacity: float, scope: str = "layer", online: OnlineConfig | None = None,
              **options) -> tuple[Residency, OnlineLearner | None]:
    """The empty cache simulate() replays `trace` through, and its online learner (with `online`)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    slots = capacity_slots(trace, capacity, scope)
    if policy == "belady" and "oracle" not in options:
        options["oracle"] = BeladyOracle(access_sequence(trace), trace.offsets)
    learner = None
    if online is not None:
        learner = options["learner"] = _learner(trace, policy, slots, scope, online, options.pop("model_path", None))
    return Residency(slots, trace.n_layers, policy_factory(policy, **options), scope, trace.top_k), learner


def _learner(trace: Trace, policy: str, slots: int, scope: str, config: OnlineConfig, model_path: str | None):
    """The in-line online learner for a replay of `trace` (the agent runs the same one in the background)."""
    if policy != "flashmoe":
        raise ValueError(f"online learning applies to the learned policy (flashmoe), not {policy!r}")
    from agent.learned.online import CacheShape, OnlineLearner
    from agent.learned.scorer import shared_net
    from agent.policies.flashmoe import DEFAULT_WEIGHTS
    return OnlineLearner(shared_net(str(Path(model_path or DEFAULT_WEIGHTS).resolve())),
                         CacheShape(slots, trace.n_layers, trace.n_experts, scope, trace.top_k), config)


def replay(trace: Trace, residency: Residency, system: SystemReplay, tokens: range | None = None,
           ahead: int = IO_THREADS, lookahead: Lookahead | None = None) -> None:
    """Drive `residency` through every step of `trace` (or those of `tokens`), as the runtime would
    with `ahead` reads in flight, and with `lookahead` (a CoActivation predictor: the trace has no
    residual stream) its prefetch guess at the next layer after each layer's step. A trace the
    runtime recorded with monitoring samples gets those, where its cache fed them, instead of `system`."""
    take = residency.take
    recorded = trace.system
    tokens = tokens if tokens is not None else range(trace.n_tokens)
    token = -1
    for row, (new_session, layer, experts) in enumerate(walk(trace)):
        if layer == 0:
            token += 1
        if token not in tokens:
            continue
        if layer == 0:
            if new_session:
                residency.session()
            sample = None if recorded else system.at(token)
            if sample is not None:
                residency.system(sample)
        if row in recorded:
            residency.system(recorded[row])
        take(layer, experts, ahead)
        if lookahead is not None and (guess := lookahead.after_route(layer, experts, None)) is not None:
            residency.guess(*guess)


def gap_closed(policy: float, lru: float, belady: float) -> float | None:
    """The share of the LRU->Belady hit-rate gap a policy closes (None when there is no gap)."""
    return (policy - lru) / (belady - lru) if belady - lru > 1e-12 else None


# -- CLI ---------------------------------------------------------------------------------------
EXAMPLE = """example:
  flashmoe-cli simulate --trace ../shared/traces/decode/olmoe_math.jsonl \\
      ../shared/traces/prefill/deepseek_v2_lite_puffin_0001-1000.npz --prompts 801..1000 \\
      --policy lru,lfu,arc,least-stale,belady --capacity 0.25 --scope layer
  flashmoe-cli simulate --trace ../shared/traces/decode/qwen_dialogue.jsonl --policy flashmoe --online

lru and belady always run: they are the two ends of the gap the table reports. --online adds the
learned policy learning online from the replayed past ("flashmoe online") beside the offline one."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXAMPLE
    parser.add_argument("--trace", nargs="+", required=True, type=Path, metavar="PATH",
                        help="routing traces: decode/recorded .jsonl or prefill .npz")
    parser.add_argument("--policy", default=",".join(policy_names()),
                        help="comma-separated policy names (default: all registered: %(default)s)")
    parser.add_argument("--capacity", type=float, default=0.25, metavar="FRACTION",
                        help="cache size as a fraction of all experts, in (0, 1] (default 0.25)")
    parser.add_argument("--scope", choices=SCOPES, default="layer", help="per-layer or global cache")
    parser.add_argument("--policy-model", type=Path, metavar="FILE", help="weights for the learned flashmoe policy")
    parser.add_argument("--experts", type=count, metavar="N", help="experts per layer when a trace's meta has null")
    parser.add_argument("--prompts", metavar="A..B", help="prefill NPZ only: prompt numbers to replay")
    parser.add_argument("--window", type=count, metavar="W",
                        help=f"lfu-window: window in accesses of one layer (default {DEFAULT_WINDOW})")
    parser.add_argument("--system-series", type=Path, metavar="FILE", help="monitoring series JSON to replay "
                        "(default: a deterministic synthetic one; a trace recorded with samples replays its own)")
    parser.add_argument("--online", action="store_true", help="also run flashmoe learning online from the "
                        "replayed past (agent.learned.online: the agent's loop, run in-line)")
    parser.add_argument("--json", action="store_true", help="print {\"results\": [...]} instead of a table")
    parser.add_argument("--db", type=Path, metavar="PATH", help="also record each result in this telemetry store "
                        "(the dashboard's Cache page compares policies from it)")


def run(args: argparse.Namespace) -> int:
    from store.errors import StoreError
    try:
        store = _results_store(args.db)  # before the replay, which can take minutes: a store it cannot use fails first
    except StoreError as e:
        print(f"flashmoe-cli simulate: cannot record to {args.db}: {e}", file=sys.stderr)
        return 2
    with store if store is not None else contextlib.nullcontext():
        try:
            results = _simulate_all(args)
        except (TraceError, ValueError) as e:
            print(f"flashmoe-cli simulate: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"results": [r.as_dict() for r in results]}, indent=1) if args.json
              else format_table(results))
        if store is not None:
            record(store, results)
    return 0


def _simulate_all(args: argparse.Namespace) -> list[SimResult]:
    policies = _policies(args.policy)
    prompts = parse_prompts(args.prompts) if args.prompts else None
    traces = [load(p, args.experts, prompts if p.suffix == ".npz" else None) for p in args.trace]
    system = SystemReplay.load(args.system_series) if args.system_series else None
    runs = [(p, None) for p in policies]
    if args.online:
        from agent.learned.online import OnlineConfig
        runs.insert(runs.index(("flashmoe", None)) + 1 if "flashmoe" in policies else -1,
                    ("flashmoe", OnlineConfig()))
    return [simulate(t, p, args.capacity, args.scope, system, online, **_options(p, args))
            for t in traces for p, online in runs]


def _results_store(db: Path | None) -> Store | None:
    if db is None:
        return None
    from store.db import Store
    return Store(db)


def record(store: Store, results: Sequence[SimResult]) -> None:
    """Write results to the telemetry store, one row each, all stamped with the same time."""
    t = time.time()
    for r in results:
        store.record_simulation(t, r.trace, r.label, r.capacity_used, r.scope, r.hit_rate)


def _raised(results: Sequence[SimResult]) -> list[str]:
    """A line for each trace whose cache was raised to one step's top-k per layer, saying what it held."""
    raised = {r.trace: r for r in results if r.capacity_used > r.capacity}
    return [f"{t}: {r.capacity:g} of experts is below one step's top-k per layer; raised to {r.slots} of "
            f"{r.experts} expert slots ({r.capacity_used:.4g})" for t, r in raised.items()]


def _policies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in policy_names()]
    if unknown or not names:
        raise ValueError(f"unknown policy {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(policy_names())}")
    return ["lru"] + [n for n in names if n not in ("lru", "belady")] + ["belady"]


def _options(policy: str, args: argparse.Namespace) -> dict:
    if policy == "flashmoe" and args.policy_model:
        return {"model_path": args.policy_model}
    if policy == "lfu-window" and args.window is not None:
        return {"window": args.window}
    return {}


def format_table(results: Sequence[SimResult]) -> str:
    """Hit rate per trace and policy, the mean, and each policy's share of the LRU->Belady gap."""
    policies = list(dict.fromkeys(r.label for r in results))
    traces = list(dict.fromkeys(r.trace for r in results))
    rate = {(r.trace, r.label): r.hit_rate for r in results}
    first = results[0]
    width = max(len(t) for t in traces + ["gap closed"]) + 2
    cols = [max(13, len(p) + 2) for p in policies]   # a long label ("flashmoe online") widens its column
    lines = [f"hit rate, capacity {first.capacity:g} of experts, {first.scope} scope, cold misses counted",
             *_raised(results), "trace".ljust(width) + "".join(p.rjust(c) for p, c in zip(policies, cols))]
    for t in traces:
        lines.append(t.ljust(width) + "".join(f"{rate[t, p]:{c}.4f}" for p, c in zip(policies, cols)))
    mean = {p: sum(rate[t, p] for t in traces) / len(traces) for p in policies}
    lines.append("mean".ljust(width) + "".join(f"{mean[p]:{c}.4f}" for p, c in zip(policies, cols)))
    gaps = [gap_closed(mean[p], mean["lru"], mean["belady"]) for p in policies]  # of the means: robust
    lines.append("gap closed".ljust(width)
                 + "".join(("-" if g is None else f"{g:.1%}").rjust(c) for g, c in zip(gaps, cols)))
    return "\n".join(lines)
