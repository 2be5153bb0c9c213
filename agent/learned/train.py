"""Train the FlashMoE retention model by imitating Belady on recorded routing traces.

Each trace is replayed through the cache core (agent.residency.Residency, per-layer scope) with
Belady making the decisions; at each eviction the candidates' features are recorded with their
true distance to next use. The loss is pairwise (RankNet): for two candidates of one decision,
the one used sooner must score higher. Only the order within a decision matters for eviction,
and the distance of an expert never used again is undefined (a cap), so regressing distances
would spend the network on a scale that no decision reads. Pairs are weighted by how far apart
their log distances are, so near-ties do not dominate.

The system tower sees random monitoring series during training: the traces carry no latency or
pressure, and all experts cost the same read, so the right answer is that the ranking does not
depend on them; training on a constant series would leave the tower's response to real samples
untrained (arbitrary), random series teach it to stay neutral.

The shipped weights (agent/policies/weights/flashmoe.safetensors) are reproduced with:

    flashmoe-cli train-policy --seed 0 --epochs 6 \\
        --trace ../shared/traces/decode/olmoe_prose.jsonl ../shared/traces/decode/olmoe_code.jsonl \\
                ../shared/traces/decode/qwen_prose.jsonl ../shared/traces/decode/qwen_code.jsonl \\
                ../shared/traces/prefill/deepseek_v2_lite_puffin_0001-1000.npz --prompts 1..800 \\
        --out agent/policies/weights/flashmoe.safetensors
"""
from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from agent.learned.features import LayerHistory
from agent.learned.model import NetConfig, RetentionNet, save
from agent.learned.scorer import SERIES_LEN, layer_inputs
from agent.policies.base import Key, Policy
from agent.policies.belady import Belady, BeladyOracle
from agent.residency import Residency
from agent.traces import Trace, access_sequence, load, parse_prompts, walk

log = logging.getLogger(__name__)

MAX_CANDIDATES = 16  # candidates kept per decision (a random subset, always with Belady's victim)


@dataclass
class Decisions:
    """Recorded eviction decisions, padded to MAX_CANDIDATES candidates each."""
    signature: np.ndarray  # [D, M, bits]
    features: np.ndarray   # [D, M, F]
    distance: np.ndarray   # [D, M] accesses until next use (trace length if never)
    mask: np.ndarray       # [D, M] True where a real candidate sits

    def __len__(self) -> int:
        return len(self.distance)

    @staticmethod
    def concat(parts: Sequence["Decisions"]) -> "Decisions":
        return Decisions(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                           ("signature", "features", "distance", "mask")))


@dataclass
class Tape:
    """Shared by the recorders of all partitions: the one replay order and the sampled rows."""
    next_use: np.ndarray  # BeladyOracle.next_use: position of each access's next use
    rate: float           # share of eviction decisions recorded
    rng: np.random.Generator
    position: int = 0     # demand accesses so far: each arrives as exactly one hit or insert
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)


class Recorder(Policy):
    """Belady's decisions for one partition, recording sampled decisions' candidates and futures."""

    def __init__(self, oracle: BeladyOracle, tape: Tape) -> None:
        self.belady, self.tape = Belady(oracle), tape
        self.layers: dict[int, LayerHistory] = {}
        self._next: dict[Key, int] = {}

    def session(self) -> None:
        for h in self.layers.values():
            h.new_session()

    def route(self, layer: int, experts: Collection[int]) -> None:
        self.layers.setdefault(layer, LayerHistory()).observe(experts)

    def hit(self, key: Key) -> None:
        self._touch(key)
        self.belady.hit(key)

    def insert(self, key: Key) -> None:
        self._touch(key)
        self.belady.insert(key)

    def remove(self, key: Key) -> None:
        self._next.pop(key, None)
        self.belady.remove(key)

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        choice = self.belady.victim(resident, pinned)
        if self.tape.rng.random() < self.tape.rate:
            self._record([k for k in resident if k not in pinned], choice)
        return choice

    def _touch(self, key: Key) -> None:
        self._next[key] = int(self.tape.next_use[self.tape.position])
        self.tape.position += 1

    def _record(self, candidates: list[Key], choice: Key) -> None:
        if len(candidates) > MAX_CANDIDATES:
            others = [k for k in candidates if k != choice]
            picked = self.tape.rng.choice(len(others), MAX_CANDIDATES - 1, replace=False)
            candidates = [choice] + [others[i] for i in sorted(picked)]
        by_layer: dict[int, list[Key]] = {}
        for k in candidates:
            by_layer.setdefault(k[0], []).append(k)
        ordered = [k for keys in by_layer.values() for k in keys]
        sigs, feats = zip(*(layer_inputs(self.layers.setdefault(layer, LayerHistory()),
                                         np.array([e for _, e in keys], np.int64))
                            for layer, keys in by_layer.items()))
        dist = np.array([self._next[k] - self.tape.position for k in ordered], np.float32)
        self.tape.rows.append((np.concatenate(sigs), np.concatenate(feats), dist))


def _capacity(trace: Trace, fraction: float) -> int:
    """Slots for `fraction` of every layer's experts, at least one token's working set per layer."""
    return max(round(fraction * trace.n_experts), trace.max_set) * trace.n_layers


def collect(trace: Trace, fraction: float, max_decisions: int, rng: np.random.Generator) -> Decisions:
    """Replay `trace` under Belady at `fraction` capacity (per-layer scope) and record decisions."""
    oracle = BeladyOracle(access_sequence(trace))
    # Belady misses roughly a third of accesses at these sizes: sample to about max_decisions.
    tape = Tape(oracle.next_use, rate=min(1.0, 3 * max_decisions / max(1, trace.n_accesses)), rng=rng)
    cache = Residency(_capacity(trace, fraction), trace.n_layers, lambda: Recorder(oracle, tape), "layer",
                      min_per_layer=trace.max_set)
    for new_session, layer, experts in walk(trace):
        if new_session:
            cache.session()
        cache.route(layer, experts)
        for e in experts:
            cache.access((layer, e))
    return _pad(tape.rows)


def _pad(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Decisions:
    d, m = len(rows), MAX_CANDIDATES
    bits, nf = (rows[0][0].shape[1], rows[0][1].shape[1]) if rows else (1, 1)
    out = Decisions(np.zeros((d, m, bits), np.float32), np.zeros((d, m, nf), np.float32),
                    np.zeros((d, m), np.float32), np.zeros((d, m), bool))
    for i, (sig, feat, dist) in enumerate(rows):
        n = len(dist)
        out.signature[i, :n], out.features[i, :n], out.distance[i, :n], out.mask[i, :n] = sig, feat, dist, True
    return out


def random_series(batch: int, generator: torch.Generator) -> torch.Tensor:
    """Plausible monitoring series [batch, SERIES_LEN, 2]: latency around the reference, pressure in 0..1."""
    level = torch.rand(batch, 1, 2, generator=generator) * torch.tensor([3.0, 1.0]) - torch.tensor([1.0, 0.0])
    noise = 0.1 * torch.randn(batch, SERIES_LEN, 2, generator=generator)
    return (level + noise).clamp(torch.tensor([-2.0, 0.0]), torch.tensor([2.0, 1.0]))


def pairwise_loss(scores: torch.Tensor, distance: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RankNet over candidate pairs of each decision: sooner next use must score higher. [B, M] inputs."""
    logd = torch.log2(1 + distance)
    gap = logd[:, None, :] - logd[:, :, None]          # [B, i, j] > 0 when i is used before j
    weight = gap.clamp(0, 4) * (mask[:, :, None] & mask[:, None, :])
    margin = scores[:, :, None] - scores[:, None, :]   # want > 0 where gap > 0
    return (weight * torch.nn.functional.softplus(-margin)).sum() / weight.sum().clamp(min=1e-6)


def victim_agreement(net: RetentionNet, data: Decisions) -> float:
    """Share of decisions where the lowest-scored candidate is one Belady would evict."""
    with torch.inference_mode():
        scores = _scores(net, data, torch.zeros(len(data), 1, 2))
    scores = scores.masked_fill(~torch.from_numpy(data.mask), float("inf"))
    dist = torch.from_numpy(data.distance).masked_fill(~torch.from_numpy(data.mask), -1)
    chosen = dist.gather(1, scores.argmin(1, keepdim=True))[:, 0]
    return float((chosen == dist.max(1).values).float().mean())


def _scores(net: RetentionNet, data: Decisions, series: torch.Tensor) -> torch.Tensor:
    b, m, bits = data.signature.shape
    h = net.expert(torch.from_numpy(data.signature).view(b * m, bits),
                   torch.from_numpy(data.features).view(b * m, -1)).view(b, m, -1)
    return (h * net.system(series)[:, None, :]).sum(-1)


def fit(data: Decisions, epochs: int, seed: int, batch: int = 256, lr: float = 2e-3) -> RetentionNet:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    net = RetentionNet(NetConfig())
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * -(-len(data) // batch)))
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=gen).numpy()
        total = 0.0
        for start in range(0, len(data), batch):
            idx = order[start:start + batch]
            part = Decisions(data.signature[idx], data.features[idx], data.distance[idx], data.mask[idx])
            scores = _scores(net, part, random_series(len(idx), gen))
            loss = pairwise_loss(scores, torch.from_numpy(part.distance), torch.from_numpy(part.mask))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        log.info("epoch %d/%d: pairwise loss %.4f", epoch + 1, epochs, total / max(1, len(data)))
    return net.eval()


def train_policy(paths: Sequence[Path], out: Path, prompts: range | None = None, epochs: int = 6,
                 seed: int = 0, capacities: Sequence[float] = (0.125, 0.25, 0.5),
                 max_decisions: int = 20000) -> dict:
    """Collect Belady's decisions on every trace and capacity, fit, write `out`; returns a summary."""
    rng = np.random.default_rng(seed)
    started = time.monotonic()
    traces = [load(p, prompts=prompts if Path(p).suffix == ".npz" else None) for p in paths]
    parts = []
    for trace in traces:
        for fraction in capacities:
            parts.append(collect(trace, fraction, max_decisions, rng))
            log.info("%s at capacity %.3g: %d decisions", trace.name, fraction, len(parts[-1]))
    data = Decisions.concat(parts)
    if len(data) == 0:
        raise ValueError("the traces produced no eviction decisions (the cache never filled); "
                         "use longer traces or a smaller capacity")
    net = fit(data, epochs, seed)
    summary = {"traces": [t.name for t in traces], "prompts": f"{prompts.start}..{prompts.stop - 1}" if prompts
               else None, "capacities": list(capacities), "epochs": epochs, "seed": seed,
               "decisions": len(data), "victim_agreement_train": round(victim_agreement(net, data), 4),
               "seconds": round(time.monotonic() - started, 1)}
    save(net, out, summary)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("example:\n  flashmoe-cli train-policy --trace ../shared/traces/decode/olmoe_prose.jsonl "
                     "--out /tmp/policy.safetensors --epochs 2")
    parser.add_argument("--trace", nargs="+", required=True, metavar="PATH", help="training traces (.jsonl, .npz)")
    parser.add_argument("--prompts", type=parse_prompts, metavar="A..B",
                        help="prompt numbers to use from .npz traces (e.g. 1..800)")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE", help="weights file to write")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-decisions", type=int, default=20000,
                        help="eviction decisions sampled per trace and capacity")


def run(args: argparse.Namespace) -> int:
    if args.epochs < 1 or args.max_decisions < 1:
        raise SystemExit("--epochs and --max-decisions must be at least 1")
    summary = train_policy([Path(p) for p in args.trace], args.out, args.prompts, args.epochs, args.seed,
                           max_decisions=args.max_decisions)
    log.info("wrote %s: %s", args.out, summary)
    return 0
