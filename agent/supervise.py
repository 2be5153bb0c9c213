"""flashmoe-cli supervise: run a command (the agent) and start it again whenever it dies.

Examples:
    flashmoe-cli supervise -- flashmoe-cli serve --model data/demo --db data/flashmoe.db --pid-file data/agent.pid
    flashmoe-cli supervise --give-up-after 3 --fast-s 30 -- flashmoe-cli serve --model data/demo

honcho stops every process of the Procfile when one ends, so an agent killed by the OOM killer or kill -9
took the collector and the dashboard, the view of what happened, down with it. Under this supervisor the
agent comes back by itself: each end is logged with the exit status or signal that caused it, and the
command starts again after 1 s, twice as long after each run shorter than --fast-s in a row (up to 30 s).
After --give-up-after such fast runs in a row (a broken model, a taken port) it stops trying and exits 1,
saying so. SIGTERM, Ctrl-C or SIGHUP (its terminal closed; not under nohup) stops the command (SIGTERM, as honcho
sends it) and then the supervisor.
A command stopped on purpose is not started again: the supervisor logs it and exits too. On purpose is how
an operator stops the agent itself (`kill <agent pid>`, Ctrl-C, SIGHUP): the agent ends its requests and exits
0; killed by one of those signals before it could (while loading), or 128 + one (the CLI's Ctrl-C, a shell's
report of it). Anything else is a death: a crash, another status, SIGKILL (kill -9, the OOM killer).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from agent.argtypes import count
from machine.stop_signals import stop_signals

log = logging.getLogger(__name__)

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
PR_SET_PDEATHSIG = 1   # prctl(2): the signal a process gets when the thread that forked it ends


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("--give-up-after", type=count, default=5,
                   help="fast runs in a row after which it stops trying and exits 1 (default 5)")
    p.add_argument("--fast-s", type=count, default=60,
                   help="a run shorter than this many seconds counts as a failure to start (default 60)")
    p.add_argument("argv", metavar="COMMAND", nargs=argparse.REMAINDER, help="the command to run, after --")


def run(args: argparse.Namespace) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        log.error("no command to supervise: give it after --, e.g. flashmoe-cli supervise -- flashmoe-cli serve ...")
        return 2
    return supervise(command, args.give_up_after, args.fast_s)


def ended(returncode: int) -> str:
    """How a child ended, as subprocess reports it (a negative code is the signal that killed it)."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    name = signal.Signals(-returncode).name
    return f"was killed by {name}" + (" (kill -9, or the kernel's OOM killer: see `dmesg`)"
                                      if returncode == -signal.SIGKILL else "")


def stopped_on_purpose(returncode: int) -> bool:
    """An exit the agent makes only when asked to stop (status 0 after its SIGTERM/SIGINT/SIGHUP shutdown), or
    death by those signals, directly or as 128 + the signal a shell or the CLI's KeyboardInterrupt reports."""
    asked = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    return returncode == 0 or -returncode in asked or returncode - 128 in asked


def exit_status(returncode: int) -> int:
    """The status a shell would report for a child's end: 128 + the signal that killed it."""
    return returncode if returncode >= 0 else 128 - returncode


def delay_after(fast_runs: int) -> float:
    """The wait before the next start: FIRST_DELAY_S, doubled for each fast run in a row, at most MAX_DELAY_S."""
    return min(FIRST_DELAY_S * 2 ** max(fast_runs - 1, 0), MAX_DELAY_S)


def _end_with(supervisor: int) -> Callable[[], None]:
    """For the child, before exec: SIGTERM when the supervisor dies, however it dies. A supervisor killed by
    SIGKILL (kill -9, the OOM killer) sends nothing, and the agent ran on unwatched, holding its port and pid
    file, so that the next supervisor's agent could not start; SIGTERM is the agent's own clean stop."""
    def arm() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != supervisor:        # it died before the line above
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


def supervise(command: Sequence[str], give_up_after: int, fast_s: float) -> int:
    """Run `command` until asked to stop (machine.stop_signals), starting it again each time it dies; returns
    1 after `give_up_after` runs in a row each shorter than `fast_s`, else how the last run ended."""
    shown = shlex.join(command[:3]) + (" ..." if len(command) > 3 else "")
    stopping = threading.Event()
    child: subprocess.Popen | None = None

    def stop(signum: int, _frame) -> None:
        stopping.set()
        if child is not None:
            child.send_signal(signal.SIGTERM)   # not a second SIGINT: the agent takes that as "stop now"

    for sig in stop_signals():
        signal.signal(sig, stop)
    fast_runs = restarts = 0
    while True:
        started = time.monotonic()
        try:
            child = subprocess.Popen(command, preexec_fn=_end_with(os.getpid()))  # no threads here to fork with
        except OSError as exc:                   # no such program, not executable: no use trying again
            log.error("cannot start %s: %s", shown, exc.strerror)
            return 2
        if stopping.is_set():                    # asked to stop while it was being started
            child.send_signal(signal.SIGTERM)
        code = child.wait()
        ran = time.monotonic() - started
        if stopping.is_set():
            log.info("%s (pid %d) %s: stopped as asked", shown, child.pid, ended(code))
            return exit_status(code)
        if stopped_on_purpose(code):
            log.info("%s (pid %d) %s: stopped on purpose, so not starting it again", shown, child.pid, ended(code))
            return exit_status(code)
        fast_runs = fast_runs + 1 if ran < fast_s else 0
        if fast_runs >= give_up_after:
            log.error("giving up on %s: it ended %d times in a row within %g s of starting (the last %s); fix what "
                      "its log above says and start it again", shown, fast_runs, fast_s, ended(code))
            return 1
        restarts += 1
        delay = delay_after(fast_runs)
        log.warning("%s (pid %d) %s after %.1f s; starting it again in %g s (restart %d)", shown, child.pid,
                    ended(code), ran, delay, restarts)
        if stopping.wait(delay):
            return 0
