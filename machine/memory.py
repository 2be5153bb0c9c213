"""Memory: /proc/meminfo, /proc/vmstat, a process's /proc/<pid>/status and stat, and pid files."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

KIB = 1024
SHORT_SHARE = 0.10    # below this share of its memory available, the machine as a whole is short of memory


def parse_kib_table(text: str) -> dict[str, int]:
    """`Key:   123 kB` lines (meminfo, /proc/<pid>/status) as bytes; lines without kB are skipped."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * KIB
    return out


def available_share(meminfo: dict[str, int]) -> float:
    """MemAvailable over MemTotal of a parsed /proc/meminfo."""
    return meminfo["MemAvailable"] / meminfo["MemTotal"]


def parse_vmstat(text: str) -> dict[str, int]:
    """/proc/vmstat `name value` lines."""
    return {name: int(value) for name, value in (line.split() for line in text.splitlines() if line)}


@dataclass(frozen=True)
class Faults:
    """Cumulative page faults of one process at monotonic time t."""
    t: float
    minflt: int
    majflt: int


def parse_proc_stat(text: str, t: float) -> Faults:
    """/proc/<pid>/stat: fields after the parenthesised comm (which may hold spaces and ')');
    minflt is field 10 and majflt field 12 (1-based, proc(5))."""
    rest = text[text.rindex(")") + 2:].split()
    return Faults(t, int(rest[10 - 3]), int(rest[12 - 3]))










def read_pid_file(path: Path) -> int | None:
    """The pid in the file if that process is alive and was running when the file was written, else None
    (no file, garbage, gone, or a later process given the pid: after a reboot or a SIGKILL the file
    stays, and the pid it names may be any process's by now)."""
    try:
        written = path.stat().st_mtime
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and alive(pid) and not started_after(pid, written) else None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (ended, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    except PermissionError:
        return True          # exists, owned by someone else
    return state[state.rindex(")") + 2] != "Z"


def started_after(pid: int, t: float) -> bool:
    """Whether process `pid` started after wall-clock time `t` (false if that cannot be read). Its start is
    field 22 of /proc/<pid>/stat, in clock ticks after boot; /proc/stat's btime is the boot in whole
    seconds, so a second's slack."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration):
        return False
    ticks = int(stat[stat.rindex(")") + 2:].split()[22 - 3])
    return boot + ticks / os.sysconf("SC_CLK_TCK") > t + 1.0
