"""Who uses a disk: each process's /proc/<pid>/io read_bytes and write_bytes, its name, and the disks
its files are on.

read_bytes (proc(5)) counts the bytes a process caused to be fetched from storage: O_DIRECT reads, the
readahead it triggered and the page faults of its file mappings included (the faulting task submits
the read), page-cache hits not. write_bytes counts the bytes it caused to be sent to storage: its
O_DIRECT writes, and the pages it dirtied (written back later, by the kernel's flusher). Both are the
process's whole, threads included, on every device at once. The disk a process uses is told by its
open files (a regular file's st_dev, a block device's st_rdev, a partition taken as its whole disk,
/sys/dev/block) and by the data files it has mapped (/proc/<pid>/maps: a mapping outlives the
descriptor it was made from, as safetensors' mmap does). Another user's /proc/<pid>/io needs root
(ptrace read access); such processes are skipped.
"""
from __future__ import annotations

import os
import stat
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")
READ_BYTES = b"\nread_bytes: "
WRITE_BYTES = b"\nwrite_bytes: "
LOCALES = "/usr/lib/locale/"     # mapped by every program that sets its locale: read at start, like code


class Io(NamedTuple):
    """A process's read_bytes and write_bytes, or their rates per second."""
    read: float
    write: float


def _field(data: bytes, key: bytes) -> int:
    i = data.find(key)
    if i < 0:
        raise ValueError(f"no {key.strip().decode()} in /proc/<pid>/io: {data[:200]!r}")
    start = i + len(key)
    return int(data[start:data.index(b"\n", start)])


def parse_io(data: bytes) -> Io:
    """read_bytes and write_bytes of a /proc/<pid>/io file's contents."""
    return Io(_field(data, READ_BYTES), _field(data, WRITE_BYTES))


def _read_io(path: str) -> Io:
    """Plain os calls on a str path: pathlib and buffered files were half of a scan's ~1.5 ms."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return parse_io(os.read(fd, 4096))
    finally:
        os.close(fd)


def io_bytes(pid: int, proc: Path = PROC) -> Io:
    """One process's read_bytes and write_bytes: its threads', those of its threads that exited and those of
    the children it reaped (proc(5)); FileNotFoundError once it has exited, PermissionError if not ours."""
    return _read_io(f"{proc}/{pid}/io")


def own_io_bytes(pid: int, proc: Path = PROC) -> Io:
    """The read_bytes and write_bytes of `pid`'s live threads alone (/proc/<pid>/task/<tid>/io): not what
    its reaped children did, which a shell running reader after reader is charged in lumps as each one
    exits. FileNotFoundError once it has exited."""
    read = write = 0
    for tid in os.listdir(f"{proc}/{pid}/task"):
        try:
            io = _read_io(f"{proc}/{pid}/task/{tid}/io")
        except FileNotFoundError:
            continue              # the thread exited meanwhile
        read, write = read + io.read, write + io.write
    return Io(read, write)


def all_io_bytes(proc: Path = PROC) -> dict[int, Io]:
    """read_bytes and write_bytes of every process this user may read, by pid (those that exit meanwhile
    are left out)."""
    out = {}
    for name in os.listdir(proc):
        if name.isdigit():
            try:
                out[int(name)] = io_bytes(int(name), proc)
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


def _mapped_data(pid: int, proc: Path = PROC):
    """(disk, writes) of each file `pid` has mapped that is data, not code (no executable mapping of it: a
    library or a program is read once at start) nor locales; `writes` when a mapping of it is shared and
    writable."""
    try:
        lines = (proc / str(pid) / "maps").read_text().splitlines()
    except OSError:
        return
    files: dict[tuple[str, str], list[str]] = {}
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and not fields[5].startswith(LOCALES):   # a file
            files.setdefault((fields[3], fields[4]), []).append(fields[1])
    for (dev, _), perms in files.items():
        if not any("x" in p for p in perms):
            major, minor = (int(part, 16) for part in dev.split(":"))
            if (disk := disk_of(os.makedev(major, minor))) is not None:
                yield disk, any(p[1] == "w" and p[3] == "s" for p in perms)


class Use(NamedTuple):
    """How a process may use a disk: whether its read_bytes and its write_bytes can be of that disk."""
    reads: bool
    writes: bool


def use_of(pid: int, disk: str, proc: Path = PROC) -> Use:
    """Whether `pid` has a file on `disk` open (or a data file mapped) for reading, and for writing. A file
    only written is not read: a shell that reaps reader after reader is charged their read_bytes
    (proc(5)) but reads nothing itself, and only writes its log."""
    reads = writes = False
    for fd, on in _fds_on(pid, proc):
        if on == disk:
            mode = _flags(pid, fd, proc) & os.O_ACCMODE
            reads, writes = reads or mode != os.O_WRONLY, writes or mode != os.O_RDONLY
    for on, shared_writes in _mapped_data(pid, proc):
        if on == disk:
            reads, writes = True, writes or shared_writes
    return Use(reads, writes)


def direct_io_disk(pid: int, proc: Path = PROC) -> str | None:
    """The disk of a file `pid` has open with O_DIRECT (the agent's expert store), or None."""
    return next((disk for fd, disk in _fds_on(pid, proc) if _flags(pid, fd, proc) & os.O_DIRECT), None)
