"""Where the prefill prompts' LRU->Belady gap is: which accesses each policy loses, and how much of it is reachable.

    nice -n 19 .venv/bin/python bench/prefill_gap.py [--prompts 601..800] [--capacity 0.25] [--online [JSON]]
        [--prior-weight A[,A...]] [--shuffle SEED] [--results NAME]

The DeepSeek prefill prompts are replayed token by token (one step per token, six experts per
layer, pinned whole: a step always fits a layer's partition, so Belady has no freedom of order
within a step). Every access is classed by where it falls in its prompt (the token's position) and
by whether it is the first use of that expert in the prompt; each policy's hit rate is given per
class. Besides Belady, "belady, this prompt only" sees the future of the prompt being replayed and
nothing after it (experts not used again in the prompt go least recently used first): the gap
between the two is what knowing the *next* prompts is worth, which no policy learning from the past
can know.

Three rows rank experts by how often the prompt uses them (PromptCounts), least recently used first
among equals. "counts, this prompt" knows each prompt's final per-expert counts at each layer (not
their order) and "counts left, this prompt" the counts of the prompt's tokens still to come: if a
layer's routing within a prompt were independent draws from a prompt-specific distribution, no policy
that sees only the past could beat keeping the most probable experts, and these two know that
distribution as well as the prompt itself tells it. "counts, estimated" is that ranking from the past
only: the count in the prompt so far plus A times the expert's rate over the earlier prompts (a
Dirichlet estimate, (count + A * rate) / (tokens + A); A from --prior-weight, chosen on validation).
`--shuffle SEED` permutes the tokens within every prompt (the same permutation for every layer):
it keeps every prompt's counts and destroys their order, which tests the independence hypothesis.
Per layer, capacity 0.25, validation prompts by default (settings are chosen there).
`--online` adds the learned policy learning online (OnlineConfig's defaults, or the settings
JSON given), with every update's hindsight judgement. JSON: bench/results/prefill_gap.json (NAME.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from agent.learned.online import OnlineConfig
from agent.learned.splits import PREFILL, TRACES_DIR
from agent.policies.base import Key, Policy
from agent.policies.belady import BeladyOracle
from agent.policies.lfu import KeyedHeap
from agent.simulator import SystemReplay, cache_for, replay
from agent.traces import Trace, access_sequence, load, parse_prompts, session_ends

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repo, so `bench` imports
from bench.common import machine, results_name, write_results  # noqa: E402

BUCKETS = (0, 8, 16, 32, 64)  # token positions in a prompt: [0, 8), [8, 16), ... [64, end)
PRIOR_WEIGHT = 32.0  # A of "counts, estimated": the best of 4, 16, 32, 64, 128 on the validation prompts 601..800


class PromptBelady(Policy):
    """Belady that sees only the current prompt's future: a key not used again in it is ranked after
    every key that is, least recently used first."""

    def __init__(self, oracle: BeladyOracle, prompt_end: np.ndarray) -> None:
        self._oracle, self._end = oracle, prompt_end
        self._heap = KeyedHeap()
        self._n = len(oracle)

    def _rank(self, key: Key) -> None:
        nxt = self._oracle.advance(key)
        at = self._oracle.consumed - 1
        self._heap.set(key, -(nxt if nxt < self._end[at] else 2 * self._n - at))

    hit = insert = _rank

    def remove(self, key: Key) -> None:
        self._heap.discard(key)

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        return self._heap.smallest(pinned)


class PromptCounts(Policy):
    """Evicts the expert with the lowest count, least recently used first among equals. An expert's
    count is `start(prompt, key)` when a prompt begins (prompts are numbered from 0 in replay order)
    and moves by `step` at each of its accesses in the prompt: the prompt's final counts (step 0) or
    the counts still to come (step -1), or A * the rate over earlier prompts (step +1: the count so far
    plus the prior, a Dirichlet estimate's order)."""

    def __init__(self, start: Callable[[int, Key], float], step: float) -> None:
        self._start, self._step = start, step
        self._prompt = -1  # the replay's first session() starts prompt 0
        self._uses: Counter[Key] = Counter()  # accesses in this prompt
        self._last: dict[Key, int] = {}  # resident keys: the clock of their last access
        self._clock = 0
        self._heap = KeyedHeap()

    def _count(self, key: Key) -> float:
        return self._start(self._prompt, key) + self._step * self._uses[key]

    def session(self) -> None:
        self._prompt += 1
        self._uses.clear()
        for key, last in self._last.items():
            self._heap.set(key, (self._count(key), last))

    def hit(self, key: Key) -> None:
        self._clock += 1
        self._uses[key] += 1
        self._last[key] = self._clock
        self._heap.set(key, (self._count(key), self._clock))

    insert = hit

    def remove(self, key: Key) -> None:
        self._heap.discard(key)
        del self._last[key]

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        return self._heap.smallest(pinned)


def prompt_counts(trace: Trace) -> np.ndarray:
    """Uses of each expert by each prompt at each layer: [prompts, layers, experts]."""
    row = np.repeat(np.arange(len(trace.offsets) - 1), np.diff(trace.offsets))  # row = token * n_layers + layer
    prompt = np.searchsorted(trace.session_starts, row // trace.n_layers, side="right") - 1
    out = np.zeros((len(trace.session_starts), trace.n_layers, trace.n_experts), np.int64)
    np.add.at(out, (prompt, row % trace.n_layers, trace.experts), 1)
    return out


def earlier_rates(trace: Trace, counts: np.ndarray) -> np.ndarray:
    """Each expert's uses per token over the prompts before each prompt (0 before the first):
    [prompts, layers, experts]."""
    tokens = np.diff(np.append(trace.session_starts, trace.n_tokens))
    before = np.cumsum(counts, 0) - counts
    return before / np.maximum(np.cumsum(tokens) - tokens, 1)[:, None, None]


def shuffled_within_prompts(trace: Trace, seed: int) -> Trace:
    """`trace` with the tokens of every prompt in a random order (all layers of a token move together)."""
    rng = np.random.default_rng(seed)
    bounds = np.append(trace.session_starts, trace.n_tokens)
    order = np.concatenate([a + rng.permutation(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
    return dataclasses.replace(trace, experts=trace.dense()[order].reshape(-1),
                               name=f"{trace.name}(shuffled within prompts, seed {seed})")


def reference_factory(trace: Trace, policy: str, prompt_end: np.ndarray, prior_weight: float) -> Callable[[], Policy]:
    """The policies of this benchmark that are not in agent.policies (they are built from the trace)."""
    if policy == "belady-prompt":
        oracle = BeladyOracle(access_sequence(trace), trace.offsets)
        return lambda: PromptBelady(oracle, prompt_end)
    counts = prompt_counts(trace)
    if policy == "counts-estimate":
        prior = prior_weight * earlier_rates(trace, counts)
        return lambda: PromptCounts(lambda p, k: prior[p, k[0], k[1]], 1.0)
    step = {"counts-final": 0.0, "counts-left": -1.0}[policy]
    return lambda: PromptCounts(lambda p, k: counts[p, k[0], k[1]], step)


REFERENCES = ("belady-prompt", "counts-estimate", "counts-final", "counts-left")


def access_classes(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per access: its token's position in the prompt, and whether it is the expert's first use in the prompt."""
    per_row = np.diff(trace.offsets)
    token = np.repeat(np.arange(trace.n_tokens), trace.n_layers)
    starts = trace.session_starts
    prompt = np.searchsorted(starts, token, side="right") - 1
    position = np.repeat(token - starts[prompt], per_row)
    acc = access_sequence(trace)
    code = (np.repeat(prompt, per_row) * trace.n_layers + acc[:, 0]) * (trace.n_experts + 1) + acc[:, 1]
    first = np.zeros(len(acc), bool)
    first[np.unique(code, return_index=True)[1]] = True
    return position, first


def hits_of(trace: Trace, policy: str, capacity: float, prompt_end: np.ndarray,
            **options) -> tuple[np.ndarray, dict | None]:
    """Per access, hit or not, replaying `trace` with `policy` (per layer)."""
    online = options.pop("online", None)
    if policy in REFERENCES:
        cache, learner = cache_for(trace, "lru", capacity)
        cache = type(cache)(cache.capacity, trace.n_layers,
                            reference_factory(trace, policy, prompt_end, options.get("prior_weight", PRIOR_WEIGHT)),
                            "layer", trace.top_k)
    else:
        cache, learner = cache_for(trace, policy, capacity, online=online, **options)
    out = np.zeros(trace.n_accesses, bool)
    i = 0
    access = cache.access

    def recorded(key: Key):
        nonlocal i
        result = access(key)
        out[i] = result[0]
        i += 1
        return result

    cache.access = recorded
    replay(trace, cache, SystemReplay.synthetic())
    return out, (dict(learner.summary()) | {"judgements": [vars(u.judgement) for u in learner.updates if u.judgement]}
                 if learner else None)


def breakdown(hit: np.ndarray, position: np.ndarray, first: np.ndarray) -> dict:
    rows = {"all": hit.mean(), "first use in prompt": hit[first].mean(), "re-use in prompt": hit[~first].mean()}
    for lo, hi in zip(BUCKETS, BUCKETS[1:] + (None,)):
        sel = (position >= lo) & (position < hi) if hi else position >= lo
        rows[f"tokens {lo}..{hi - 1 if hi else 'end'}"] = hit[sel].mean()
    return {k: float(v) for k, v in rows.items()}


def prior_weights(text: str) -> list[float]:
    """'16,32' -> [16.0, 32.0]: each a positive weight."""
    try:
        weights = [float(a) for a in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}") from None
    if not all(a > 0 for a in weights):
        raise argparse.ArgumentTypeError(f"every prior weight must be positive, got {text!r}")
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=TRACES_DIR)
    parser.add_argument("--prompts", default="601..800")
    parser.add_argument("--capacity", type=float, default=0.25)
    parser.add_argument("--online", nargs="?", const="{}", metavar="JSON",
                        help="also the learned policy learning online (slow), with these OnlineConfig settings")
    parser.add_argument("--prior-weight", type=prior_weights, default=[PRIOR_WEIGHT], metavar="A[,A...]",
                        help="counts, estimated: the prior's weight in tokens, one row each (default %(default)s)")
    parser.add_argument("--shuffle", type=int, metavar="SEED", help="permute the tokens within every prompt first")
    parser.add_argument("--results", type=results_name, default="prefill_gap",
                        help="results name: bench/results/NAME.json")
    args = parser.parse_args()
    trace = load(args.traces / PREFILL, prompts=parse_prompts(args.prompts))
    if args.shuffle is not None:
        trace = shuffled_within_prompts(trace, args.shuffle)
    (position, first), end = access_classes(trace), session_ends(trace)
    estimates = [(f"counts-estimate A={a:g}" if len(args.prior_weight) > 1 else "counts-estimate", {"prior_weight": a})
                 for a in args.prior_weight]
    runs = [("lru", {}), ("lfu-window", {"window": 512}), ("flashmoe", {"decision": "score"}), *estimates,
            ("counts-final", {}), ("counts-left", {}), ("belady-prompt", {}), ("belady", {})]
    if args.online is not None:
        runs.insert(3, ("flashmoe online", {"decision": "score", "online": OnlineConfig(**json.loads(args.online))}))
    shares = {"first use in prompt": float(first.mean())}
    shares |= {f"tokens {lo}..": float((position >= lo).mean()) for lo in BUCKETS}
    results, hits = {}, {}
    for label, options in runs:
        start = time.perf_counter()
        hits[label], learner = hits_of(trace, label.split()[0], args.capacity, end, **options)
        results[label] = {"options": {k: v if k != "online" else dataclasses.asdict(v) for k, v in options.items()},
                          "hit_rate": breakdown(hits[label], position, first), "learner": learner,
                          "seconds": time.perf_counter() - start}
        print(f"{label:<24}" + "  ".join(f"{k} {v:.4f}" for k, v in results[label]["hit_rate"].items()),
              flush=True)
    # Where the learned policy's misses that Belady hits fall.
    lost = {label: {"first use in prompt": int((hits["belady"] & ~hits[label] & first).sum()),
                    "re-use in prompt": int((hits["belady"] & ~hits[label] & ~first).sum())}
            for label in hits if label != "belady"}
    write_results(args.results, {"machine": machine(), "trace": trace.name, "capacity": args.capacity,
                                  "scope": "layer", "shuffle_seed": args.shuffle, "accesses": int(trace.n_accesses),
                                  "tokens": int(trace.n_tokens), "prompts": len(trace.session_starts),
                                  "access_shares": shares, "policies": results,
                                  "belady_hits_lost": lost})


if __name__ == "__main__":
    main()
