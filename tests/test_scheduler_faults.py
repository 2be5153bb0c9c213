"""A batch step that fails (a damaged expert block) fails only the requests that meet the fault."""
from __future__ import annotations

import threading

from agent.serve.scheduler import Event, Request, Scheduler, StepIO

TIMEOUT_S = 30


class DamagedEngine:
    """Fails every step that carries a request whose prompt routes to the damaged block (token 666)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.ended: list[str] = []

    def begin(self, request: Request) -> None:
        return None

    def step(self, batch: list[Request]) -> tuple[list[int], StepIO]:
        self.batches.append([r.id for r in batch])
        if any(666 in r.pending_tokens for r in batch):
            raise OSError("expert block layer 0 expert 3 fails its CRC32 check")
        return [7] * len(batch), StepIO(hits=len(batch))

    def end(self, request: Request) -> None:
        self.ended.append(request.id)


def test_a_damaged_block_fails_its_request_alone_and_the_batch_mates_finish():
    engine = DamagedEngine()
    events: dict[str, list[Event]] = {rid: [] for rid in ("a", "b", "bad", "c")}
    finished = threading.Semaphore(0)

    def sink(rid: str):
        def put(ev: Event) -> None:
            events[rid].append(ev)
            if ev.kind != "token":
                finished.release()
        return put

    # a batch limit of 4 closes the admission window as soon as all four wait: they share the first step
    sched = Scheduler(engine, 4, lambda stats: None, admit_window_s=1.0)
    for rid in events:
        sched.submit(Request(rid, [666] if rid == "bad" else [1, 2], 3, 0.0, sink(rid)))
    sched.start()
    try:
        for _ in events:
            assert finished.acquire(timeout=TIMEOUT_S)
    finally:
        sched.stop()
    assert engine.batches[0] == ["a", "b", "bad", "c"]                          # they did share the step
    assert engine.batches[1:5] == [["a"], ["b"], ["bad"], ["c"]]                # then each ran alone
    assert engine.batches[5:] == [["a", "b", "c"], ["a", "b", "c"]]             # and the rest go on together
    assert [ev.kind for ev in events["bad"]] == ["error"] and "CRC32" in events["bad"][0].error
    for rid in ("a", "b", "c"):
        assert [ev.kind for ev in events[rid]] == ["token", "token", "token", "done"]
        assert events[rid][-1].stats.completion_tokens == 3
    assert sorted(engine.ended) == ["a", "b", "bad", "c"]
    assert sched.tokens_total == 9 and not sched.running
