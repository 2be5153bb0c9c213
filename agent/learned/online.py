"""The online loop: the learned policy keeps learning from the routing its own device sees.

The learner sees every routing step the cache makes (through the FlashMoE policy's route hook) and
keeps the last `window` of them. Every `every` steps an update falls due, and one job runs:

1. judge the last update in hindsight: replay the steps routed since it took effect through the
   device's cache once with the weights it was fine-tuned from and once with its own; if its hit
   rate is lower it is rolled back, and this job fine-tunes the weights it was made from instead;
2. label decisions in hindsight with each candidate's true distance to its next use within the
   window (a use beyond its end counts as "not before the end", as the end of a trace does
   offline): a sample of the cache's own decisions, as it made them (the policy hands the learner
   the candidates' features at a `live` share of its evictions: the states the weights in use
   really meet, at no replay's cost), and sampled decisions of a replay of the window with Belady
   deciding (the states an ideal cache is in);
3. fine-tune (never from scratch: from the shipped weights and the updates since) on those
   decisions, then move the result a small share (`anchor`) of the way back to the shipped
   weights, so that a run of odd windows cannot drag it far. With a `holdout`, first check that
   it pays: fine-tune on the window without its last `holdout` steps and replay those with both
   weights; if the fine-tuned ones do no better, the job makes no update (the hindsight check
   above only catches a bad update after it has decided `every` steps).

Labels may stop at the end of each session (`within_sessions`): what the next prompt routes is
the part of Belady's future no policy learning from the past can know (BENCHMARKS.md).

The new weights take effect at the next step boundary: the learner swaps them in when the first
layer of a step routes, and each partition's policy adopts them at its next eviction, so no step is
decided by two networks. The learner only ever holds steps the cache has already routed: nothing
from the future reaches a decision (tests/test_online.py permutes a trace's future to prove it).

Where the job runs is the executor's business: `Inline` runs it at the step it falls due (the
simulator: reproducible), agent.learned.background in a low-priority child process under a CPU
budget (the agent), its result swapped in at the first step boundary after it arrives.
"""
from __future__ import annotations

import bisect
import logging
import random
import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from agent.experts.reader import IO_THREADS
from agent.learned.model import NetConfig, RetentionNet
from agent.learned.scorer import SharedNet
from agent.learned.train import MAX_CANDIDATES, Decisions, collect, fit, padded
from agent.residency import Residency
from agent.simulator import SystemReplay, replay
from agent.policies.base import Key
from agent.traces import Trace, access_sequence, from_sets, session_ends

log = logging.getLogger(__name__)

Weights = dict[str, np.ndarray]  # a RetentionNet's state, as numpy arrays: cheap to pickle to a child process
DRIVERS = ("belady", "current", "lru")  # who may decide in a labelling replay ("current": the weights in use)
KEPT_UPDATES = 100  # the most recent updates the learner keeps for status and logs


@dataclass(frozen=True)
class OnlineConfig:
    window: int = 512        # routing steps kept and learned from
    every: int = 128         # routing steps between two updates
    warmup: int = 64         # steps of a replay before decisions are recorded: features need a history
    decisions: int = 2000    # decisions sampled per replay driver and update
    live: float = 0.3        # share of the cache's own evictions whose candidates are recorded for labelling
    epochs: int = 4
    lr: float = 3e-3
    anchor: float = 1e-2     # share of the way back to the shipped weights after each update
    drivers: tuple[str, ...] = ("belady",)  # who decides in the labelling replays
    # labels see no further than the session (a prompt, a request): a use in a later one counts as none,
    # since no policy can know what the next prompt routes (BENCHMARKS.md: what that foresight is worth)
    within_sessions: bool = False
    # steps at the window's end that check, before any update is made, whether fine-tuning on the steps
    # before them does better on them than the weights in use; if not, no update (0: every job updates,
    # judged only in hindsight)
    holdout: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "every", "decisions", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"online {name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.warmup < self.window:
            raise ValueError(f"online warmup must be within 0..window-1, got {self.warmup}")
        if not 0 <= self.holdout < self.window - self.warmup:
            raise ValueError(f"online holdout must be within 0..window-warmup-1, got {self.holdout}")
        if not (self.lr > 0 and 0 <= self.anchor <= 1):  # NaN fails both
            raise ValueError(f"online lr must be > 0 and anchor within 0..1, got {self.lr} and {self.anchor}")
        if set(self.drivers) - set(DRIVERS) or not 0 <= self.live <= 1 or not (self.drivers or self.live):
            raise ValueError(f"online drivers must be some of {DRIVERS} and live a share within 0..1, with "
                             f"something to learn from; got {self.drivers} and {self.live}")


@dataclass(frozen=True)
class CacheShape:
    """The device cache a window is replayed through: the same slots, scope, top-k (the least a layer
    holds) and reads in flight (how far a batched step larger than a partition is pinned ahead)."""
    slots: int
    n_layers: int
    n_experts: int
    scope: str = "layer"
    min_per_layer: int = 1
    ahead: int = IO_THREADS

    def residency(self, factory) -> Residency:
        return Residency(self.slots, self.n_layers, factory, self.scope, self.min_per_layer)


@dataclass(frozen=True)
class LiveDecision:
    """An eviction the cache made: its candidates as the policy saw them, and when (in accesses)."""
    position: int                 # accesses routed so far, this layer's step included
    keys: list[Key]
    signature: np.ndarray         # [candidates, HISTORY_BITS]
    features: np.ndarray          # [candidates, FEATURES]


@dataclass(frozen=True)
class Job:
    number: int
    steps: list[list[list[int]]]  # the window, oldest first: per step, per layer, the routed experts
    first_access: int             # the position of the window's first access
    live: list[LiveDecision]      # the cache's recorded decisions within the window
    sessions: list[int]           # steps of the window that start a session
    judge_from: int | None        # the step of the window where the weights in use took effect
    shape: CacheShape
    weights: Weights              # in use now
    parent: Weights | None        # the weights those were fine-tuned from (kept for rollback)
    shipped: Weights              # the anchor
    config: OnlineConfig


@dataclass(frozen=True)
class Judgement:
    """The last update in hindsight, on the steps routed since it took effect."""
    steps: int
    old_hit_rate: float           # the weights it was fine-tuned from
    new_hit_rate: float           # its own
    rolled_back: bool


@dataclass(frozen=True)
class Result:
    number: int
    weights: Weights              # the new weights
    parent: Weights               # what they were fine-tuned from
    decisions: int
    judgement: Judgement | None
    cpu_s: float
    held_out: Judgement | None = None  # the new weights against the base on the held-out steps (rolled_back: not taken)

    @property
    def swaps(self) -> bool:
        """The weights in use change: the last update was rolled back, or the new ones passed the check."""
        return bool(self.judgement and self.judgement.rolled_back) or not (self.held_out and self.held_out.rolled_back)


@dataclass(frozen=True)
class Update:
    """One update as logged, exported and shown: when, how much it learned from, how the last one did."""
    number: int
    step: int                     # the learner's step count when it took effect
    time: float
    decisions: int
    cpu_s: float
    judgement: Judgement | None


@dataclass(frozen=True)
class Ready:
    """A finished job with its weights already made into a scorer: swapping it in is one assignment."""
    result: Result
    net: SharedNet


def prepare(result: Result) -> Ready:
    return Ready(result, SharedNet(to_net(result.weights)))


# -- the job: pure, runs in-line or in a child process ------------------------------------------------
def run_job(job: Job) -> Result:
    """Judge the last update, label the window, fine-tune; the Result carries the new weights."""
    cpu = time.thread_time()
    trace = window_trace(job)
    weights, judgement = job.weights, None
    if job.judge_from is not None and job.parent is not None and job.judge_from < len(job.steps):
        old = hit_rate(trace, job.shape, job.parent, job.judge_from, job.config.warmup)
        new = hit_rate(trace, job.shape, job.weights, job.judge_from, job.config.warmup)
        judgement = Judgement(len(job.steps) - job.judge_from, old, new, rolled_back=new < old)
        if judgement.rolled_back:
            weights = job.parent
    # with a holdout, first fine-tune on the steps before `cut` and check on those after: only if that
    # does better than the weights in use is the update made, from the whole window (a short window, the
    # first, holds out less)
    holdout = max(0, min(job.config.holdout, len(job.steps) - job.config.warmup - 1))
    cut, held_out, decisions = len(job.steps) - holdout, None, 0
    if holdout:
        candidate, decisions = fine_tune(job, window_trace(job, cut), weights)
        old = hit_rate(trace, job.shape, weights, cut, job.config.warmup)
        new = hit_rate(trace, job.shape, candidate, cut, job.config.warmup)
        held_out = Judgement(holdout, old, new, rolled_back=new <= old)
    new_weights = weights
    if not (held_out and held_out.rolled_back):
        new_weights, learned = fine_tune(job, trace, weights)
        decisions += learned
    return Result(job.number, new_weights, weights, decisions, judgement, time.thread_time() - cpu, held_out)


def fine_tune(job: Job, trace: Trace, weights: Weights) -> tuple[Weights, int]:
    """`weights` fine-tuned on `trace` (the window, or its first steps) labelled in hindsight, and the
    number of decisions learned from."""
    rng = np.random.default_rng([job.config.seed, job.number])
    parts = [collect(trace, job.shape.slots, _driver(name, weights), job.config.decisions, rng, job.shape.scope,
                     job.config.warmup, job.shape.ahead, job.config.within_sessions) for name in job.config.drivers]
    live = [d for d in job.live if d.position - job.first_access <= trace.n_accesses]
    data = Decisions.concat(parts + [label_live(trace, live, job.first_access, job.config.within_sessions)])
    if not len(data):
        return weights, 0
    net = fit(data, job.config.epochs, job.config.seed + job.number, lr=job.config.lr, net=to_net(weights))
    if job.config.anchor:
        net = _pull(net, job.shipped, job.config.anchor)
    return to_weights(net), len(data)


def label_live(trace: Trace, live: list[LiveDecision], first_access: int, within_sessions: bool = False) -> Decisions:
    """The cache's own decisions with each candidate's distance (in accesses) to its next use in the window
    (`within_sessions`: in the session of the decision's step)."""
    accesses = access_sequence(trace)
    ends = session_ends(trace) if within_sessions else None
    uses: dict[Key, list[int]] = {}
    for position, (layer, expert) in enumerate(accesses.tolist()):
        uses.setdefault((layer, expert), []).append(position)
    rows = []
    for d in live:
        at = d.position - first_access  # the accesses from `at` on come after this decision's step
        end = len(accesses) if ends is None or not at else int(ends[at - 1])
        nxt = [next_use(uses.get(k, []), at, end) for k in d.keys]
        rows.append((d.signature, d.features, np.array(nxt, np.float32) - at, None))
    return padded(rows)


def next_use(positions: list[int], at: int, end: int) -> int:
    """The first of the rising `positions` at or after `at`, if before `end`; else `end`."""
    i = bisect.bisect_left(positions, at)
    return positions[i] if i < len(positions) and positions[i] < end else end


def _pull(net: RetentionNet, shipped: Weights, strength: float) -> RetentionNet:
    """Move every weight a share `strength` of the way back to the shipped weights."""
    with torch.no_grad():
        for name, p in net.state_dict().items():
            p.mul_(1 - strength).add_(torch.from_numpy(shipped[name]), alpha=strength)
    return net


def _driver(name: str, weights: Weights):
    if name != "current":
        return name
    from agent.policies.flashmoe import FlashMoE
    shared = SharedNet(to_net(weights))
    return lambda: FlashMoE(net=shared)


def window_trace(job: Job, steps: int | None = None) -> Trace:
    """The window as a trace; its first `steps` only, if given."""
    kept = job.steps[:steps]
    return from_sets(kept, f"online window {job.number}", job.shape.n_experts, job.shape.min_per_layer,
                     session_starts=[i for i in job.sessions if i < len(kept)] or [0])


def hit_rate(trace: Trace, shape: CacheShape, weights: Weights, start: int, warmup: int) -> float:
    """The hit rate of the steps from `start` on, replayed with `weights` deciding from `warmup` steps
    before it (an empty cache and no history at first: those steps fill both)."""
    from agent.policies.flashmoe import FlashMoE
    shared = SharedNet(to_net(weights))
    cache = shape.residency(lambda: FlashMoE(net=shared))
    system = SystemReplay.synthetic()
    replay(trace, cache, system, range(max(0, start - warmup), start), shape.ahead)
    before = sum(s.hits for s in cache.stats), sum(s.misses for s in cache.stats)
    replay(trace, cache, system, range(start, trace.n_tokens), shape.ahead)
    hits, misses = sum(s.hits for s in cache.stats) - before[0], sum(s.misses for s in cache.stats) - before[1]
    return hits / (hits + misses) if hits + misses else 0.0


def to_weights(net: RetentionNet) -> Weights:
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def to_net(weights: Weights) -> RetentionNet:
    net = RetentionNet(NetConfig())
    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})
    return net.eval()


# -- executors ----------------------------------------------------------------------------------------
class Executor(Protocol):
    def submit(self, job: Job) -> None:
        """Start `job`; never blocks the caller for longer than it takes to hand the job over."""

    def poll(self) -> Ready | None:
        """A finished job's result, once."""

    def busy(self) -> bool:
        """A job is running: no other is submitted meanwhile."""

    def close(self) -> None:
        ...


class Inline:
    """Runs each job where it is submitted: the simulator's executor, deterministic."""

    def __init__(self) -> None:
        self._done: Ready | None = None

    def submit(self, job: Job) -> None:
        self._done = prepare(run_job(job))

    def poll(self) -> Ready | None:
        done, self._done = self._done, None
        return done

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        pass


# -- the learner ----------------------------------------------------------------------------------------
@dataclass
class _Step:
    number: int                   # routing steps before it
    first_access: int             # accesses routed before it
    new_session: bool
    layers: list[list[int]] = field(default_factory=list)  # per layer, the routed experts


@dataclass
class _Window:
    """The last `size` routing steps, and the cache's recorded decisions among them."""
    size: int
    steps: deque[_Step] = field(default_factory=deque)
    live: deque[LiveDecision] = field(default_factory=deque)

    def append(self, step: _Step) -> None:
        self.steps.append(step)
        if len(self.steps) > self.size:
            self.steps.popleft()
            while self.live and self.live[0].position < self.steps[0].first_access:
                self.live.popleft()

    def complete(self, n_layers: int) -> list[_Step]:
        """The steps that routed every layer (a step cut short by an error is left out)."""
        return [s for s in self.steps if len(s.layers) == n_layers]


class OnlineLearner:
    """Shared by every partition policy of one cache: sees its routing, owns the weights in use."""

    def __init__(self, shipped: SharedNet, shape: CacheShape, config: OnlineConfig = OnlineConfig(),
                 executor: Executor | None = None) -> None:
        self.shape, self.config = shape, config
        self.executor = executor or Inline()
        self.net, self.version = shipped, 0   # the weights in use; the version changes with every swap
        self._shipped = to_weights(shipped.net)
        self._weights, self._parent = self._shipped, None
        self._window = _Window(config.window)
        self._step: _Step | None = None
        self._early: Ready | None = None      # a finished job polled ahead of the step boundary (upcoming)
        self._asked = False                   # upcoming() polled for the coming boundary: it takes only that
        self._layer = -1
        self._new_session = True
        self._rng = random.Random(config.seed)  # which evictions are recorded
        self.steps = 0                        # routing steps seen
        self.accesses = 0                     # experts routed, over all steps and layers
        self._since = 0                       # steps since the last update was submitted
        self._took_effect = 0                 # the step the weights in use took effect at
        self._number = 0
        self.updates: deque[Update] = deque(maxlen=KEPT_UPDATES)
        self.totals = {"updates": 0, "rollbacks": 0, "not_taken": 0, "decisions": 0, "cpu_s": 0.0}

    # -- what the cache's policies report ----------------------------------------------------------------
    def session(self) -> None:
        self._new_session = True  # every partition reports it: the next step starts the session

    def observe(self, layer: int, experts: Collection[int]) -> None:
        """A layer routed `experts`. A layer at or below the last one starts a new step: the boundary
        where a finished update is swapped in and a due one is submitted."""
        if self._boundary_at(layer):
            self._boundary()
            self._step = _Step(self.steps, self.accesses, self._new_session)
            self._window.append(self._step)
            self._new_session = False
            self.steps += 1
            self._since += 1
        self._layer = layer
        self._step.layers.append(list(experts))
        self.accesses += len(experts)

    def upcoming(self, layer: int) -> SharedNet:
        """The weights in use once a step of `layer` is observed: a finished update is polled here if that
        step starts a new one, so a policy can run them outside the cache's lock; the boundary still
        installs it, and only it: a job that finishes in between waits for the next boundary rather than be
        installed unprepared."""
        if not self._asked and self._boundary_at(layer):
            self._early, self._asked = self.executor.poll(), True
        ready = self._early
        return ready.net if ready is not None and ready.result.swaps else self.net

    def _boundary_at(self, layer: int) -> bool:
        return layer <= self._layer or self._step is None

    def sampled(self) -> bool:
        """Whether the eviction about to be made is one to record (a `live` share of them)."""
        return self._rng.random() < self.config.live

    def record(self, keys: list[Key], signature: np.ndarray, features: np.ndarray) -> None:
        """An eviction among `keys` (the candidates, with their inputs as the policy sees them) in the step
        being routed: labelled with their next uses by a later job."""
        if len(keys) > MAX_CANDIDATES:
            keep = sorted(self._rng.sample(range(len(keys)), MAX_CANDIDATES))
            keys, signature, features = [keys[i] for i in keep], signature[keep], features[keep]
        self._window.live.append(LiveDecision(self.accesses, keys, signature, features))

    # -- between steps -----------------------------------------------------------------------------------
    def _boundary(self) -> None:
        if self._since >= self.config.every and self._early is None and not self.executor.busy():
            self._submit()  # (a job polled early still keeps the executor busy)
        ready = self._early if self._asked else self.executor.poll()
        self._early, self._asked = None, False
        if ready is not None:
            self._install(ready)

    def _submit(self) -> None:
        steps = self._window.complete(self.shape.n_layers)
        if len(steps) <= self.config.warmup:
            return
        judge_from = next((i for i, s in enumerate(steps) if s.number >= self._took_effect), None) \
            if self.totals["updates"] else None
        first = steps[0].first_access
        self._number += 1
        self._since = 0
        self.executor.submit(Job(self._number, [s.layers for s in steps], first,
                                 [d for d in self._window.live if d.position >= first],
                                 [i for i, s in enumerate(steps) if s.new_session], judge_from, self.shape,
                                 self._weights, self._parent, self._shipped, self.config))

    def _install(self, ready: Ready) -> None:
        result = ready.result
        if not result.swaps:  # no better than the weights in use on the held-out steps: they stay
            self.totals["not_taken"] += 1
            self.totals["decisions"] += result.decisions
            self.totals["cpu_s"] += result.cpu_s
            h = result.held_out
            log.info("online job %d: new weights not taken (held-out hit rate %.4f, %.4f with the weights in use)",
                     result.number, h.new_hit_rate, h.old_hit_rate)
            return
        self._weights, self._parent = result.weights, result.parent
        self.net = ready.net
        self.version += 1
        self._took_effect = self.steps  # the step about to start is the first the new weights decide
        update = Update(result.number, self._took_effect, time.time(), result.decisions, result.cpu_s,
                        result.judgement)
        self.updates.append(update)
        for key, value in (("updates", 1), ("rollbacks", bool(result.judgement and result.judgement.rolled_back)),
                           ("decisions", result.decisions), ("cpu_s", result.cpu_s)):
            self.totals[key] += value
        j = result.judgement
        log.info("online update %d at step %d: %d decisions, %.2f s CPU%s", update.number, update.step,
                 update.decisions, update.cpu_s,
                 "" if j is None else f"; the last update on the {j.steps} steps since: hit rate "
                 f"{j.old_hit_rate:.4f} before, {j.new_hit_rate:.4f} with it"
                 f"{', rolled back' if j.rolled_back else ''}")

    def summary(self) -> Mapping[str, float]:
        return dict(self.totals)

    def close(self) -> None:
        self.executor.close()
