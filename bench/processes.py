"""The processes a benchmark starts (agents, generate runs, disk readers): never left running behind it.

    with started([*CLI, "serve", ...], stdout=log) as proc:   # killed if the block fails or is interrupted,
        ...                                                    # stopped with SIGTERM when it ends

A signal that lands while `subprocess.Popen` returns (its child forked, no handle to it yet) would leave
that child running unseen, an agent holding its port and memory after the bench is gone: `started` holds
SIGINT and SIGTERM until the handle is taken, then acts on them as the bench's own handlers would have.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def started(argv: list[str], stop_s: float = 120, **popen) -> Iterator[subprocess.Popen]:
    """`argv` running during the block (`popen` as for subprocess.Popen; main thread only, as signal handlers
    are). If the block fails or is interrupted, the process is killed; when it ends, the process (its process
    group, with start_new_session) gets SIGTERM and `stop_s` seconds to exit, else it is killed and that is
    a SystemExit. A process that already exited and was waited for is left alone."""
    group = popen.get("start_new_session", False)
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: held.append(signum)) for s in INTERRUPTS}
    proc = None
    try:
        try:
            proc = subprocess.Popen(argv, **popen)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        for signum in held:
            signal.raise_signal(signum)    # now that the process is held, the except below stops it
        yield proc
    except BaseException:
        if proc is not None:
            _send(proc, signal.SIGKILL, group)
            proc.wait()
        raise
    _send(proc, signal.SIGTERM, group)
    try:
        proc.wait(stop_s)
    except subprocess.TimeoutExpired:
        _send(proc, signal.SIGKILL, group)
        proc.wait()
        raise SystemExit(f"{' '.join(argv)[:200]} did not stop within {stop_s:.0f} s of SIGTERM; killed") from None


def _send(proc: subprocess.Popen, signum: int, group: bool) -> None:
    """`signum` to a process that has not been waited for (poll() reaps one that exited: its pid is not reused)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
