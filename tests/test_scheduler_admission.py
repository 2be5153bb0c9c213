"""The scheduler's admission window: a burst that finds it idle shares the first step.

A fake clock decides when the window closes, so no assertion depends on how fast threads run: the
scheduler cannot step before the test moves the clock past the window (or the batch fills). The
clock also tells when the scheduler thread has read it, i.e. is holding an idle batch open, so a
test can send its second request after that point rather than racing the scheduler thread.
"""
from __future__ import annotations

import threading

import pytest

from agent.serve.scheduler import Overloaded, Request, Scheduler, SchedulerBusy, StepIO

WINDOW_S = 0.05
TIMEOUT_S = 30


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.read_by_scheduler = threading.Event()

    def __call__(self) -> float:
        if threading.current_thread().name == "scheduler":
            self.read_by_scheduler.set()
        return self.now


class RecordingEngine:
    """Records each step's batch; `hold` keeps a step from returning until the test releases it."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.stepping = threading.Event()
        self.hold = threading.Event()
        self.hold.set()

    def begin(self, request: Request) -> None:
        return None

    def step(self, batch: list[Request]) -> tuple[list[int], StepIO]:
        self.batches.append([r.id for r in batch])
        self.stepping.set()
        assert self.hold.wait(TIMEOUT_S)
        return [1] * len(batch), StepIO()

    def end(self, request: Request) -> None:
        pass


def request(rid: str, max_tokens: int = 1) -> tuple[Request, threading.Event]:
    done = threading.Event()
    return Request(rid, [1, 2, 3], max_tokens, 0.0, lambda ev: ev.kind == "done" and done.set()), done


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine() -> RecordingEngine:
    return RecordingEngine()


def scheduler(engine, clock, max_batch=16, window_s=WINDOW_S, max_waiting=256, answered=None) -> Scheduler:
    """`answered`, a list: the request ids the scheduler reports as answered (its on_finish)."""
    s = Scheduler(engine, max_batch, lambda stats: answered is not None and answered.append(stats.request_id),
                  admit_window_s=window_s, clock=clock, max_waiting=max_waiting)
    s.start()
    return s


def test_two_requests_arriving_within_the_window_share_the_first_step(engine, clock):
    s = scheduler(engine, clock)
    first, first_done = request("first")
    second, second_done = request("second")
    s.submit(first)
    assert clock.read_by_scheduler.wait(TIMEOUT_S)  # the scheduler holds `first` in its window
    clock.now = WINDOW_S / 2
    s.submit(second)
    clock.now = WINDOW_S  # the window closes
    assert first_done.wait(TIMEOUT_S) and second_done.wait(TIMEOUT_S)
    s.stop()
    assert engine.batches == [["first", "second"]]


def test_a_request_arriving_during_a_step_opens_no_window_and_runs_in_the_next(engine, clock):
    s = scheduler(engine, clock)
    engine.hold.clear()
    first, first_done = request("first")
    s.submit(first)
    clock.now = WINDOW_S
    assert engine.stepping.wait(TIMEOUT_S)
    second, second_done = request("second")
    s.submit(second)  # a window opened now would never close: the clock stays where it is
    engine.hold.set()
    assert first_done.wait(TIMEOUT_S) and second_done.wait(TIMEOUT_S)
    s.stop()
    assert engine.batches == [["first"], ["second"]]


def test_a_full_batch_ends_the_window_early(engine, clock):
    s = scheduler(engine, clock, max_batch=2)
    (first, first_done), (second, second_done) = request("first"), request("second")
    s.submit(first)
    assert clock.read_by_scheduler.wait(TIMEOUT_S)
    s.submit(second)  # the clock never moves: only a full batch lets the step start
    assert first_done.wait(TIMEOUT_S) and second_done.wait(TIMEOUT_S)
    s.stop()
    assert engine.batches == [["first", "second"]]


def test_no_window_steps_a_lone_request_at_once(engine, clock):
    s = scheduler(engine, clock, window_s=0.0)
    first, first_done = request("first")
    s.submit(first)  # the clock never moves
    assert first_done.wait(TIMEOUT_S)
    s.stop()
    assert engine.batches == [["first"]]


@pytest.mark.parametrize("window_s", [-0.001, 1.5])
def test_a_window_out_of_bounds_is_refused(engine, clock, window_s):
    with pytest.raises(ValueError, match="between 0 and 1000 ms"):
        Scheduler(engine, 16, lambda stats: None, admit_window_s=window_s, clock=clock)


def test_a_control_call_that_outwaits_a_slow_step_is_withdrawn_and_never_runs(engine, clock):
    s = scheduler(engine, clock, window_s=0.0)
    engine.hold.clear()
    first, first_done = request("first")
    s.submit(first)
    assert engine.stepping.wait(TIMEOUT_S)          # a step that will not end (memory thrash, say)
    ran = []
    with pytest.raises(SchedulerBusy, match="did not finish within 0 s.*not applied"):
        s.call(lambda: ran.append("late"), timeout=0.1)
    engine.hold.set()
    assert first_done.wait(TIMEOUT_S)
    assert s.call(lambda: "next") == "next"          # the next call runs, the withdrawn one never did
    s.stop()
    assert ran == []


def test_a_request_cancelled_while_it_waits_is_ended_and_never_runs(engine, clock):
    answered: list[str] = []
    s = scheduler(engine, clock, max_batch=1, window_s=0.0, answered=answered)
    engine.hold.clear()
    first, first_done = request("first")
    s.submit(first)
    assert engine.stepping.wait(TIMEOUT_S)      # `first` fills the batch: `second` must wait
    ended = []
    second = Request("second", [1, 2, 3], 1, 0.0, lambda ev: ev.kind == "done" and ended.append(ev.finish_reason))
    s.submit(second)
    second.cancelled = True                     # its client went away before it was admitted
    engine.hold.set()
    assert first_done.wait(TIMEOUT_S)
    assert s.call(lambda: "after") == "after"   # the scheduler has passed its admission since
    s.stop()
    assert ended == ["cancelled"]               # its handler is told, instead of waiting for ever
    assert engine.batches == [["first"]]
    assert answered == ["first"] and s.unserved["abandoned"] == 1   # counted, not as an answer


def test_close_ends_running_and_waiting_requests_before_their_next_step_and_refuses_more(engine, clock):
    answered: list[str] = []
    s = scheduler(engine, clock, max_batch=1, window_s=0.0, answered=answered)
    engine.hold.clear()
    ended: dict[str, str] = {}
    running, waiting = (Request(rid, [1, 2, 3], 1000, 0.0, lambda ev, rid=rid: ev.kind == "done" and
                                ended.setdefault(rid, ev.finish_reason)) for rid in ("running", "waiting"))
    s.submit(running)
    assert engine.stepping.wait(TIMEOUT_S)      # `running` is in its first step, `waiting` waits for room
    s.submit(waiting)
    s.close()
    engine.hold.set()
    s.stop()
    assert ended == {"running": "cancelled", "waiting": "cancelled"}
    assert engine.batches == [["running"]]      # no step after the close
    assert answered == [] and s.unserved == {"failed": 0, "refused": 2, "abandoned": 0}
    with pytest.raises(RuntimeError, match="shutting down"):
        s.submit(request("late")[0])


def test_a_request_beyond_the_waiting_bound_is_refused_and_the_queue_stays_whole(engine, clock):
    s = scheduler(engine, clock, max_waiting=2)
    first, first_done = request("first")
    second, second_done = request("second")
    s.submit(first)
    assert clock.read_by_scheduler.wait(TIMEOUT_S)  # held in the window: both wait
    s.submit(second)
    with pytest.raises(Overloaded, match="2 requests already wait"):
        s.submit(request("third")[0])
    clock.now = WINDOW_S
    assert first_done.wait(TIMEOUT_S) and second_done.wait(TIMEOUT_S)
    later, later_done = request("later")
    s.submit(later)                                 # room again once they were admitted
    clock.now = 2 * WINDOW_S                        # its own window closes
    assert later_done.wait(TIMEOUT_S)
    s.stop()
    assert engine.batches == [["first", "second"], ["later"]]


def test_a_request_whose_kv_would_overflow_the_budget_waits_for_a_running_one_to_end(engine, clock):
    s = Scheduler(engine, 16, lambda stats: None, admit_window_s=0.0, clock=clock, kv_budget=10)
    engine.hold.clear()
    first = Request("first", [1, 2, 3], 2, 0.0, lambda ev: None)          # 5 positions
    second, second_done = request("second", max_tokens=3)                # 6: 11 with first's, over 10
    third, third_done = request("third", max_tokens=1)                   # 4: fits, but waits behind second
    s.start()
    s.submit(first)
    assert engine.stepping.wait(TIMEOUT_S)                               # first's first step runs
    s.submit(second)
    s.submit(third)
    engine.hold.set()
    assert second_done.wait(TIMEOUT_S) and third_done.wait(TIMEOUT_S)
    s.stop()
    assert engine.batches[:2] == [["first"], ["first"]]                  # first ran its two tokens alone
    assert engine.batches[2] == ["second", "third"]                      # 6 + 4 positions fit together


def test_a_request_larger_than_the_whole_kv_budget_runs_alone(engine, clock):
    s = scheduler(engine, clock, window_s=0.0)
    s.kv_budget = 4
    big, big_done = request("big", max_tokens=5)                         # 8 positions
    s.submit(big)
    assert big_done.wait(TIMEOUT_S)
    s.stop()
    assert engine.batches[0] == ["big"]
