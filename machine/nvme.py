"""NVMe health: the SMART / Health Information log page (Log Identifier 02h, 512 bytes).

Read through the admin passthrough ioctl (NVME_IOCTL_ADMIN_CMD with a Get Log Page command), which
needs CAP_SYS_ADMIN and an NVMe character device (/dev/nvmeN). Without either, only the
controller's hwmon temperature (sysfs, readable by anyone) is available. Field offsets follow the
NVMe Base Specification 2.0, figure "SMART / Health Information Log Page".
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from machine.sources import SourceUnavailable

LOG_SIZE = 512
KELVIN = 273.15
DATA_UNIT_BYTES = 512_000          # "data units" are thousands of 512-byte units
GET_LOG_PAGE = 0x02
SMART_LOG_ID = 0x02
NSID_ALL = 0xFFFFFFFF

CRITICAL_WARNING_BITS = {
    0: "available spare below threshold",
    1: "temperature above an over- or below an under-temperature threshold",
    2: "NVM subsystem reliability degraded (media or internal errors)",
    3: "media placed in read-only mode",
    4: "volatile memory backup device failed",
    5: "persistent memory region read-only or unreliable",
}


class NvmeAdminCmd(ctypes.Structure):
    """struct nvme_admin_cmd (= nvme_passthru_cmd) from <linux/nvme_ioctl.h>, 72 bytes."""
    _fields_ = [("opcode", ctypes.c_uint8), ("flags", ctypes.c_uint8), ("rsvd1", ctypes.c_uint16),
                ("nsid", ctypes.c_uint32), ("cdw2", ctypes.c_uint32), ("cdw3", ctypes.c_uint32),
                ("metadata", ctypes.c_uint64), ("addr", ctypes.c_uint64),
                ("metadata_len", ctypes.c_uint32), ("data_len", ctypes.c_uint32),
                ("cdw10", ctypes.c_uint32), ("cdw11", ctypes.c_uint32), ("cdw12", ctypes.c_uint32),
                ("cdw13", ctypes.c_uint32), ("cdw14", ctypes.c_uint32), ("cdw15", ctypes.c_uint32),
                ("timeout_ms", ctypes.c_uint32), ("result", ctypes.c_uint32)]


def _iowr(kind: str, number: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord(kind) << 8) | number


NVME_IOCTL_ADMIN_CMD = _iowr("N", 0x41, ctypes.sizeof(NvmeAdminCmd))   # 0xC0484E41


@dataclass(frozen=True)
class SmartLog:
    """Every field of the SMART / Health Information log, in base units where the spec has one."""
    critical_warning: int
    composite_temperature_k: int
    available_spare_pct: int
    available_spare_threshold_pct: int
    percentage_used: int
    endurance_group_critical_warning: int
    data_units_read: int
    data_units_written: int
    host_read_commands: int
    host_write_commands: int
    controller_busy_time_min: int
    power_cycles: int
    power_on_hours: int
    unsafe_shutdowns: int
    media_errors: int
    error_log_entries: int
    warning_temperature_time_min: int
    critical_temperature_time_min: int
    temperature_sensors_k: tuple[int | None, ...]     # sensors 1..8; None = not implemented
    thermal_mgmt_t1_transitions: int
    thermal_mgmt_t2_transitions: int
    thermal_mgmt_t1_total_s: int
    thermal_mgmt_t2_total_s: int

    @property
    def composite_temperature_c(self) -> float:
        return self.composite_temperature_k - KELVIN

    @property
    def data_read_bytes(self) -> int:
        return self.data_units_read * DATA_UNIT_BYTES

    @property
    def data_written_bytes(self) -> int:
        return self.data_units_written * DATA_UNIT_BYTES

    @property
    def warnings(self) -> list[str]:
        """The critical warning bits that are set, in words."""
        return [text for bit, text in CRITICAL_WARNING_BITS.items() if self.critical_warning >> bit & 1]


def _u(log: bytes, offset: int, size: int) -> int:
    return int.from_bytes(log[offset:offset + size], "little")


def parse_smart_log(log: bytes) -> SmartLog:
    """Parse the 512-byte log page; integers are little-endian, counters up to 128 bits."""
    if len(log) != LOG_SIZE:
        raise ValueError(f"SMART / Health log must be {LOG_SIZE} bytes, got {len(log)}")
    sensors = tuple(_u(log, 200 + 2 * i, 2) or None for i in range(8))
    return SmartLog(
        critical_warning=log[0], composite_temperature_k=_u(log, 1, 2),
        available_spare_pct=log[3], available_spare_threshold_pct=log[4], percentage_used=log[5],
        endurance_group_critical_warning=log[6],
        data_units_read=_u(log, 32, 16), data_units_written=_u(log, 48, 16),
        host_read_commands=_u(log, 64, 16), host_write_commands=_u(log, 80, 16),
        controller_busy_time_min=_u(log, 96, 16), power_cycles=_u(log, 112, 16),
        power_on_hours=_u(log, 128, 16), unsafe_shutdowns=_u(log, 144, 16),
        media_errors=_u(log, 160, 16), error_log_entries=_u(log, 176, 16),
        warning_temperature_time_min=_u(log, 192, 4), critical_temperature_time_min=_u(log, 196, 4),
        temperature_sensors_k=sensors,
        thermal_mgmt_t1_transitions=_u(log, 216, 4), thermal_mgmt_t2_transitions=_u(log, 220, 4),
        thermal_mgmt_t1_total_s=_u(log, 224, 4), thermal_mgmt_t2_total_s=_u(log, 228, 4))


def get_log_page_cmd(buffer: ctypes.Array, log_id: int = SMART_LOG_ID) -> NvmeAdminCmd:
    """The Get Log Page admin command filling `buffer` (NUMDL = dwords - 1, 0's based)."""
    numd = len(buffer) // 4 - 1
    return NvmeAdminCmd(opcode=GET_LOG_PAGE, nsid=NSID_ALL, addr=ctypes.addressof(buffer),
                        data_len=len(buffer), cdw10=(numd & 0xFFFF) << 16 | log_id,
                        cdw11=numd >> 16)


def read_smart_log(device: str | Path) -> SmartLog:
    """Read and parse the log from /dev/nvmeN; raises SourceUnavailable saying why it cannot."""
    buffer = ctypes.create_string_buffer(LOG_SIZE)
    cmd = get_log_page_cmd(buffer)
    try:
        fd = os.open(device, os.O_RDONLY)
    except FileNotFoundError:
        raise SourceUnavailable(f"{device} does not exist (no NVMe character device)") from None
    except PermissionError:
        raise SourceUnavailable(f"cannot open {device}: run the collector as root or give it "
                                f"CAP_SYS_ADMIN to read the SMART log") from None
    try:
        status = fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, cmd)
    except OSError as e:
        hint = ("needs CAP_SYS_ADMIN" if e.errno in (errno.EPERM, errno.EACCES)
                else "the device does not accept NVMe admin commands")
        raise SourceUnavailable(f"Get Log Page 02h on {device} failed: {e.strerror} ({hint})") from None
    finally:
        os.close(fd)
    if status != 0:
        raise SourceUnavailable(f"Get Log Page 02h on {device} returned NVMe status {status:#x}")
    return parse_smart_log(buffer.raw)


def hwmon_temperature_c(controller_sysfs: Path) -> float:
    """The controller's composite temperature from its hwmon node (temp1_input, millidegrees)."""
    for node in sorted(controller_sysfs.glob("hwmon*/temp1_input")) + sorted(
            controller_sysfs.glob("device/hwmon/hwmon*/temp1_input")):
        return int(node.read_text()) / 1000.0
    raise SourceUnavailable(f"{controller_sysfs} has no hwmon temperature (kernel without "
                            f"CONFIG_NVME_HWMON)")
