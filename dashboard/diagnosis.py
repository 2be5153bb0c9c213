"""Memory-thrash diagnosis: a verdict, the evidence behind it and a cache-cap recommendation.

A pure function of the samples, so the Memory page only renders what `diagnose` returns and the
rules are tested without Streamlit. Thresholds follow the kernel's own pressure guidance: PSI
"full" means every non-idle task stalled on memory at once, the clearest sign of thrash; major
faults and workingset refaults say pages are being read back as fast as they are dropped.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIB = 1 << 20
RAM_SHARE = 0.70          # the cache cap never goes above 70% of physical memory (DESIGN.md)
SHRINK_STEP = 0.80        # when the arithmetic cannot free memory, step down as the memory guard does
MIN_SAMPLES_OVER = 2      # one spike is noise; two samples over is a trend


@dataclass(frozen=True)
class Threshold:
    signal: str
    label: str
    limit: float
    unit: str


@dataclass(frozen=True)
class Evidence:
    threshold: Threshold
    peak: float
    first_t: float
    last_t: float
    samples_over: int
    samples: int

    def sentence(self) -> str:
        th = self.threshold
        return (f"{th.label} above {th.limit:g} {th.unit} in {self.samples_over} of {self.samples} "
                f"samples (peak {self.peak:.3g} {th.unit})")


@dataclass(frozen=True)
class Recommendation:
    cache_cap_bytes: int
    reason: str


@dataclass(frozen=True)
class Diagnosis:
    verdict: str                       # "thrashing", "under pressure", "healthy" or "no data"
    summary: str
    evidence: tuple[Evidence, ...]
    recommendation: Recommendation | None


def evidence_for(threshold: Threshold, samples: Sequence[tuple[float, float]]) -> Evidence | None:
    """Evidence that `samples` (t, value) crossed `threshold` at least MIN_SAMPLES_OVER times."""
    over = [(t, v) for t, v in samples if v is not None and v > threshold.limit]
    if len(over) < MIN_SAMPLES_OVER:
        return None
    return Evidence(threshold, max(v for _, v in over), over[0][0], over[-1][0], len(over), len(samples))


RULE = "PSI full alone, or any two signals, is thrash; one signal is pressure"


def verdict_of(evidence: Sequence[Evidence], full_signal: str) -> str:
    if any(e.threshold.signal == full_signal for e in evidence) or len(evidence) >= 2:
        return "thrashing"
    return "under pressure" if evidence else "healthy"


def recommend_cap(verdict: str, mem_total: float | None, mem_available: float | None,
                  cache_cap: float | None) -> Recommendation | None:
    """A cap that keeps all memory in use within 70% of RAM, or one step down if that frees nothing."""
    if mem_total is None or cache_cap is None:
        return None
    ceiling = RAM_SHARE * mem_total
    if verdict == "healthy":
        if cache_cap <= ceiling:
            return None
        cap = ceiling
        reason = f"the cap is above {RAM_SHARE:.0%} of RAM ({ceiling / MIB:,.0f} MiB)"
    else:
        in_use_besides_cache = (mem_total - (mem_available if mem_available is not None else 0)) - cache_cap
        cap = min(ceiling, ceiling - max(in_use_besides_cache, 0.0))
        reason = (f"keeps memory in use (the cache plus {max(in_use_besides_cache, 0) / MIB:,.0f} MiB "
                  f"besides it) within {RAM_SHARE:.0%} of RAM ({ceiling / MIB:,.0f} MiB)")
        if cap >= cache_cap:
            cap = SHRINK_STEP * cache_cap
            reason = (f"memory is under pressure although the cache fits in {RAM_SHARE:.0%} of RAM: "
                      f"shrink by {1 - SHRINK_STEP:.0%} and watch the signals")
    cap_bytes = int(max(cap, MIB) // MIB * MIB)
    return Recommendation(cap_bytes, f"{cap_bytes / MIB:,.0f} MiB {reason}")


def diagnose(samples: Mapping[str, Sequence[tuple[float, float]]], thresholds: Sequence[Threshold],
             full_signal: str, mem_total: float | None = None, mem_available: float | None = None,
             cache_cap: float | None = None) -> Diagnosis:
    """Judge memory thrash from per-signal (t, value) samples against `thresholds`.

    `full_signal` names the PSI-full signal, which alone is enough to call it thrash.
    """
    if not any(samples.get(th.signal) for th in thresholds):
        return Diagnosis("no data", "No memory signals in the store yet: start the collector "
                         "(`flashmoe-cli collect --db ...`) and come back in a few seconds.", (), None)
    evidence = tuple(e for th in thresholds if (e := evidence_for(th, samples.get(th.signal, ()))))
    verdict = verdict_of(evidence, full_signal)
    summary = {
        "thrashing": "The system is thrashing: pages are evicted and read back faster than work gets done.",
        "under pressure": "Memory is under pressure, not yet thrashing.",
        "healthy": "No sign of memory thrash: every signal stayed below its threshold.",
    }[verdict]
    return Diagnosis(verdict, summary, evidence, recommend_cap(verdict, mem_total, mem_available, cache_cap))
