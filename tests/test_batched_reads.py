"""What a batched serving run reads: hit rate and bytes of a small deterministic run of the real
scheduler, model and expert cache (no HTTP, no clock: each client sends its next request the moment
the last one finishes, so every step's batch is fixed).

Bytes read and hits are not timings and are asserted exactly; lookahead prefetch is off because
its reads race the step's own (which of them finishes first may change the fetch order), and the
policy hears nothing from the machine (read latency, memory pressure and SSD load differ from run
to run and are features of the learned policy).
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)
from test_serve import demo_model

from agent.experts.cache import CacheStats, ExpertCache
from agent.experts.cap import parse_cap
from agent.experts.layout import INDEX, Index
from agent.monitor import SystemSample, SystemSampler
from agent.serve.engine import ModelEngine
from agent.serve.scheduler import Event, Request, Scheduler
from agent.tokenizer import load_tokenizer
from bench.serve import request_mix

TIMEOUT_S = 120


class Deaf(SystemSampler):
    """A sampler with no reading: the policy decides on the routes alone."""

    def sample(self, max_age_s: float = 0.0) -> SystemSample:
        return SystemSample()


def batched_run(model: Path, prompts: list[list[tuple[str, int]]], policy: str = "lru", cap: str = "25%"
                ) -> tuple[CacheStats, int, int]:
    """Run each client's (prompt, max_tokens) list in turn, all clients batched; returns the cache's
    statistics, the model steps and the experts routed (each step's union, summed over layers)."""
    tokenizer = load_tokenizer(model)
    with ExpertCache(model, _cap(model, cap), policy=policy, monitor=Deaf()) as cache:
        engine = ModelEngine(model, cache, prefetch=False)
        scheduler: Scheduler | None = None
        left = threading.Semaphore(0)

        def request(client: int, i: int) -> Request:
            def sink(event: Event) -> None:
                if event.kind == "done":
                    if i + 1 < len(prompts[client]):
                        scheduler.submit(request(client, i + 1))  # on the scheduler thread: joins the next step
                    left.release()
            text, max_tokens = prompts[client][i]
            return Request(f"{client}.{i}", list(tokenizer.encode(text)), max_tokens, 0.0, sink)

        scheduler = Scheduler(engine, max_batch=len(prompts), on_finish=lambda stats: None)
        for client in range(len(prompts)):
            scheduler.submit(request(client, 0))  # the batch is full: the first step takes them all
        scheduler.start()
        try:
            for _ in range(sum(map(len, prompts))):
                assert left.acquire(timeout=TIMEOUT_S), "the batched run did not finish"
        finally:
            scheduler.stop()
        return cache.stats(), scheduler.steps, sum(engine.routes.take().values())


def _cap(model: Path, cap: str) -> int:
    index = Index.load(model / INDEX)
    return parse_cap(cap, index.nbytes * len(index.blocks))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_model(tmp_path_factory)


def bench_mix(clients: int) -> list[list[tuple[str, int]]]:
    """bench/serve.py's request mix (two requests per client), as (prompt, max_tokens)."""
    return [[(r["prompt"], r["max_tokens"]) for r in client] for client in request_mix(clients, 2)]


@pytest.mark.parametrize("policy, cap, hits, misses", [("lru", "25%", 442, 1133), ("flashmoe", "25%", 478, 1097),
                                                      ("lru", "75%", 1213, 362), ("flashmoe", "75%", 1267, 308)])
def test_the_bench_mix_reads_what_it_read_when_this_test_was_written(model, policy, cap, hits, misses):
    """bench/serve.py's mix for 8 clients, 24 steps. A change in these numbers is a change in what
    batched serving reads: say why in the commit and update them. At 25% (the bench's cap) most steps
    route more experts than a layer's 16 slots hold, and the learned policy scores the step's own
    earlier arrivals like every other candidate (kept as the freshest, they came out the same as LRU
    and, later, 464/1111 and 1254/321); at 75% it keeps what LRU would have evicted."""
    stats, steps, routed = batched_run(model, bench_mix(8), policy, cap)
    assert steps == 24
    assert stats.hits + stats.misses == routed   # every routed expert is one access per step
    assert stats.bytes_read == stats.misses * Index.load(model / INDEX).nbytes  # each miss is one block read
    assert (stats.hits, stats.misses) == (hits, misses)


def test_identical_prompts_batched_read_what_one_reads_alone(model):
    """A batch of equal prompts routes each step exactly as one of them would: same reads, same hits."""
    prompt = [("Client 3 asks about SSD latency and a haiku.", 8)]
    alone, _, _ = batched_run(model, [prompt])
    together, _, _ = batched_run(model, [prompt] * 6)
    assert (together.hits, together.misses, together.bytes_read) == (alone.hits, alone.misses, alone.bytes_read)
    assert together.misses > 0 and together.hits > 0
