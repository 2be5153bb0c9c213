"""A process's memory cgroup: where it is, its memory limit, and what memory.stat says of its paging.

Both hierarchies: cgroup v1's memory controller (mounted at /sys/fs/cgroup/memory) and cgroup v2
(/sys/fs/cgroup, or /sys/fs/cgroup/unified where v1 and v2 are mounted side by side). A
container may mount its own cgroup as the root while /proc/<pid>/cgroup names the host's full
path, so leading parts of that path that do not exist under the mount are skipped.

Counters are the cgroup's own, not its descendants': in v1 memory.stat's unprefixed lines (the
total_* ones add the children), in v2 memory.stat as it is (a v2 cgroup that holds processes has
no children with memory of their own). So a child cgroup thrashing under the agent's does not count
as the agent's.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from machine.memory import parse_vmstat
from machine.pressure import parse_psi
from machine.sources import SourceUnavailable

ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 2**60              # v1 says "no limit" with a huge page-rounded number, v2 with "max"
COUNTERS = ("pgmajfault", "workingset_refault_file", "workingset_refault_anon")


def own_paths(text: str) -> dict[str, str]:
    """/proc/<pid>/cgroup's `id:controllers:path` lines as {controllers: path} ("" is the v2 hierarchy)."""
    paths = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        paths[controllers] = path
    return paths


def chain(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory under `mount`, then each parent up to `mount` itself."""
    parts = [p for p in path.split("/") if p]
    here = next((mount.joinpath(*parts[i:]) for i in range(len(parts)) if mount.joinpath(*parts[i:]).is_dir()), mount)
    out = [here]
    while out[-1] != mount:
        out.append(out[-1].parent)
    return out


def _v2_mount(root: Path) -> Path | None:
    return next((m for m in (root, root / "unified") if (m / "cgroup.controllers").exists()), None)


def _hierarchies(own: Mapping[str, str], root: Path) -> list[tuple[str, Path, str]]:
    """(version, mount, the process's path under it) for each hierarchy with a memory controller."""
    found = []
    v2 = _v2_mount(root)
    if "" in own and v2 is not None and "memory" in (v2 / "cgroup.controllers").read_text().split():
        found.append(("v2", v2, own[""]))
    if "memory" in own and (root / "memory").is_dir():
        found.append(("v1", root / "memory", own["memory"]))
    return found


def limits(own: Mapping[str, str], root: Path = ROOT) -> list[int]:
    """Every memory limit set on the process's cgroups and their ancestors (v2 memory.max, v1
    memory.limit_in_bytes). A limit file that exists but cannot be read raises OSError: under memory
    pressure the read itself can fail (ENOMEM), and a limit not read is not the absence of one."""
    out = []
    for version, mount, path in _hierarchies(own, root):
        name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
        for directory in chain(mount, path):
            try:
                value = (directory / name).read_text().strip()
            except FileNotFoundError:      # a level without the file (e.g. the v2 root)
                continue
            if value.isdigit() and int(value) < NO_LIMIT:
                out.append(int(value))
    return out


def memory_limit(pid: int | str = "self", root: Path = ROOT) -> int | None:
    """The tightest memory limit on the process's cgroups and their ancestors, or None without one (or
    without the process). OSError when a cgroup file that is there cannot be read (see `limits`)."""
    try:
        own = own_paths(Path(f"/proc/{pid}/cgroup").read_text())
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    return min(limits(own, root), default=None)


@dataclass(frozen=True)
class MemoryReading:
    usage_bytes: int
    limit_bytes: int | None
    counters: dict[str, int]              # COUNTERS, cumulative
    psi: dict[str, dict[str, float]] | None   # memory.pressure of a v2 cgroup


@dataclass(frozen=True)
class MemoryCgroup:
    """One process's memory cgroup in the hierarchy that controls its memory."""
    version: str              # "v1" or "v2"
    path: str                 # as /proc/<pid>/cgroup names it
    directory: Path
    own: dict[str, str]       # the process's paths in every hierarchy, for its limits
    root: Path

    def read(self) -> MemoryReading:
        stat = parse_vmstat((self.directory / "memory.stat").read_text())
        usage = "memory.current" if self.version == "v2" else "memory.usage_in_bytes"
        return MemoryReading(int((self.directory / usage).read_text()), min(limits(self.own, self.root), default=None),
                             {name: stat[name] for name in COUNTERS if name in stat}, self._pressure())

    def others(self, pid: int) -> int:
        """Processes in this cgroup other than `pid` and its descendants (e.g. the agent's online
        learner): with any, the cgroup's counters are not the agent's alone."""
        procs = [int(p) for p in (self.directory / "cgroup.procs").read_text().split()]
        mine = _descent(procs, pid)
        return sum(1 for p in procs if not mine[p])

    def _pressure(self) -> dict[str, dict[str, float]] | None:
        """The cgroup's memory.pressure (cgroup v2 keeps one per cgroup, whether or not its memory
        controller is on; in a v1 setup the unified hierarchy's copy), unless it is the root's,
        which is the machine's own /proc/pressure/memory."""
        mount, path = _v2_mount(self.root), self.own.get("", "/")
        directory = chain(mount, path)[0] if mount is not None else None
        if directory is None or directory == mount:
            return None
        try:
            return parse_psi((directory / "memory.pressure").read_text())
        except OSError:
            return None


def parent(pid: int) -> int | None:
    """The parent of process `pid` (/proc/<pid>/stat's fourth field), None once it has exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])   # the name in parentheses may hold spaces


def _descent(procs: list[int], ancestor: int) -> dict[int | None, bool]:
    """Whether each of `procs` is `ancestor` or descends from it, reading each process's parent once
    (the chains of a cgroup's processes share most of their ancestors)."""
    known: dict[int | None, bool] = {ancestor: True, None: False, 0: False}
    for p in procs:
        chain = []
        while p not in known:
            chain.append(p)
            p = parent(p)
        known.update(dict.fromkeys(chain, known[p]))
    return known


def memory_cgroup(pid: int, root: Path = ROOT) -> MemoryCgroup:
    """The memory cgroup of process `pid` (see locate)."""
    try:
        return locate(own_paths(Path(f"/proc/{pid}/cgroup").read_text()), root)
    except FileNotFoundError:
        raise SourceUnavailable(f"process {pid} exited") from None


def locate(own: Mapping[str, str], root: Path = ROOT) -> MemoryCgroup:
    """The memory cgroup of a process in the cgroups `own`; SourceUnavailable when it has none of its
    own (no memory controller mounted, or the root cgroup, whose counters are the machine's)."""
    found = _hierarchies(own, root)
    if not found:
        raise SourceUnavailable(f"no cgroup memory controller is mounted under {root}")
    version, mount, path = found[0]
    if path == "/":
        raise SourceUnavailable("the process is in the root memory cgroup, whose counters are the machine's "
                                "(sampled as vm.* and psi.*)")
    return MemoryCgroup(version, path, chain(mount, path)[0], dict(own), root)
