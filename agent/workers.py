"""The cores a model step computes on: its own thread and, with `workers` > 1, helper threads beside it.

A one-token decode step is a chain of small matvecs that torch's intra-op threads split badly (two torch
threads ran OLMoE's decode at 0.26x one thread's speed here: they busy-wait against each other and the
cache's I/O threads). Here the parallelism is explicit and coarse instead: a layer's experts are handed
out whole, one at a time, to whichever worker is free (agent/model/routed.py), and a large one-token
matvec is split by rows into a few parts per worker (agent/bf16_matvec.py). The work runs in numba loops
compiled nogil and in torch ops, which both release the GIL. Every worker computes its share exactly as
one thread would, so a result does not depend on how many there are or which one took what.

torch's intra-op thread count is the process's, so helpers' torch ops use what the model's thread does
(generate --threads, 1 by default). `Workers.splitting()` marks the thread that steps the model; work
handed out by `each` is not split again inside (a helper is busy with its own share by then).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

T = TypeVar("T")
# generate's default: two where the process may run on two cores (BENCHMARKS.md, "Decode on both cores": 1.06-1.20x
# decode tokens/s at seed scale, the demo model unmoved); more were not measured
DEFAULT_WORKERS = min(2, len(os.sched_getaffinity(0)))
_splitting: ContextVar[Workers | None] = ContextVar("splitting", default=None)


class Workers:
    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self._helpers = (ThreadPoolExecutor(workers - 1, thread_name_prefix="model-worker")
                         if workers > 1 else None)

    def each(self, items: Iterable[T], fn: Callable[[T], None]) -> None:
        """fn(item) for every item, on every worker at once (the calling thread is one): each takes the
        next item in order when it is free. Returns when every worker has stopped. An error stops every
        worker at its next item and is raised as itself: the calling thread's own, or else a helper's."""
        if self._helpers is None:
            for item in items:
                fn(item)
            return
        failed: list[BaseException] = []
        queue = iter(list(items))   # a list's iterator: each item once across threads (a generator's raises)

        def work() -> None:
            with torch.inference_mode():   # thread-local, as the model step's is
                for item in _until(queue, failed):
                    try:
                        fn(item)
                    except BaseException as exc:
                        failed.append(exc)
                        raise

        helpers = [self._helpers.submit(work) for _ in range(self.workers - 1)]
        token = _splitting.set(None)   # the helpers are busy with their share: no split inside fn
        try:
            work()
        finally:
            _splitting.reset(token)
            for helper in helpers:
                helper.exception()     # wait for every worker before anything it computes on may be freed
        if failed:
            raise failed[0]

    def close(self) -> None:
        """End the helper threads now, once their work in hand is done. A dropped Workers' helpers end by
        themselves only some time after it is collected, and never while something still holds it (a
        traceback's frame, a cycle); `each` raises RuntimeError after this."""
        if self._helpers is not None:
            self._helpers.shutdown()

    @contextmanager
    def splitting(self) -> Iterator[None]:
        """Within: large one-token matvecs on this thread are split over the workers (split_workers)."""
        token = _splitting.set(self if self._helpers is not None else None)
        try:
            yield
        finally:
            _splitting.reset(token)


def split_workers() -> Workers | None:
    """The workers to split a large matvec over on this thread, if any (see Workers.splitting)."""
    return _splitting.get()


def parts(rows: int, n: int) -> list[tuple[int, int]]:
    """[start, stop) of n parts of rows as equal as can be, in order (empty ones left out)."""
    bounds = [rows * i // n for i in range(n + 1)]
    return [(start, stop) for start, stop in zip(bounds, bounds[1:]) if stop > start]


def _until(queue: Iterator[T], failed: list[BaseException]) -> Iterator[T]:
    for item in queue:
        if failed:
            return
        yield item

