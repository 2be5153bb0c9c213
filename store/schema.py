"""The telemetry store's schema: every series and every row table, declared once.

Series: every process uses this one catalogue. The collector writes the `block.*`, `mem.*`,
`vm.*`, `psi.*`, `nvme.*` and `collector.*` series, the agent the `agent.*` series, and the
dashboard reads them by the same names. Names with `{dev}`, `{ctrl}`, `{res}` or `{n}` are
templates: `block.{dev}.util` covers `block.vda.util`, `block.nvme0n1.util`... Units are base units
(bytes, seconds, fractions 0..1, percent only where the kernel reports percent). `precision` is the
fixed-point step the codec keeps (values are lossless to within half of it); counters use 1 and are
exact. Precisions follow what the source can resolve: memory is counted in 4 KiB pages (so 4096 is
exact), per-second rates are counts over a measured interval that jitters by milliseconds (so
0.1/s and 1 KiB/s). Each series also names the `reading` that produces it and that reading's
`field` (by default the name's last part): the collector and the agent's recorder name what they
write with `series_of`, so a new metric of an existing reading is one line here (plus its view).

A series not in the catalogue can still be written after `Store.declare(name, unit, kind,
precision)`.

Row tables: declared as `RowTable`s, from which their DDL, the writer's INSERT, retention and the
`store stats` row counts are derived.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from store.rollup import Rollup

# 2: chunks carry a format byte (store.codec.FORMAT). 3: per-minute rollups of cache_stats and
# activations, cache_stats.prefetches, simulations.capacity a fraction (store.migrations upgrades 2).
# 4: the disk_readers table. 5: disk_readers.write_bytes_per_s.
SCHEMA_VERSION = 5
DEFAULT_RETENTION_DAYS = 7.0
KINDS = ("gauge", "counter")


@dataclass(frozen=True)
class SeriesSpec:
    """One series (or template of series) with its unit, kind and codec precision; in the catalogue
    also the reading that produces it (not stored, and not part of a spec's identity)."""
    name: str
    unit: str
    kind: str = "gauge"
    precision: float = 0.01
    description: str = ""
    reading: str = field(default="", compare=False)   # "meminfo", "block", "tick"... (see module docstring)
    field: str = field(default="", compare=False)     # the reading's field, if not the name's last part

    @property
    def source_field(self) -> str:
        return self.field or self.name.rsplit(".", 1)[-1]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"series {self.name!r}: kind must be one of {KINDS}, not {self.kind!r}")
        if not self.precision > 0:
            raise ValueError(f"series {self.name!r}: precision must be > 0, not {self.precision!r}")


def _block(metric: str, unit: str, precision: float, description: str) -> SeriesSpec:
    """block.{dev}.<metric>, a field of machine.block.BlockRates."""
    return SeriesSpec(f"block.{{dev}}.{metric}", unit, "gauge", precision, description, "block")


def _meminfo(name: str, key: str, description: str = "") -> SeriesSpec:
    return SeriesSpec(name, "B", "gauge", 4096.0, description or key, "meminfo", key)


def _status(name: str, key: str, description: str = "") -> SeriesSpec:
    return SeriesSpec(name, "B", "gauge", 4096.0, f"agent {description or key}", "status", key)


def _smart(metric: str, unit: str, kind: str, description: str, attribute: str = "") -> SeriesSpec:
    """nvme.{ctrl}.<metric>, a field of machine.nvme.SmartLog (or the named attribute)."""
    return SeriesSpec(f"nvme.{{ctrl}}.{metric}", unit, kind, 1.0, description, "smart", attribute)


def _cgroup(metric: str, unit: str, precision: float, description: str) -> SeriesSpec:
    """cgroup.agent.<metric>, a field of the collector's reading of the agent's memory cgroup."""
    return SeriesSpec(f"cgroup.agent.{metric}", unit, "gauge", precision, description, "cgroup")


# Where a generated token's time goes (agent/model/profile.py and the expert cache), one series each.
TOKEN_PHASES = {"attention": "attention", "router": "the routers and the lookahead's guess",
                "route": "routing to the expert cache", "wait": "waiting for expert reads",
                "experts": "expert matmuls", "head": "embedding and LM head",
                "crc": "CRC checks (I/O threads)", "policy": "the cache policy"}


def _agent(metric: str, unit: str, precision: float, description: str, attribute: str = "") -> SeriesSpec:
    """agent.<metric>, an attribute of the agent's one-second agent.serve.metrics.Tick."""
    return SeriesSpec(f"agent.{metric}", unit, "gauge", precision, description, "tick", attribute)


CATALOGUE: tuple[SeriesSpec, ...] = (
    # Block devices, computed from /sys/block/<dev>/stat exactly as iostat -x does.
    _block("reads_per_s", "1/s", 0.1, "completed reads per second (iostat r/s)"),
    _block("writes_per_s", "1/s", 0.1, "completed writes per second (iostat w/s)"),
    _block("read_bytes_per_s", "B/s", 1024.0, "bytes read per second (iostat rkB/s x 1024)"),
    _block("write_bytes_per_s", "B/s", 1024.0, "bytes written per second (iostat wkB/s x 1024)"),
    _block("util", "fraction", 0.001, "time the device had I/O in flight, 0..1 (iostat %util / 100)"),
    _block("r_await_s", "s", 1e-5, "mean read latency incl. queueing (iostat r_await / 1000)"),
    _block("w_await_s", "s", 1e-5, "mean write latency incl. queueing (iostat w_await / 1000)"),
    _block("avg_request_bytes", "B", 512.0, "mean request size (iostat areq-sz x 1024)"),
    _block("queue_depth", "requests", 0.01, "mean requests in flight (iostat aqu-sz)"),
    # System memory, /proc/meminfo (kB there, bytes here).
    _meminfo("mem.total_bytes", "MemTotal"),
    _meminfo("mem.available_bytes", "MemAvailable"),
    _meminfo("mem.free_bytes", "MemFree"),
    _meminfo("mem.cached_bytes", "Cached", "Cached (page cache)"),
    _meminfo("mem.dirty_bytes", "Dirty"),
    _meminfo("mem.swap_used_bytes", "SwapUsed", "SwapTotal - SwapFree"),  # computed by collector.series
    # The agent process, /proc/<pid>/status and /proc/<pid>/stat.
    _status("mem.agent.rss_bytes", "VmRSS"),
    _status("mem.agent.hwm_bytes", "VmHWM", "VmHWM (peak RSS)"),
    _status("mem.agent.rss_anon_bytes", "RssAnon"),
    _status("mem.agent.rss_file_bytes", "RssFile", "RssFile (mapped files)"),
    _status("mem.agent.swap_bytes", "VmSwap"),
    SeriesSpec("mem.agent.minflt_per_s", "1/s", "gauge", 0.1, "agent minor page faults per second", "faults", "minflt"),
    SeriesSpec("mem.agent.majflt_per_s", "1/s", "gauge", 0.1, "agent major page faults per second", "faults", "majflt"),
    # The agent's memory cgroup: memory.stat counters as per-second rates, usage and the effective limit
    # (cgroup v1 or v2), and memory.pressure where v2 offers it (machine.cgroup).
    _cgroup("usage_bytes", "B", 4096.0, "memory charged to the agent's cgroup"),
    _cgroup("limit_bytes", "B", 4096.0, "the agent's cgroup memory limit, the tightest of its own and its ancestors'"),
    _cgroup("other_processes", "count", 1.0, "processes in the agent's memory cgroup besides the agent and its "
                                              "children: with any, the cgroup's counters are not the agent's alone"),
    _cgroup("pgmajfault_per_s", "1/s", 0.1, "major faults in the agent's cgroup per second"),
    _cgroup("workingset_refault_file_per_s", "1/s", 0.1, "file pages of the agent's cgroup refaulted soon after "
            "eviction, per second"),
    _cgroup("workingset_refault_anon_per_s", "1/s", 0.1, "anon pages of the agent's cgroup refaulted soon after "
            "eviction, per second"),
    _cgroup("psi_some_avg10", "%", 0.01, "agent cgroup: share of time some task stalled on memory, 10 s avg"),
    _cgroup("psi_full_avg10", "%", 0.01, "agent cgroup: share of time all tasks stalled on memory, 10 s avg"),
    # System paging, /proc/vmstat counters as per-second rates.
    SeriesSpec("vm.pgmajfault_per_s", "1/s", "gauge", 0.1, "major faults per second, all processes",
               "vmstat", "pgmajfault"),
    SeriesSpec("vm.workingset_refault_anon_per_s", "1/s", "gauge", 0.1,
               "anon pages refaulted soon after eviction, per second (thrash signal)", "vmstat",
               "workingset_refault_anon"),
    SeriesSpec("vm.workingset_refault_file_per_s", "1/s", "gauge", 0.1,
               "file pages refaulted soon after eviction, per second (thrash signal)", "vmstat",
               "workingset_refault_file"),
    # Pressure stall information, /proc/pressure/{memory,io}.
    SeriesSpec("psi.{res}.some_avg10", "%", "gauge", 0.01, "share of time some task stalled, 10 s avg", "psi"),
    SeriesSpec("psi.{res}.full_avg10", "%", "gauge", 0.01, "share of time all tasks stalled, 10 s avg", "psi"),
    SeriesSpec("psi.{res}.some_total_us", "us", "counter", 1.0, "total some-stall time", "psi"),
    SeriesSpec("psi.{res}.full_total_us", "us", "counter", 1.0, "total full-stall time", "psi"),
    # Who uses the agent's disk (the one holding the file it reads with O_DIRECT): its reads and writes as
    # the device counts them, split by /proc/<pid>/io; the top other readers and writers by name go to
    # disk_readers.
    SeriesSpec("io.{dev}.agent_read_bytes_per_s", "B/s", "gauge", 1024.0, "bytes the agent process caused "
               "to be read from storage per second (/proc/<pid>/io read_bytes)", "disk_readers", "agent"),
    SeriesSpec("io.{dev}.others_read_bytes_per_s", "B/s", "gauge", 1024.0, "bytes the agent's disk read per "
               "second for other processes: the device's reads less the agent's", "disk_readers", "others"),
    SeriesSpec("io.{dev}.others_write_bytes_per_s", "B/s", "gauge", 1024.0, "bytes the agent's disk wrote per "
               "second for other processes: the device's writes less the agent's (/proc/<pid>/io write_bytes)",
               "disk_readers", "others_write"),
    # NVMe controllers: SMART / Health log (Get Log Page 02h), or hwmon temperature only.
    _smart("temperature_c", "degC", "gauge", "composite temperature", "composite_temperature_c"),
    _smart("temp_sensor{n}_c", "degC", "gauge", "temperature sensor n (1..8)"),
    _smart("critical_warning", "bits", "gauge", "critical warning bit field"),
    _smart("available_spare_pct", "%", "gauge", "available spare"),
    _smart("percentage_used", "%", "gauge", "endurance used (may exceed 100)"),
    _smart("data_read_bytes", "B", "counter", "data units read x 512,000"),
    _smart("data_written_bytes", "B", "counter", "data units written x 512,000"),
    _smart("host_read_commands", "commands", "counter", "host read commands"),
    _smart("host_write_commands", "commands", "counter", "host write commands"),
    _smart("busy_time_min", "min", "counter", "controller busy time", "controller_busy_time_min"),
    _smart("power_on_hours", "h", "counter", "power-on hours"),
    _smart("unsafe_shutdowns", "count", "counter", "unsafe shutdowns"),
    _smart("media_errors", "count", "counter", "media and data integrity errors"),
    _smart("error_log_entries", "count", "counter", "error information log entries"),
    # The collector's own cost.
    SeriesSpec("collector.cpu_fraction", "fraction", "gauge", 0.0001, "collector CPU, share of one core", "self"),
    SeriesSpec("collector.missed_samples", "count", "gauge", 1.0, "ticks the collector was too late for since "
               "its previous sample: each lacks a sample of every collector series", "self"),
    # The agent (written by agent/serve); more agent.* series may be declared at run time.
    _agent("tokens_per_s", "1/s", 0.01, "generated tokens per second"),
    _agent("hit_rate", "fraction", 0.0001, "expert cache hit rate, 0..1"),
    _agent("batch_size", "requests", 1.0, "requests in the current batch"),
    _agent("batch_limit", "requests", 1.0, "most requests stepped together (the knob max_batch_size)"),
    _agent("queue_depth", "requests", 1.0, "requests waiting"),
    _agent("requests_failed", "requests", 1.0, "requests that failed in the second: an error in their step "
           "(answered 500)"),
    _agent("requests_refused", "requests", 1.0, "requests refused in the second: the queue full (429) or the agent "
           "stopping (503)"),
    _agent("requests_abandoned", "requests", 1.0, "requests whose client went away in the second, before its answer "
           "was whole"),
    _agent("cache_bytes", "B", 4096.0, "bytes held in the expert cache"),
    _agent("cache_cap_bytes", "B", 4096.0, "expert cache cap", "cap_bytes"),
    _agent("cache_cap_min_bytes", "B", 1.0, "smallest cache cap the agent accepts now", "cap_min_bytes"),
    _agent("cache_cap_max_bytes", "B", 1.0, "largest cache cap the agent accepts now: 70% of its memory limit "
           "less what the model keeps besides the slots", "cap_max_bytes"),
    _agent("reread_rate", "fraction", 0.001, "share of expert lookups that missed on a block the cache held and "
           "evicted (first reads excluded)"),
    _agent("read_latency_s", "s", 1e-6, "mean expert read latency"),
    _agent("read_bytes_per_s", "B/s", 512.0, "expert bytes read from the SSD per second"),
    *(_agent(f"token_ms.{phase}", "ms", 0.01, f"ms of a generated token spent in {what}", f"token_ms_{phase}")
      for phase, what in TOKEN_PHASES.items()),
)


def _template_regex(template: str, part: str = r"[A-Za-z0-9_:\-]+") -> re.Pattern[str]:
    """A regex matching the names a template covers, each `{label}` a named group."""
    pieces = re.split(r"(\{\w+\})", template)
    return re.compile("".join(f"(?P<{p[1:-1]}>{part})" if p.startswith("{") else re.escape(p) for p in pieces) + r"\Z")


@lru_cache(maxsize=None)
def _patterns() -> tuple[tuple[re.Pattern[str], SeriesSpec], ...]:
    return tuple((_template_regex(spec.name), spec) for spec in CATALOGUE)


def spec_for(name: str) -> SeriesSpec | None:
    """The catalogue entry for a concrete series name (templates filled in), or None."""
    for regex, spec in _patterns():
        if regex.match(name):
            return SeriesSpec(name, spec.unit, spec.kind, spec.precision, spec.description)
    return None


@lru_cache(maxsize=None)
def _produced_by(reading: str) -> tuple[tuple[SeriesSpec, str, re.Pattern[str] | None], ...]:
    return tuple((spec, spec.source_field, _template_regex(spec.source_field, r"\d+") if "{" in spec.source_field
                  else None) for spec in CATALOGUE if spec.reading == reading)


def fields_of(reading: str) -> tuple[str, ...]:
    """The fields of a reading that the catalogue stores (templates as written, e.g. temp_sensor{n}_c)."""
    return tuple(f for _, f, _ in _produced_by(reading))


def series_of(reading: str, values: Mapping[str, float | None], **labels: str) -> dict[str, float]:
    """One reading's values under their series names: each catalogue series of `reading` whose field
    is in `values` (None is skipped), its name's template filled from `labels` ({dev}, {ctrl},
    {res}) and from the field's own placeholders ({n} of temp_sensor{n}_c)."""
    out = {}
    for spec, name, regex in _produced_by(reading):
        if regex is None:
            if values.get(name) is not None:
                out[spec.name.format(**labels)] = values[name]
            continue
        for key, value in values.items():
            match = regex.match(key)
            if match and value is not None:
                out[spec.name.format(**labels, **match.groupdict())] = value
    return out


@dataclass(frozen=True)
class RowTable:
    """A table of records (not series), indexed on its time column t (Unix seconds)."""
    name: str
    columns: tuple[tuple[str, str], ...]   # (name, SQL type and constraints), in table order
    buffered: bool = True                  # frequent rows wait for the next flush; rare ones are written through
    expires: bool = True                   # retention deletes rows older than it...
    keep_latest_of: str | None = None      # ...except the newest row of each value of this column
    indexed: bool = True

    @property
    def inserted(self) -> tuple[str, ...]:
        """The columns a recorded row gives, in order (an INTEGER PRIMARY KEY numbers itself)."""
        return tuple(c for c, sql in self.columns if sql != "INTEGER PRIMARY KEY")

    @property
    def insert(self) -> str:
        return (f"INSERT INTO {self.name} ({', '.join(self.inserted)}) "
                f"VALUES ({', '.join('?' * len(self.inserted))})")

    def ddl(self) -> tuple[str, ...]:
        columns = ", ".join(f"{c} {sql}" for c, sql in self.columns)
        index = (f"CREATE INDEX IF NOT EXISTS {self.name}_t ON {self.name} (t)",) if self.indexed else ()
        return (f"CREATE TABLE IF NOT EXISTS {self.name} ({columns})",) + index


# cache_stats.prefetches is the last column because upgraded stores gain it by ALTER TABLE ... ADD
# COLUMN; NULL there means "not recorded" (rows of version 2, or a writer that does not pass it),
# not "none issued". simulations.capacity is a fraction of all experts, as `simulate` takes it.
ROW_TABLES: tuple[RowTable, ...] = (
    RowTable("requests", (("t", "REAL NOT NULL"), ("request_id", "TEXT NOT NULL"), ("ttft_s", "REAL"),
                          ("tpot_s", "REAL"), ("latency_s", "REAL"), ("prompt_tokens", "INTEGER"),
                          ("completion_tokens", "INTEGER"), ("hits", "INTEGER"), ("misses", "INTEGER"),
                          ("bytes_read", "INTEGER"))),
    RowTable("cache_stats", (("t", "REAL NOT NULL"), ("layer", "INTEGER NOT NULL"), ("hits", "INTEGER NOT NULL"),
                             ("misses", "INTEGER NOT NULL"), ("evictions", "INTEGER NOT NULL"),
                             ("prefetch_hits", "INTEGER NOT NULL"), ("bytes_read", "INTEGER NOT NULL"),
                             ("read_latency_s", "REAL"), ("prefetches", "INTEGER"))),
    RowTable("activations", (("t", "REAL NOT NULL"), ("layer", "INTEGER NOT NULL"), ("expert", "INTEGER NOT NULL"),
                             ("count", "INTEGER NOT NULL"))),
    RowTable("knob_changes", (("id", "INTEGER PRIMARY KEY"), ("t", "REAL NOT NULL"), ("knob", "TEXT NOT NULL"),
                              ("old", "TEXT"), ("new", "TEXT NOT NULL"), ("source", "TEXT NOT NULL")),
             buffered=False, keep_latest_of="knob"),
    RowTable("events", (("id", "INTEGER PRIMARY KEY"), ("t", "REAL NOT NULL"), ("kind", "TEXT NOT NULL"),
                        ("message", "TEXT NOT NULL")), buffered=False),
    # The top other readers and writers of the agent's disk, one row each per collector tick while they use
    # it (write_bytes_per_s NULL in rows of version 4, which did not count writes).
    RowTable("disk_readers", (("t", "REAL NOT NULL"), ("device", "TEXT NOT NULL"), ("pid", "INTEGER NOT NULL"),
                              ("name", "TEXT NOT NULL"), ("read_bytes_per_s", "REAL NOT NULL"),
                              ("write_bytes_per_s", "REAL"))),
    RowTable("simulations", (("t", "REAL NOT NULL"), ("trace", "TEXT NOT NULL"), ("policy", "TEXT NOT NULL"),
                             ("capacity", "REAL NOT NULL CHECK (capacity > 0 AND capacity <= 1)"),
                             ("scope", "TEXT NOT NULL"), ("hit_rate", "REAL NOT NULL")),
             buffered=False, expires=False, indexed=False),
    RowTable("sweeps", (("t", "REAL NOT NULL"), ("cache_cap_bytes", "INTEGER NOT NULL"),
                        ("tokens_per_s", "REAL NOT NULL"), ("hit_rate", "REAL NOT NULL")),
             buffered=False, expires=False, indexed=False),
)
ROW_TABLE = {table.name: table for table in ROW_TABLES}

# Series points live in chunks, each holding one series' points encoded by store.codec; the open
# (still filling) chunk of a writer is rewritten in place until it is full.
TABLES: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS series (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, unit TEXT NOT NULL,
    kind TEXT NOT NULL, precision REAL NOT NULL, description TEXT NOT NULL DEFAULT '')""",
    """CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL REFERENCES series(id),
    t_start REAL NOT NULL, t_end REAL NOT NULL, n_points INTEGER NOT NULL,
    precision REAL NOT NULL, data BLOB NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS chunks_series_t ON chunks (series_id, t_end)",
) + tuple(statement for table in ROW_TABLES for statement in table.ddl())

# What the dashboard sums over long windows, kept per minute (store.rollup).
CACHE_STATS_ROLLUP = Rollup("cache_stats", ("layer",), (
    ("hits", "{row}.hits"), ("misses", "{row}.misses"), ("evictions", "{row}.evictions"),
    ("prefetches", "COALESCE({row}.prefetches, 0)"), ("prefetch_hits", "{row}.prefetch_hits"),
    # prefetch hits of the rows that also say how many prefetches were issued: the accuracy's numerator
    ("counted_prefetch_hits", "CASE WHEN {row}.prefetches IS NULL THEN 0 ELSE {row}.prefetch_hits END"),
    ("bytes_read", "{row}.bytes_read"),
    ("latency_sum", "COALESCE({row}.read_latency_s, 0.0)"),
    ("latency_n", "{row}.read_latency_s IS NOT NULL"),
))
ACTIVATIONS_ROLLUP = Rollup("activations", ("layer", "expert"), (("count", "{row}.count"),))
ROLLUPS = (CACHE_STATS_ROLLUP, ACTIVATIONS_ROLLUP)

DDL: tuple[str, ...] = TABLES + tuple(stmt for rollup in ROLLUPS for stmt in rollup.ddl())
