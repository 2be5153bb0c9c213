"""The scheduler's engine: the model, its expert cache and sampling, one batched step at a time."""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from agent.experts.cache import CacheStats, ExpertCache
from agent.experts.provider import Expert, ExpertProvider
from agent.model.config import MoEConfig
from agent.model.generation import sample
from agent.model.model import Sequence as Sequence_
from agent.model.loading import load_model
from agent.serve.scheduler import Request, StepIO


PREFILL_TOKENS = 64  # a step with this many new tokens (an admission's prompts) runs on prefill_threads
STEP_PROFILES = 256  # the most recent steps' profiles kept (bench/serve.py reads them from /v1/status)


@dataclass(frozen=True)
class StepProfile:
    """Where one model step's wall time went: the model's phases and the cache's (agent/model/profile.py),
    and the reads it made. A step with prompt tokens is an admission step (it prefills them)."""
    sequences: int
    tokens: int              # all new tokens of the step, prompts included
    prompt_tokens: int
    wall_s: float
    phases_s: dict[str, float]
    bytes_read: int
    reads: int
    io_busy_s: float         # wall time with at least one read running
    read_s: float            # summed over the reads: / io_busy_s = reads in flight while busy

    @classmethod
    def between(cls, batch: list[Request], wall_s: float, phases_s: dict[str, float], before: CacheStats,
                after: CacheStats) -> "StepProfile":
        return cls(len(batch), sum(len(r.pending_tokens) for r in batch),
                   sum(len(r.prompt_ids) for r in batch if not r.generated), wall_s,
                   {**phases_s, **after.phases_since(before)}, after.bytes_read - before.bytes_read,
                   after.reads - before.reads, after.io_busy_s - before.io_busy_s, after.read_s - before.read_s)


class RouteCounter:
    """An ExpertProvider in front of another that counts which experts the routers chose.

    Counts are per step that routed an expert (the union over the step's tokens), which is what
    the cache sees. Used for the store's activation heatmap and by warm-up to find hot experts."""

    def __init__(self, inner: ExpertProvider) -> None:
        self.inner = inner
        self._counts: collections.Counter[tuple[int, int]] = collections.Counter()
        self._lock = threading.Lock()

    def route(self, layer: int, experts: Sequence[int]) -> Sequence[int] | None:
        with self._lock:
            self._counts.update((layer, e) for e in experts)
        return self.inner.route(layer, experts)

    def get(self, layer: int, expert: int) -> Expert:
        return self.inner.get(layer, expert)

    def done(self, layer: int, expert: int) -> None:
        self.inner.done(layer, expert)

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        self.inner.prefetch(layer, experts)

    def take(self) -> dict[tuple[int, int], int]:
        """The counts since the last take, and start counting afresh."""
        with self._lock:
            counts, self._counts = self._counts, collections.Counter()
        return dict(counts)


class ModelEngine:
    """Runs the model on whichever thread calls begin/step (the scheduler's).

    `threads` is torch's intra-op thread count for that thread (default 1, as `flashmoe-cli generate`):
    a step is many small per-expert matmuls while the cache's reads and CRC checks run on other
    threads. A step of PREFILL_TOKENS new tokens or more (prompts being admitted) runs on
    `prefill_threads` instead (default: `threads`): its matmuls are large enough to split (an OLMoE
    projection of 850 tokens 34 -> 19 ms on two idle cores), and at seed scale that step is
    compute-bound with the disk idle most of it. Served on this shared 2-core machine two threads did
    not shorten it (BENCHMARKS.md, "Where (a)'s time goes when serving"), so it stays opt-in. `workers`:
    the threads a step's experts run on, whole experts at once (agent/workers.py, agent/model/routed.py). The
    count is set on the calling thread itself, because OpenMP and MKL keep the count per thread: a
    thread that never sets it uses one per core whatever the main thread set, and libgomp's idle team
    members then spin on the cores the reads and the step need. On a busy 2-core machine that made
    every expert matmul ~20x slower, unless some torch op had happened to run on the main thread
    first (which changes libgomp's spin policy; the learned policy's construction did, LRU's did
    not)."""

    def __init__(self, model_dir: Path, cache: ExpertCache, prefetch: bool = True, seed: int = 0,
                 threads: int = 1, route_trace: Sequence[Path] = (), prefill_threads: int | None = None,
                 dense: str = "stored", int8_activations: bool = True,
                 workers: int = 1) -> None:
        prefill_threads = prefill_threads or threads
        if min(threads, prefill_threads) < 1:
            raise ValueError(f"threads must be at least 1, got {threads} and {prefill_threads} for prefill")
        self.cache, self.threads, self.prefill_threads = cache, threads, prefill_threads
        self._configured = threading.local()
        self.routes = RouteCounter(cache)
        self.model = load_model(model_dir, self.routes, prefetch, route_trace, dense=dense,
                                int8_activations=int8_activations, workers=workers)
        self.generator = torch.Generator().manual_seed(seed)
        self.profiles: collections.deque[StepProfile] = collections.deque(maxlen=STEP_PROFILES)

    @property
    def config(self) -> MoEConfig:
        return self.model.config

    def _own_thread(self, tokens: int = 1) -> None:
        """Set the intra-op thread count for a step of `tokens` new tokens on the calling thread, when it changes."""
        count = self.prefill_threads if tokens >= PREFILL_TOKENS else self.threads
        if getattr(self._configured, "threads", None) != count:
            torch.set_num_threads(count)
            self._configured.threads = count

    def begin(self, request: Request) -> Sequence_:
        self._own_thread()
        self.cache.session()
        if request.seed is not None:
            request.sampler = torch.Generator().manual_seed(request.seed)
        return self.model.new_sequence(len(request.prompt_ids) + request.max_tokens)

    def step(self, batch: list[Request]) -> tuple[list[int], StepIO]:
        self._own_thread(sum(len(r.pending_tokens) for r in batch))
        before, seconds, start = self.cache.stats(), dict(self.model.profile.seconds), time.perf_counter()
        try:
            logits = self.model.step([(r.state, torch.tensor(r.pending_tokens)) for r in batch])
        finally:
            self.cache.idle()  # between steps nothing is pinned: knob changes run there
        after = self.cache.stats()
        self.profiles.append(StepProfile.between(batch, time.perf_counter() - start,
                                                 self.model.profile.since(seconds), before, after))
        tokens = [sample(l, greedy=r.temperature <= 0, temperature=r.temperature, top_p=r.top_p,
                         generator=r.sampler or self.generator) for l, r in zip(logits, batch)]
        return tokens, StepIO(after.hits - before.hits, after.misses - before.misses,
                              after.bytes_read - before.bytes_read)

    def end(self, request: Request) -> None:
        request.state = request.sampler = None  # the Sequence owns the KV cache: dropping it frees the memory
