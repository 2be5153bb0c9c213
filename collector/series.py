"""The store series (store.schema's catalogue) that each reading of the machine becomes."""
from __future__ import annotations

from machine.block import BlockRates
from machine.memory import Faults
from machine.nvme import KELVIN, SmartLog

MEMINFO_SERIES = {"MemTotal": "mem.total_bytes", "MemAvailable": "mem.available_bytes",
                  "MemFree": "mem.free_bytes", "Cached": "mem.cached_bytes", "Dirty": "mem.dirty_bytes"}
STATUS_SERIES = {"VmRSS": "mem.agent.rss_bytes", "VmHWM": "mem.agent.hwm_bytes",
                 "RssAnon": "mem.agent.rss_anon_bytes", "RssFile": "mem.agent.rss_file_bytes",
                 "VmSwap": "mem.agent.swap_bytes"}
VMSTAT_RATES = {"pgmajfault": "vm.pgmajfault_per_s",
                "workingset_refault_anon": "vm.workingset_refault_anon_per_s",
                "workingset_refault_file": "vm.workingset_refault_file_per_s"}


def block_series(device: str, rates: BlockRates) -> dict[str, float]:
    """block.{dev}.* of one interval."""
    return {f"block.{device}.{name}": value for name, value in vars(rates).items()}


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


def psi_series(resource: str, psi: dict[str, dict[str, float]]) -> dict[str, float]:
    """psi.{res}.{some,full}_{avg10,total_us} present in one reading."""
    series = {}
    for kind in ("some", "full"):
        if kind in psi:
            series[f"psi.{resource}.{kind}_avg10"] = psi[kind]["avg10"]
            series[f"psi.{resource}.{kind}_total_us"] = int(psi[kind]["total"])
    return series


def smart_series(ctrl: str, log: SmartLog) -> dict[str, float]:
    """nvme.{ctrl}.* of one parsed SMART / Health log."""
    series: dict[str, float] = {
        f"nvme.{ctrl}.temperature_c": round(log.composite_temperature_c),
        f"nvme.{ctrl}.critical_warning": log.critical_warning,
        f"nvme.{ctrl}.available_spare_pct": log.available_spare_pct,
        f"nvme.{ctrl}.percentage_used": log.percentage_used,
        f"nvme.{ctrl}.data_read_bytes": log.data_read_bytes,
        f"nvme.{ctrl}.data_written_bytes": log.data_written_bytes,
        f"nvme.{ctrl}.host_read_commands": log.host_read_commands,
        f"nvme.{ctrl}.host_write_commands": log.host_write_commands,
        f"nvme.{ctrl}.busy_time_min": log.controller_busy_time_min,
        f"nvme.{ctrl}.power_on_hours": log.power_on_hours,
        f"nvme.{ctrl}.unsafe_shutdowns": log.unsafe_shutdowns,
        f"nvme.{ctrl}.media_errors": log.media_errors,
        f"nvme.{ctrl}.error_log_entries": log.error_log_entries,
    }
    for i, kelvin in enumerate(log.temperature_sensors_k, start=1):
        if kelvin is not None:
            series[f"nvme.{ctrl}.temp_sensor{i}_c"] = round(kelvin - KELVIN)
    return series
