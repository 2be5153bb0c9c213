"""The telemetry store's schema: SQLite tables and the catalogue of series names.

Every process uses this one catalogue: the collector writes the `block.*`, `mem.*`, `vm.*`,
`psi.*` and `nvme.*` series, the agent the `agent.*` series, and the dashboard reads them by the
same names. Names with `{dev}`, `{ctrl}` or `{n}` are templates: `block.{dev}.util` covers
`block.vda.util`, `block.nvme0n1.util`... Units are base units (bytes, seconds, fractions 0..1,
percent only where the kernel reports percent). `precision` is the fixed-point step the codec keeps
(values are lossless to within half of it); counters use 1 and are exact. Precisions follow what
the source can resolve: memory is counted in 4 KiB pages (so 4096 is exact), per-second rates are
counts over a measured interval that jitters by milliseconds (so 0.1/s and 1 KiB/s).

A series not in the catalogue can still be written after `Store.declare(name, unit, kind,
precision)`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from store.rollup import Rollup

# 2: chunks carry a format byte (store.codec.FORMAT). 3: per-minute rollups of cache_stats and
# activations, cache_stats.prefetches, simulations.capacity a fraction (store.migrations upgrades 2).
SCHEMA_VERSION = 3
DEFAULT_RETENTION_S = 7 * 24 * 3600
KINDS = ("gauge", "counter")


@dataclass(frozen=True)
class SeriesSpec:
    """One series (or template of series) with its unit, kind and codec precision."""
    name: str
    unit: str
    kind: str = "gauge"
    precision: float = 0.01
    description: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"series {self.name!r}: kind must be one of {KINDS}, not {self.kind!r}")
        if not self.precision > 0:
            raise ValueError(f"series {self.name!r}: precision must be > 0, not {self.precision!r}")


def _block(metric: str, unit: str, precision: float, description: str) -> SeriesSpec:
    return SeriesSpec(f"block.{{dev}}.{metric}", unit, "gauge", precision, description)


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
    SeriesSpec("mem.total_bytes", "B", "gauge", 4096.0, "MemTotal"),
    SeriesSpec("mem.available_bytes", "B", "gauge", 4096.0, "MemAvailable"),
    SeriesSpec("mem.free_bytes", "B", "gauge", 4096.0, "MemFree"),
    SeriesSpec("mem.cached_bytes", "B", "gauge", 4096.0, "Cached (page cache)"),
    SeriesSpec("mem.dirty_bytes", "B", "gauge", 4096.0, "Dirty"),
    SeriesSpec("mem.swap_used_bytes", "B", "gauge", 4096.0, "SwapTotal - SwapFree"),
    # The agent process, /proc/<pid>/status and /proc/<pid>/stat.
    SeriesSpec("mem.agent.rss_bytes", "B", "gauge", 4096.0, "agent VmRSS"),
    SeriesSpec("mem.agent.hwm_bytes", "B", "gauge", 4096.0, "agent VmHWM (peak RSS)"),
    SeriesSpec("mem.agent.rss_anon_bytes", "B", "gauge", 4096.0, "agent RssAnon"),
    SeriesSpec("mem.agent.rss_file_bytes", "B", "gauge", 4096.0, "agent RssFile (mapped files)"),
    SeriesSpec("mem.agent.swap_bytes", "B", "gauge", 4096.0, "agent VmSwap"),
    SeriesSpec("mem.agent.minflt_per_s", "1/s", "gauge", 0.1, "agent minor page faults per second"),
    SeriesSpec("mem.agent.majflt_per_s", "1/s", "gauge", 0.1, "agent major page faults per second"),
    # System paging, /proc/vmstat.
    SeriesSpec("vm.pgmajfault_per_s", "1/s", "gauge", 0.1, "major faults per second, all processes"),
    SeriesSpec("vm.workingset_refault_anon_per_s", "1/s", "gauge", 0.1,
               "anon pages refaulted soon after eviction, per second (thrash signal)"),
    SeriesSpec("vm.workingset_refault_file_per_s", "1/s", "gauge", 0.1,
               "file pages refaulted soon after eviction, per second (thrash signal)"),
    # Pressure stall information, /proc/pressure/{memory,io}.
    SeriesSpec("psi.{res}.some_avg10", "%", "gauge", 0.01, "share of time some task stalled, 10 s avg"),
    SeriesSpec("psi.{res}.full_avg10", "%", "gauge", 0.01, "share of time all tasks stalled, 10 s avg"),
    SeriesSpec("psi.{res}.some_total_us", "us", "counter", 1.0, "total some-stall time"),
    SeriesSpec("psi.{res}.full_total_us", "us", "counter", 1.0, "total full-stall time"),
    # NVMe controllers: SMART / Health log (Get Log Page 02h), or hwmon temperature only.
    SeriesSpec("nvme.{ctrl}.temperature_c", "degC", "gauge", 1.0, "composite temperature"),
    SeriesSpec("nvme.{ctrl}.temp_sensor{n}_c", "degC", "gauge", 1.0, "temperature sensor n (1..8)"),
    SeriesSpec("nvme.{ctrl}.critical_warning", "bits", "gauge", 1.0, "critical warning bit field"),
    SeriesSpec("nvme.{ctrl}.available_spare_pct", "%", "gauge", 1.0, "available spare"),
    SeriesSpec("nvme.{ctrl}.percentage_used", "%", "gauge", 1.0, "endurance used (may exceed 100)"),
    SeriesSpec("nvme.{ctrl}.data_read_bytes", "B", "counter", 1.0, "data units read x 512,000"),
    SeriesSpec("nvme.{ctrl}.data_written_bytes", "B", "counter", 1.0, "data units written x 512,000"),
    SeriesSpec("nvme.{ctrl}.host_read_commands", "commands", "counter", 1.0, "host read commands"),
    SeriesSpec("nvme.{ctrl}.host_write_commands", "commands", "counter", 1.0, "host write commands"),
    SeriesSpec("nvme.{ctrl}.busy_time_min", "min", "counter", 1.0, "controller busy time"),
    SeriesSpec("nvme.{ctrl}.power_on_hours", "h", "counter", 1.0, "power-on hours"),
    SeriesSpec("nvme.{ctrl}.unsafe_shutdowns", "count", "counter", 1.0, "unsafe shutdowns"),
    SeriesSpec("nvme.{ctrl}.media_errors", "count", "counter", 1.0, "media and data integrity errors"),
    SeriesSpec("nvme.{ctrl}.error_log_entries", "count", "counter", 1.0, "error information log entries"),
    # The collector's own cost.
    SeriesSpec("collector.cpu_fraction", "fraction", "gauge", 0.0001, "collector CPU, share of one core"),
    # The agent (written by agent/serve); more agent.* series may be declared at run time.
    SeriesSpec("agent.tokens_per_s", "1/s", "gauge", 0.01, "generated tokens per second"),
    SeriesSpec("agent.hit_rate", "fraction", "gauge", 0.0001, "expert cache hit rate, 0..1"),
    SeriesSpec("agent.batch_size", "requests", "gauge", 1.0, "requests in the current batch"),
    SeriesSpec("agent.queue_depth", "requests", "gauge", 1.0, "requests waiting"),
    SeriesSpec("agent.cache_bytes", "B", "gauge", 4096.0, "bytes held in the expert cache"),
    SeriesSpec("agent.cache_cap_bytes", "B", "gauge", 4096.0, "expert cache cap"),
    SeriesSpec("agent.read_latency_s", "s", "gauge", 1e-6, "mean expert read latency"),
    SeriesSpec("agent.read_bytes_per_s", "B/s", "gauge", 512.0, "expert bytes read from the SSD per second"),
)


@lru_cache(maxsize=None)
def _patterns() -> tuple[tuple[re.Pattern[str], SeriesSpec], ...]:
    compiled = []
    for spec in CATALOGUE:
        parts = re.split(r"(\{\w+\})", spec.name)
        regex = "".join(r"[A-Za-z0-9_:\-]+" if p.startswith("{") else re.escape(p) for p in parts)
        compiled.append((re.compile(regex + r"\Z"), spec))
    return tuple(compiled)


def spec_for(name: str) -> SeriesSpec | None:
    """The catalogue entry for a concrete series name (templates filled in), or None."""
    for regex, spec in _patterns():
        if regex.match(name):
            return SeriesSpec(name, spec.unit, spec.kind, spec.precision, spec.description)
    return None


# Times are Unix seconds (REAL). Chunks hold one series' points encoded by store.codec; the
# open (still filling) chunk of a writer is rewritten in place until it is full. One statement per
# item (run inside the caller's transaction). cache_stats.prefetches is the last column because
# upgraded stores gain it by ALTER TABLE ... ADD COLUMN; NULL there means "not recorded" (rows of
# version 2, or a writer that does not pass it), not "none issued".
SIMULATIONS = """CREATE TABLE IF NOT EXISTS simulations (
    t REAL NOT NULL, trace TEXT NOT NULL, policy TEXT NOT NULL,
    capacity REAL NOT NULL CHECK (capacity > 0 AND capacity <= 1),
    scope TEXT NOT NULL, hit_rate REAL NOT NULL)"""  # capacity: a fraction of all experts, as `simulate` takes it
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
    """CREATE TABLE IF NOT EXISTS requests (
    t REAL NOT NULL, request_id TEXT NOT NULL, ttft_s REAL, tpot_s REAL, latency_s REAL,
    prompt_tokens INTEGER, completion_tokens INTEGER, hits INTEGER, misses INTEGER,
    bytes_read INTEGER)""",
    "CREATE INDEX IF NOT EXISTS requests_t ON requests (t)",
    """CREATE TABLE IF NOT EXISTS cache_stats (
    t REAL NOT NULL, layer INTEGER NOT NULL, hits INTEGER NOT NULL, misses INTEGER NOT NULL,
    evictions INTEGER NOT NULL, prefetch_hits INTEGER NOT NULL, bytes_read INTEGER NOT NULL,
    read_latency_s REAL, prefetches INTEGER)""",
    "CREATE INDEX IF NOT EXISTS cache_stats_t ON cache_stats (t)",
    """CREATE TABLE IF NOT EXISTS activations (
    t REAL NOT NULL, layer INTEGER NOT NULL, expert INTEGER NOT NULL, count INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS activations_t ON activations (t)",
    """CREATE TABLE IF NOT EXISTS knob_changes (
    id INTEGER PRIMARY KEY, t REAL NOT NULL, knob TEXT NOT NULL, old TEXT, new TEXT NOT NULL,
    source TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS knob_changes_t ON knob_changes (t)",
    """CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY, t REAL NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS events_t ON events (t)",
    SIMULATIONS,
    """CREATE TABLE IF NOT EXISTS sweeps (
    t REAL NOT NULL, cache_cap_bytes INTEGER NOT NULL, tokens_per_s REAL NOT NULL,
    hit_rate REAL NOT NULL)""",
)

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
