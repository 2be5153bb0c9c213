"""The store series each reading of the machine becomes: the values of one reading, by the field
names the catalogue (store.schema) gives them, named with `series_of`."""
from __future__ import annotations

from machine.block import BlockRates
from machine.cgroup import MemoryReading
from machine.memory import Faults
from machine.nvme import KELVIN, SmartLog
from store.schema import fields_of, series_of


def block_series(device: str, rates: BlockRates) -> dict[str, float]:
    """block.{dev}.* of one interval."""
    return series_of("block", vars(rates), dev=device)


def disk_reader_series(device: str, agent: float, others: float, others_write: float) -> dict[str, float]:
    """io.{dev}.*: the agent's disk's reads, the agent's and the other processes', and the other processes'
    writes (bytes per second)."""
    return series_of("disk_readers", {"agent": agent, "others": others, "others_write": others_write}, dev=device)


def meminfo_series(meminfo: dict[str, int]) -> dict[str, float]:
    """mem.* of /proc/meminfo; swap in use is SwapTotal - SwapFree."""
    if "SwapTotal" in meminfo and "SwapFree" in meminfo:
        meminfo = meminfo | {"SwapUsed": meminfo["SwapTotal"] - meminfo["SwapFree"]}
    return series_of("meminfo", meminfo)


def status_series(status: dict[str, int]) -> dict[str, float]:
    """mem.agent.* of the agent's /proc/<pid>/status."""
    return series_of("status", status)


def vmstat_series(previous: dict[str, int], current: dict[str, int], dt: float) -> dict[str, float]:
    """vm.*_per_s: per-second increases of the /proc/vmstat counters present in both readings."""
    return series_of("vmstat", {key: max(0, current[key] - previous[key]) / dt
                                for key in fields_of("vmstat") if key in previous and key in current})


def fault_series(previous: Faults, current: Faults) -> dict[str, float]:
    """mem.agent.*flt_per_s: the agent's page faults per second."""
    dt = current.t - previous.t
    return series_of("faults", {"minflt": max(0, current.minflt - previous.minflt) / dt,
                                "majflt": max(0, current.majflt - previous.majflt) / dt})


def cgroup_series(previous: tuple[float, MemoryReading] | None, reading: MemoryReading, t: float,
                  others: int | None = None) -> dict[str, float]:
    """cgroup.agent.*: usage, limit and memory pressure of one reading, and how many other processes
    share the cgroup; with the reading before it (at monotonic time previous[0]), its counters as
    per-second rates."""
    values: dict[str, float | None] = {"usage_bytes": reading.usage_bytes, "limit_bytes": reading.limit_bytes,
                                       "other_processes": others}
    for kind, fields in (reading.psi or {}).items():
        values[f"psi_{kind}_avg10"] = fields["avg10"]
    if previous is not None:
        then, before = previous
        values |= {f"{name}_per_s": max(0, count - before.counters[name]) / (t - then)
                   for name, count in reading.counters.items() if name in before.counters}
    return series_of("cgroup", values)


def psi_series(resource: str, psi: dict[str, dict[str, float]]) -> dict[str, float]:
    """psi.{res}.{some,full}_{avg10,total_us} present in one reading."""
    values = {}
    for kind, fields in psi.items():
        values[f"{kind}_avg10"] = fields["avg10"]
        values[f"{kind}_total_us"] = int(fields["total"])
    return series_of("psi", values, res=resource)


def smart_series(ctrl: str, log: SmartLog) -> dict[str, float]:
    """nvme.{ctrl}.* of one parsed SMART / Health log (temperatures in degrees Celsius)."""
    sensors = {f"temp_sensor{i}_c": kelvin - KELVIN
               for i, kelvin in enumerate(log.temperature_sensors_k, start=1) if kelvin is not None}
    return series_of("smart", vars(log) | sensors | {
        "composite_temperature_c": log.composite_temperature_c,
        "data_read_bytes": log.data_read_bytes, "data_written_bytes": log.data_written_bytes}, ctrl=ctrl)


def hwmon_series(ctrl: str, temperature_c: float) -> dict[str, float]:
    """nvme.{ctrl}.temperature_c from the controller's hwmon node, where no SMART log can be read."""
    return series_of("smart", {"composite_temperature_c": temperature_c}, ctrl=ctrl)


def self_series(cpu_fraction: float) -> dict[str, float]:
    """collector.*: the collector's own cost."""
    return series_of("self", {"cpu_fraction": cpu_fraction})


def loop_series(missed: int) -> dict[str, float]:
    """collector.*: the sampling loop's own record, the ticks it was too late for."""
    return series_of("self", {"missed_samples": missed})
