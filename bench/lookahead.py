"""What the lookahead's guess reads, and what it saves, when a route trace decides the routing.

    nice -n 19 .venv/bin/python bench/lookahead.py [--names olmoe_code,qwen_code] [--batches 1,16]
        [--results lookahead]

Replays each decode trace through the simulator's cache core (agent.residency, the runtime's) per
layer at capacity 0.25 with the learned policy and with LRU, the lookahead guessing each next layer
after a layer's step as the runtime does, for four guesses side by side: none; the co-activation
counts ranked and cut at as many experts as the layer routed (the guess before agent/model/lookahead.py
estimated chances, kept here as the baseline); the shipped CoActivation (every expert whose
estimated chance is at least GUESS_AT); and that with a second guess at the layer after next
(TwoAhead, not shipped: its reads did not pay in time). B > 1 replays bench/batching.py's batched steps (B requests a
step, 12 tokens each, 16 waves); DeepSeek-V2-Lite's prompts are replayed token by token, as generate
prefills them. Counted, not timed: a token's demand misses are what decode waits for;
its prefetch reads cost bandwidth; both are expert reads of the same size.
JSON: bench/results/lookahead.json (or --results NAME).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from agent.model.lookahead import CoActivation, Lookahead  # noqa: E402
from agent.simulator import SystemReplay, cache_for, replay  # noqa: E402
from agent.traces import Trace, load, parse_prompts  # noqa: E402
from bench.batching import TRACES, batched  # noqa: E402
from bench.common import counts, machine, results_name, write_results  # noqa: E402

CAPACITY = 0.25
PREFILL = TRACES.parent / "prefill" / "deepseek_v2_lite_puffin_0001-1000.npz"


class TopCounts(CoActivation):
    """The guess before chances: the experts most often seen at layer+1 with those routed now, as many."""

    def predict(self, layer: int, routed: list[int], residual) -> tuple[int, list[int]] | None:
        self.learn(layer, routed)
        score = self.counts[layer, routed].sum(0)
        best = np.argsort(-score, kind="stable")[:len(routed)]
        guess = [int(e) for e in best if score[e] > 0]
        return (self.after(layer), guess) if guess else None


class TwoLayersOn(CoActivation):
    """Co-activation counts two layers apart: a guess at the layer after next."""
    AHEAD = 2


class TwoAhead(CoActivation):
    """The shipped guess, and a second at the layer after next (TwoLayersOn) decided right after it
    (`GuessingTwice`): what the cache's counters show when it reads that one too. Tried in the runtime,
    its reads started only while no other read ran: BENCHMARKS.md, "A second guess, two layers ahead"."""

    def __init__(self, n_layers: int, n_experts: int) -> None:
        super().__init__(n_layers, n_experts)
        self.two = TwoLayersOn(n_layers, n_experts)
        self.later: tuple[int, list[int]] | None = None

    def predict(self, layer: int, routed: list[int], residual) -> tuple[int, list[int]] | None:
        self.later = self.two.predict(layer, routed, residual)
        return super().predict(layer, routed, residual)


class GuessingTwice:
    """A Residency that, given a guess, also takes TwoAhead's guess at the layer after."""

    def __init__(self, residency, predictor: TwoAhead) -> None:
        self._residency, self._predictor = residency, predictor

    def __getattr__(self, name: str):
        return getattr(self._residency, name)

    def guess(self, layer: int, experts: list[int]) -> None:
        self._residency.guess(layer, experts)
        if self._predictor.later is not None:
            self._residency.guess(*self._predictor.later)


GUESSES = {"none": None, "top counts": TopCounts, "chances (shipped)": CoActivation, "chances, two ahead": TwoAhead}


def measure(trace: Trace, policy: str, guess) -> dict:
    residency, _ = cache_for(trace, policy, CAPACITY)
    lookahead = Lookahead(guess(trace.n_layers, trace.n_experts)) if guess else None
    driven = GuessingTwice(residency, lookahead.predictor) if guess is TwoAhead else residency
    replay(trace, driven, SystemReplay.synthetic(), lookahead=lookahead)
    stats = residency.stats
    hits, misses = sum(s.hits for s in stats), sum(s.misses for s in stats)
    prefetches, used = sum(s.prefetches for s in stats), sum(s.prefetch_hits for s in stats)
    steps = trace.n_tokens
    return {"demand_misses_per_step": misses / steps, "prefetch_reads_per_step": prefetches / steps,
            "prefetch_used": used / prefetches if prefetches else None,
            "reads_per_step": (misses + prefetches) / steps, "hit_rate": hits / (hits + misses)}


def replays(args: argparse.Namespace) -> Iterator[tuple[str, int, Trace]]:
    """(name, requests a step, trace): each decode trace at each batch size, then each prompt range."""
    for name in args.names.split(","):
        source = load(args.traces / f"{name}.jsonl")
        for batch in args.batches:
            yield name, batch, source if batch == 1 else batched(source, batch, tokens=12, waves=16)
    for prompts in map(parse_prompts, args.prompts.split(",")):
        yield f"prompts {prompts.start}..{prompts.stop - 1}", 1, load(args.prefill, prompts=prompts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--names", default="olmoe_code,qwen_code,olmoe_math,olmoe_dialogue,qwen_dialogue",
                        help="decode traces (validation first, then report)")
    parser.add_argument("--batches", type=counts, default=[1, 16], help="requests a step (decode traces)")
    parser.add_argument("--prefill", type=Path, default=PREFILL,
                        help="DeepSeek-V2-Lite's prompt routing, replayed token by token as generate prefills")
    parser.add_argument("--prompts", default="601..800,801..1000",
                        help="prompt ranges of --prefill (validation, report)")
    parser.add_argument("--results", type=results_name, default="lookahead")
    args = parser.parse_args()
    rows = []
    print(f"{'trace':18s} {'B':>3s} {'policy':9s} {'guess':18s} {'demand/step':>11s} {'prefetch/step':>13s} "
          f"{'used':>5s} {'reads/step':>10s} {'hit':>6s}")
    for name, batch, trace in replays(args):
        for policy in ("flashmoe", "lru"):
            for label, guess in GUESSES.items():
                row = {"trace": name, "batch": batch, "policy": policy, "guess": label,
                       **measure(trace, policy, guess)}
                rows.append(row)
                used = f"{row['prefetch_used']:.2f}" if row["prefetch_used"] is not None else "-"
                print(f"{name:18s} {batch:3d} {policy:9s} {label:18s} {row['demand_misses_per_step']:11.2f} "
                      f"{row['prefetch_reads_per_step']:13.2f} {used:>5s} {row['reads_per_step']:10.2f} "
                      f"{row['hit_rate']:6.4f}", flush=True)
    write_results(args.results, {"machine": machine(), "capacity": CAPACITY, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
