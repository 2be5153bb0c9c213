"""Memory: /proc/meminfo, /proc/vmstat, and the agent process's /proc/<pid>/status and stat."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

KIB = 1024
MEMINFO_SERIES = {"MemTotal": "mem.total_bytes", "MemAvailable": "mem.available_bytes",
                  "MemFree": "mem.free_bytes", "Cached": "mem.cached_bytes", "Dirty": "mem.dirty_bytes"}
STATUS_SERIES = {"VmRSS": "mem.agent.rss_bytes", "VmHWM": "mem.agent.hwm_bytes",
                 "RssAnon": "mem.agent.rss_anon_bytes", "RssFile": "mem.agent.rss_file_bytes",
                 "VmSwap": "mem.agent.swap_bytes"}
VMSTAT_RATES = {"pgmajfault": "vm.pgmajfault_per_s",
                "workingset_refault_anon": "vm.workingset_refault_anon_per_s",
                "workingset_refault_file": "vm.workingset_refault_file_per_s"}


def parse_kib_table(text: str) -> dict[str, int]:
    """`Key:   123 kB` lines (meminfo, /proc/<pid>/status) as bytes; lines without kB are skipped."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * KIB
    return out


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


def meminfo_series(meminfo: dict[str, int]) -> dict[str, float]:
    series = {name: meminfo[key] for key, name in MEMINFO_SERIES.items() if key in meminfo}
    if "SwapTotal" in meminfo and "SwapFree" in meminfo:
        series["mem.swap_used_bytes"] = meminfo["SwapTotal"] - meminfo["SwapFree"]
    return series


def status_series(status: dict[str, int]) -> dict[str, float]:
    return {name: status[key] for key, name in STATUS_SERIES.items() if key in status}


def rates(previous: dict[str, int], current: dict[str, int], dt: float,
          names: dict[str, str]) -> dict[str, float]:
    """Per-second increases of the counters in `names` present in both readings."""
    return {series: max(0, current[key] - previous[key]) / dt
            for key, series in names.items() if key in previous and key in current}


def fault_series(previous: Faults, current: Faults) -> dict[str, float]:
    dt = current.t - previous.t
    return {"mem.agent.minflt_per_s": max(0, current.minflt - previous.minflt) / dt,
            "mem.agent.majflt_per_s": max(0, current.majflt - previous.majflt) / dt}


def read_pid_file(path: Path) -> int | None:
    """The pid in the file if that process is alive, else None (no file, garbage, or gone)."""
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and Path(f"/proc/{pid}/stat").exists() and _alive(pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True          # exists, owned by someone else
    state = Path(f"/proc/{pid}/stat").read_text()
    return state[state.rindex(")") + 2] != "Z"
