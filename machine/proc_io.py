"""Who reads a disk: each process's /proc/<pid>/io read_bytes, its name, and the disks its files are on.

read_bytes (proc(5)) counts the bytes a process caused to be fetched from storage, O_DIRECT reads
and the readahead it triggered included, page-cache hits not; it is the process's whole, threads
included, on every device at once. The disk a process reads is told by its open files: a regular
file's st_dev, a block device's st_rdev, a partition taken as its whole disk (/sys/dev/block).
Another user's /proc/<pid>/io needs root (ptrace read access); such processes are skipped.
"""
from __future__ import annotations

import os
import stat
from functools import lru_cache
from pathlib import Path

PROC = Path("/proc")
READ_BYTES = b"\nread_bytes: "


def parse_read_bytes(data: bytes) -> int:
    """read_bytes of a /proc/<pid>/io file's contents."""
    i = data.find(READ_BYTES)
    if i < 0:
        raise ValueError(f"no read_bytes in /proc/<pid>/io: {data[:200]!r}")
    start = i + len(READ_BYTES)
    return int(data[start:data.index(b"\n", start)])


def read_bytes(pid: int, proc: Path = PROC) -> int:
    """One process's read_bytes; FileNotFoundError once it has exited, PermissionError if not ours.
    Plain os calls on a str path: pathlib and buffered files were half of a scan's ~1.5 ms."""
    fd = os.open(f"{proc}/{pid}/io", os.O_RDONLY)
    try:
        return parse_read_bytes(os.read(fd, 4096))
    finally:
        os.close(fd)


def all_read_bytes(proc: Path = PROC) -> dict[int, int]:
    """read_bytes of every process this user may read, by pid (those that exit meanwhile are left out)."""
    out = {}
    for name in os.listdir(proc):
        if name.isdigit():
            try:
                out[int(name)] = read_bytes(int(name), proc)
            except (OSError, ValueError):
                continue
    return out


def process_name(pid: int, proc: Path = PROC) -> str:
    """The process's command name (comm), or "?" once it has exited. Any process sets its own (prctl
    PR_SET_NAME) to any bytes: those that are not printable UTF-8 are shown escaped (\\xff, \\x1b), as they
    would otherwise fail the reading or reach a terminal (escape sequences) and the store."""
    try:
        raw = (proc / str(pid) / "comm").read_bytes().removesuffix(b"\n")
    except OSError:
        return "?"
    return printable(raw.decode(errors="backslashreplace"))


def printable(text: str) -> str:
    """`text` with what is not printable escaped (\\x1b, \\u202e): a name a process chose, safe to show."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


@lru_cache(maxsize=64)
def disk_of(devnum: int, sys_dev_block: Path = Path("/sys/dev/block")) -> str | None:
    """The whole disk (its /sys/block name) of a block device number; a partition's parent disk; None
    for a number that is no block device (tmpfs, overlayfs, a pipe's)."""
    node = sys_dev_block / f"{os.major(devnum)}:{os.minor(devnum)}"
    if not node.exists():
        return None
    path = node.resolve()
    return path.parent.name if (path / "partition").exists() else path.name


def _file_devnum(path: Path) -> int | None:
    """The device an open file's reads go to: a block device's own number, a file's filesystem's."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev


def _flags(pid: int, fd: str, proc: Path = PROC) -> int:
    """An open descriptor's open flags (fdinfo's octal `flags:`); 0 once it is closed."""
    try:
        info = (proc / str(pid) / "fdinfo" / fd).read_text()
    except OSError:
        return 0
    return next((int(line.split()[1], 8) for line in info.splitlines() if line.startswith("flags:")), 0)


def _fds_on(pid: int, proc: Path = PROC):
    """(descriptor, disk) of each open file of `pid` on a disk; nothing once it has exited or if not ours."""
    try:
        fds = os.listdir(proc / str(pid) / "fd")
    except OSError:
        return
    for fd in fds:
        devnum = _file_devnum(proc / str(pid) / "fd" / fd)
        if devnum is not None and (disk := disk_of(devnum)) is not None:
            yield fd, disk


def reads_disk(pid: int, disk: str, proc: Path = PROC) -> bool:
    """Whether `pid` has a file on `disk` open for reading. Not one it only writes: a shell that reaps
    reader after reader is charged their read_bytes (proc(5)), but reads nothing itself."""
    return any(on == disk and _flags(pid, fd, proc) & os.O_ACCMODE != os.O_WRONLY for fd, on in _fds_on(pid, proc))


def direct_io_disk(pid: int, proc: Path = PROC) -> str | None:
    """The disk of a file `pid` has open with O_DIRECT (the agent's expert store), or None."""
    return next((disk for fd, disk in _fds_on(pid, proc) if _flags(pid, fd, proc) & os.O_DIRECT), None)
