"""The edge device's memory in a benchmark: a cgroup memory limit around the agent, its peak RSS,
and a file dropped from the page cache so a run starts cold.

    cgroup = MemoryCgroup(device_memory(store, cap_bytes))   # .path None if the machine refuses
    cgroup.add(pid); ...; cgroup.peak(); cgroup.remove()
"""
from __future__ import annotations

import atexit
import math
import os
import signal
from pathlib import Path

from agent.experts.cap import MAX_MEMORY_SHARE, resident_bytes
from agent.experts.layout import DENSE, EXPERTS, INDEX, Index, drop_page_cache

WORKING_MEMORY = 1024 * 2**20   # python, torch, the policy's libraries, activations


def device_memory(store: Path, cap_bytes: int) -> int:
    """The edge device's memory for a run at `cap_bytes`: the cache, what the model keeps in RAM
    (dense weights, KV budget) and working memory, and at least what the 70% rule needs to allow the
    cap (slots + dense + KV within MAX_MEMORY_SHARE), in whole MiB."""
    model = resident_bytes(store, Index.load(store / INDEX))
    need = max(cap_bytes + model + WORKING_MEMORY, math.ceil((cap_bytes + model) / MAX_MEMORY_SHARE))
    return -(-need // 2**20) * 2**20


def interrupt_on_sigterm() -> None:
    """Make SIGTERM act like Ctrl-C, so a bench's `finally` blocks stop its processes and remove its cgroup."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)


class MemoryCgroup:
    """A child memory cgroup of this process's own (v2 memory.max, else v1 memory.limit_in_bytes)."""

    def __init__(self, limit: int, name: str = "") -> None:
        self.limit, self.path, self.kind, self.why_not = limit, None, None, ""
        interrupt_on_sigterm()   # a cgroup outlives a killed bench: its `finally` must run to remove it
        for kind, base, limit_file in self._candidates():
            path = base / (name or f"flashmoe-bench-{os.getpid()}")
            try:
                path.mkdir()
                (path / limit_file).write_text(str(limit))
            except OSError as exc:
                self.why_not += f"{kind} at {base}: {exc.strerror}; "
                if path.exists():
                    path.rmdir()
                continue
            self.path, self.kind, self._limit_file = path, kind, limit_file
            atexit.register(self.remove)   # also when SIGTERM lands before the bench's `try` is entered
            return

    def set_limit(self, limit: int) -> None:
        """Change the limit of a cgroup already in use (the kernel reclaims down to it, or refuses)."""
        (self.path / self._limit_file).write_text(str(limit))
        self.limit = limit

    @staticmethod
    def _candidates():
        """(kind, our own cgroup directory, limit file): v2 where it has the memory controller, then v1."""
        own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
        root = Path("/sys/fs/cgroup")
        for v2 in (root, root / "unified"):
            controllers = v2 / own.get("", "/").lstrip("/") / "cgroup.controllers"
            if controllers.exists() and "memory" in controllers.read_text().split():
                yield "v2", controllers.parent, "memory.max"
        if "memory" in own:
            yield "v1", root / "memory" / own["memory"].lstrip("/"), "memory.limit_in_bytes"

    def add(self, pid: int) -> None:
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(pid))

    def peak(self) -> int | None:
        if self.path is None:
            return None
        name = "memory.peak" if self.kind == "v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except OSError:
            return None

    def reset_peak(self) -> None:
        if self.kind == "v1":
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def remove(self) -> None:
        """Remove the cgroup (once its processes are gone); again is a no-op."""
        if self.path is not None and self.path.exists():
            self.path.rmdir()

    def describe(self) -> str:
        if self.path is None:
            return f"no cgroup memory limit ({self.why_not.strip('; ') or 'no memory controller'})"
        return f"cgroup {self.kind} memory limit {self.limit / 2**20:.0f} MiB at {self.path}"


def drop_stores_pages(*stores: Path) -> None:
    """Every store's expert file and dense weights out of the page cache: a run starts cold, and pages a
    run of another store left charged to the shared cgroup do not crowd it."""
    for store in stores:
        drop_page_cache(store / EXPERTS)
        drop_page_cache(store / DENSE)


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
