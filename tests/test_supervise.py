"""`flashmoe-cli supervise`, the Procfile's agent line: an agent killed with SIGKILL comes back on the same port
by itself, with the kill logged; a command that fails at once is given up on with a message; SIGTERM, SIGINT
or SIGHUP (its terminal closed) stops the command and the supervisor; an agent stopped on purpose (SIGTERM to
the agent itself, a clean exit) is not started again; under honcho the other processes keep running through
the kill, and honcho's own stop still ends everything."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agents import CLI, START_TIMEOUT_S, demo_model, free_port, spawn, stop, wait_for, wait_http
from machine.memory import alive, read_pid_file
from store import queries

HONCHO = str(Path(sys.executable).with_name("honcho"))


def test_an_agent_killed_with_sigkill_comes_back_on_its_port_and_sigterm_stops_both(tmp_path_factory, tmp_path):
    """The collector beside it, as in the Procfile, keeps running and samples the new agent."""
    port, db, pid_file, log = free_port(), tmp_path / "flashmoe.db", tmp_path / "agent.pid", tmp_path / "supervise.log"
    proc = spawn([*CLI, "supervise", "--", *CLI, "serve", "--model", str(demo_model(tmp_path_factory)),
                  "--port", str(port), "--db", str(db), "--pid-file", str(pid_file)], log)
    collector = spawn([*CLI, "collect", "--db", str(db), "--pid-file", str(pid_file)], tmp_path / "collector.log")
    url = f"http://127.0.0.1:{port}/v1/status"
    try:
        wait_http(url, proc, log)
        first = read_pid_file(pid_file)
        assert first is not None and first != proc.pid
        os.kill(first, signal.SIGKILL)
        killed = time.time()
        second = wait_for(lambda: (pid := read_pid_file(pid_file)) not in (None, first) and pid, START_TIMEOUT_S,
                          "a new agent's pid file")
        wait_http(url, proc, log)
        assert httpx.get(url, timeout=10).json()["experts"]
        text = log.read_text()
        assert f"(pid {first}) was killed by SIGKILL" in text and "(restart 1)" in text, text
        wait_for(lambda: len(queries.points(db, "mem.agent.rss_bytes", killed)[0]), 60, "the new agent's RSS")
        assert collector.poll() is None, (tmp_path / "collector.log").read_text()[-3000:]
        os.kill(proc.pid, signal.SIGTERM)          # the supervisor alone, as `kill <its pid>` would
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert not alive(second), "the agent outlived its supervisor"
    finally:
        stop(collector)
        stop(proc)


def test_an_agent_stopped_with_sigterm_to_itself_is_not_started_again(tmp_path_factory, tmp_path):
    """`kill <agent pid>` by an operator: the agent shuts down cleanly (exit 0) and the supervisor ends with it."""
    port, pid_file, log = free_port(), tmp_path / "agent.pid", tmp_path / "supervise.log"
    proc = spawn([*CLI, "supervise", "--", *CLI, "serve", "--model", str(demo_model(tmp_path_factory)),
                  "--port", str(port), "--pid-file", str(pid_file)], log)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/status", proc, log)
        agent = read_pid_file(pid_file)
        os.kill(agent, signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert f"(pid {agent}) exited with status 0: stopped on purpose, so not starting it again" in text, text
        assert "(restart 1)" not in text and not pid_file.exists(), text
    finally:
        stop(proc)


@pytest.mark.parametrize("how, status", [("exit 0", 0), ("kill -TERM $$", 128 + signal.SIGTERM),
                                         ("kill -HUP $$", 128 + signal.SIGHUP), ("exit 130", 130)])
def test_a_command_stopped_on_purpose_runs_once(how, status):
    done = subprocess.run([*CLI, "supervise", "--", "sh", "-c", f"echo started; {how}"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == status and done.stdout.count("started") == 1, done
    assert "stopped on purpose, so not starting it again" in done.stderr, done.stderr


@pytest.mark.parametrize("how", ["kill -KILL $$", "kill -SEGV $$", "exit 1"])
def test_a_command_that_dies_is_started_again(how):
    done = subprocess.run([*CLI, "supervise", "--give-up-after", "2", "--", "sh", "-c", f"echo started; {how}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout.count("started") == 2, done
    assert "(restart 1)" in done.stderr, done.stderr


def test_a_command_that_fails_at_once_is_given_up_on_with_a_message(tmp_path):
    done = subprocess.run([*CLI, "supervise", "--give-up-after", "3", "--", "sh", "-c", "echo started; exit 3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout.count("started") == 3, done
    assert "giving up on sh -c 'echo started; exit 3': it ended 3 times in a row within 60 s of starting (the " \
           "last exited with status 3)" in done.stderr, done.stderr


def test_a_command_that_cannot_start_is_one_line(tmp_path):
    done = subprocess.run([*CLI, "supervise", "--", str(tmp_path / "nothing")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and f"cannot start {tmp_path / 'nothing'}: No such file or directory" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_supervisor_stops_its_command_and_then_itself(sig, tmp_path):
    child_pid, log = tmp_path / "child.pid", tmp_path / "supervise.log"
    proc = spawn([*CLI, "supervise", "--", "sh", "-c", f"echo $$ > {child_pid}; exec sleep 600"], log)
    try:
        pid = wait_for(lambda: child_pid.exists() and child_pid.read_text().strip(), 30, "the command's pid")
        os.kill(proc.pid, sig)
        assert proc.wait(30) == 128 + signal.SIGTERM, log.read_text()      # sleep ends on the SIGTERM sent on
        assert not alive(int(pid)) and "stopped as asked" in log.read_text()
    finally:
        stop(proc)


def test_a_supervisor_killed_with_sigkill_takes_its_command_with_it(tmp_path):
    """The command outlived a supervisor killed by SIGKILL (kill -9, the OOM killer): an agent nobody watched,
    holding its port and pid file, so that the next supervisor's agent could not start."""
    child_pid, log = tmp_path / "child.pid", tmp_path / "supervise.log"
    proc = spawn([*CLI, "supervise", "--", "sh", "-c", f"echo $$ > {child_pid}; exec sleep 600"], log)
    try:
        pid = int(wait_for(lambda: child_pid.exists() and child_pid.read_text().strip(), 30, "the command's pid"))
        proc.kill()
        proc.wait(30)
        wait_for(lambda: not alive(pid), 10, "the command to end with its supervisor")
    finally:
        stop(proc)


def test_under_honcho_the_others_outlive_a_killed_agent_and_honchos_stop_ends_everything(tmp_path):
    child_pid, other_pid, log = tmp_path / "child.pid", tmp_path / "other.pid", tmp_path / "honcho.log"
    cli = " ".join(CLI)
    (tmp_path / "Procfile").write_text(
        f"agent: {cli} supervise -- sh -c 'echo $$ > {child_pid}; exec sleep 600'\n"
        f"dashboard: sh -c 'echo $$ > {other_pid}; exec sleep 600'\n")
    honcho = spawn([HONCHO, "start", "-f", str(tmp_path / "Procfile"), "-d", str(tmp_path)], log)
    try:
        first = wait_for(lambda: child_pid.exists() and int(child_pid.read_text() or 0), 60, "the agent's pid")
        other = wait_for(lambda: other_pid.exists() and int(other_pid.read_text() or 0), 60, "the dashboard's pid")
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: (pid := int(child_pid.read_text() or 0)) != first and pid, 30, "a new agent")
        assert honcho.poll() is None and alive(other) and alive(second), log.read_text()
        os.kill(honcho.pid, signal.SIGINT)          # as `pkill -INT -f "honcho start"` and Ctrl-C do
        honcho.wait(30)
        assert not alive(other) and not alive(second), log.read_text()
    finally:
        stop(honcho)
