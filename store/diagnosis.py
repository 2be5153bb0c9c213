"""Memory-thrash diagnosis from the store: who thrashes, the evidence in numbers, and the fix; with
the agent's disk judged beside it (store.disk_diagnosis: another process's reads slowing the agent's).

One function, `diagnose`, is behind the dashboard's Memory page and `flashmoe-cli diagnose`. It
tells apart:
- **agent thrashing**: the agent's own pages are dropped and read back — its major faults, its
  cgroup's workingset refaults and major faults (memory.stat), its cgroup's memory PSI where cgroup
  v2 offers it. The fix is a smaller cache, within the agent's knob bounds.
- **pressure from another process**: the machine stalls on memory (PSI) or re-reads pages it just
  dropped (refaults) while the agent's own counters stay flat. The fix is outside the agent;
  shrinking its cache would only slow it down.
- **cache thrashing**: memory is calm but most expert lookups (over 60%, in 10 s averages) miss on a
  block the cache held and evicted (first reads do not count, so a cold start is not thrash): the cap is below
  the working set, and a larger one, where the bounds allow, turns those misses into hits. Judged on
  lookups, not on misses: at a hit rate of 0.95 nearly every miss is a re-read.
- **healthy**, or **no data** when the collector has written no memory signal in the window.

A signal counts when its bucket averages stay over the threshold for SUSTAIN_S seconds of the
window: an agent's start-up burst of faults or one busy second is not thrash. Thresholds are data
(THRESHOLDS), so the page draws each on its chart and every verdict states the ones it used.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from machine.memory import SHORT_SHARE
from store import queries
from store.disk_diagnosis import DiskDiagnosis, judge_disk
from store.errors import StoreError
from store.queries import Bucket, Db
from store.cli import parse_time
from store.units import human

log = logging.getLogger(__name__)
SUSTAIN_S = 20.0          # seconds over a threshold that make a trend rather than a spike
SAMPLE_S = 1.0            # the collector's and the agent's sampling interval: one bucket holds at least this much
BUCKETS = 240             # the judged resolution; the page charts the same buckets
SHRINK = 0.75             # a thrashing agent's cache steps down by a quarter, then the evidence says if that was enough
GROW = 4.0                # a cache thrashing below its working set steps up fourfold, within memory and its bounds
MIB = 1 << 20
VERDICTS = ("agent thrashing", "pressure from another process", "cache thrashing", "healthy", "no data")
CAP = "cache_cap_bytes"
SHARED = "cgroup.agent.other_processes"
REREADS = "agent.reread_rate"


@dataclass(frozen=True)
class Threshold:
    series: str
    label: str
    limit: float
    unit: str                 # the series' catalogue unit
    side: str                 # "agent", "system" or "cache": whose trouble it shows
    average_s: float = 0.0    # judged on averages over at least this many seconds; 0: the window's buckets

    def text(self) -> str:
        return f"{self.label} above {human(self.limit, self.unit)}"


THRESHOLDS: tuple[Threshold, ...] = (
    Threshold("mem.agent.majflt_per_s", "agent major faults", 50.0, "1/s", "agent"),
    Threshold("cgroup.agent.pgmajfault_per_s", "agent cgroup major faults", 50.0, "1/s", "agent"),
    Threshold("cgroup.agent.workingset_refault_file_per_s", "agent cgroup file refaults", 500.0, "1/s", "agent"),
    Threshold("cgroup.agent.workingset_refault_anon_per_s", "agent cgroup anon refaults", 100.0, "1/s", "agent"),
    Threshold("cgroup.agent.psi_full_avg10", "agent cgroup memory PSI full (avg10)", 2.0, "%", "agent"),
    Threshold("psi.memory.some_avg10", "memory PSI some (avg10)", 10.0, "%", "system"),
    Threshold("psi.memory.full_avg10", "memory PSI full (avg10)", 2.0, "%", "system"),
    Threshold("vm.workingset_refault_file_per_s", "system file refaults", 10_000.0, "1/s", "system"),
    Threshold("vm.workingset_refault_anon_per_s", "system anon refaults", 1_000.0, "1/s", "system"),
    # 10 s averages: the agent's per-second rate is noisy (the small demo at its default cap: mean 0.46, a
    # fifth of its seconds over 0.5, 10 s averages 0.42-0.52; at its smallest cap every second 0.66-0.72)
    Threshold(REREADS, "expert lookups re-reading a block the cache evicted", 0.6, "fraction", "cache",
              average_s=10.0),
)


def shared(threshold: Threshold, others: int) -> Threshold:
    """A threshold on the agent's cgroup when `others` processes share that cgroup: its counters are
    theirs too, so they tell of pressure from another process, and only the agent's own faults
    (mem.agent.*) can tell that the agent thrashes."""
    if not others or not threshold.series.startswith("cgroup.agent."):
        return threshold
    return replace(threshold, side="system",
                   label=f"{threshold.label} (a cgroup shared with {others} other process{'es' * (others > 1)})")


@dataclass(frozen=True)
class Signal:
    """One threshold judged over the window: the bucket averages and how long they stayed over."""
    threshold: Threshold
    buckets: list[Bucket]
    peak: float               # the highest bucket average
    mean: float               # of the bucket averages
    seconds_over: float

    @property
    def sustained(self) -> bool:
        return self.seconds_over >= SUSTAIN_S

    def sentence(self) -> str:
        th = self.threshold
        over = (f"over {human(th.limit, th.unit)} for {self.seconds_over:,.0f} s" if self.seconds_over
                else f"never over {human(th.limit, th.unit)}")
        averaged = f" ({th.average_s:.0f} s averages)" if th.average_s else ""
        return f"{th.label}{averaged}: peak {human(self.peak, th.unit)}, mean {human(self.mean, th.unit)}, {over}"

    def as_dict(self) -> dict[str, Any]:
        th = self.threshold
        return {"series": th.series, "label": th.label, "side": th.side, "threshold": th.limit, "unit": th.unit,
                "peak": self.peak, "mean": self.mean, "seconds_over": self.seconds_over,
                "sustained": self.sustained, "text": self.sentence()}


@dataclass(frozen=True)
class Recommendation:
    text: str                                               # what to do and what to expect
    changes: dict[str, Any] = field(default_factory=dict)   # knob -> value; empty when the fix is not a knob


@dataclass(frozen=True)
class Diagnosis:
    verdict: str              # one of VERDICTS
    summary: str
    since: float
    until: float
    signals: tuple[Signal, ...]
    unsampled: tuple[Threshold, ...]   # thresholds whose series has no point in the window
    recommendation: Recommendation | None
    disk: DiskDiagnosis       # the agent's disk, judged beside memory (store.disk_diagnosis)

    @property
    def evidence(self) -> tuple[Signal, ...]:
        """The signals that decided the verdict: those sustained over their thresholds."""
        return tuple(s for s in self.signals if s.sustained)

    def signal(self, series: str) -> Signal | None:
        return next((s for s in self.signals if s.threshold.series == series), None)

    def as_dict(self) -> dict[str, Any]:
        rec = self.recommendation
        return {"verdict": self.verdict, "summary": self.summary, "since": self.since, "until": self.until,
                "sustain_s": SUSTAIN_S, "signals": [s.as_dict() for s in self.signals],
                "unsampled": [th.series for th in self.unsampled],
                "recommendation": None if rec is None else {"text": rec.text, "changes": rec.changes},
                "disk": self.disk.as_dict()}

    def lines(self) -> list[str]:
        """The verdict as the CLI prints it: verdict, evidence, the rest of the signals, the fix."""
        out = [f"{self.verdict.upper()}: {self.summary}"]
        out += [f"  evidence: {s.sentence()}" for s in self.evidence]
        out += [f"  calm:     {s.sentence()}" for s in self.signals if not s.sustained]
        if self.unsampled:
            out.append("  not sampled: " + ", ".join(th.label for th in self.unsampled))
        out.append(f"  rule: a signal counts when it stays over its threshold for {SUSTAIN_S:.0f} s of the window")
        if self.recommendation is not None:
            out.append(f"recommendation: {self.recommendation.text}")
        return out + self.disk.lines()


@dataclass(frozen=True)
class Facts:
    """What a recommendation needs besides the signals: the cap, its bounds, the memory around it."""
    cap: float | None
    cap_min: float | None
    cap_max: float | None
    cgroup_limit: float | None
    available: float | None
    cgroup_others: int = 0    # processes besides the agent in its memory cgroup: its counters are theirs too
    total: float | None = None  # the machine's memory
    hit_rate: float | None = None          # the cache's, over the window: what a cap change moves
    read_bytes_per_s: float | None = None  # expert bytes read from the SSD, over the window


def judge(threshold: Threshold, buckets: Sequence[Bucket], width_s: float) -> Signal:
    """The threshold judged on bucket averages that are `width_s` seconds apart."""
    averages = [avg for _, _, avg, _ in buckets]
    over = sum(1 for v in averages if v > threshold.limit)
    return Signal(threshold, list(buckets), max(averages), sum(averages) / len(averages),
                  over * max(width_s, SAMPLE_S))


def verdict_of(signals: Sequence[Signal]) -> str:
    """The first side, in order agent, system, cache, with a sustained signal; "no data" without any
    memory signal (the cache's re-reads alone cannot tell whether memory is short)."""
    if all(s.threshold.side == "cache" for s in signals):
        return "no data"
    sides = {s.threshold.side for s in signals if s.sustained}
    for side, verdict in (("agent", "agent thrashing"), ("system", "pressure from another process"),
                          ("cache", "cache thrashing")):
        if side in sides:
            return verdict
    return "healthy"


SUMMARIES = {
    "agent thrashing": "the agent's own pages are dropped and read back faster than it works.",
    "pressure from another process": "pages are dropped and read back on this box (the machine short of memory, "
                                     "or another process's own limit), but the agent's own fault and refault "
                                     "counters stayed flat: something else is thrashing.",
    "cache thrashing": "memory is calm, but most expert lookups re-read a block the cache held and evicted: "
                       "its cap is below the working set.",
    "healthy": "no memory signal stayed over its threshold.",
    "no data": "no memory signal in the store for this window: start the collector "
               "(`flashmoe-cli collect --db ... --pid-file ...`) and come back in a few seconds.",
}


def _mib_floor(n: float) -> int:
    return int(n // MIB * MIB)


def _size(n: float) -> str:
    return human(n, "B")


def _most_allowed(facts: Facts) -> str:
    """Why the cap's upper bound is what it is, e.g. "70% of its memory limit of 700 MiB"."""
    return f"70% of its memory limit{f' of {_size(facts.cgroup_limit)}' if facts.cgroup_limit else ''}"


def _outside(facts: Facts, signals: Sequence[Signal]) -> str:
    """Why the fix for another process's shortage is not the agent's cache, and what it is. Whether a
    smaller cache would help at all depends on where memory is short: the machine as a whole (then
    the cache's slots are memory handed back) or inside the other process's own limit (then not)."""
    flat = [s for s in signals if s.threshold.side == "agent"]
    calm = ("its own counters stayed low (" + "; ".join(f"{s.threshold.label} peak {human(s.peak, s.threshold.unit)}"
                                                       for s in flat) + "). ") if flat else ""
    available, total = facts.available, facts.total
    if available is None or not total:
        why = ("A smaller cache would slow the agent, and help only if the machine as a whole is short of memory "
               "(not sampled here). ")
    elif available < SHORT_SHARE * total:
        why = (f"The machine as a whole is short too ({_size(available)} of {_size(total)} available): a smaller "
               f"cache cap would hand memory back at the cost of the agent's hit rate, but the cause is elsewhere. ")
    else:
        why = (f"Shrinking the agent's cache would slow it without freeing the memory that is short: the machine "
               f"has {_size(available)} of {_size(total)} available, so the shortage is inside another process's "
               f"own memory limit. ")
    shared = (f" The agent's memory cgroup holds {facts.cgroup_others} other process"
              f"{'es' * (facts.cgroup_others > 1)} too: give the agent a cgroup of its own, so that its cgroup's "
              f"counters are its own." if facts.cgroup_others else "")
    return (f"The fix is outside the agent: {calm}{why}Find the process re-reading its pages (`ps -eo "
            f"pid,maj_flt,rss,comm --sort=-maj_flt | head`, or the workingset_refault lines of each cgroup's "
            f"memory.stat) and give it more memory or stop it.{shared}")


def _cache_evidence(facts: Facts) -> str:
    """The cache's hit rate and SSD reads over the window, e.g. " (hit rate 0.30, SSD reads 9.8 MiB/s)"."""
    said = ([f"hit rate {facts.hit_rate:.2f}"] if facts.hit_rate is not None else []) + (
        [f"SSD reads {human(facts.read_bytes_per_s, 'B/s')}"] if facts.read_bytes_per_s is not None else [])
    return f" ({', '.join(said)})" if said else ""


def raised_cap(facts: Facts) -> int:
    """The cap GROW times larger, within its bound and half the memory available."""
    room = facts.cap + facts.available / 2 if facts.available is not None else facts.cap_max
    return min(int(facts.cap_max), _mib_floor(min(facts.cap * GROW, room)))


def cap_relief(facts: Facts, reread: float | None) -> tuple[str, dict[str, Any]]:
    """What the larger cap the cache-thrashing verdict would advise (raised_cap) cuts of the agent's reads,
    for the disk verdict: at most
    its re-reads (lookups missing on a block it held), reread / (1 - hit rate) of its misses; first
    reads no cap avoids."""
    cap, h, reads = facts.cap, facts.hit_rate, facts.read_bytes_per_s
    if cap is None or facts.cap_max is None or h is None or reread is None or reads is None or h >= 1:
        return "Whether a larger cache cap would cut its reads is unknown here (no cap, hit rate or re-read rate " \
               "recorded in the window).", {}
    share = min(1.0, reread / (1 - h))
    new = raised_cap(facts)
    if new <= cap:
        return (f"The cache cap ({human(cap, 'B')}) is already the most memory allows, so the agent's reads "
                f"cannot be cut that way."), {}
    return (f"Raising the cache cap from {human(cap, 'B')} to {human(new, 'B')} would cut at most {share:.0%} of "
            f"its reads ({human(reads * share, 'B/s')} of {human(reads, 'B/s')}): the re-reads of blocks it "
            f"held (re-read rate {reread:.2f} at hit rate {h:.2f}); the rest are first reads no cap "
            f"avoids."), {CAP: new}



def recommend(verdict: str, facts: Facts, signals: Sequence[Signal]) -> Recommendation | None:
    """The fix for `verdict`: a cap within [cap_min, cap_max] and what to expect, or what to do instead.
    A cap above its bound (the agent's memory limit fell) is brought to the bound whatever the verdict."""
    cap, lo, hi = facts.cap, facts.cap_min, facts.cap_max
    over = cap is not None and hi is not None and cap > hi
    if verdict == "no data":
        return None
    if verdict == "pressure from another process":
        outside = _outside(facts, signals)
        if not over:
            return Recommendation(outside)
        return Recommendation(
            f"{outside} Apart from that, the agent's cache cap of {_size(cap)} is above the most it allows now "
            f"({_size(hi)}, {_most_allowed(facts)}): set it to {_size(hi)} so its own cache fits inside that "
            f"limit once it fills.", {CAP: int(hi)})
    if cap is None or lo is None or hi is None:
        return None if verdict == "healthy" else Recommendation(
            "The agent's cache cap and its bounds are unknown (no agent answering and none recorded in the "
            "store); start the agent to get a cap recommendation.")
    if over:
        return Recommendation(
            f"Set the cache cap to {_size(hi)}, the most the agent allows now ({_most_allowed(facts)}): the cap of "
            f"{_size(cap)} is above it since the limit fell. Expect the agent's major faults and refaults to fall "
            f"under their thresholds within a minute.", {CAP: int(hi)})
    if verdict == "agent thrashing":
        if cap <= lo:
            return Recommendation(
                f"The cache is already at its minimum ({_size(lo)}, one layer's working set): the agent needs "
                f"more memory. Raise its memory limit"
                f"{f' (now {_size(facts.cgroup_limit)})' if facts.cgroup_limit else ''} or run it on a larger machine.")
        new = max(int(lo), _mib_floor(cap * SHRINK))
        return Recommendation(
            f"Shrink the cache cap from {_size(cap)} to {_size(new)}: its slots give {_size(cap - new)} back to the "
            f"pages the agent keeps re-reading. Expect its major faults and refaults to fall under their "
            f"thresholds within a minute; if they do not, shrink again.", {CAP: new})
    if verdict == "cache thrashing":
        new = raised_cap(facts)
        if new <= cap:
            return Recommendation(
                f"The cache cap ({_size(cap)}) is already the most memory allows{_cache_evidence(facts)}: a larger "
                f"machine, or a model with smaller experts, is the fix.")
        return Recommendation(
            f"Raise the cache cap from {_size(cap)} to {_size(new)}{_cache_evidence(facts)}: the blocks it re-reads "
            f"are ones it held, so a larger cache keeps more of them. Expect the re-read rate and the SSD reads to "
            f"fall within a minute; if the re-read rate stays over its threshold, raise the cap again. The memory "
            f"signals here will show what it costs.", {CAP: new})
    return None


def cache_also(verdict: str, facts: Facts, signals: Sequence[Signal]) -> str:
    """What the cache's re-reads need when a memory verdict hides them (verdict_of names one side): the
    memory verdict's fix does not cure them, and a shrink makes them worse."""
    rereads = next((s for s in signals if s.threshold.series == REREADS and s.sustained), None)
    if rereads is None or verdict not in ("agent thrashing", "pressure from another process"):
        return ""
    seen = (f"The cache thrashes too: {rereads.sentence()}{_cache_evidence(facts)}. Its cap is below the working "
            f"set, so ")
    if verdict == "agent thrashing":
        return seen + ("a smaller cap costs more SSD reads; the lasting fix is more memory for the agent (a higher "
                       "memory limit), then a larger cap.")
    if facts.cap is None or facts.cap_max is None or (new := raised_cap(facts)) <= facts.cap:
        return seen + "a larger machine or smaller experts would cure it: the cap cannot be raised (see its bounds)."
    if facts.available is not None and facts.total and facts.available >= SHORT_SHARE * facts.total:
        return seen + (f"raise the cap to {_size(new)} now: the machine has {_size(facts.available)} of "
                       f"{_size(facts.total)} available, so a larger cache takes none of the memory that is short.")
    return seen + (f"once memory is no longer short, raise the cap to {_size(new)}; while it is, a larger cache "
                   f"would take memory the machine lacks.")


@dataclass(frozen=True)
class Effect:
    """A signal before and after a change: what the page shows once a recommendation is applied."""
    threshold: Threshold
    before: float | None      # mean over the BEFORE_S before the change
    after: float | None       # mean from SETTLE_S after the change on (None: no sample yet)

    @property
    def improved(self) -> bool:
        return (self.before is not None and self.after is not None
                and self.after <= min(self.before, self.threshold.limit))

    def sentence(self) -> str:
        th = self.threshold
        if self.after is None:
            return f"{th.label}: {human(self.before, th.unit)} before; no samples yet since the change took hold"
        state = ("improved: under its threshold" if self.improved else
                 "not yet under its threshold" if self.after > th.limit else "no better")
        return f"{th.label}: {human(self.before, th.unit)} before, {human(self.after, th.unit)} since ({state})"


BEFORE_S = 60.0
SETTLE_S = 10.0           # PSI's avg10 and the per-second rates need this long to show a change


def effect(db: Db, changed_at: float, until: float, series: Sequence[str]) -> list[Effect]:
    """Each threshold's signal in `series` before the change at `changed_at` and after it (to `until`)."""
    def mean(name: str, lo: float, hi: float) -> float | None:
        if hi < lo:
            return None
        _, values = queries.points(db, name, lo, hi)
        return float(values.mean()) if len(values) else None
    return [Effect(th, mean(th.series, changed_at - BEFORE_S, changed_at),
                   mean(th.series, changed_at + SETTLE_S, until))
            for th in THRESHOLDS if th.series in series]


def facts(db: Db, knobs: Mapping[str, Mapping[str, Any]] | None, since: float, until: float) -> Facts:
    """The cap and its bounds from GET /v1/knobs when given (live), else as the agent last recorded them;
    the most processes that shared the agent's cgroup from `since` to `until`."""
    def last(name: str) -> float | None:
        point = queries.latest(db, name)
        return point[1] if point else None

    def mean(name: str) -> float | None:
        _, values = queries.points(db, name, since, until)
        return float(values.mean()) if len(values) else None
    cap = knobs.get(CAP) if knobs else None
    if cap is not None:
        value, lo, hi = cap["value"], cap.get("min"), cap.get("max")
    else:
        value, lo, hi = (last("agent.cache_cap_bytes"), last("agent.cache_cap_min_bytes"),
                         last("agent.cache_cap_max_bytes"))
    others = max((most for *_, most in queries.series(db, SHARED, since, until, 1)), default=0)
    return Facts(value, lo, hi, last("cgroup.agent.limit_bytes"), last("mem.available_bytes"), int(others),
                 last("mem.total_bytes"), mean("agent.hit_rate"), mean("agent.read_bytes_per_s"))


def diagnose(db: str | Path, window: float = 300.0, until: float | None = None,
             knobs: Mapping[str, Mapping[str, Any]] | None = None, buckets: int = BUCKETS) -> Diagnosis:
    """Judge memory thrash over the `window` seconds before `until` (default now) and recommend a
    fix. `knobs` is the agent's GET /v1/knobs answer when it is reachable; without it the cap and
    its bounds are the ones the agent last recorded in the store."""
    if not (math.isfinite(window) and window > 0):
        raise ValueError(f"window must be a positive number of seconds, not {window!r}")
    until = time.time() if until is None else until
    conn = queries.connect_ro(db)
    if conn is None:
        raise StoreError(f"there is no store at {db} yet; start the collector and the agent with "
                         f"--db {db}, or point --db at the file they write")
    try:
        signals, unsampled = [], []
        known = facts(conn, knobs, until - window, until)
        for th in THRESHOLDS:
            n = max(1, min(buckets, int(window // th.average_s))) if th.average_s else buckets
            rows = queries.series(conn, th.series, until - window, until, n)
            if rows:
                signals.append(judge(shared(th, known.cgroup_others), rows, window / n))
            else:
                unsampled.append(th)
        verdict = verdict_of(signals)
        recommendation = recommend(verdict, known, signals)
        if recommendation is not None and (also := cache_also(verdict, known, signals)):
            recommendation = replace(recommendation, text=f"{recommendation.text} {also}")
        rereads = next((s.mean for s in signals if s.threshold.series == REREADS), None)
        disk = judge_disk(conn, until - window, until, verdict, cap_relief(known, rereads), buckets)
    finally:
        conn.close()
    summary = SUMMARIES[verdict] if verdict != "no data" else _no_data(db, until - window, until)
    return Diagnosis(verdict, summary, until - window, until, tuple(signals), tuple(unsampled), recommendation, disk)


def _no_data(db: str | Path, since: float, until: float) -> str:
    """What "no data" says: a store whose memory samples lie outside the window (one copied from another box, a
    collector stopped hours ago) was told to start the collector, as if it held none."""
    held = [(i.t_first, i.t_last) for i in queries.series_info(db)
            if i.points and i.name in {th.series for th in THRESHOLDS if th.side != "cache"}]
    if not held:
        return SUMMARIES["no data"]
    first, last = min(a for a, _ in held), max(b for _, b in held)
    return (f"no memory signal in the store for this window; it holds memory samples from {_utc(first)} to "
            f"{_utc(last)}: judge that time (`flashmoe-cli diagnose --until {_utc(last)}`, or the dashboard's time "
            f"range), or start the collector for the present.")


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- flashmoe-cli diagnose: a thin wrapper with the library's parameter names --------------------------
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds from "300", "90s", "5m", "1h" or "2d"."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in DURATION_UNITS else (text, "s")
    try:
        seconds = float(number) * DURATION_UNITS[unit]
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: give seconds or a number with s, m, h "
                                         f"or d, e.g. 5m")
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("examples:\n  flashmoe-cli diagnose --db data/flashmoe.db\n"
                     "  flashmoe-cli diagnose --db data/flashmoe.db --window 1h --until 2026-01-31T12:00:00 --json")
    parser.add_argument("--db", required=True, type=Path, help="the store the collector and the agent write")
    parser.add_argument("--window", type=parse_duration, default=300.0,
                        help="how far back to judge: seconds or 90s, 5m, 1h, 2d (default 5m)")
    parser.add_argument("--until", type=parse_time, default=None,
                        help="end of the window: Unix seconds or ISO 8601 time (default now)")
    parser.add_argument("--json", action="store_true", help="print the verdict, every signal and the fix as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        result = diagnose(args.db, args.window, args.until)
    except StoreError as e:
        log.error("%s", e)
        return 1
    sys.stdout.write(json.dumps(result.as_dict(), indent=2) + "\n" if args.json else "\n".join(result.lines()) + "\n")
    return 0
