"""Where the prefill prompts' LRU->Belady gap is: which accesses each policy loses, and how much of it is reachable.

    nice -n 19 .venv/bin/python bench/prefill_gap.py [--prompts 601..800] [--capacity 0.25] [--online [JSON]]
        [--results NAME]

The DeepSeek prefill prompts are replayed token by token (one step per token, six experts per
layer, pinned whole: a step always fits a layer's partition, so Belady has no freedom of order
within a step). Every access is classed by where it falls in its prompt (the token's position) and
by whether it is the first use of that expert in the prompt; each policy's hit rate is given per
class. Besides Belady, "belady, this prompt only" sees the future of the prompt being replayed and
nothing after it (experts not used again in the prompt go least recently used first): the gap
between the two is what knowing the *next* prompts is worth, which no policy learning from the past
can know. Per layer, capacity 0.25, validation prompts by default (settings are chosen there).
`--online` adds the learned policy learning online (OnlineConfig's defaults, or the settings
JSON given), with every update's hindsight judgement. JSON: bench/results/prefill_gap.json (NAME.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Collection
from dataclasses import asdict
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
from bench.common import machine, write_results  # noqa: E402

BUCKETS = (0, 8, 16, 32, 64)  # token positions in a prompt: [0, 8), [8, 16), ... [64, end)


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
    if policy == "belady-prompt":
        oracle = BeladyOracle(access_sequence(trace), trace.offsets)
        cache, learner = cache_for(trace, "lru", capacity)
        cache = type(cache)(cache.capacity, trace.n_layers, lambda: PromptBelady(oracle, prompt_end), "layer",
                            trace.top_k)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=TRACES_DIR)
    parser.add_argument("--prompts", default="601..800")
    parser.add_argument("--capacity", type=float, default=0.25)
    parser.add_argument("--online", nargs="?", const="{}", metavar="JSON",
                        help="also the learned policy learning online (slow), with these OnlineConfig settings")
    parser.add_argument("--results", default="prefill_gap", help="results name: bench/results/NAME.json")
    args = parser.parse_args()
    trace = load(args.traces / PREFILL, prompts=parse_prompts(args.prompts))
    (position, first), end = access_classes(trace), session_ends(trace)
    runs = [("lru", {}), ("lfu-window", {"window": 512}), ("flashmoe", {"decision": "score"}),
            ("belady-prompt", {}), ("belady", {})]
    if args.online is not None:
        runs.insert(3, ("flashmoe online", {"decision": "score", "online": OnlineConfig(**json.loads(args.online))}))
    shares = {"first use in prompt": float(first.mean())}
    shares |= {f"tokens {lo}..": float((position >= lo).mean()) for lo in BUCKETS}
    results, hits = {}, {}
    for label, options in runs:
        start = time.perf_counter()
        hits[label], learner = hits_of(trace, label.split()[0], args.capacity, end, **options)
        results[label] = {"options": {k: v if k != "online" else asdict(v) for k, v in options.items()},
                          "hit_rate": breakdown(hits[label], position, first), "learner": learner,
                          "seconds": time.perf_counter() - start}
        print(f"{label:<16}" + "  ".join(f"{k} {v:.4f}" for k, v in results[label]["hit_rate"].items()),
              flush=True)
    # Where the learned policy's misses that Belady hits fall.
    lost = {label: {"first use in prompt": int((hits["belady"] & ~hits[label] & first).sum()),
                    "re-use in prompt": int((hits["belady"] & ~hits[label] & ~first).sum())}
            for label in hits if label != "belady"}
    write_results(args.results, {"machine": machine(), "trace": trace.name, "capacity": args.capacity,
                                  "scope": "layer", "accesses": int(trace.n_accesses),
                                  "tokens": int(trace.n_tokens), "prompts": len(trace.session_starts),
                                  "access_shares": shares, "policies": results,
                                  "belady_hits_lost": lost})


if __name__ == "__main__":
    main()
