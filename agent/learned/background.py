"""The agent's online-learning jobs in a child process: lowest priority, a CPU budget, off the step path.

A thread would share the interpreter lock with the thread that steps the model: a training job
holding it, descheduled at low priority on a busy machine, would stall a step (priority
inversion). A child process cannot. It runs at nice 19 and SCHED_IDLE, with one torch thread.

The budget: a job starts only while the child's CPU time since it was started (read from /proc,
its start-up and imports included), plus what the last job cost, stays within `cpu_share` of the
wall time since then. Counting the job about to run (as its predecessor's cost) keeps the average
within `cpu_share` at every moment, not only in the long run: without it an update started just
within budget overshot it by a whole job (5.3% of a core over an 8-minute run). Handing a job over and
taking the result are done by two threads of this process; the learner's step boundary only reads
a flag and swaps a reference.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
from pathlib import Path

from agent.learned.online import Job, Ready, prepare, run_job

log = logging.getLogger(__name__)

CPU_SHARE = 0.05            # of one core, on average
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _child(jobs, results) -> None:
    """The worker process: lowest priority, one thread, one job at a time until the pipe closes."""
    os.nice(19)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed: nice 19 alone
        pass
    import torch
    torch.set_num_threads(1)
    while True:
        try:
            job = jobs.recv()
        except EOFError:
            return
        try:
            results.send(("ok", run_job(job)))
        except Exception as exc:  # a job that fails is reported; the worker serves the next one
            results.send(("error", f"{type(exc).__name__}: {exc}"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class Background:
    """An online.Executor that runs jobs in a low-priority child process, started on the first job."""

    def __init__(self, cpu_share: float = CPU_SHARE) -> None:
        if not 0 < cpu_share <= 1:
            raise ValueError(f"cpu_share must be within (0, 1], got {cpu_share}")
        self.cpu_share = cpu_share
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and torch
        self._proc = None
        self._since = time.monotonic()   # learning turned on: the budget's reference
        self._spent = 0.0                # CPU seconds of workers that have exited
        self._last_job = 0.0             # CPU seconds the last job took (the first: with the worker's start-up)
        self._outbox: queue.Queue[Job | None] = queue.Queue()
        self._ready: Ready | None = None
        self._running = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.failures = 0

    # -- the Executor contract ----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            self._running = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="online-learning", daemon=True)
                self._thread.start()
        self._outbox.put(job)

    def poll(self) -> Ready | None:
        with self._lock:
            ready, self._ready = self._ready, None
        return ready

    def busy(self) -> bool:
        """A job runs or waits to be taken, or the worker has spent its CPU budget."""
        with self._lock:
            return self._running or self._ready is not None or not self._within_budget()

    def close(self) -> None:
        """Stop the worker (a job it is running is dropped) and the thread that talks to it."""
        self._closing = True
        self._outbox.put(None)
        proc = self._proc  # the serving thread may reap it (and clear self._proc) at any moment from here on
        if proc is not None and proc.is_alive():
            proc.terminate()
        if self._thread is not None:
            self._thread.join(10)
        self._reap()

    # -- budget -------------------------------------------------------------------------------------
    def cpu_used(self) -> float:
        """CPU seconds the worker processes have used since learning was turned on."""
        return self._spent + self._cpu_of_current()

    def _cpu_of_current(self) -> float:
        if self._proc is None or self._proc.pid is None:
            return 0.0
        try:
            return cpu_seconds(self._proc.pid)
        except (OSError, IndexError, ValueError):  # gone: what it used is counted in _spent on its exit
            return 0.0

    def _within_budget(self) -> bool:
        return self.cpu_used() + self._last_job <= self.cpu_share * (time.monotonic() - self._since)

    # -- the thread that talks to the worker ------------------------------------------------------------
    def _serve(self) -> None:
        while (job := self._outbox.get()) is not None:
            try:
                ready = self._run(job)
            except (EOFError, OSError) as exc:  # the worker died (killed, out of memory): a new one next time
                if not self._closing:
                    self.failures += 1
                    log.error("online learning: the worker process stopped (%s); update %d is lost", exc,
                              job.number)
                self._reap()
                ready = None
            with self._lock:
                self._ready, self._running = ready, False
        self._reap()

    def _run(self, job: Job) -> Ready | None:
        if self._proc is None or not self._proc.is_alive():
            self._reap()
            self._spawn()
        before = self._cpu_of_current()
        self._jobs.send(job)
        status, payload = self._results.recv()
        self._last_job = self._cpu_of_current() - before
        if status != "ok":
            self.failures += 1
            log.error("online learning: update %d failed in the worker: %s", job.number, payload)
            return None
        return prepare(payload)  # builds the scorer's arrays here, not at the step boundary

    def _spawn(self) -> None:
        self._jobs, jobs_child = self._ctx.Pipe()
        self._results, results_child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_child, args=(jobs_child, results_child), daemon=True,
                                       name="flashmoe-online")
        self._proc.start()
        jobs_child.close()
        results_child.close()
        log.info("online learning: worker process %d started (nice 19, SCHED_IDLE, at most %.0f%% of one core "
                 "on average)", self._proc.pid, 100 * self.cpu_share)

    def _reap(self) -> None:
        """Close the pipes to the worker and let it exit; what it used stays counted."""
        if self._proc is None:
            return
        self._spent += self._cpu_of_current()
        self._jobs.close()
        self._results.close()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._proc = None
