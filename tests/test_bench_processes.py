"""bench/processes.py: a process a bench starts is stopped when the block ends, killed when it fails, and held
(not left running unseen) when a signal lands while it starts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents import ROOT

sys.path.insert(0, str(ROOT))
from bench.memory import interrupt_on_sigterm  # noqa: E402
from bench.processes import started  # noqa: E402

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def sigterm_interrupts():
    """SIGTERM raises KeyboardInterrupt, as in a bench with a cgroup; pytest's own handler is put back after."""
    previous = signal.getsignal(signal.SIGTERM)
    interrupt_on_sigterm()
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_while_popen_returns_is_acted_on_once_the_process_is_held(monkeypatch, sigterm_interrupts):
    """The child is forked when the signal lands, before Popen hands it over: it must not outlive the bench."""
    children = []
    real_popen = subprocess.Popen

    def popen_then_signalled(*args, **kwargs):
        children.append(real_popen(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGTERM)
        return children[-1]

    monkeypatch.setattr(subprocess, "Popen", popen_then_signalled)
    interrupting = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with started(SLEEPER):
            pytest.fail("the block ran although a SIGTERM was pending")
    assert children[0].returncode == -signal.SIGKILL          # killed and waited for: not running, not a zombie
    assert signal.getsignal(signal.SIGTERM) is interrupting    # the bench's handler given back


def test_the_block_ending_stops_the_process_and_its_failure_kills_it():
    with started(SLEEPER) as proc:
        assert proc.poll() is None
    assert proc.returncode == -signal.SIGTERM
    with pytest.raises(ValueError, match="the block's own"):
        with started(SLEEPER) as proc:
            raise ValueError("the block's own error")
    assert proc.returncode == -signal.SIGKILL


def test_a_session_leader_is_stopped_with_its_whole_group():
    with started(["sh", "-c", "sleep 60 & echo $!; wait"], start_new_session=True, stdout=subprocess.PIPE,
                 text=True) as proc:
        sleep_pid = int(proc.stdout.readline())
    proc.stdout.close()
    assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 30
    while alive(sleep_pid) and time.monotonic() < deadline:   # the signal is sent; its delivery is the kernel's
        time.sleep(0.01)
    assert not alive(sleep_pid)                                # the background sleep went too


def alive(pid: int) -> bool:
    """Running, not exited (a zombie waits for its new parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def test_a_process_that_ignores_sigterm_is_killed_and_said_so():
    ignoring = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                      "print('ready', flush=True); time.sleep(60)"]
    with pytest.raises(SystemExit, match="did not stop within 1 s of SIGTERM; killed"):
        with started(ignoring, stop_s=1, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout.readline() == "ready\n"
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


def test_a_process_the_block_waited_for_is_left_alone():
    with started([sys.executable, "-c", "raise SystemExit(3)"]) as proc:
        proc.wait()
    assert proc.returncode == 3
