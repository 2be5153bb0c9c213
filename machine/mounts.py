"""Which mount holds a path, from /proc/self/mountinfo (proc(5)): its filesystem type and whether
it is read-only, so that a file that cannot be written is explained by where it is."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# Kernel filesystems whose files are the kernel's interfaces: no ordinary file can be created there.
KERNEL_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
                                "configfs", "bpf", "pstore", "efivarfs", "fusectl", "binfmt_misc"})


@dataclass(frozen=True)
class Mount:
    point: Path
    fstype: str
    read_only: bool

    @property
    def is_kernel_interface(self) -> bool:
        return self.fstype in KERNEL_FILESYSTEMS


def _unescape(field: str) -> str:
    """Mount points escape space, tab, newline and backslash as octal (\\040...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """`36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue` lines,
    in mount order. Read-only if the mount or its superblock says `ro`."""
    mounts = []
    for line in text.splitlines():
        head, _, tail = line.partition(" - ")
        fields, super_fields = head.split(), tail.split()
        if len(fields) < 6 or len(super_fields) < 3:
            continue
        options = set(fields[5].split(",")) | set(super_fields[2].split(","))
        mounts.append(Mount(Path(_unescape(fields[4])), super_fields[0], "ro" in options))
    return mounts


def mount_of(path: str | Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> Mount | None:
    """The mount that holds `path` (or, for a path not created yet, its nearest existing parent);
    None if mountinfo cannot be read."""
    try:
        mounts = parse_mountinfo(mountinfo.read_text())
    except OSError:
        return None
    target = Path(path).absolute()
    while not target.exists() and target != target.parent:
        target = target.parent
    target = target.resolve()
    best = None
    for mount in mounts:   # the deepest mount point holding the path; of equals the last (an over-mount)
        if (target == mount.point or mount.point in target.parents) and \
                (best is None or len(mount.point.parts) >= len(best.point.parts)):
            best = mount
    return best
