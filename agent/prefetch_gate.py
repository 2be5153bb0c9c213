"""Adaptive prefetch: issue the lookahead's reads only while they pay, judged from what the run measures.

The lookahead guesses every layer's experts whether or not its reads are issued, and Residency scores
each guess when its layer routes. What is scored is the guess's *reads*: the guessed experts that were
not resident and would have been admitted (Residency.guess), each right (the layer then used it) or
wrong. Scoring goes on while no read is issued, so the gate sees when guesses get good again.

The rule, counted in block reads on the device:
- a right read takes one demand read off the critical path: it gains 1;
- a wrong read costs the device time of one read (on this I/O-bound path it delays the reads the model
  waits for), 1, plus `e`, how much likelier the policy's block it evicted is read back than one the
  policy evicts for a demand miss: e = max(0, r_prefetch - r_demand), r the share of such evictions
  whose block was read again on demand (the policy's blocks only: evicting a wasted prefetch costs
  nothing), counted over the run (e is measured while reads are issued and kept while they are not).
  Any eviction's block tends to come back over a long run (at 25% of OLMoE, 96% of them do), so only
  the excess is the prefetch's.
Prefetch pays while p·1 > (1 − p)·(1 + e), p the accuracy of the last WINDOW scored reads: the
break-even accuracy is (1 + e) / (2 + e), 0.5 with no eviction cost. Hysteresis so it does not flap:
issuing stops when p falls below break-even − MARGIN and starts again above break-even + MARGIN, and
nothing is judged before MIN_SCORED reads are in the window. It starts issuing. One gate per model
(kept simple; per-layer accuracy was not measured), and the models differ: replayed at a 25% cache
with prefetch on, 35-38% of the reads issued on DeepSeek-V2-Lite's recorded prompt routing were used
(LRU), on OLMoE's decode traces 61-65% with LRU and 52% with the learned policy (it keeps more of
what a guess would read), e at most 0.04 on all; since the lookahead guesses by estimated chances
(agent/model/lookahead.py), 65-68% on the DeepSeek prompts and 58-80% on OLMoE (bench/lookahead.py),
replayed over many prompts. A predictor learning online (CoActivation) guesses poorly over its first
tokens (33-35% on one DeepSeek prompt in a fresh generate), so a short run may stop issuing there and
resume once its window is right more often.

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
        self.evictions = {True: 0, False: 0}   # the policy's blocks evicted, by a prefetch (True) or a demand miss
        self.rereads = {True: 0, False: 0}     # of those, read back on demand

    @property
    def issues(self) -> bool:
        """Whether the guessed reads are issued now."""
        return self.mode == "on" or (self.mode == "auto" and self.issuing)

    @property
    def accuracy(self) -> float | None:
        return sum(self._scores) / len(self._scores) if self._scores else None

    @property
    def eviction_cost(self) -> float:
        """e: how much likelier a block a prefetch evicted is read back than one a demand miss evicted."""
        r = {by: self.rereads[by] / self.evictions[by] if self.evictions[by] else 0.0 for by in (True, False)}
        return max(0.0, r[True] - r[False])

    @property
    def break_even(self) -> float:
        e = self.eviction_cost
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

    def evicted(self, by_prefetch: bool) -> None:
        """A block the policy held was evicted, to admit a prefetch or a demand miss."""
        self.evictions[by_prefetch] += 1

    def reread(self, by_prefetch: bool) -> None:
        """A block evicted (by a prefetch or a demand miss) was read back on demand."""
        self.rereads[by_prefetch] += 1

    def state(self) -> dict:
        """What generate's --json, /v1/status and /metrics show: the mode, whether reads are issued, the
        accuracy judged (of the last `scored` reads; None before any) and the break-even it is judged against."""
        return {"mode": self.mode, "issuing": self.issues, "accuracy": self.accuracy,
                "scored": len(self._scores), "break_even": self.break_even}


def mode_of(prefetch: bool, adaptive: bool) -> str:
    """The mode of the agent's two knobs: prefetch (false: off) and prefetch_adaptive (false: on)."""
    return "off" if not prefetch else "auto" if adaptive else "on"


def knobs_of(mode: str) -> dict[str, bool]:
    """The agent's two knobs that give `mode` (mode_of's inverse)."""
    return {"prefetch": check_mode(mode) != "off", "prefetch_adaptive": mode == "auto"}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"prefetch must be one of {', '.join(MODES)}; got {mode!r}")
    return mode
