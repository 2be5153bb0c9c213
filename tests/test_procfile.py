"""The Procfile `make demo` runs: every process finds the agent on the port the agent listens on, and
both ports can be moved (FLASHMOE_AGENT_PORT, FLASHMOE_DASHBOARD_PORT) when 8600 or 8501 is taken.
Each command is expanded by sh, as honcho runs it. Closing `make demo`'s terminal stops every process."""
from __future__ import annotations

import fcntl
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from agents import ROOT, free_port, wait_for

PROCFILE = Path(__file__).resolve().parent.parent / "Procfile"


def expanded(env: dict[str, str]) -> dict[str, list[str]]:
    """Each process's command line as sh expands it under `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLASHMOE_")} | env
    lines = [line.split(":", 1) for line in PROCFILE.read_text().splitlines() if line.strip()]
    return {name: subprocess.run(["sh", "-c", f"printf '%s\\n' {command}"], env=clean, capture_output=True,
                                 text=True, check=True).stdout.split() for name, command in lines}


def after(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


MOVED = {"FLASHMOE_AGENT_PORT": "18621", "FLASHMOE_DASHBOARD_PORT": "18522"}


@pytest.mark.parametrize("env, agent, dashboard", [({}, "8600", "8501"), (MOVED, "18621", "18522")])
def test_every_process_finds_the_agent_on_its_port(env, agent, dashboard):
    procs = expanded(env)
    assert set(procs) == {"agent", "collector", "dashboard", "traffic"}
    assert procs["agent"][:5] == ["flashmoe-cli", "supervise", "--", "flashmoe-cli", "serve"]   # comes back if killed
    assert after(procs["agent"], "--port") == agent
    assert f"FLASHMOE_AGENT_URL=http://127.0.0.1:{agent}" in procs["dashboard"]
    assert after(procs["dashboard"], "--server.port") == dashboard
    assert after(procs["traffic"], "--agent-url") == f"http://127.0.0.1:{agent}"
    assert after(procs["collector"], "--pid-file") == after(procs["agent"], "--pid-file")


MAKEFILE = PROCFILE.with_name("Makefile")
HONCHO = Path(sys.executable).with_name("honcho")
RUNNER = [sys.executable, "-m", "agent.run_procfile"]   # what `make demo` runs honcho under


def test_make_demo_runs_honcho_under_the_runner_the_next_test_hangs_up():
    assert '$(BIN)/python -m agent.run_procfile $(BIN)/honcho start' in MAKEFILE.read_text()


def take_terminal() -> None:
    """In the child, a session leader by then: its stdin, a pty, becomes its controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_closing_the_terminal_stops_every_process_and_frees_their_ports(tmp_path):
    """honcho handles SIGTERM and SIGINT only: the terminal's SIGHUP killed it, and its processes, each in a
    session of its own, ran on orphaned with their ports, which the next `make demo` found taken."""
    ports = [free_port(), free_port()]
    (tmp_path / "Procfile").write_text("".join(
        f"web{i}: echo $$ > web{i}.pid && exec {sys.executable} -m http.server {port} --bind 127.0.0.1\n"
        for i, port in enumerate(ports)))
    terminal, its_end = os.openpty()
    command = " ".join(map(shlex.quote, [*RUNNER, str(HONCHO), "start"]))
    shell = subprocess.Popen(["sh", "-c", f"{command}; echo exit $?"], stdin=its_end, stdout=its_end,
                             stderr=its_end, cwd=tmp_path, start_new_session=True, preexec_fn=take_terminal,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})     # as a terminal's shell runs make
    os.close(its_end)
    shown = b""
    try:
        deadline = time.monotonic() + 30
        while not all(listening(port) for port in ports) and time.monotonic() < deadline:
            if select.select([terminal], [], [], 0.1)[0]:
                shown += os.read(terminal, 65536)
        assert all(listening(port) for port in ports), shown.decode(errors="replace")
        pids = [int((tmp_path / f"web{i}.pid").read_text()) for i in range(len(ports))]
    finally:
        os.close(terminal)                  # the terminal closes: the kernel hangs up its session
    shell.wait(timeout=30)                  # the hangup ends it, and its foreground job gets SIGHUP too
    try:
        wait_for(lambda: not any(map(running, pids)), 30, "every process of the Procfile to stop")
    finally:
        for pid in filter(running, pids):   # left by a runner that failed: not to hold their ports on
            os.kill(pid, signal.SIGKILL)
    assert not any(listening(port) for port in ports)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("argv, code, said", [
    (["/nonexistent/honcho", "start"], 127, "cannot start /nonexistent/honcho"),
    (["/etc/passwd"], 126, "cannot start /etc/passwd: Permission denied"),
    ([], 2, "usage:")])
def test_a_runner_that_cannot_start_is_one_line_not_a_traceback(argv, code, said):
    """A venv without honcho (or no runner given) ended the runner in a FileNotFoundError or IndexError traceback."""
    done = subprocess.run([sys.executable, "-m", "agent.run_procfile", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == code and said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1
