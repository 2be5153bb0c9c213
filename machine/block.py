"""Block-device statistics from /sys/block/<dev>/stat, computed as `iostat -x` computes them.

The stat file (Documentation/block/stat.rst) holds cumulative counters: reads, reads merged,
sectors read, ms reading, writes, writes merged, sectors written, ms writing, in flight,
io_ticks ms, time_in_queue ms, then discard and flush fields on newer kernels. Sectors are
always 512 bytes here, whatever the device's logical block size.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SECTOR = 512
WRAP_32 = 1 << 32


@dataclass(frozen=True)
class BlockStat:
    """One reading of the counters, with the monotonic time it was taken."""
    t: float
    reads: int
    sectors_read: int
    read_ms: int
    writes: int
    sectors_written: int
    write_ms: int
    in_flight: int
    io_ticks_ms: int
    time_in_queue_ms: int


@dataclass(frozen=True)
class BlockRates:
    """iostat -x columns over an interval, in base units."""
    reads_per_s: float
    writes_per_s: float
    read_bytes_per_s: float
    write_bytes_per_s: float
    util: float               # fraction 0..1 (iostat %util / 100)
    r_await_s: float
    w_await_s: float
    avg_request_bytes: float
    queue_depth: float        # iostat aqu-sz


def parse_stat(text: str, t: float) -> BlockStat:
    """Parse the stat file's text; at least the 11 classic fields must be present."""
    fields = [int(x) for x in text.split()]
    if len(fields) < 11:
        raise ValueError(f"block stat needs >= 11 fields, got {len(fields)}: {text!r}")
    return BlockStat(t, fields[0], fields[2], fields[3], fields[4], fields[6], fields[7],
                     fields[8], fields[9], fields[10])


def read_stat(device: str, t: float, sys_block: Path = Path("/sys/block")) -> BlockStat:
    return parse_stat((sys_block / device / "stat").read_text(), t)


def counter_delta(previous: int, current: int) -> int:
    """Increase of a cumulative counter. A decrease from a value that fits 32 bits is a 32-bit
    wrap (unsigned long on 32-bit kernels); any other decrease is a reset (device re-added),
    counted from zero, as iostat does."""
    if current >= previous:
        return current - previous
    if previous < WRAP_32:
        return current + WRAP_32 - previous
    return current


def block_rates(previous: BlockStat, current: BlockStat) -> BlockRates:
    """iostat -x over two readings (current taken after previous)."""
    dt = current.t - previous.t
    if dt <= 0:
        raise ValueError(f"block stat readings must be in time order, got dt={dt}")
    d = {name: counter_delta(getattr(previous, name), getattr(current, name))
         for name in ("reads", "sectors_read", "read_ms", "writes", "sectors_written", "write_ms",
                      "io_ticks_ms", "time_in_queue_ms")}
    ios = d["reads"] + d["writes"]
    return BlockRates(
        reads_per_s=d["reads"] / dt,
        writes_per_s=d["writes"] / dt,
        read_bytes_per_s=d["sectors_read"] * SECTOR / dt,
        write_bytes_per_s=d["sectors_written"] * SECTOR / dt,
        util=min(1.0, d["io_ticks_ms"] / (dt * 1000)),
        r_await_s=d["read_ms"] / d["reads"] / 1000 if d["reads"] else 0.0,
        w_await_s=d["write_ms"] / d["writes"] / 1000 if d["writes"] else 0.0,
        avg_request_bytes=(d["sectors_read"] + d["sectors_written"]) * SECTOR / ios if ios else 0.0,
        queue_depth=d["time_in_queue_ms"] / (dt * 1000),
    )
