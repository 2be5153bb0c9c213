"""The collector's samplers: each reads one part of the machine (machine/) and names its store series."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from collector import series
from collector.status import SourceStatus
from machine import cgroup, memory, nvme, pressure, proc_io
from machine.block import BlockStat, block_rates, read_stat
from machine.devices import NvmeController
from machine.sources import SourceUnavailable


class Sampler(Protocol):
    source: str

    def sample(self, t: float) -> dict[str, float]:
        """Series values at monotonic time t; raises SourceUnavailable (or OSError) if it cannot."""


@dataclass
class BlockSampler:
    device: str
    source: str = ""
    _previous: BlockStat | None = None

    def __post_init__(self) -> None:
        self.source = f"block statistics of {self.device} (/sys/block/{self.device}/stat)"

    def sample(self, t: float) -> dict[str, float]:
        current = read_stat(self.device, t)
        previous, self._previous = self._previous, current
        return series.block_series(self.device, block_rates(previous, current)) if previous else {}


@dataclass
class SystemMemorySampler:
    source: str = "system memory (/proc/meminfo, /proc/vmstat)"
    _previous: tuple[float, dict[str, int]] | None = None

    def sample(self, t: float) -> dict[str, float]:
        out = series.meminfo_series(memory.parse_kib_table(Path("/proc/meminfo").read_text()))
        vmstat = memory.parse_vmstat(Path("/proc/vmstat").read_text())
        if self._previous is not None:
            out |= series.vmstat_series(self._previous[1], vmstat, t - self._previous[0])
        self._previous = (t, vmstat)
        return out


def agent_pid(pid_file: Path | None) -> int:
    """The running agent's pid, or SourceUnavailable saying why there is none."""
    if pid_file is None:
        raise SourceUnavailable("no --pid-file given, so the agent's memory is not sampled")
    pid = memory.read_pid_file(pid_file)
    if pid is None:
        raise SourceUnavailable(f"the agent is not running (no live pid in {pid_file})")
    return pid


@dataclass
class AgentSampler:
    pid_file: Path | None
    source: str = "the agent process"
    _pid: int | None = None
    _previous: memory.Faults | None = None

    def sample(self, t: float) -> dict[str, float]:
        pid = agent_pid(self.pid_file)
        if pid != self._pid:
            self._pid, self._previous = pid, None
        try:
            status = memory.parse_kib_table(Path(f"/proc/{pid}/status").read_text())
            faults = memory.parse_proc_stat(Path(f"/proc/{pid}/stat").read_text(), t)
        except FileNotFoundError:
            raise SourceUnavailable(f"the agent (pid {pid}) exited") from None
        out = series.status_series(status)
        if self._previous is not None:
            out |= series.fault_series(self._previous, faults)
        self._previous = faults
        return out


@dataclass
class CgroupSampler:
    """The agent's memory cgroup (machine.cgroup): found again at every sample, since the agent may
    restart or be moved to another cgroup, whose counters then start afresh."""
    pid_file: Path | None
    source: str = "the agent's memory cgroup"
    _previous: tuple[Path, float, cgroup.MemoryReading] | None = None

    def sample(self, t: float) -> dict[str, float]:
        try:
            pid = agent_pid(self.pid_file)
        except SourceUnavailable:
            return {}             # AgentSampler says why there is no agent; once is enough
        group = cgroup.memory_cgroup(pid)
        reading = group.read()
        same = self._previous is not None and self._previous[0] == group.directory
        previous = self._previous[1:] if same else None
        self._previous = (group.directory, t, reading)
        return series.cgroup_series(previous, reading, t, group.others(pid))


MIB = 1 << 20
READER_FLOOR = 1.0 * MIB    # B/s: the others' reads and writes below this are background, and no process is looked for
TOP_READERS = 3
CHARGED = 1.5               # a process's reads (writes) over this many times the disk's are not of it (see _users)
LOOK_AGAIN_S = 10.0         # how often to look for the agent's O_DIRECT file while it has none open


@dataclass(frozen=True)
class Reading:
    """The agent's disk at monotonic time t: its counters and the agent's own read_bytes and write_bytes."""
    pid: int
    disk: str
    block: BlockStat
    agent: proc_io.Io


@dataclass
class DiskReadersSampler:
    """Who uses the agent's disk: the device's reads and writes split into the agent's (its
    /proc/<pid>/io) and the others'; while the others read and write over READER_FLOOR, every process's
    read_bytes and write_bytes are read too (machine.proc_io: ~1.3 ms for 86 processes) and the top few
    with a file open (or mapped) on that disk for what they did are kept in `top` for the collector to
    record. A calm disk costs two small reads a tick."""
    pid_file: Path | None
    source: str = "readers and writers of the agent's disk (/proc/<pid>/io)"
    top: list[tuple[int, str, float, float]] = field(default_factory=list)   # (pid, name, read, write B/s)
    _disk: tuple[int, str | None, float] | None = None                # (agent pid, its disk, when looked for)
    _previous: Reading | None = None
    _scan: tuple[float, dict[int, proc_io.Io]] | None = None          # (t, io bytes by pid) while others use the disk
    _use: dict[int, tuple[proc_io.Use, float]] = field(default_factory=dict)   # by pid: (its use, when looked)
    _own: dict[int, proc_io.Io] = field(default_factory=dict)         # the last scan's candidates' own I/O

    @property
    def disk(self) -> str | None:
        return self._disk[1] if self._disk else None

    def sample(self, t: float) -> dict[str, float]:
        self.top = []
        try:
            pid = agent_pid(self.pid_file)
        except SourceUnavailable:
            return {}             # AgentSampler says why there is no agent; once is enough
        disk = self._agent_disk(pid, t)
        try:
            current = Reading(pid, disk, read_stat(disk, t), proc_io.io_bytes(pid))
        except FileNotFoundError:
            raise SourceUnavailable(f"the agent (pid {pid}) exited") from None
        previous, self._previous = self._previous, current
        if previous is None or (previous.pid, previous.disk) != (pid, disk):
            return {}
        dt = t - previous.block.t
        device = block_rates(previous.block, current.block)
        agent = proc_io.Io(*(max(0, now - then) / dt for now, then in zip(current.agent, previous.agent)))
        others = proc_io.Io(max(0.0, device.read_bytes_per_s - agent.read),
                            max(0.0, device.write_bytes_per_s - agent.write))
        if sum(others) >= READER_FLOOR:
            self.top = self._users(pid, disk, t, proc_io.Io(device.read_bytes_per_s, device.write_bytes_per_s))
        else:
            self._scan = None
            self._use.clear()
            self._own.clear()
        return series.disk_reader_series(disk, agent.read, others.read, others.write)

    def _agent_disk(self, pid: int, t: float) -> str:
        """The disk holding the file the agent reads with O_DIRECT, looked for again every LOOK_AGAIN_S
        while it has none open (it opens its expert store as it loads)."""
        if self._disk is None or self._disk[0] != pid or (self._disk[1] is None and t - self._disk[2] >= LOOK_AGAIN_S):
            self._disk = (pid, proc_io.direct_io_disk(pid), t)
        if self._disk[1] is None:
            raise SourceUnavailable(f"the agent (pid {pid}) has no file open with O_DIRECT (yet), so the disk "
                                    f"of its expert store is not known; looking again every {LOOK_AGAIN_S:.0f} s")
        return self._disk[1]

    def _users(self, agent: int, disk: str, t: float, device: proc_io.Io) -> list[tuple[int, str, float, float]]:
        """The top TOP_READERS processes besides the agent and the collector that read and wrote over
        READER_FLOOR since the last scan with a file open (or mapped) on `disk` for it (a read counts with
        a file it may read, a write with one it may write); none at the first scan. The candidates are
        found by their /proc/<pid>/io, then judged on their live threads' own I/O, which leaves out the
        children they reaped (a shell running dd after dd): a process new since the last scan did all of
        it in between; one older, first a candidate now, is judged from the next scan on. Reads (writes)
        over CHARGED times the disk's were not of this disk. Whether a process has a file there is looked
        at again every LOOK_AGAIN_S: a process that opened one after it was looked at (first using another
        disk), or a pid taken by another process, was judged by the first look for as long as others kept
        using the disk."""
        now = proc_io.all_io_bytes()
        previous, self._scan = self._scan, (t, now)
        if previous is None:
            return []
        dt = t - previous[0]
        rates = [(sum(n - p for n, p in zip(io, previous[1].get(pid, (0, 0)))) / dt, pid)
                 for pid, io in now.items() if pid not in (agent, os.getpid())]
        top, own = [], {}
        for rate, pid in sorted(rates, reverse=True):
            if rate < READER_FLOOR or len(top) == TOP_READERS:
                break
            if pid not in self._use or t - self._use[pid][1] >= LOOK_AGAIN_S:
                self._use[pid] = (proc_io.use_of(pid, disk), t)   # its fds and maps cost ~1 ms: not every tick
            use = self._use[pid][0]
            if not any(use):
                continue          # nothing on this disk: its threads are not worth reading
            try:
                own[pid] = proc_io.own_io_bytes(pid)
            except OSError:
                continue          # exited, or not ours
            before = self._own.get(pid, proc_io.Io(0, 0) if pid not in previous[1] else None)
            if before is None:
                continue
            read, write = (max(0, n - b) / dt for n, b in zip(own[pid], before))
            read = read if use.reads and read <= CHARGED * device.read else 0.0
            write = write if use.writes and write <= CHARGED * device.write else 0.0
            if read + write >= READER_FLOOR:
                top.append((pid, proc_io.process_name(pid), read, write))
        self._own = own
        return top


@dataclass
class PressureSampler:
    resource: str
    source: str = ""

    def __post_init__(self) -> None:
        self.source = f"{self.resource} pressure (/proc/pressure/{self.resource})"

    def sample(self, t: float) -> dict[str, float]:
        return series.psi_series(self.resource, pressure.read_psi(self.resource))


@dataclass
class NvmeSampler:
    controller: NvmeController
    status: SourceStatus
    source: str = ""

    def __post_init__(self) -> None:
        self.source = f"NVMe temperature of {self.controller.name}"

    def sample(self, t: float) -> dict[str, float]:
        smart_source = f"NVMe SMART / Health log of {self.controller.name} ({self.controller.devnode})"
        try:
            out = series.smart_series(self.controller.name, nvme.read_smart_log(self.controller.devnode))
            self.status.available(smart_source)
            return out
        except SourceUnavailable as e:
            self.status.unavailable(smart_source, f"{e}; falling back to the hwmon temperature")
        return series.hwmon_series(self.controller.name, nvme.hwmon_temperature_c(self.controller.sysfs))


@dataclass
class SelfSampler:
    source: str = "the collector's own CPU time"
    _previous: tuple[float, float] | None = None

    def sample(self, t: float) -> dict[str, float]:
        times = os.times()
        cpu = times.user + times.system
        previous, self._previous = self._previous, (t, cpu)
        return series.self_series((cpu - previous[1]) / (t - previous[0])) if previous else {}
