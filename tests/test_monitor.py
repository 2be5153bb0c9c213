"""The one monitoring sampler: each signal from the first source that can be read, in one order."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.monitor import SystemSampler
from store.db import Store

PSI = "some avg10=3.10 avg60=1.00 avg300=0.20 total=100\nfull avg10=12.50 avg60=2.00 avg300=0.00 total=50\n"


def write_stat(path: Path, majflt: int) -> None:
    fields = ["S"] + [str(i) for i in range(4, 12)] + [str(majflt), "13"]  # majflt is field 12
    path.write_text("42 (a name) with) " + " ".join(fields) + "\n")


def write_block(root: Path, disk: str, io_ticks_ms: int) -> None:
    (root / disk).mkdir(parents=True, exist_ok=True)
    (root / disk / "stat").write_text(f"10 0 80 5 0 0 0 0 0 {io_ticks_ms} {io_ticks_ms}\n")


@pytest.fixture
def machine(tmp_path):
    """A machine made of files: PSI, this process's stat, one disk's counters."""
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "memory").write_text(PSI)
    write_stat(tmp_path / "stat", 1234)
    write_block(tmp_path / "block", "vdz", 0)
    (tmp_path / "meminfo").write_text("MemTotal:       8000000 kB\nMemFree:         100000 kB\n"
                                      "MemAvailable:    400000 kB\n")
    return tmp_path


def sampler(machine: Path, disk: str | None = "vdz", telemetry: Path | None = None) -> SystemSampler:
    return SystemSampler(disk, telemetry, psi_root=machine / "pressure", stat_path=machine / "stat",
                         sys_block=machine / "block", meminfo=machine / "meminfo")


def test_own_readings_come_first_and_rates_wait_for_a_second_reading(machine):
    s = sampler(machine)
    first = s.sample()
    assert (first.mem_pressure, first.psi_full_avg10, first.mem_available_share) == (0.031, 12.5, 0.05)
    assert first.ssd_util is None and first.major_faults_per_s is None  # rates: no previous reading yet
    assert first.sources["ssd_util"] == "/sys/block/vdz/stat"  # waits for its own source, no fallback
    write_stat(machine / "stat", 1334)
    write_block(machine / "block", "vdz", 10_000)  # 10 s of busy time: util is capped at 1
    second = s.sample()
    assert second.major_faults_per_s > 0 and second.ssd_util == 1.0
    assert second.policy_inputs() == {"mem_pressure": 0.031, "ssd_util": 1.0}  # no read latency before a read


def test_the_collectors_fresh_series_stand_in_for_what_the_agent_cannot_read(machine, tmp_path):
    (machine / "pressure" / "memory").unlink()
    db = tmp_path / "telemetry.db"
    with Store(db, autoflush_s=0) as store:
        store.append("psi.memory.some_avg10", time.time(), 40.0)
        store.append("psi.memory.full_avg10", time.time(), 20.0)
        store.append("block.ghost.util", time.time() - 60, 0.5)  # stale: not the current state
    s = sampler(machine, disk="ghost", telemetry=db)
    sample = s.sample()
    assert (sample.mem_pressure, sample.psi_full_avg10) == (0.4, 20.0)
    assert sample.sources["mem_pressure"] == "collector psi.memory.some_avg10"
    assert sample.sources["ssd_util"] == "expert cache read-busy time" and sample.ssd_util is None


def test_without_any_source_a_signal_is_none_and_the_cache_estimates_ssd_utilisation(machine):
    (machine / "pressure" / "memory").unlink()
    s = sampler(machine, disk=None)
    s.sample()
    s.read_done(0.004)
    s.read_done(0.002)
    time.sleep(0.05)
    sample = s.sample()
    assert sample.mem_pressure is None and sample.sources["mem_pressure"] == "none"
    (machine / "meminfo").unlink()
    assert s.sample().mem_available_share is None                      # no /proc/meminfo: the guard counts PSI alone
    assert sample.read_latency_s == pytest.approx(0.003)
    assert 0 < sample.ssd_util <= 0.006 / 0.05 and sample.sources["ssd_util"] == "expert cache read-busy time"
    assert "mem_pressure" not in sample.policy_inputs()


def test_a_sample_is_reread_only_when_older_than_asked(machine):
    s = sampler(machine)
    first = s.sample()
    assert s.sample(max_age_s=60) is first
    assert s.sample() is not first  # max_age_s 0: always a new reading
