"""Where a batched decode step leaves the disk idle, and what the lookahead guess's order changes.

    flock /work/wt/bench.lock .venv/bin/python bench/prefetch_guess.py --model /work/models/olmoe-1b-7b-int8 \
        --route-trace /work/shared/traces/decode/olmoe_math.jsonl /work/shared/traces/decode/olmoe_dialogue.jsonl \
        [--clients 16] [--rounds 2] [--policy flashmoe] [--results prefetch-guess]

bench/serve.py's burst without the HTTP around it: its request mix (one request per client, 4-12
greedy tokens), every prompt admitted in one step, then batched decode steps until the last request
ends, on the model and ExpertCache in this process (O_DIRECT, cache cap 25% of expert bytes, as the
agent serves; no cgroup: O_DIRECT reads do not go through the page cache). Each round runs it twice
from a cold cache, in alternating order: with the guess ranked (the runtime's: most likely first) and
with the same guess in ascending expert ids (what the predictors gave before). A 2-client run before
the rounds, not counted, faults in the dense weights and compiles what compiles.

Every read's start and end (the cache's own busy accounting: a read and its CRC check) and every
layer's route() and get() are timed, and the decode steps' disk idle (no read running) is split by
where the model was: the step's start (before its first layer routes), within a layer (between its
route() and its last get(): the residents computed first while the misses wait for their slots), and
the layer change (after a layer's last get(): its last experts' matmuls, the next layer's attention
and router). Hits, misses, prefetch reads and prefetch hits do not depend on timing here: each
variant reads the same in every round. Writes bench/results/prefetch-guess.json (or --results NAME).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from agent.argtypes import count  # noqa: E402
from agent.experts.cache import ExpertCache  # noqa: E402
from agent.experts.cap import parse_cap  # noqa: E402
from agent.experts.layout import INDEX, Index  # noqa: E402
from agent.model.loading import load_model  # noqa: E402
from agent.model.lookahead import Predictor  # noqa: E402
from agent.tokenizer import load_tokenizer  # noqa: E402
from bench.common import machine, results_name, write_results  # noqa: E402
from bench.serve import CAP, request_mix  # noqa: E402

VARIANTS = ("ranked", "ascending")


class Ascending:
    """A predictor's guess in ascending expert ids: the order both predictors gave before they ranked it."""

    def __init__(self, inner: Predictor) -> None:
        self.inner = inner

    def predict(self, layer, routed, residual):
        guess = self.inner.predict(layer, routed, residual)
        return None if guess is None else (guess[0], sorted(guess[1]))


class Timeline:
    """Times of the cache's reads (from its own busy accounting) and of the model's route() and get() calls."""

    def __init__(self, cache: ExpertCache) -> None:
        self.busy: list[tuple[float, float]] = []      # stretches with at least one read running
        self.calls: list[tuple[float, str, int]] = []  # (time, "route" or "get", layer)
        self._lock, self._running, self._since = threading.Lock(), 0, 0.0
        begins, ends, route, get = cache._read_begins, cache._read_ends, cache.route, cache.get

        def read_begins() -> None:
            with self._lock:
                self._running += 1
                if self._running == 1:
                    self._since = time.perf_counter()
            begins()

        def read_ends() -> None:
            ends()
            with self._lock:
                self._running -= 1
                if not self._running:
                    self.busy.append((self._since, time.perf_counter()))

        def timed(call, kind):
            def wrapper(layer, *args):
                self.calls.append((time.perf_counter(), kind, layer))
                return call(layer, *args)
            return wrapper
        cache._read_begins, cache._read_ends = read_begins, read_ends   # wrapped, not replaced
        cache.route, cache.get = timed(route, "route"), timed(get, "get")

    def idle(self, t0: float, t1: float) -> dict[str, float]:
        """Disk idle within [t0, t1], split by where the model was when it began (see the module's docstring)."""
        gaps, at = [], t0
        for a, b in sorted(self.busy):
            if b > t0 and a < t1:
                if a > at:
                    gaps.append((at, a))
                at = max(at, b)
        if at < t1:
            gaps.append((at, t1))
        calls = [c for c in self.calls if t0 <= c[0] <= t1]
        split = {"step start": 0.0, "within a layer": 0.0, "layer change": 0.0}
        for a, b in gaps:
            routed = [layer for t, kind, layer in calls if kind == "route" and t <= a]
            if not routed:
                split["step start"] += b - a
                continue
            gets = [t for t, kind, layer in calls if kind == "get" and layer == routed[-1]]
            split["layer change" if gets and a >= max(gets) else "within a layer"] += b - a
        return split


def burst(model_dir: Path, traces: list[Path], clients: int, policy: str, variant: str, cap: str = CAP) -> dict:
    """One cold run of the burst; the decode steps' wall time, disk idle and counts, and the admission's wall."""
    index = Index.load(model_dir / INDEX)
    with ExpertCache(model_dir, parse_cap(cap, index.nbytes * len(index.blocks)), policy=policy,
                     prefetch="on") as cache:  # the guess's order is measured: its reads always issued
        model = load_model(model_dir, cache, prefetch=True, route_trace=traces)
        if variant == "ascending":
            model.lookahead.predictor = Ascending(model.lookahead.predictor)
        timeline, tokenizer = Timeline(cache), load_tokenizer(model_dir)
        requests = [client[0] for client in request_mix(clients, 1)]
        running = []
        for r in requests:
            ids = list(tokenizer.encode(r["prompt"]))
            running.append([model.new_sequence(len(ids) + r["max_tokens"]), ids, r["max_tokens"]])
        steps = []
        while running:
            before, start = cache.stats(), time.perf_counter()
            logits = model.step([(seq, torch.tensor(tokens)) for seq, tokens, _ in running])
            cache.idle()
            steps.append((start, time.perf_counter(), before, cache.stats()))
            for r, l in zip(running, logits):
                r[1], r[2] = [int(l.argmax())], r[2] - 1
            running = [r for r in running if r[2] > 0]
    (a0, a1, _, _), decode = steps[0], steps[1:]
    first, last = decode[0][2], decode[-1][3]
    idle = [timeline.idle(t0, t1) for t0, t1, _, _ in decode]
    return {"variant": variant, "admission_wall_s": a1 - a0, "decode_steps": len(decode),
            "decode_wall_s": sum(t1 - t0 for t0, t1, _, _ in decode),
            "decode_idle_s": {k: sum(i[k] for i in idle) for k in idle[0]},
            "decode_hits": last.hits - first.hits, "decode_misses": last.misses - first.misses,
            "prefetches": last.prefetches - first.prefetches, "prefetch_hits": last.prefetch_hits - first.prefetch_hits,
            "decode_gb_read": (last.bytes_read - first.bytes_read) / 1e9}


def table(runs: list[dict]) -> str:
    head = ["guess", "rounds", "admission s", "decode s", "idle s", "at step start", "within a layer",
            "at layer change", "hits", "misses", "prefetches", "prefetch hits", "wasted", "GB read"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        med = lambda f: statistics.median(f(r) for r in mine)  # noqa: E731
        lines.append("| " + " | ".join([
            variant, str(len(mine)), f"{med(lambda r: r['admission_wall_s']):.1f}",
            f"{med(lambda r: r['decode_wall_s']):.1f}",
            f"{med(lambda r: sum(r['decode_idle_s'].values())):.2f}",
            *[f"{med(lambda r: r['decode_idle_s'][k]):.2f}" for k in ("step start", "within a layer", "layer change")],
            *[f"{med(lambda r: r[k]):.0f}" for k in ("decode_hits", "decode_misses", "prefetches", "prefetch_hits")],
            f"{med(lambda r: r['prefetches'] - r['prefetch_hits']):.0f}", f"{med(lambda r: r['decode_gb_read']):.2f}"])
            + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an expert store (flashmoe-cli convert)")
    parser.add_argument("--route-trace", type=Path, nargs="+", required=True,
                        help="recorded routing (serve --route-trace)")
    parser.add_argument("--clients", type=count, default=16)
    parser.add_argument("--rounds", type=count, default=2)
    parser.add_argument("--policy", default="flashmoe")
    parser.add_argument("--results", type=results_name, default="prefetch-guess")
    args = parser.parse_args()
    torch.set_num_threads(1)   # as the agent's decode thread
    burst(args.model, args.route_trace, 2, args.policy, VARIANTS[0])  # warm-up: the first run faulted in
    runs = []                                                                  # the dense weights, 2-3x slower
    for round_ in range(args.rounds):
        for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
            print(f"round {round_ + 1}/{args.rounds}: {variant} ...", flush=True)
            runs.append({"round": round_, **burst(args.model, args.route_trace, args.clients, args.policy, variant)})
            print(runs[-1], flush=True)
    print(table(runs))
    write_results(args.results, {"machine": machine(args.model), "args": {k: str(v) for k, v in vars(args).items()},
                                 "runs": runs, "table": table(runs)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
