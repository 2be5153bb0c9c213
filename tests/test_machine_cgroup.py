"""A process's memory cgroup (machine.cgroup) on constructed v1 and v2 trees, and on this machine's
real cgroup v1 memory controller (a child cgroup made for the test, with a limit)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.memory import MemoryCgroup
from collector import series
from collector.samplers import CgroupSampler
from machine import cgroup
from machine.sources import SourceUnavailable

V1_STAT = """cache 9379840
rss 12525568
workingset_refault_anon 3
workingset_refault_file 70
pgmajfault 11
hierarchical_memory_limit 4000000000
total_workingset_refault_file 9000
total_pgmajfault 5000
"""
PSI = "some avg10=12.50 avg60=3.00 avg300=1.00 total=100\nfull avg10=2.25 avg60=0.50 avg300=0.10 total=50\n"


def v1_tree(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    agent = root / "memory" / "bench" / "agent"
    agent.mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")     # v1: no limit
    (root / "memory" / "bench" / "memory.limit_in_bytes").write_text("4000000000\n")
    (agent / "memory.limit_in_bytes").write_text("6000000000\n")
    (agent / "memory.usage_in_bytes").write_text("123456789\n")
    (agent / "memory.stat").write_text(V1_STAT)
    return root


def test_limits_are_read_from_the_process_cgroup_and_its_ancestors(tmp_path):
    root = v1_tree(tmp_path)
    (root / "memory.max").write_text("max\n")
    # the container's cgroup is mounted as the root, /proc/<pid>/cgroup names it from the host's root
    own = cgroup.own_paths("0::/\n4:memory:/process_api/abc/bench/agent\n")
    assert sorted(cgroup.limits(own, root)) == [4000000000, 6000000000]
    assert cgroup.limits(cgroup.own_paths("0::/\n4:memory:/\n"), root) == []


def test_a_limit_file_that_cannot_be_read_is_an_error_not_the_absence_of_a_limit(tmp_path):
    root = v1_tree(tmp_path)
    bench = root / "memory" / "bench"
    (bench / "memory.limit_in_bytes").unlink()
    own = cgroup.own_paths("4:memory:/bench/agent\n")
    assert cgroup.limits(own, root) == [6000000000]            # a level without the file: skipped
    (bench / "memory.limit_in_bytes").mkdir()                   # there, but unreadable (as ENOMEM makes it)
    with pytest.raises(OSError):
        cgroup.limits(own, root)


def test_a_v1_cgroup_reads_its_own_counters_not_its_childrens(tmp_path):
    root = v1_tree(tmp_path)
    group = cgroup.MemoryCgroup("v1", "/bench/agent", root / "memory" / "bench" / "agent",
                                cgroup.own_paths("4:memory:/bench/agent\n"), root)
    reading = group.read()
    assert reading.usage_bytes == 123456789 and reading.limit_bytes == 4000000000    # the tighter, its parent's
    assert reading.counters == {"pgmajfault": 11, "workingset_refault_file": 70, "workingset_refault_anon": 3}
    assert reading.psi is None                       # no v2 hierarchy to keep pressure in


def test_a_v2_cgroup_reads_memory_current_max_and_its_pressure(tmp_path):
    root = tmp_path / "cgroup"
    agent = root / "agents" / "one"
    agent.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "agents" / "memory.max").write_text("3000000000\n")
    (agent / "memory.max").write_text("max\n")
    (agent / "memory.current").write_text("2000000\n")
    (agent / "memory.stat").write_text("anon 1\nfile 2\npgmajfault 7\nworkingset_refault_file 8\n")
    (agent / "memory.pressure").write_text(PSI)
    (root / "memory.pressure").write_text(PSI.replace("12.50", "99.00"))
    group = cgroup.MemoryCgroup("v2", "/agents/one", agent, {"": "/agents/one"}, root)
    reading = group.read()
    assert (reading.usage_bytes, reading.limit_bytes) == (2000000, 3000000000)
    assert reading.counters == {"pgmajfault": 7, "workingset_refault_file": 8}
    assert reading.psi["some"]["avg10"] == 12.5 and reading.psi["full"]["avg10"] == 2.25   # its own, not the root's
    values = series.cgroup_series(None, reading, 0.0)
    assert values == {"cgroup.agent.usage_bytes": 2000000, "cgroup.agent.limit_bytes": 3000000000,
                      "cgroup.agent.psi_some_avg10": 12.5, "cgroup.agent.psi_full_avg10": 2.25}


def test_counter_rates_between_two_readings(tmp_path):
    before = cgroup.MemoryReading(10, None, {"pgmajfault": 100, "workingset_refault_file": 50}, None)
    after = cgroup.MemoryReading(10, None, {"pgmajfault": 160, "workingset_refault_file": 40}, None)
    assert series.cgroup_series((1.0, before), after, 3.0) == {
        "cgroup.agent.usage_bytes": 10, "cgroup.agent.pgmajfault_per_s": 30.0,
        "cgroup.agent.workingset_refault_file_per_s": 0.0}                   # a counter reset is not negative


@pytest.fixture
def sleeper_in_a_cgroup():
    """A real process in a child memory cgroup of ours, limited to 512 MiB, that touches 32 MiB once in it
    (cgroup v1 charges memory to the cgroup it is allocated in, not to one the process moves to later)."""
    group = MemoryCgroup(512 << 20, name=f"flashmoe-test-cgroup-{os.getpid()}")
    assert group.path is not None, group.describe()
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.readline(); "
                             "b = bytearray(32 << 20); print(flush=True); time.sleep(60)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        group.add(proc.pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        proc.stdout.readline()                 # it has touched its 32 MiB
        yield group, proc.pid
    finally:
        proc.kill()
        proc.wait()
        time.sleep(0.1)
        group.remove()


def test_this_machines_cgroup_of_a_real_process_and_its_limit(sleeper_in_a_cgroup):
    group, pid = sleeper_in_a_cgroup
    found = cgroup.memory_cgroup(pid)
    assert found.directory == group.path and found.version == group.kind
    reading = found.read()
    assert reading.limit_bytes == 512 << 20 == cgroup.memory_limit(pid)
    assert reading.usage_bytes >= 32 << 20 and set(reading.counters) == set(cgroup.COUNTERS)
    group.set_limit(256 << 20)
    assert found.read().limit_bytes == 256 << 20 == cgroup.memory_limit(pid)      # read afresh every time


def test_the_collector_samples_the_agents_cgroup_from_its_pid_file(sleeper_in_a_cgroup, tmp_path):
    group, pid = sleeper_in_a_cgroup
    pid_file = tmp_path / "agent.pid"
    pid_file.write_text(str(pid))
    sampler = CgroupSampler(pid_file)
    first = sampler.sample(time.monotonic())
    assert first["cgroup.agent.limit_bytes"] == 512 << 20 and "cgroup.agent.pgmajfault_per_s" not in first
    second = sampler.sample(time.monotonic() + 1)
    assert second["cgroup.agent.pgmajfault_per_s"] >= 0 and "cgroup.agent.workingset_refault_file_per_s" in second


def test_other_processes_in_the_cgroup_are_counted_but_not_the_agents_children():
    """A real parent that forks a child inside the cgroup, then a stranger joins it."""
    group = MemoryCgroup(512 << 20, name=f"flashmoe-test-shared-{os.getpid()}")
    assert group.path is not None, group.describe()
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; sys.stdin.readline(); "
                               "child = subprocess.Popen(['sleep', '60']); print(child.pid, flush=True); child.wait()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stranger, child = subprocess.Popen(["sleep", "60"]), None
    try:
        group.add(parent.pid)
        parent.stdin.write("go\n")
        parent.stdin.flush()
        child = int(parent.stdout.readline())       # forked inside the cgroup: a member too
        found = cgroup.memory_cgroup(parent.pid)
        assert found.others(parent.pid) == 0        # its own child is the agent's, not another process
        assert found.others(child) == 1             # the parent is not the child's
        group.add(stranger.pid)
        assert found.others(parent.pid) == 1
        reading = series.cgroup_series(None, found.read(), 1.0, found.others(parent.pid))
        assert reading["cgroup.agent.other_processes"] == 1
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        for proc in (parent, stranger):
            proc.kill()
            proc.wait()
        while (group.path / "cgroup.procs").read_text().strip():   # the kernel lets the child go last
            time.sleep(0.05)
        group.remove()


def test_a_process_in_the_root_cgroup_or_gone_has_no_cgroup_to_sample(tmp_path):
    root = v1_tree(tmp_path)
    with pytest.raises(SourceUnavailable, match="root memory cgroup"):
        cgroup.locate(cgroup.own_paths("0::/\n4:memory:/\n"), root)
    with pytest.raises(SourceUnavailable, match="no cgroup memory controller"):
        cgroup.locate(cgroup.own_paths("0::/x\n"), root)
    with pytest.raises(SourceUnavailable, match="exited"):
        cgroup.memory_cgroup(2**22 + 12345, root)            # no such process
