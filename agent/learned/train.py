"""Train the FlashMoE retention model by imitating Belady on recorded routing traces.

Each trace is replayed through the cache core (agent.residency.Residency, per-layer scope, via the
simulator's replay) with Belady, windowed LFU or LRU making the decisions; at sampled evictions
the candidates' features are recorded with their true distance to next use (Belady's oracle).
Belady alone shows only the states an ideal cache is in; the learned policy in use meets the
fuller, messier states of an imperfect cache, and training on those too (a cheap stand-in for
DAgger), together with log-scaled rates, lifted olmoe_dialogue from 0.594 to 0.627 at 0.25.

The loss is pairwise (RankNet): for two candidates of one decision, the one used sooner must
score higher. Only the order within a decision matters for eviction,
and the distance of an expert never used again is undefined (a cap), so regressing distances
would spend the network on a scale that no decision reads. Pairs are weighted by how far apart
their log distances are, so near-ties do not dominate.

The system tower sees random monitoring series during training: the traces carry no latency or
pressure, and all experts cost the same read, so the right answer is that the ranking does not
depend on them; training on a constant series would leave the tower's response to real samples
untrained (arbitrary), random series teach it to stay neutral.

Training reads the train split only (agent.learned.splits: olmoe_prose, qwen_prose, prefill prompts
1..600); the validation split chooses settings and the report split is never trained on. The
shipped weights (agent/policies/weights/flashmoe.safetensors) are reproduced with:

    flashmoe-cli train-policy --train-split --seed 0 --epochs 3 --out agent/policies/weights/flashmoe.safetensors

and the weights that never saw one architecture (for the report on architectures absent from
training) with `--without olmoe` (qwen, deepseek) and `--out .../flashmoe-no-olmoe.safetensors`.

Defaults: capacity 0.25 per layer, decisions made by Belady, windowed LFU and LRU (about 12000
sampled per trace and driver), at most 30000 tokens per trace (prefill: whole prompts spread
evenly over the split's). `--trace` takes any traces; a prefill NPZ among them gives its train
split prompts unless `--prompts` says otherwise, so its report prompts are never taken by default.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from agent import argtypes
from agent.experts.reader import IO_THREADS
from agent.learned.features import FEATURES, HISTORY_BITS, LayerHistory
from agent.learned.model import NetConfig, RetentionNet, check_writable, save
from agent.learned.scorer import SERIES_LEN, layer_inputs, system_input
from agent.learned.splits import ARCHITECTURES, TRACES_DIR, TRAIN_PROMPTS, Part, split_parts
from agent.policies import policy_factory
from agent.policies.base import Key, Policy
from agent.policies.belady import Belady, BeladyOracle
from agent.residency import Residency
from agent.simulator import SystemReplay, capacity_slots, replay
from agent.traces import Trace, access_sequence, parse_prompts, session_ends

log = logging.getLogger(__name__)

MAX_CANDIDATES = 16  # candidates kept per decision (a random subset, always with Belady's victim)
SYSTEM_INPUTS_SEEN = ("random", "recorded")  # what the system tower sees in training (fit)


@dataclass
class Decisions:
    """Recorded eviction decisions, padded to MAX_CANDIDATES candidates each."""
    signature: np.ndarray  # [D, M, bits]
    features: np.ndarray   # [D, M, F]
    distance: np.ndarray   # [D, M] accesses until next use (trace length if never)
    mask: np.ndarray       # [D, M] True where a real candidate sits
    series: np.ndarray     # [D, SERIES_LEN, 2] the system tower's input then; NaN if the trace had no real samples

    def __len__(self) -> int:
        return len(self.distance)

    def __getitem__(self, rows) -> "Decisions":
        return Decisions(*(getattr(self, f)[rows] for f in FIELDS))

    @staticmethod
    def concat(parts: Sequence["Decisions"]) -> "Decisions":
        return Decisions(*(np.concatenate([getattr(p, f) for p in parts]) for f in FIELDS))


FIELDS = ("signature", "features", "distance", "mask", "series")


@dataclass
class Tape:
    """Shared by the recorders of all partitions: the one replay order and the sampled rows."""
    future: BeladyOracle  # each access's next use (a reader of its own: Belady, if it decides, has another)
    rate: float           # share of eviction decisions recorded
    rng: np.random.Generator
    start: int = 0        # no decision is recorded before this access (the features need a history)
    # per access, the position a label's distance stops at (a use after it counts as none before it):
    # the end of the access's session, for labels that see no further than the session; None: the trace's end
    horizon: np.ndarray | None = None
    position: int = 0     # demand accesses so far: each arrives as exactly one hit or insert
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = field(default_factory=list)
    real: bool = False    # the trace carries the monitoring samples its cache was fed: record the series
    series: deque = field(default_factory=lambda: deque(maxlen=SERIES_LEN))  # the tower's inputs so far
    _last: object = None  # the last sample: every partition's recorder passes the same one on

    def system(self, sample: Mapping[str, float]) -> None:
        if sample is not self._last:
            self._last = sample
            self.series.append(system_input(sample))

    def current_series(self) -> np.ndarray | None:
        """The series the policy would see now, front-padded with its first value to SERIES_LEN."""
        if not self.real or not self.series:
            return None
        values = list(self.series)
        return np.array([values[0]] * (SERIES_LEN - len(values)) + values, np.float32)


class Recorder(Policy):
    """Forwards every hook to the `driver` policy that decides, and records sampled decisions'
    candidates with their true futures. Driving with Belady shows the states an ideal cache sees;
    driving with LRU or windowed LFU shows the imperfect states a learned policy meets in use."""

    def __init__(self, driver: Policy, tape: Tape) -> None:
        self.driver, self.tape = driver, tape
        self.layers: dict[int, LayerHistory] = {}
        self._next: dict[Key, int] = {}

    def session(self) -> None:
        for h in self.layers.values():
            h.new_session()
        self.driver.session()

    def system(self, sample: Mapping[str, float]) -> None:
        self.tape.system(sample)
        self.driver.system(sample)

    def route(self, layer: int, experts: Collection[int]) -> None:
        self.layers.setdefault(layer, LayerHistory()).observe(experts)
        self.driver.route(layer, experts)

    def hit(self, key: Key) -> None:
        self._touch(key)
        self.driver.hit(key)

    def insert(self, key: Key) -> None:
        self._touch(key)
        self.driver.insert(key)

    def remove(self, key: Key) -> None:
        self._next.pop(key, None)
        self.driver.remove(key)

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        choice = self.driver.victim(resident, pinned)
        if self.tape.position >= self.tape.start and self.tape.rng.random() < self.tape.rate:
            candidates = [k for k in resident if k not in pinned]
            self._record(candidates, max(candidates, key=self._next.__getitem__))
        return choice

    def _touch(self, key: Key) -> None:
        self._next[key] = self.tape.future.advance(key)
        self.tape.position += 1

    def _record(self, candidates: list[Key], furthest: Key) -> None:
        if len(candidates) > MAX_CANDIDATES:  # keep Belady's victim, so every decision has its answer
            others = [k for k in candidates if k != furthest]
            picked = self.tape.rng.choice(len(others), MAX_CANDIDATES - 1, replace=False)
            candidates = [furthest] + [others[i] for i in sorted(picked)]
        by_layer: dict[int, list[Key]] = {}
        for k in candidates:
            by_layer.setdefault(k[0], []).append(k)
        ordered = [k for keys in by_layer.values() for k in keys]
        sigs, feats = zip(*(layer_inputs(self.layers.setdefault(layer, LayerHistory()),
                                         np.array([e for _, e in keys], np.int64))
                            for layer, keys in by_layer.items()))
        nxt = np.array([self._next[k] for k in ordered], np.float32)
        if self.tape.horizon is not None:
            nxt = np.minimum(nxt, self.tape.horizon[self.tape.position])
        dist = nxt - self.tape.position
        self.tape.rows.append((np.concatenate(sigs), np.concatenate(feats), dist, self.tape.current_series()))


def collect(trace: Trace, slots: int, driver: str | Callable[[], Policy], max_decisions: int,
            rng: np.random.Generator, scope: str = "layer", after: int = 0, ahead: int = IO_THREADS,
            within_sessions: bool = False) -> Decisions:
    """Replay `trace` through a cache of `slots` (`scope`) with `driver` deciding (a policy name, or a
    constructor of one); record about `max_decisions` sampled decisions from token `after` on. The cache
    holds top-k per layer at least; a batched step larger than a partition is narrowed as the runtime
    narrows it with `ahead` reads in flight (Residency.take). `within_sessions`: a candidate's distance
    stops at the end of the session (a use in a later one counts as none before it)."""
    oracle = BeladyOracle(access_sequence(trace), trace.offsets)
    start = int(trace.offsets[min(after, trace.n_tokens) * trace.n_layers])
    # about a third of accesses miss at these sizes: sample to about max_decisions
    tape = Tape(oracle.fresh(), rate=min(1.0, 3 * max_decisions / max(1, trace.n_accesses - start)), rng=rng,
                start=start, real=bool(trace.system), horizon=session_ends(trace) if within_sessions else None)
    make = (lambda: Belady(oracle)) if driver == "belady" else policy_factory(driver) if isinstance(driver, str) \
        else driver
    cache = Residency(slots, trace.n_layers, lambda: Recorder(make(), tape), scope, min_per_layer=trace.top_k)
    replay(trace, cache, SystemReplay.synthetic(), ahead=ahead)
    return padded(tape.rows)


def spread_sessions(trace: Trace, max_tokens: int) -> Trace:
    """At most `max_tokens` tokens of `trace`: whole sessions, evenly spread over it (e.g. prompts)."""
    if trace.n_tokens <= max_tokens:
        return trace
    bounds = np.append(trace.session_starts, trace.n_tokens)
    lengths = np.diff(bounds)
    keep = np.unique(np.linspace(0, len(lengths) - 1, max(1, round(len(lengths) * max_tokens / trace.n_tokens)))
                     .round().astype(int))
    first, last = trace.offsets[bounds[keep] * trace.n_layers], trace.offsets[bounds[keep + 1] * trace.n_layers]
    flat = np.concatenate([trace.experts[a:b] for a, b in zip(first, last)])
    rows = np.concatenate([np.arange(bounds[i] * trace.n_layers, bounds[i + 1] * trace.n_layers) for i in keep])
    offsets = np.concatenate([[0], np.cumsum(np.diff(trace.offsets)[rows])])
    starts = np.concatenate([[0], np.cumsum(lengths[keep])[:-1]])
    return Trace(f"{trace.name}(sampled {len(keep)} sessions)", trace.model, trace.n_layers, trace.n_experts,
                 trace.top_k, offsets, flat, starts, trace.layer_ids)


def padded(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]) -> Decisions:
    """Decisions from (signature, features, distance, series or None) rows of up to MAX_CANDIDATES candidates."""
    d, m, bits, nf = len(rows), MAX_CANDIDATES, HISTORY_BITS, len(FEATURES)
    out = Decisions(np.zeros((d, m, bits), np.float32), np.zeros((d, m, nf), np.float32),
                    np.zeros((d, m), np.float32), np.zeros((d, m), bool),
                    np.full((d, SERIES_LEN, 2), np.nan, np.float32))
    for i, (sig, feat, dist, series) in enumerate(rows):
        n = len(dist)
        out.signature[i, :n], out.features[i, :n], out.distance[i, :n], out.mask[i, :n] = sig, feat, dist, True
        if series is not None:
            out.series[i] = series
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
        scores = _scores(net, data, torch.zeros(1, 1, 2))
    scores = scores.masked_fill(~torch.from_numpy(data.mask), float("inf"))
    dist = torch.from_numpy(data.distance).masked_fill(~torch.from_numpy(data.mask), -1)
    chosen = dist.gather(1, scores.argmin(1, keepdim=True))[:, 0]
    return float((chosen == dist.max(1).values).float().mean())


def _scores(net: RetentionNet, data: Decisions, series: torch.Tensor) -> torch.Tensor:
    b, m, bits = data.signature.shape
    h = net.expert(torch.from_numpy(data.signature).view(b * m, bits),
                   torch.from_numpy(data.features).view(b * m, -1)).view(b, m, -1)
    return (h * net.system(series)[:, None, :]).sum(-1)


def fit(data: Decisions, epochs: int, seed: int, batch: int = 512, lr: float = 3e-3,
        net: RetentionNet | None = None, system: str = "random") -> RetentionNet:
    """Train a new network on `data`, or fine-tune `net` (in place). The system tower sees one random
    series per batch (`system="random"`: no trace here says how latency should change a ranking), or
    each decision's recorded series where it has one (`"recorded"`), a random one elsewhere."""
    if system not in SYSTEM_INPUTS_SEEN:
        raise ValueError(f"system must be one of {SYSTEM_INPUTS_SEEN}, got {system!r}")
    torch.set_num_threads(1)  # small matrices: extra threads only spin, and one thread is bit-reproducible
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    net = net.train() if net is not None else RetentionNet(NetConfig())
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * -(-len(data) // batch)))
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=gen).numpy()
        total = 0.0
        for first in range(0, len(data), batch):
            idx = order[first:first + batch]
            part = data[idx]
            series = random_series(1, gen)  # one system state per batch
            if system == "recorded":
                recorded = torch.from_numpy(part.series)
                series = torch.where(recorded.isnan(), series.expand_as(recorded), recorded)
            scores = _scores(net, part, series)
            loss = pairwise_loss(scores, torch.from_numpy(part.distance), torch.from_numpy(part.mask))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        log.debug("epoch %d/%d: pairwise loss %.4f", epoch + 1, epochs, total / max(1, len(data)))
    return net.eval()


def train_policy(parts: Sequence[Part], out: Path, root: Path = Path("."), epochs: int = 3,
                 seed: int = 0, capacities: Sequence[float] = (0.25,),
                 drivers: Sequence[str] = ("belady", "lfu-window", "lru"), max_decisions: int = 12000,
                 max_tokens: int = 30000) -> dict:
    """Collect decisions on every trace (`parts`, relative to `root`), capacity and driver, fit, write
    `out`; returns a summary."""
    rng = np.random.default_rng(seed)
    started = time.monotonic()
    traces = [spread_sessions(part.load(root), max_tokens) for part in parts]
    parts = []
    for trace in traces:
        for fraction in capacities:
            for driver in drivers:
                parts.append(collect(trace, capacity_slots(trace, fraction, "layer"), driver, max_decisions, rng))
                log.info("%s, capacity %g, %s deciding: %d decisions", trace.name, fraction, driver, len(parts[-1]))
    data = Decisions.concat(parts)
    if len(data) == 0:
        raise ValueError("the traces produced no eviction decisions (the cache never filled); "
                         "use longer traces or a smaller capacity")
    net = fit(data, epochs, seed)
    summary = {"traces": [t.name for t in traces], "capacities": list(capacities), "drivers": list(drivers),
               "epochs": epochs, "seed": seed, "decisions": len(data), "max_tokens": max_tokens,
               "victim_agreement_train": round(victim_agreement(net, data), 4),
               "seconds": round(time.monotonic() - started, 1)}
    save(net, out, summary)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("examples:\n  flashmoe-cli train-policy --train-split --out /tmp/policy.safetensors\n"
                     "  flashmoe-cli train-policy --trace ../shared/traces/decode/olmoe_prose.jsonl "
                     "--out /tmp/policy.safetensors --epochs 2")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", nargs="+", type=Path, metavar="PATH", help="training traces (.jsonl, .npz)")
    source.add_argument("--train-split", action="store_true",
                        help="the train split of the shared traces (agent.learned.splits), under --traces-dir")
    parser.add_argument("--traces-dir", type=Path, default=TRACES_DIR, metavar="DIR",
                        help="the shared traces directory, for --train-split (default %(default)s)")
    parser.add_argument("--without", choices=ARCHITECTURES,
                        help="--train-split without this architecture's traces: weights that never saw it")
    parser.add_argument("--prompts", metavar="A..B",
                        help=f"prompt numbers to use from .npz traces (default: the train split's, "
                             f"{TRAIN_PROMPTS.start}..{TRAIN_PROMPTS.stop - 1}: never the report prompts)")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE", help="weights file to write")
    parser.add_argument("--epochs", type=argtypes.count, default=3, help="passes over the decisions (default 3)")
    parser.add_argument("--seed", type=argtypes.seed, default=0, help="sampling and initialisation seed (default 0)")
    parser.add_argument("--max-decisions", type=argtypes.count, default=12000,
                        help="eviction decisions sampled per trace, capacity and deciding policy")
    parser.add_argument("--max-tokens", type=argtypes.count, default=30000,
                        help="tokens replayed per trace: longer traces keep whole sessions spread evenly")


def training_parts(args: argparse.Namespace) -> tuple[tuple[Part, ...], Path]:
    """The traces the command line names, and the directory they are relative to."""
    if args.train_split:
        if args.prompts is not None:
            raise ValueError("--prompts applies to --trace; --train-split takes the split's own prompts")
        return split_parts("train", args.without), args.traces_dir
    if args.without is not None:
        raise ValueError("--without applies to --train-split")
    prompts = parse_prompts(args.prompts) if args.prompts else TRAIN_PROMPTS
    return tuple(Part(str(p), prompts if Path(p).suffix == ".npz" else None) for p in args.trace), Path(".")


def run(args: argparse.Namespace) -> int:
    try:
        parts, root = training_parts(args)
        check_writable(args.out)
        summary = train_policy(parts, args.out, root, args.epochs, args.seed,
                               max_decisions=args.max_decisions, max_tokens=args.max_tokens)
    except ValueError as e:  # TraceError included: the message names the file and what to fix
        print(f"flashmoe-cli train-policy: error: {e}", file=sys.stderr)
        return 2
    log.info("wrote %s: %s", args.out, summary)
    return 0
