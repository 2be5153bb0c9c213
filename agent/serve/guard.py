"""The memory guard: shrink the expert cache step by step while memory pressure is sustained.

Two signals, either one counts: the agent's own major-fault rate (/proc/self/stat majflt: pages it
had to read back from disk), and pressure stall information (/proc/pressure/memory "full avg10", the
share of the last 10 s in which every task was stalled on memory) while the machine as a whole is
short of memory (under machine.memory.SHORT_SHARE of it available): a stall inside another process's
own memory limit is not relieved by the agent's cache, as the Memory page's diagnosis says, and the
guard leaves it alone. One interval over a threshold
is noise; `intervals` consecutive ones are thrash. The signals come from agent.monitor (a value is
None where it has no source, e.g. a kernel without PSI: the other signal then decides alone).
`decide` is pure so it can be tested exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

from agent.monitor import SystemSample
from machine.memory import SHORT_SHARE


@dataclass(frozen=True)
class GuardConfig:
    psi_full_avg10: float = 10.0        # percent of time fully stalled on memory
    major_faults_per_s: float = 200.0   # of the agent process
    intervals: int = 5                  # consecutive samples over a threshold before a step
    step: float = 0.10                  # shrink by this share of the current cap per step


@dataclass(frozen=True)
class Shrink:
    new_cap: int
    reason: str


def over_thresholds(p: SystemSample, cfg: GuardConfig) -> list[str]:
    """Each signal over its threshold, described as 'signal value > threshold'."""
    out = []
    short = p.mem_available_share is None or p.mem_available_share < SHORT_SHARE   # unknown: as before
    if p.psi_full_avg10 is not None and p.psi_full_avg10 > cfg.psi_full_avg10 and short:
        available = "" if p.mem_available_share is None else f" with {p.mem_available_share:.0%} of memory available"
        out.append(f"PSI memory full avg10 {p.psi_full_avg10:.1f}% > {cfg.psi_full_avg10:g}%{available}")
    if p.major_faults_per_s is not None and p.major_faults_per_s > cfg.major_faults_per_s:
        out.append(f"major faults {p.major_faults_per_s:.0f}/s > {cfg.major_faults_per_s:g}/s")
    return out


def decide(streak: int, p: SystemSample, cap: int, floor: int, cfg: GuardConfig) -> tuple[int, Shrink | None]:
    """(new streak, a shrink or None) after one sample. A step resets the streak, so the next one
    again needs `intervals` pressured samples; the cap never goes below `floor` (the working set)."""
    signals = over_thresholds(p, cfg)
    if not signals:
        return 0, None
    streak += 1
    if streak < cfg.intervals:
        return streak, None
    new_cap = max(floor, int(cap * (1 - cfg.step)))
    if new_cap >= cap:
        return streak, None  # already at the working set: nothing left to give back
    reason = (f"memory pressure for {streak} consecutive intervals: {'; '.join(signals)}; "
              f"cache cap {cap} -> {new_cap} bytes (-{cfg.step:.0%}, floor {floor})")
    return 0, Shrink(new_cap, reason)
