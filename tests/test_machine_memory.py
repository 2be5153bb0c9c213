"""Memory and pressure parsers on constructed text and on this machine's real /proc."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collector import series
from machine import memory, pressure

MEMINFO = """MemTotal:       24684544 kB
MemFree:        23908352 kB
MemAvailable:   24248320 kB
Cached:           501248 kB
Dirty:               128 kB
SwapTotal:       1048576 kB
SwapFree:         524288 kB
HugePages_Total:       0
"""
STATUS = "Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nRssAnon:\t   81920 kB\n" \
         "RssFile:\t   20480 kB\nVmSwap:\t       0 kB\nThreads:\t4\n"


def test_meminfo_becomes_bytes_and_swap_used():
    out = series.meminfo_series(memory.parse_kib_table(MEMINFO))
    assert out == {"mem.total_bytes": 24684544 * 1024, "mem.available_bytes": 24248320 * 1024,
                      "mem.free_bytes": 23908352 * 1024, "mem.cached_bytes": 501248 * 1024,
                      "mem.dirty_bytes": 128 * 1024, "mem.swap_used_bytes": 524288 * 1024}


def test_status_fields_of_the_agent():
    assert series.status_series(memory.parse_kib_table(STATUS)) == {
        "mem.agent.rss_bytes": 102400 * 1024, "mem.agent.hwm_bytes": 204800 * 1024,
        "mem.agent.rss_anon_bytes": 81920 * 1024, "mem.agent.rss_file_bytes": 20480 * 1024,
        "mem.agent.swap_bytes": 0}


def test_fault_counters_survive_a_command_name_with_spaces_and_parens():
    line = "4242 (my (odd) agent) S 1 4242 4242 0 -1 4194560 1500 0 37 0 12 3 0 0 20 0 4 0"
    faults = memory.parse_proc_stat(line, 5.0)
    assert (faults.minflt, faults.majflt) == (1500, 37)
    later = memory.Faults(7.0, 1700, 41)
    assert series.fault_series(faults, later) == {"mem.agent.minflt_per_s": 100.0,
                                                  "mem.agent.majflt_per_s": 2.0}


def test_vmstat_rates_per_second():
    before = memory.parse_vmstat("pgmajfault 100\nworkingset_refault_anon 0\nworkingset_refault_file 50\n")
    after = memory.parse_vmstat("pgmajfault 160\nworkingset_refault_anon 4\nworkingset_refault_file 50\n")
    assert series.vmstat_series(before, after, 2.0) == {
        "vm.pgmajfault_per_s": 30.0, "vm.workingset_refault_anon_per_s": 2.0,
        "vm.workingset_refault_file_per_s": 0.0}


def test_real_proc_files_parse():
    own = memory.parse_proc_stat(Path("/proc/self/stat").read_text(), 0.0)
    assert own.minflt > 0
    assert series.meminfo_series(memory.parse_kib_table(Path("/proc/meminfo").read_text()))["mem.total_bytes"] > 0
    assert "pgmajfault" in memory.parse_vmstat(Path("/proc/vmstat").read_text())


def test_pid_file_finds_a_live_process_only(tmp_path):
    pid_file = tmp_path / "agent.pid"
    assert memory.read_pid_file(pid_file) is None                    # no file
    pid_file.write_text("not a pid\n")
    assert memory.read_pid_file(pid_file) is None
    pid_file.write_text(f"{os.getpid()}\n")
    assert memory.read_pid_file(pid_file) == os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    pid_file.write_text(str(child.pid))
    assert memory.read_pid_file(pid_file) is None                    # exited and reaped


def test_a_pid_file_older_than_the_process_it_names_names_no_agent(tmp_path):
    """A pid file left by a killed agent, or from before a reboot, named whichever process had the pid since:
    the collector sampled it as the agent and serve refused to start ("another agent is up")."""
    pid_file = tmp_path / "agent.pid"
    with subprocess.Popen(["sleep", "60"]) as later:
        pid_file.write_text(f"{later.pid}\n")
        os.utime(pid_file, (time.time() - 3600, time.time() - 3600))  # written an hour before `later` started
        assert memory.read_pid_file(pid_file) is None
        assert memory.started_after(later.pid, time.time() - 3600)
        os.utime(pid_file)                                              # written now, by a process that runs
        assert memory.read_pid_file(pid_file) == later.pid
        assert not memory.started_after(later.pid, time.time())
        later.kill()


PSI = "some avg10=1.50 avg60=0.75 avg300=0.10 total=123456\nfull avg10=0.25 avg60=0.00 avg300=0.00 total=789\n"


def test_psi_lines_become_series():
    assert series.psi_series("io", pressure.parse_psi(PSI)) == {
        "psi.io.some_avg10": 1.5, "psi.io.some_total_us": 123456,
        "psi.io.full_avg10": 0.25, "psi.io.full_total_us": 789}


def test_real_pressure_files_parse():
    psi = pressure.read_psi("memory")
    assert {"some", "full"} <= set(psi) and psi["some"]["total"] >= 0


def test_a_kernel_without_pressure_files_says_what_it_needs(tmp_path):
    from machine.sources import SourceUnavailable
    with pytest.raises(SourceUnavailable, match="CONFIG_PSI=y"):
        pressure.read_psi("memory", tmp_path)
