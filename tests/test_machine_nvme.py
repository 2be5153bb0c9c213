"""The SMART / Health log parser on logs built byte by byte per the NVMe spec, and the ioctl."""
import ctypes
import struct

import pytest

from collector import series
from machine import nvme
from machine.sources import SourceUnavailable

U128 = (1 << 128) - 1


def build_log(**fields) -> bytes:
    """A 512-byte log page with the given fields at their spec offsets (little-endian)."""
    log = bytearray(512)
    layout = {"critical_warning": (0, 1), "temperature_k": (1, 2), "spare": (3, 1),
              "spare_threshold": (4, 1), "used": (5, 1), "eg_warning": (6, 1),
              "units_read": (32, 16), "units_written": (48, 16), "host_reads": (64, 16),
              "host_writes": (80, 16), "busy_min": (96, 16), "power_cycles": (112, 16),
              "power_on_hours": (128, 16), "unsafe": (144, 16), "media_errors": (160, 16),
              "error_entries": (176, 16), "warn_min": (192, 4), "crit_min": (196, 4),
              "tmt1_count": (216, 4), "tmt2_count": (220, 4), "tmt1_s": (224, 4), "tmt2_s": (228, 4)}
    for name, value in fields.items():
        if name == "sensors":
            for i, kelvin in enumerate(value):
                log[200 + 2 * i:202 + 2 * i] = struct.pack("<H", kelvin)
            continue
        offset, size = layout[name]
        log[offset:offset + size] = value.to_bytes(size, "little")
    return bytes(log)


def test_every_field_is_read_from_its_offset():
    log = nvme.parse_smart_log(build_log(
        critical_warning=0b100101, temperature_k=318, spare=97, spare_threshold=10, used=3,
        eg_warning=0b1, units_read=1_234_567, units_written=U128, host_reads=2**64 + 5,
        host_writes=77, busy_min=1440, power_cycles=12, power_on_hours=8760, unsafe=4,
        media_errors=2, error_entries=(1 << 100) + 1, warn_min=15, crit_min=1,
        sensors=[320, 0, 330, 0, 0, 0, 0, 273], tmt1_count=6, tmt2_count=7, tmt1_s=600, tmt2_s=30))
    assert log.critical_warning == 0b100101
    assert log.warnings == [nvme.CRITICAL_WARNING_BITS[0], nvme.CRITICAL_WARNING_BITS[2],
                            nvme.CRITICAL_WARNING_BITS[5]]
    assert log.composite_temperature_k == 318
    assert log.composite_temperature_c == pytest.approx(44.85)
    assert (log.available_spare_pct, log.available_spare_threshold_pct, log.percentage_used) == (97, 10, 3)
    assert log.endurance_group_critical_warning == 1
    assert log.data_units_read == 1_234_567
    assert log.data_read_bytes == 1_234_567 * 512_000
    assert log.data_units_written == U128                          # full 128 bits
    assert log.host_read_commands == 2**64 + 5                     # beyond 64 bits
    assert (log.host_write_commands, log.controller_busy_time_min, log.power_cycles) == (77, 1440, 12)
    assert (log.power_on_hours, log.unsafe_shutdowns, log.media_errors) == (8760, 4, 2)
    assert log.error_log_entries == (1 << 100) + 1
    assert (log.warning_temperature_time_min, log.critical_temperature_time_min) == (15, 1)
    assert log.temperature_sensors_k == (320, None, 330, None, None, None, None, 273)
    assert (log.thermal_mgmt_t1_transitions, log.thermal_mgmt_t2_transitions) == (6, 7)
    assert (log.thermal_mgmt_t1_total_s, log.thermal_mgmt_t2_total_s) == (600, 30)


def test_a_healthy_empty_log_has_no_warnings_and_no_sensors():
    log = nvme.parse_smart_log(build_log(temperature_k=300, spare=100, spare_threshold=10))
    assert log.warnings == [] and log.temperature_sensors_k == (None,) * 8
    assert log.data_written_bytes == 0


def test_series_use_the_catalogue_names_and_celsius():
    log = nvme.parse_smart_log(build_log(temperature_k=318, units_written=10, sensors=[320, 0, 0, 0, 0, 0, 0, 0]))
    out = series.smart_series("nvme0", log)
    assert out["nvme.nvme0.temperature_c"] == pytest.approx(44.85)  # the store keeps whole degrees
    assert out["nvme.nvme0.data_written_bytes"] == 5_120_000
    assert out["nvme.nvme0.temp_sensor1_c"] == pytest.approx(46.85)
    assert "nvme.nvme0.temp_sensor2_c" not in out
    from store.schema import spec_for
    assert all(spec_for(name) is not None for name in out)


@pytest.mark.parametrize("size", [0, 511, 513, 4096])
def test_a_log_of_the_wrong_size_is_refused(size):
    with pytest.raises(ValueError, match="must be 512 bytes, got"):
        nvme.parse_smart_log(bytes(size))


def test_the_admin_command_matches_linux_and_the_spec():
    assert ctypes.sizeof(nvme.NvmeAdminCmd) == 72
    assert nvme.NVME_IOCTL_ADMIN_CMD == 0xC0484E41
    buffer = ctypes.create_string_buffer(512)
    cmd = nvme.get_log_page_cmd(buffer)
    assert (cmd.opcode, cmd.nsid, cmd.data_len) == (0x02, 0xFFFFFFFF, 512)
    assert cmd.cdw10 == (127 << 16) | 0x02          # NUMDL = 128 dwords - 1, LID = 02h
    assert cmd.cdw11 == 0 and cmd.addr == ctypes.addressof(buffer)


def test_reading_a_missing_or_non_nvme_device_says_why(tmp_path):
    with pytest.raises(SourceUnavailable, match="does not exist"):
        nvme.read_smart_log(tmp_path / "nvme9")
    with pytest.raises(SourceUnavailable, match="Get Log Page 02h on /dev/null failed"):
        nvme.read_smart_log("/dev/null")           # a real device that rejects the ioctl


def test_hwmon_temperature_reads_millidegrees_or_says_it_is_missing(tmp_path):
    (tmp_path / "hwmon3").mkdir()
    (tmp_path / "hwmon3" / "temp1_input").write_text("41850\n")
    assert nvme.hwmon_temperature_c(tmp_path) == 41.85
    with pytest.raises(SourceUnavailable, match="no hwmon temperature"):
        nvme.hwmon_temperature_c(tmp_path / "hwmon3")
