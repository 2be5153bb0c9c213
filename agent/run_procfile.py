"""`make demo`'s way of running the Procfile's runner (honcho), so that closing its terminal stops every process.

honcho stops its processes on SIGTERM and SIGINT only. SIGHUP, which the terminal or SSH session sends when it
closes, killed honcho on the spot, and the agent, collector, dashboard and traffic, each in a session of its own,
ran on orphaned, holding the ports the next `make demo` needs. Here honcho runs in a session of its own, which the
terminal's hangup does not reach, and this process, in the terminal's foreground, passes SIGHUP on to it as
SIGTERM (SIGINT and SIGTERM as they are). honcho's output comes through a pty (a pipe when ours is no terminal, so
a log gets no colour codes) and goes on to our output until that fails, the terminal gone; after that it is read
and dropped, so that honcho, printing what it stops, neither fails on the closed terminal nor blocks.

    python -m agent.run_procfile honcho start
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import termios

PASSED_ON = {signal.SIGHUP: signal.SIGTERM, signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM}
CHUNK = 65536


def output_channel() -> tuple[int, int]:
    """(read end, write end): a pty, as honcho colours its output only on a terminal, without the pty's turning
    of each newline into CR LF; a pipe when our output is no terminal."""
    if not os.isatty(sys.stdout.fileno()):
        return os.pipe()
    reader, writer = os.openpty()
    attributes = termios.tcgetattr(writer)
    attributes[1] &= ~termios.OPOST
    termios.tcsetattr(writer, termios.TCSANOW, attributes)
    return reader, writer


def relay(reader: int) -> None:
    """Copy what comes from `reader` to our output until its end; once writing fails, drop the rest."""
    writing = True
    while chunk := read(reader):
        try:
            while writing and chunk:
                chunk = chunk[os.write(sys.stdout.fileno(), chunk):]
        except OSError:                # EIO or EPIPE: the terminal closed
            writing = False


def read(reader: int) -> bytes:
    """The next bytes from `reader`, b"" at its end (a pty whose every writer has closed it reads EIO)."""
    try:
        return os.read(reader, CHUNK)
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        return b""


def run(argv: list[str]) -> int:
    """Run `argv` in a session of its own with our stop signals passed on; its exit code (128 + a signal's)."""
    if not argv:
        print("usage: python -m agent.run_procfile RUNNER [ARG ...], e.g. .venv/bin/honcho start", file=sys.stderr)
        return 2
    reader, writer = output_channel()
    try:
        runner = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=writer, stderr=writer, start_new_session=True)
    except OSError as exc:   # a venv without honcho, or a broken one: one line, as a shell says it, not a traceback
        print(f"cannot start {argv[0]}: {exc.strerror}; `make demo` installs honcho into .venv from requirements.txt",
              file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    os.close(writer)
    for ours, theirs in PASSED_ON.items():
        signal.signal(ours, lambda _signum, _frame, theirs=theirs: runner.send_signal(theirs))
    relay(reader)
    code = runner.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
