"""Block devices and NVMe controllers via pyudev, which disk holds a path, and hot-plug.

Attributes come from sysfs through pyudev (`size`, `queue/logical_block_size`, `device/model`,
`serial`); udev's database (ID_MODEL, ID_SERIAL) is used when present, which it is not in most
containers.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pyudev

log = logging.getLogger(__name__)
SECTOR = 512
VIRTUAL_PREFIXES = ("loop", "ram", "zram")    # memory- or file-backed: not a storage device


@dataclass(frozen=True)
class BlockDevice:
    name: str                   # vda, nvme0n1
    devnode: str | None         # /dev/vda
    major: int
    minor: int
    model: str
    serial: str
    size_bytes: int
    logical_block_size: int
    rotational: bool
    controller: str | None      # nvme0 for nvme0n1, else None

    def describe(self) -> str:
        size_gb = self.size_bytes / 1e9
        return (f"{self.name} ({self.model or 'unknown model'}, serial {self.serial or 'unknown'}, "
                f"{size_gb:.1f} GB, {self.logical_block_size}-byte blocks)")


@dataclass(frozen=True)
class NvmeController:
    name: str                   # nvme0
    devnode: str                # /dev/nvme0 (admin commands go here)
    sysfs: Path
    model: str
    serial: str
    firmware: str


def _attr(device: pyudev.Device, name: str) -> str:
    try:
        value = device.attributes.get(name)
    except (OSError, KeyError):
        return ""
    return value.decode(errors="replace").strip() if value else ""


def _block_device(device: pyudev.Device) -> BlockDevice:
    props = device.properties
    parent = device.find_parent("nvme")
    model = props.get("ID_MODEL") or _attr(device, "device/model") or (_attr(parent, "model") if parent else "")
    serial = (props.get("ID_SERIAL_SHORT") or _attr(device, "serial") or _attr(device, "device/serial")
              or (_attr(parent, "serial") if parent else ""))
    size = _attr(device, "size")
    block_size = _attr(device, "queue/logical_block_size")
    return BlockDevice(
        name=device.sys_name, devnode=device.device_node,
        major=os.major(device.device_number), minor=os.minor(device.device_number),
        model=model, serial=serial, size_bytes=int(size or 0) * SECTOR,
        logical_block_size=int(block_size or SECTOR),
        rotational=_attr(device, "queue/rotational") == "1",
        controller=parent.sys_name if parent is not None else None)


def block_devices(context: pyudev.Context, include_virtual: bool = False) -> list[BlockDevice]:
    """Whole disks (no partitions), sorted by name; loop/ram/zram only if asked."""
    disks = [_block_device(d) for d in context.list_devices(subsystem="block", DEVTYPE="disk")]
    return sorted((d for d in disks if include_virtual or not d.name.startswith(VIRTUAL_PREFIXES)),
                  key=lambda d: d.name)


def nvme_controllers(context: pyudev.Context) -> list[NvmeController]:
    """NVMe controllers (class nvme), sorted by name."""
    out = []
    for device in context.list_devices(subsystem="nvme"):
        if not device.sys_name.startswith("nvme") or device.device_node is None:
            continue
        out.append(NvmeController(device.sys_name, device.device_node, Path(device.sys_path),
                                  _attr(device, "model"), _attr(device, "serial"),
                                  _attr(device, "firmware_rev")))
    return sorted(out, key=lambda c: c.name)


def disk_holding(path: str | os.PathLike[str], context: pyudev.Context) -> BlockDevice:
    """The whole disk that holds `path`: its st_dev (major:minor) as a block device, and a
    partition's parent disk. Raises ValueError if the path is on no block device (tmpfs, overlay
    of a pseudo device...)."""
    st_dev = os.stat(path).st_dev
    try:
        device = pyudev.Devices.from_device_number(context, "block", st_dev)
    except pyudev.DeviceNotFoundError:
        raise ValueError(f"{path} is on device {os.major(st_dev)}:{os.minor(st_dev)}, which is not a "
                         f"block device (tmpfs, overlayfs or a network filesystem?)") from None
    if device.device_type == "partition":
        device = device.find_parent("block", "disk")
    return _block_device(device)


@dataclass(frozen=True)
class Hotplug:
    action: str      # add, remove, change...
    subsystem: str
    name: str


class HotplugWatcher:
    """A udev monitor for block and nvme devices, polled without blocking."""

    def __init__(self, context: pyudev.Context) -> None:
        self.monitor = pyudev.Monitor.from_netlink(context, source="kernel")
        self.monitor.filter_by("block")
        self.monitor.filter_by("nvme")
        self.monitor.start()

    def poll(self) -> list[Hotplug]:
        """Events that arrived since the last poll (never waits)."""
        events = []
        while (device := self.monitor.poll(timeout=0)) is not None:
            events.append(Hotplug(device.action or "change", device.subsystem, device.sys_name))
        return events

    def fileno(self) -> int:
        return self.monitor.fileno()
