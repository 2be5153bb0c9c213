"""Continuous batching: one thread owns the model and the cache and runs decode steps for everyone.

Between steps it runs queued control calls (knob changes, preloads, stat snapshots: nothing else
touches the cache, so no lock is needed), admits waiting requests into the running batch up to the
current limit, and retires finished ones. A newly admitted request's whole prompt (prefill) shares
the step with the others' single decode tokens.

Admission window: when a request finds the scheduler idle, the first step waits until
`admit_window_s` after its arrival (or until the batch is full), so a burst of arrivals shares one
prefill instead of the first prompt running alone and the rest after it. That is worth tens of
milliseconds because a step's experts are the union of its tokens': a prompt of ~50 tokens routes
nearly every expert of every layer, so two prefill steps read the routed experts twice. A busy
scheduler needs no window: arrivals wait for the running step anyway and join the next one.

KV budget: a running request holds KV cache for its prompt and its max_tokens (the engine allocates them
when it begins), and the cache cap's memory rule counted `kv_budget` positions for all of them together
(serve --kv-budget; agent/experts/cap.py). So a request is admitted only while the running ones'
positions and its own fit in that budget; else it waits, with those behind it (first come, first served),
for a running one to end. The HTTP API refuses a request larger than the whole budget; one that reaches
the scheduler all the same runs when it is alone.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.experts.cap import KV_BUDGET_TOKENS

log = logging.getLogger(__name__)
# Requests waiting for a place in the batch; more are refused (HTTP 429), not held without bound: each
# holds its prompt, and a queue that outgrows the model only lengthens every wait
MAX_WAITING = 256


@dataclass(frozen=True)
class StepIO:
    """Expert-cache traffic of one step, shared among its requests by their share of its tokens."""
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0


@dataclass(frozen=True)
class RequestStats:
    request_id: str
    submitted: float          # time.time() when the request arrived
    ttft_s: float
    tpot_s: float             # mean time per output token after the first
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    hits: float
    misses: float
    bytes_read: float


@dataclass
class Event:
    kind: str                 # "token", "done" or "error"
    token: int = -1
    finish_reason: str = ""
    stats: RequestStats | None = None
    error: str = ""


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    sink: Callable[[Event], None]   # called on the scheduler thread; must not block
    stop_ids: frozenset[int] = frozenset()
    top_p: float = 1.0              # nucleus sampling: 1 samples from every token
    seed: int | None = None         # its own random draws, whoever shares its steps; None: the engine's
    submitted: float = field(default_factory=time.time)
    state: Any = None               # the engine's per-request state (a model Sequence)
    sampler: Any = None             # the engine's random generator of a seeded request
    generated: list[int] = field(default_factory=list)
    first_token_at: float = 0.0
    cancelled: bool = False
    stopped: bool = False           # cancelled by its stop string: the answer is whole
    io: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # hits, misses, bytes_read

    @property
    def pending_tokens(self) -> list[int]:
        """The tokens this request feeds into its next step: the prompt, then its last token."""
        return self.generated[-1:] if self.generated else self.prompt_ids

    @property
    def kv_positions(self) -> int:
        """The KV cache positions its sequence holds while it runs: its prompt and every token it may make."""
        return len(self.prompt_ids) + self.max_tokens


class Engine(Protocol):
    def begin(self, request: Request) -> Any: ...
    def step(self, batch: list[Request]) -> tuple[list[int], StepIO]: ...
    def end(self, request: Request) -> None: ...


ADMIT_WINDOW_S = 0.05       # the default: 16 requests sent at once reach the scheduler within ~30 ms (load 7)
MAX_ADMIT_WINDOW_S = 1.0    # a longer wait would cost a lone request more than a shared prefill saves
CONTROL_WAIT_S = 60.0       # how long a control call waits for the running step to end


def check_admit_window(seconds: float) -> float:
    """The admission window if it is within bounds, else ValueError saying what is allowed."""
    if not 0 <= seconds <= MAX_ADMIT_WINDOW_S:
        raise ValueError(f"the admission window must be between 0 and {MAX_ADMIT_WINDOW_S * 1000:g} ms, "
                         f"got {seconds * 1000:g} ms")
    return seconds


class ControlRefused(Exception):
    """A control call that was not run (nothing changed): the caller may retry later (HTTP 503)."""


class SchedulerBusy(ControlRefused, TimeoutError):
    """A control call waited too long for the running step to end and was withdrawn."""


STOPPING = "the agent is shutting down"


# Why a request ended without an answer: an error in its step (e.g. a damaged expert block; a 500), it was
# refused (the queue full, a 429; or the agent stopping, a 503, at the door or before its next step), or its
# client went away before the answer was whole ("abandoned"). Counted, not to vanish unseen nor to pass for an
# answer (its truncated latency in the histograms).
UNSERVED = ("failed", "refused", "abandoned")


class Overloaded(Exception):
    """As many requests wait for a place in the batch as the agent queues: the caller should retry later."""


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int, on_finish: Callable[[RequestStats], None],
                 admit_window_s: float = ADMIT_WINDOW_S, clock: Callable[[], float] = time.monotonic,
                 max_waiting: int = MAX_WAITING, kv_budget: int = KV_BUDGET_TOKENS) -> None:
        self.engine, self.on_finish, self.max_waiting, self.kv_budget = engine, on_finish, max_waiting, kv_budget
        self.admit_window_s, self.clock = check_admit_window(admit_window_s), clock
        self._window_ends = float("-inf")   # set by the first request that finds the scheduler idle
        self.max_batch = max_batch  # the knob max_batch_size: most requests stepped together
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.tokens_total = 0       # generated tokens since start (for tokens/s)
        self.unserved = dict.fromkeys(UNSERVED, 0)   # requests since start that ended without an answer, by why
        self.steps = 0              # model steps since start: fewer than tokens when requests share steps
        self._calls: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # -- other threads ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, finish the accepted ones (unless closed) and end the thread."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive():   # never started: an agent that stopped before it served
            self._thread.join(timeout)

    def close(self) -> None:
        """Refuse new requests and end the accepted ones before their next step ("cancelled"): the agent
        is stopping, and finishing them could take minutes its process manager does not wait."""
        with self._wake:
            self._stop = True
            for request in (*self.running, *self.waiting):
                request.cancelled = True
            self._wake.notify()

    def submit(self, request: Request) -> None:
        with self._wake:
            if self._stop:
                self.unserved["refused"] += 1
                raise RuntimeError(f"{STOPPING}; retry against a running agent")
            if len(self.waiting) >= self.max_waiting:
                self.unserved["refused"] += 1
                raise Overloaded(f"{len(self.waiting)} requests already wait for the model, as many as this agent "
                                 "queues (serve --max-waiting); retry later")
            if not (self.running or self.waiting):
                self._window_ends = self.clock() + self.admit_window_s
            self.waiting.append(request)
            self._wake.notify()

    def call(self, fn: Callable[[], Any], timeout: float = CONTROL_WAIT_S) -> Any:
        """Run fn on the scheduler thread between two steps and return its result (or raise its error).
        A step still running after `timeout` (memory thrash can make one that slow) withdraws the call,
        so it never runs later unreported: SchedulerBusy says so."""
        future: Future = Future()
        with self._wake:
            if self._stop:   # its thread may have ended: the call would wait out the server's graceful timeout
                raise ControlRefused(f"{STOPPING}: nothing was changed; retry against a running agent")
            self._calls.append((fn, future))
            self._wake.notify()
        try:
            return future.result(timeout)
        except TimeoutError:
            if not future.cancel():          # it started meanwhile: it is quick, wait for it
                return future.result()
            raise SchedulerBusy(f"the model's running step did not finish within {timeout:.0f} s (memory thrash "
                                f"makes steps that slow), so the change was not applied; try again") from None

    @property
    def batch_size(self) -> int:
        return len(self.running)

    @property
    def kv_positions(self) -> int:
        """KV cache positions the running requests hold."""
        return sum(r.kv_positions for r in self.running)

    # -- the scheduler thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stop or self._calls or self.waiting or self.running):
                    self._wake.wait()
                if not self.running:
                    self._gather()
                if self._stop and not self.running and not self.waiting:
                    break
            self._run_calls()
            self._admit()
            if self.running:
                self._step()
        self._run_calls()

    def _gather(self) -> None:
        """Idle with requests waiting: wait while the admission window is open and the batch not full.
        A control call or stop cuts the window short (it is a few ms; the call runs between steps)."""
        while self.waiting and len(self.waiting) < self.max_batch and not (self._stop or self._calls):
            left = self._window_ends - self.clock()
            if left <= 0:
                return
            self._wake.wait(left)

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue                     # withdrawn by its caller, who gave up waiting
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who reports it
                future.set_exception(exc)

    def _admit(self) -> None:
        self.running = [r for r in self.running if not r.cancelled or self._retire(r, "cancelled")]
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            if request.cancelled:  # its client left while it waited: its handler still waits for an end
                self._retire(self.waiting.popleft(), "cancelled")
                continue
            if self.running and self.kv_positions + request.kv_positions > self.kv_budget:
                return             # it waits, and those behind it, until a running request ends
            self.waiting.popleft()
            try:
                request.state = self.engine.begin(request)
            except Exception as exc:
                self._fail(request, exc)
                continue
            self.running.append(request)

    def _step(self) -> None:
        batch = list(self.running)
        try:
            tokens, io = self.engine.step(batch)
        except Exception as exc:  # e.g. a damaged expert block
            if len(batch) == 1:
                self.running = self._fail(batch[0], exc)
                return
            log.warning("decode step failed for %d requests (%s); retrying each alone", len(batch), exc)
            self.running = [kept for r in batch for kept in self._step_alone(r)]
            return
        self.running = self._advance(batch, tokens, io)

    def _step_alone(self, r: Request) -> list[Request]:
        """A failed batch step run again for one request: only the requests that meet the fault fail, and
        their batch-mates go on. A step that fails writes no position of a sequence, so it can be rerun."""
        try:
            tokens, io = self.engine.step([r])
        except Exception as exc:
            return self._fail(r, exc)
        return self._advance([r], tokens, io)

    def _fail(self, r: Request, exc: Exception) -> list[Request]:
        log.error("request %s failed: %s", r.id, exc)
        self.unserved["failed"] += 1
        self.engine.end(r)
        r.sink(Event("error", error=str(exc)))
        return []

    def _advance(self, batch: list[Request], tokens: list[int], io: StepIO) -> list[Request]:
        """Hand out one step's tokens and traffic; returns the requests still running."""
        now = time.time()
        self.steps += 1
        share = [len(r.pending_tokens) for r in batch]
        total = sum(share)
        for r, token, n in zip(batch, tokens, share):
            for i, amount in enumerate((io.hits, io.misses, io.bytes_read)):
                r.io[i] += amount * n / total
            r.generated.append(token)
            r.first_token_at = r.first_token_at or now
            self.tokens_total += 1
            r.sink(Event("token", token=token))
        return [r for r in batch if not self._finished(r) or self._retire(r, self._reason(r))]

    def _finished(self, r: Request) -> bool:
        return r.cancelled or len(r.generated) >= r.max_tokens or r.generated[-1] in r.stop_ids

    def _reason(self, r: Request) -> str:
        if r.cancelled:
            return "cancelled"
        return "stop" if r.generated[-1] in r.stop_ids else "length"

    def _retire(self, r: Request, reason: str) -> bool:
        """Free the request's state and report it, an answer or one of the unserved; returns False so list
        filters drop it."""
        self.engine.end(r)
        stats = request_stats(r, time.time())
        answered = not r.cancelled or r.stopped     # before the sink: its handler cancels the request once told
        r.sink(Event("done", finish_reason=reason, stats=stats))
        if answered:
            self.on_finish(stats)
        else:   # cut short: by the agent stopping (close), or else by its client leaving
            self.unserved["refused" if self._stop else "abandoned"] += 1
        return False


def request_stats(r: Request, done: float) -> RequestStats:
    n = len(r.generated)
    first = r.first_token_at or done
    return RequestStats(
        request_id=r.id, submitted=r.submitted, ttft_s=first - r.submitted,
        tpot_s=(done - first) / (n - 1) if n > 1 else 0.0, latency_s=done - r.submitted,
        prompt_tokens=len(r.prompt_ids), completion_tokens=n,
        hits=r.io[0], misses=r.io[1], bytes_read=r.io[2])
