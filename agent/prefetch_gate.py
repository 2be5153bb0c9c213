"""Adaptive prefetch: issue the lookahead's reads only while they pay, judged from what the run measures.

The lookahead guesses every layer's experts whether or not its reads are issued, and Residency scores
each guess when its layer routes. What is scored is the guess's *reads*: the guessed experts that were
not resident and would have been admitted (Residency.guess), each right (the layer then used it) or
wrong. Scoring goes on while no read is issued, so the gate sees when guesses get good again.

The rule, counted in block reads on the device:
- a right read takes one demand read off the critical path: it gains 1;
- a wrong read costs the device time of one read (on this I/O-bound path it delays the reads the model
  waits for), 1, plus the block it evicted when the policy wanted it back: `e` = re-reads of blocks a
  prefetch evicted (the policy's own blocks, not other wasted prefetches) over such evictions, measured
  over the run while reads were issued (0 before any).
Prefetch pays while p·1 > (1 − p)·(1 + e), p the accuracy of the last WINDOW scored reads: the
break-even accuracy is (1 + e) / (2 + e), 0.5 with no eviction cost. Hysteresis so it does not flap:
issuing stops when p falls below break-even − MARGIN and starts again above break-even + MARGIN, and
nothing is judged before MIN_SCORED reads are in the window. It starts issuing. One gate per model:
on DeepSeek-V2-Lite's recorded routing the guesses are 42-46% right and on OLMoE's 61-72%, a model's
layers falling on one side.

Modes: "on" always issues (scores too), "off" never guesses at all, "auto" follows the rule. Nothing
here depends on time, so a replay (the simulator) decides as the runtime does.
"""
from __future__ import annotations

from collections import deque

MODES = ("on", "off", "auto")
WINDOW = 256        # scored reads the accuracy is judged over
MIN_SCORED = 64     # fewer in the window: too few to judge, the state stays
MARGIN = 0.05       # hysteresis around the break-even accuracy


class PrefetchGate:
    def __init__(self, mode: str = "auto") -> None:
        check_mode(mode)
        self.mode = mode
        self.issuing = True
        self._scores: deque[bool] = deque(maxlen=WINDOW)
        self.evictions = 0          # blocks the policy held that prefetch evicted
        self.evicted_rereads = 0    # of those, read again on demand

    @property
    def issues(self) -> bool:
        """Whether the guessed reads are issued now."""
        return self.mode == "on" or (self.mode == "auto" and self.issuing)

    @property
    def accuracy(self) -> float | None:
        return sum(self._scores) / len(self._scores) if self._scores else None

    @property
    def break_even(self) -> float:
        e = self.evicted_rereads / self.evictions if self.evictions else 0.0
        return (1 + e) / (2 + e)

    def score(self, right: int, wrong: int) -> None:
        """A layer routed: `right` of its guessed reads were used, `wrong` not. Then judge."""
        self._scores.extend([True] * right + [False] * wrong)
        if len(self._scores) < MIN_SCORED:
            return
        p, b = self.accuracy, self.break_even
        if self.issuing and p < b - MARGIN:
            self.issuing = False
        elif not self.issuing and p > b + MARGIN:
            self.issuing = True

    def evicted(self) -> None:
        """A prefetch evicted a block the policy held."""
        self.evictions += 1

    def reread(self) -> None:
        """A block a prefetch evicted was read again on demand."""
        self.evicted_rereads += 1

    def state(self) -> dict:
        """What generate's --json, /v1/status and /metrics show: the mode, whether reads are issued, the
        accuracy judged (of the last `scored` reads; None before any) and the break-even it is judged against."""
        return {"mode": self.mode, "issuing": self.issues, "accuracy": self.accuracy,
                "scored": len(self._scores), "break_even": self.break_even}


def mode_of(prefetch: bool, adaptive: bool) -> str:
    """The mode of the agent's two knobs: prefetch (false: off) and prefetch_adaptive (false: on)."""
    return "off" if not prefetch else "auto" if adaptive else "on"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"prefetch must be one of {', '.join(MODES)}; got {mode!r}")
    return mode
