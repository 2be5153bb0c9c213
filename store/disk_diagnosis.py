"""Disk diagnosis from the store: is the agent's expert reading slowed by another process using its
disk (and which), by its own reads, or not at all; the evidence in numbers, and the fix.

`disk_diagnosis.judge_disk` runs inside `store.diagnosis.diagnose`, so the dashboard's Memory page and
`flashmoe-cli diagnose` show it beside the memory verdict. It judges AVERAGE_S bucket averages of the
agent's mean expert read latency (agent.read_latency_s) and of the collector's split of its disk's
reads and writes (io.{dev}.*, collector.samplers.DiskReadersSampler; block.{dev}.util):
- the agent's **baseline** is the median latency of its calm buckets (others reading and writing under
  OTHERS_FLOOR, the device under BUSY_UTIL) in the window and the BASELINE_S before it; when those hold
  fewer than MIN_CALM (another process has used the disk for longer), the median of the latest calm
  buckets remembered in the store's REMEMBER_S before that; without any, there is nothing to compare
  with (a cold start), and no verdict but healthy. The evidence says which baseline it was. A baseline is
  of one thing measured: the agent records what its reads are at start (an EXPERT_READS event: backend, block
  size, expert store, disk), and calm buckets from before it last began reading something else are not used
  (another model's blocks read at another latency gave wrong verdicts);
- a bucket is **slow** when the latency is over SLOWER x the baseline and SLOWER_BY_S above it;
- **disk contention from another process**: slow buckets where the others read and write over
  OTHERS_FLOOR and the agent's share of the disk's bytes is under SMALL_SHARE, for SUSTAIN_S of the
  window; the processes are named from the disk_readers rows of those buckets;
- **the agent's own reads saturate the disk**: slow buckets where the device is over BUSY_UTIL and
  the agent's share over OWN_SHARE, for SUSTAIN_S. When the memory verdict is "cache thrashing",
  that verdict's cap raise is the fix and is not repeated here.
"""
from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from machine.proc_io import printable
from store import queries
from store.queries import Db
from store.units import human

AVERAGE_S = 5.0           # the judged bucket width (at least): a 1 s latency is one read's luck
BASELINE_S = 300.0        # calm buckets before the window that give the baseline too
REMEMBER_S = 86400.0      # how far back calm buckets are looked for when the window and BASELINE_S hold none
MIN_CALM = 2              # calm buckets needed for a baseline
SUSTAIN_S = 20.0          # slow seconds that make a trend, as the memory verdicts count them
SLOWER = 3.0              # a slow bucket's latency over the baseline, as a ratio...
SLOWER_BY_S = 0.5e-3      # ...and by at least this much: 0.2 ms against 0.06 ms is no slowdown
OTHERS_FLOOR = 4.0 * (1 << 20)   # B/s other processes read and write below which the disk is the agent's
SMALL_SHARE = 0.25        # the agent's share of the disk's bytes under which others crowd it out
OWN_SHARE = 0.5           # ...and over which the bytes are mostly its own
BUSY_UTIL = 0.9           # device busy (iostat %util / 100)
TOP = 3
DISK_VERDICTS = ("disk contention from another process", "the agent's own reads saturate the disk", "healthy",
                 "no data")
OTHERS = re.compile(r"io\.(?P<dev>.+)\.others_read_bytes_per_s\Z")
EXPERT_READS = "agent.expert_reads"   # event kind: what the agent's expert reads are, as reads_described says


def reads_described(backend: str, block_bytes: int, store_dir: str, disk: str | None) -> str:
    """What the agent's read latency measures: equal texts, equal reads (the EXPERT_READS event's message)."""
    return f"{backend} reads of {block_bytes} B expert blocks of {store_dir} on {disk or 'no block device'}"


def measuring_since(db: Db, until: float) -> float | None:
    """When the agent began reading what it reads at `until` (the first EXPERT_READS event after the last one
    that described other reads), or None when nothing else was read before (or a store without the events)."""
    marks = [e for e in queries.events(db, kind=EXPERT_READS) if e["t"] <= until]
    other = [i for i, e in enumerate(marks) if e["message"] != marks[-1]["message"]] if marks else []
    return marks[other[-1] + 1]["t"] if other else None


def did(read: float, write: float) -> str:
    """What other processes did to the disk, each counted from a tenth of it: read, wrote, or read and wrote."""
    total = read + write
    return "wrote" if read < 0.1 * total else "read" if write < 0.1 * total else "read and wrote"


@dataclass(frozen=True)
class Reader:
    """Another process reading or writing the agent's disk in the counted buckets (disk_readers rows)."""
    name: str
    pids: tuple[int, ...]
    seconds: int              # ticks it was among the top readers and writers
    read: float               # B/s read over those ticks
    write: float              # B/s written over those ticks
    peak: float               # the most B/s read and written in one tick

    @property
    def mean(self) -> float:
        return self.read + self.write

    @property
    def shown(self) -> str:
        """The name as a code span: a process names itself, and the Memory page renders Markdown (a name such
        as "[Apply](//x.co)" was a link there)."""
        return f"`{printable(self.name).replace('`', chr(39))}`"   # printable: stores before the escaping

    def sentence(self) -> str:
        pids = ", ".join(map(str, self.pids[-3:])) + (f" and {len(self.pids) - 3} more" if len(self.pids) > 3 else "")
        split = (f" ({human(self.read, 'B/s')} read, {human(self.write, 'B/s')} written)" if self.write else "")
        return (f"{self.shown} (pid {pids}): {human(self.mean, 'B/s')}{split} for {self.seconds} s, "
                f"peak {human(self.peak, 'B/s')}")


@dataclass(frozen=True)
class Bucket:
    start: float
    latency: float | None     # the agent's mean expert read latency, s
    agent: float              # B/s the agent read
    others_read: float        # B/s the device read for others
    others_write: float       # B/s the device wrote for others
    util: float | None

    @property
    def others(self) -> float:
        return self.others_read + self.others_write

    @property
    def share(self) -> float:
        total = self.agent + self.others
        return self.agent / total if total else 1.0

    @property
    def calm(self) -> bool:
        return self.latency is not None and self.others < OTHERS_FLOOR and (self.util is None or self.util < BUSY_UTIL)


@dataclass(frozen=True)
class Grid:
    """n equal buckets over [since, until], as queries.series cuts them."""
    since: float
    until: float
    n: int

    @classmethod
    def over(cls, since: float, until: float, width: float) -> "Grid":
        """The buckets nearest `width` wide that fill [since, until]."""
        return cls(since, until, max(1, round((until - since) / width)))

    @property
    def width(self) -> float:
        return (self.until - self.since) / self.n

    def index(self, t: float) -> int:
        """The bucket queries.series puts a point at time t in."""
        return min(int((t - self.since) // self.width), self.n - 1)


@dataclass(frozen=True)
class Baseline:
    latency: float            # the agent's calm read latency, s
    source: str               # where it came from, for the evidence


@dataclass(frozen=True)
class DiskDiagnosis:
    verdict: str              # one of DISK_VERDICTS
    summary: str
    device: str | None
    baseline: Baseline | None
    counted: tuple[Bucket, ...]   # the buckets that decided the verdict
    seconds: float            # how long they last
    readers: tuple[Reader, ...]
    recommendation: str | None
    changes: dict[str, Any] = field(default_factory=dict)

    @property
    def baseline_s(self) -> float | None:
        return self.baseline.latency if self.baseline else None

    def _mean(self, attr: str) -> float | None:
        values = [getattr(b, attr) for b in self.counted if getattr(b, attr) is not None]
        return sum(values) / len(values) if values else None

    def evidence(self) -> list[str]:
        """The numbers behind the verdict, one sentence each."""
        out = []
        if self.baseline is not None:
            out.append(f"the agent's expert read latency when its disk is calm: {human(self.baseline.latency, 's')} "
                       f"({self.baseline.source})")
        if self.counted:
            peak = max(b.latency for b in self.counted if b.latency is not None)
            out.append(f"in the {self.seconds:,.0f} s that count ({AVERAGE_S:.0f} s averages): read latency "
                       f"{human(self._mean('latency'), 's')} (peak {human(peak, 's')}); {self.device} read "
                       f"{human(self._mean('others_read'), 'B/s')} and wrote "
                       f"{human(self._mean('others_write'), 'B/s')} "
                       f"for other processes and read {human(self._mean('agent'), 'B/s')} for the agent (its share "
                       f"{self._mean('share'):.0%})" + (f", busy {self._mean('util'):.0%} of the time"
                                                         if self._mean('util') is not None else ""))
        out += [f"reader: {r.sentence()}" for r in self.readers]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "summary": self.summary, "device": self.device,
                "baseline_latency_s": self.baseline_s,
                "baseline_source": self.baseline.source if self.baseline else None, "seconds": self.seconds,
                "latency_s": self._mean("latency"), "others_read_bytes_per_s": self._mean("others_read"),
                "others_write_bytes_per_s": self._mean("others_write"),
                "agent_read_bytes_per_s": self._mean("agent"), "agent_share": self._mean("share"),
                "readers": [{"name": r.name, "pids": list(r.pids), "seconds": r.seconds, "read_bytes_per_s": r.read,
                             "write_bytes_per_s": r.write, "peak_bytes_per_s": r.peak} for r in self.readers],
                "evidence": self.evidence(),
                "recommendation": None if self.recommendation is None else {"text": self.recommendation,
                                                                            "changes": self.changes}}

    def lines(self) -> list[str]:
        out = [f"DISK: {self.verdict.upper()}: {self.summary}"]
        out += [f"  evidence: {e}" for e in self.evidence()]
        if self.device is not None:
            out.append(f"  rule: the agent's read latency over {SLOWER:g}x its calm baseline for {SUSTAIN_S:.0f} s "
                       f"while others read and write over {human(OTHERS_FLOOR, 'B/s')} and the agent's share is "
                       f"under {SMALL_SHARE:.0%} (contention), or the disk is over {BUSY_UTIL:.0%} busy and the share "
                       f"over {OWN_SHARE:.0%} (its own reads)")
        if self.recommendation is not None:
            out.append(f"recommendation: {self.recommendation}")
        return out


def agent_disk(db: Db, since: float, until: float) -> str | None:
    """The disk the collector found the agent reading from in [since, until]: the one with most samples."""
    counts = {m["dev"]: len(queries.points(db, name, since, until)[0])
              for name in queries.series_names(db) if (m := OTHERS.match(name))}
    counts = {dev: n for dev, n in counts.items() if n}
    return max(counts, key=counts.get) if counts else None


def buckets(db: Db, device: str, grid: Grid) -> list[Bucket]:
    """The bucket averages of the judged series on `grid` (the same buckets for every series)."""
    def averages(name: str) -> dict[float, float]:
        return {start: avg for start, _, avg, _ in queries.series(db, name, grid.since, grid.until, grid.n)}
    latency, agent = averages("agent.read_latency_s"), averages(f"io.{device}.agent_read_bytes_per_s")
    others, util = averages(f"io.{device}.others_read_bytes_per_s"), averages(f"block.{device}.util")
    writes = averages(f"io.{device}.others_write_bytes_per_s")   # none in a store of a collector that split reads only
    return [Bucket(start, latency.get(start), agent[start], others[start], writes.get(start, 0.0), util.get(start))
            for start in sorted(others) if start in agent]


def _median(calm: Sequence[Bucket]) -> float:
    return statistics.median(b.latency for b in calm)


def baseline(db: Db, device: str, grid: Grid, cells: Sequence[Bucket], window: float) -> Baseline | None:
    """The agent's calm read latency: from the calm ones of the `cells` of `grid` (the window and the
    BASELINE_S before it), else from the latest calm buckets remembered in the REMEMBER_S before it; either
    only since the agent began reading what it reads at the window's end (measuring_since)."""
    since = measuring_since(db, grid.until)
    since = -math.inf if since is None else since
    calm = [b for b in cells if b.calm and b.start >= since]
    if len(calm) >= MIN_CALM:
        return Baseline(_median(calm), f"median of {len(calm)} calm {grid.width:.0f} s averages in the "
                                       f"{window:,.0f} s judged and the {BASELINE_S:,.0f} s before")
    if since >= grid.since:
        return None
    earlier = Grid.over(grid.since - REMEMBER_S, grid.since, grid.width)
    calm = [b for b in buckets(db, device, earlier) if b.calm and b.start >= since]
    calm = calm[-max(MIN_CALM, round(BASELINE_S / grid.width)):]
    if len(calm) < MIN_CALM:
        return None
    ago = grid.since + BASELINE_S - (calm[-1].start + earlier.width)
    ago_text = f"{ago:,.0f} s" if ago < 600 else f"{ago / 60:,.0f} min"
    return Baseline(_median(calm), f"remembered: median of the last {len(calm)} calm {earlier.width:.0f} s averages "
                                   f"in the store, ending {ago_text} before the window; the window and the "
                                   f"{BASELINE_S:,.0f} s before it had no calm stretch")


def slow(b: Bucket, base: float) -> bool:
    return b.latency is not None and b.latency > SLOWER * base and b.latency - base > SLOWER_BY_S


def contended(b: Bucket) -> bool:
    return b.others >= OTHERS_FLOOR and b.share < SMALL_SHARE


def saturating(b: Bucket) -> bool:
    return b.util is not None and b.util >= BUSY_UTIL and b.share > OWN_SHARE


def readers(db: Db, device: str, counted: Sequence[Bucket], grid: Grid) -> tuple[Reader, ...]:
    """The TOP other readers and writers (by name) of `device` in the counted buckets of `grid`, most
    bytes first."""
    counted_at = {grid.index(b.start + grid.width / 2) for b in counted}
    rows = [r for r in queries.disk_readers(db, device, grid.since, grid.until) if grid.index(r["t"]) in counted_at]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    found = []
    for name, rs in by_name.items():
        ticks = len({r["t"] for r in rs})
        reads, writes = (sum(r[column] or 0.0 for r in rs) / ticks             # writes NULL in version 4's rows
                         for column in ("read_bytes_per_s", "write_bytes_per_s"))
        peak = max(r["read_bytes_per_s"] + (r["write_bytes_per_s"] or 0.0) for r in rs)
        found.append(Reader(name, tuple(dict.fromkeys(r["pid"] for r in rs)), ticks, reads, writes, peak))
    return tuple(sorted(found, key=lambda r: -r.mean * r.seconds)[:TOP])


def _pids(found: Sequence[Reader]) -> str:
    return " ".join(str(r.pids[-1]) for r in found)


def contention_fix(device: str, found: Sequence[Reader], relief: str) -> str:
    """What to do about the other readers and writers, then what the agent can do if they cannot move."""
    who = ", ".join(r.shown for r in found) or "the other process"
    pids = _pids(found)
    ionice = (f"`ionice -c3 -p {pids}` (idle class: it uses the disk only when it is otherwise idle; the bfq "
              f"and mq-deadline schedulers honour it for reads and direct writes, none does not: see "
              f"/sys/block/{device}/queue/scheduler), or start it so (`ionice -c3 COMMAND`)" if pids else
              "`ionice -c3 -p PID` (find it with `iotop -o` or `pidstat -d 1`)")
    return (f"Give {who} less of {device}: {ionice}; or throttle its cgroup (io.max rbps and wbps), or run it "
            f"when the agent is idle. If it cannot move: {relief}")


def judge_disk(db: Db, since: float, until: float, memory_verdict: str, relief: tuple[str, dict[str, Any]],
               n_buckets: int) -> DiskDiagnosis:
    """The disk verdict over [since, until] on buckets of at least AVERAGE_S, with the BASELINE_S before;
    `relief` is what a larger cache cap would cut of the agent's reads, and its knob change."""
    device = agent_disk(db, since - BASELINE_S, until)
    if device is None:
        return DiskDiagnosis("no data", "the collector has not split the agent's disk reads in this window: start "
                             "it with the agent's --pid-file (the agent must be reading its experts with "
                             "O_DIRECT).", None, None, (), 0.0, (), None)
    grid = Grid.over(since - BASELINE_S, until, max(AVERAGE_S, (until - since) / n_buckets))
    cells = buckets(db, device, grid)
    base = baseline(db, device, grid, cells, until - since)
    judged = [b for b in cells if b.start >= since - 1e-6]
    if base is None:
        found = readers(db, device, [b for b in judged if contended(b)], grid)
        busy = (f" Other processes used it hard meanwhile ({', '.join(r.sentence() for r in found)}): whether "
                f"they slow the agent shows once they pause." if found else "")
        return DiskDiagnosis("healthy", f"the agent's reads of {device} have no calm stretch to compare with "
                             f"(a cold start, the first reads of what it reads now, or a disk busy for all the "
                             f"{REMEMBER_S / 3600:,.0f} h remembered), so "
                             f"no slowdown is judged.{busy}", device, None, (), 0.0, found, None)
    for verdict, rule in (("disk contention from another process", contended),
                          ("the agent's own reads saturate the disk", saturating)):
        counted = tuple(b for b in judged if slow(b, base.latency) and rule(b))
        if len(counted) * grid.width >= SUSTAIN_S:
            break
    else:
        return DiskDiagnosis("healthy", f"the agent's expert reads of {device} were not sustainedly slower than "
                             f"its calm {human(base.latency, 's')}.", device, base, (), 0.0, (), None)
    seconds = len(counted) * grid.width
    slowed = (f"the agent's expert reads slowed from {human(base.latency, 's')} to "
              f"{human(sum(b.latency for b in counted) / len(counted), 's')} for {seconds:,.0f} s")
    if verdict == "disk contention from another process":
        found = readers(db, device, counted, grid)
        who = ", ".join(r.shown for r in found) or "another process (none named: none had a file on it open or mapped)"
        verb = did(sum(b.others_read for b in counted), sum(b.others_write for b in counted))
        return DiskDiagnosis(verdict, f"{slowed} while {who} {verb} {device}: another process's I/O, not the "
                             f"agent's reads, fills the disk.", device, base, counted, seconds, found,
                             contention_fix(device, found, relief[0]), relief[1])
    summary = f"{slowed} with {device} busy, mostly with the agent's own reads."
    if memory_verdict == "cache thrashing":
        return DiskDiagnosis(verdict, summary, device, base, counted, seconds, (),
                             "The cache-thrashing verdict's cap raise is the fix: its misses are these reads.")
    return DiskDiagnosis(verdict, summary, device, base, counted, seconds, (),
                         f"{relief[0]} Otherwise the disk is the limit: a faster one, or smaller (quantised) "
                         f"experts.", relief[1])
