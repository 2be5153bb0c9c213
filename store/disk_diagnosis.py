"""Disk diagnosis from the store: is the agent's expert reading slowed by another process reading its
disk (and which), by its own reads, or not at all; the evidence in numbers, and the fix.

`disk_diagnosis.judge_disk` runs inside `store.diagnosis.diagnose`, so the dashboard's Memory page and
`flashmoe-cli diagnose` show it beside the memory verdict. It judges AVERAGE_S bucket averages of the
agent's mean expert read latency (agent.read_latency_s) and of the collector's split of its disk's
reads (io.{dev}.*, collector.samplers.DiskReadersSampler; block.{dev}.util):
- the agent's **baseline** is the median latency of its calm buckets (others reading under
  OTHERS_FLOOR, the device under BUSY_UTIL) in the window and the BASELINE_S before it; without
  MIN_CALM of them there is nothing to compare with (a cold start), and no verdict but healthy;
- a bucket is **slow** when the latency is over SLOWER x the baseline and SLOWER_BY_S above it;
- **disk contention from another process**: slow buckets where the others read over OTHERS_FLOOR
  and the agent's share of the disk's reads is under SMALL_SHARE, for SUSTAIN_S of the window;
  the processes are named from the disk_readers rows of those buckets;
- **the agent's own reads saturate the disk**: slow buckets where the device is over BUSY_UTIL and
  the agent's share over OWN_SHARE, for SUSTAIN_S. When the memory verdict is "cache thrashing",
  that verdict's cap raise is the fix and is not repeated here.
"""
from __future__ import annotations

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
MIN_CALM = 2              # calm buckets needed for a baseline
SUSTAIN_S = 20.0          # slow seconds that make a trend, as the memory verdicts count them
SLOWER = 3.0              # a slow bucket's latency over the baseline, as a ratio...
SLOWER_BY_S = 0.5e-3      # ...and by at least this much: 0.2 ms against 0.06 ms is no slowdown
OTHERS_FLOOR = 4.0 * (1 << 20)   # B/s other processes read below which the disk is the agent's
SMALL_SHARE = 0.25        # the agent's share of the disk's reads under which others crowd it out
OWN_SHARE = 0.5           # ...and over which the reads are mostly its own
BUSY_UTIL = 0.9           # device busy (iostat %util / 100)
TOP = 3
DISK_VERDICTS = ("disk contention from another process", "the agent's own reads saturate the disk", "healthy",
                 "no data")
OTHERS = re.compile(r"io\.(?P<dev>.+)\.others_read_bytes_per_s\Z")


@dataclass(frozen=True)
class Reader:
    """Another process reading the agent's disk in the counted buckets (disk_readers rows)."""
    name: str
    pids: tuple[int, ...]
    seconds: int              # ticks it was among the top readers
    mean: float               # B/s over those ticks
    peak: float

    @property
    def shown(self) -> str:
        """The name as a code span: a process names itself, and the Memory page renders Markdown (a name such
        as "[Apply](//x.co)" was a link there)."""
        return f"`{printable(self.name).replace('`', chr(39))}`"   # printable: stores before the escaping

    def sentence(self) -> str:
        pids = ", ".join(map(str, self.pids[-3:])) + (f" and {len(self.pids) - 3} more" if len(self.pids) > 3 else "")
        return (f"{self.shown} (pid {pids}): {human(self.mean, 'B/s')} for {self.seconds} s, "
                f"peak {human(self.peak, 'B/s')}")


@dataclass(frozen=True)
class Bucket:
    start: float
    latency: float | None     # the agent's mean expert read latency, s
    agent: float              # B/s the agent read
    others: float             # B/s the device read for others
    util: float | None

    @property
    def share(self) -> float:
        total = self.agent + self.others
        return self.agent / total if total else 1.0


@dataclass(frozen=True)
class DiskDiagnosis:
    verdict: str              # one of DISK_VERDICTS
    summary: str
    device: str | None
    baseline_s: float | None  # the agent's calm read latency
    counted: tuple[Bucket, ...]   # the buckets that decided the verdict
    seconds: float            # how long they last
    readers: tuple[Reader, ...]
    recommendation: str | None
    changes: dict[str, Any] = field(default_factory=dict)

    def _mean(self, attr: str) -> float | None:
        values = [getattr(b, attr) for b in self.counted if getattr(b, attr) is not None]
        return sum(values) / len(values) if values else None

    def evidence(self) -> list[str]:
        """The numbers behind the verdict, one sentence each."""
        out = []
        if self.baseline_s is not None:
            out.append(f"the agent's expert read latency when its disk is calm: {human(self.baseline_s, 's')}")
        if self.counted:
            peak = max(b.latency for b in self.counted if b.latency is not None)
            out.append(f"in the {self.seconds:,.0f} s that count ({AVERAGE_S:.0f} s averages): read latency "
                       f"{human(self._mean('latency'), 's')} (peak {human(peak, 's')}); {self.device} read "
                       f"{human(self._mean('others'), 'B/s')} for other processes and "
                       f"{human(self._mean('agent'), 'B/s')} for the agent (its share "
                       f"{self._mean('share'):.0%})" + (f", busy {self._mean('util'):.0%} of the time"
                                                         if self._mean('util') is not None else ""))
        out += [f"reader: {r.sentence()}" for r in self.readers]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "summary": self.summary, "device": self.device,
                "baseline_latency_s": self.baseline_s, "seconds": self.seconds,
                "latency_s": self._mean("latency"), "others_read_bytes_per_s": self._mean("others"),
                "agent_read_bytes_per_s": self._mean("agent"), "agent_share": self._mean("share"),
                "readers": [{"name": r.name, "pids": list(r.pids), "seconds": r.seconds,
                             "read_bytes_per_s": r.mean, "peak_read_bytes_per_s": r.peak} for r in self.readers],
                "evidence": self.evidence(),
                "recommendation": None if self.recommendation is None else {"text": self.recommendation,
                                                                            "changes": self.changes}}

    def lines(self) -> list[str]:
        out = [f"DISK: {self.verdict.upper()}: {self.summary}"]
        out += [f"  evidence: {e}" for e in self.evidence()]
        if self.device is not None:
            out.append(f"  rule: the agent's read latency over {SLOWER:g}x its calm baseline for {SUSTAIN_S:.0f} s "
                       f"while others read over {human(OTHERS_FLOOR, 'B/s')} and the agent's share is under "
                       f"{SMALL_SHARE:.0%} (contention), or the disk is over {BUSY_UTIL:.0%} busy and the share "
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


def buckets(db: Db, device: str, since: float, until: float, n: int) -> list[Bucket]:
    """The aligned bucket averages (same since, until and n for every series) of the judged series."""
    def averages(name: str) -> dict[float, float]:
        return {start: avg for start, _, avg, _ in queries.series(db, name, since, until, n)}
    latency, agent = averages("agent.read_latency_s"), averages(f"io.{device}.agent_read_bytes_per_s")
    others, util = averages(f"io.{device}.others_read_bytes_per_s"), averages(f"block.{device}.util")
    return [Bucket(start, latency.get(start), agent[start], others[start], util.get(start))
            for start in sorted(others) if start in agent]


def baseline(grid: Sequence[Bucket]) -> float | None:
    calm = [b.latency for b in grid if b.latency is not None and b.others < OTHERS_FLOOR
            and (b.util is None or b.util < BUSY_UTIL)]
    return statistics.median(calm) if len(calm) >= MIN_CALM else None


def slow(b: Bucket, base: float) -> bool:
    return b.latency is not None and b.latency > SLOWER * base and b.latency - base > SLOWER_BY_S


def contended(b: Bucket) -> bool:
    return b.others >= OTHERS_FLOOR and b.share < SMALL_SHARE


def saturating(b: Bucket) -> bool:
    return b.util is not None and b.util >= BUSY_UTIL and b.share > OWN_SHARE


def readers(db: Db, device: str, counted: Sequence[Bucket], since: float, until: float, n: int
            ) -> tuple[Reader, ...]:
    """The TOP other readers (by name) of `device` in the counted buckets of the grid of `n` over
    [since, until] (a row in the bucket queries.series puts its time in), most bytes first."""
    width = (until - since) / n
    counted_at = {round((b.start - since) / width) for b in counted}
    rows = [r for r in queries.disk_readers(db, device, since, until)
            if min(int((r["t"] - since) // width), n - 1) in counted_at]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    found = [Reader(name, tuple(dict.fromkeys(r["pid"] for r in rs)), len({r["t"] for r in rs}),
                    sum(r["read_bytes_per_s"] for r in rs) / len({r["t"] for r in rs}),
                    max(r["read_bytes_per_s"] for r in rs)) for name, rs in by_name.items()]
    return tuple(sorted(found, key=lambda r: -r.mean * r.seconds)[:TOP])


def _pids(found: Sequence[Reader]) -> str:
    return " ".join(str(r.pids[-1]) for r in found)


def contention_fix(device: str, found: Sequence[Reader], relief: str) -> str:
    """What to do about the other readers, then what the agent can do if they cannot move."""
    who = ", ".join(r.shown for r in found) or "the other reader"
    pids = _pids(found)
    ionice = (f"`ionice -c3 -p {pids}` (idle class: it reads only when the disk is otherwise idle; the bfq "
              f"and mq-deadline schedulers honour it, none does not: see /sys/block/{device}/queue/scheduler), "
              f"or start it so (`ionice -c3 COMMAND`)" if pids else "`ionice -c3 -p PID` (find it with "
              "`iotop -o` or `pidstat -d 1`)")
    return (f"Give {who} less of {device}: {ionice}; or throttle its cgroup (io.max rbps), or run it when the "
            f"agent is idle. If it cannot move: {relief}")


def judge_disk(db: Db, since: float, until: float, memory_verdict: str, relief: tuple[str, dict[str, Any]],
               n_buckets: int) -> DiskDiagnosis:
    """The disk verdict over [since, until] on buckets of at least AVERAGE_S, with the BASELINE_S before;
    `relief` is what a larger cache cap would cut of the agent's reads, and its knob change."""
    device = agent_disk(db, since - BASELINE_S, until)
    if device is None:
        return DiskDiagnosis("no data", "the collector has not split the agent's disk reads in this window: start "
                             "it with the agent's --pid-file (the agent must be reading its experts with "
                             "O_DIRECT).", None, None, (), 0.0, (), None)
    width = max(AVERAGE_S, (until - since) / n_buckets)
    n = max(1, round((until - since + BASELINE_S) / width))
    width = (until - since + BASELINE_S) / n
    grid = buckets(db, device, since - BASELINE_S, until, n)
    base = baseline(grid)
    judged = [b for b in grid if b.start >= since - 1e-6]
    if base is None:
        crowded = tuple(b for b in judged if contended(b))
        found = readers(db, device, crowded, since - BASELINE_S, until, n)
        busy = (f" Other processes read it hard meanwhile ({', '.join(r.sentence() for r in found)}): whether "
                f"they slow the agent shows once they pause." if found else "")
        return DiskDiagnosis("healthy", f"the agent's reads of {device} have no calm stretch to compare with "
                             f"(a cold start, or a disk busy all along), so no slowdown is judged.{busy}",
                             device, None, (), 0.0, found, None)
    for verdict, rule in (("disk contention from another process", contended),
                          ("the agent's own reads saturate the disk", saturating)):
        counted = tuple(b for b in judged if slow(b, base) and rule(b))
        if len(counted) * width >= SUSTAIN_S:
            break
    else:
        return DiskDiagnosis("healthy", f"the agent's expert reads of {device} were not sustainedly slower than "
                             f"its calm {human(base, 's')}.", device, base, (), 0.0, (), None)
    seconds = len(counted) * width
    lat = sum(b.latency for b in counted) / len(counted)
    if verdict == "disk contention from another process":
        found = readers(db, device, counted, since - BASELINE_S, until, n)
        who = ", ".join(r.shown for r in found) or "another process (none named: no reader had a file open on it)"
        return DiskDiagnosis(verdict, f"the agent's expert reads slowed from {human(base, 's')} to {human(lat, 's')} "
                             f"for {seconds:,.0f} s while {who} read {device}: another process's reads, not the "
                             f"agent's, fill the disk.", device, base, counted, seconds, found,
                             contention_fix(device, found, relief[0]), relief[1])
    summary = (f"the agent's expert reads slowed from {human(base, 's')} to {human(lat, 's')} for {seconds:,.0f} s "
               f"with {device} busy, mostly with the agent's own reads.")
    if memory_verdict == "cache thrashing":
        return DiskDiagnosis(verdict, summary, device, base, counted, seconds, (),
                             "The cache-thrashing verdict's cap raise is the fix: its misses are these reads.")
    return DiskDiagnosis(verdict, summary, device, base, counted, seconds, (),
                         f"{relief[0]} Otherwise the disk is the limit: a faster one, or smaller (quantised) "
                         f"experts.", relief[1])
