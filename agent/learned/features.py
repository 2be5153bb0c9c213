"""Per-expert features of the learned policy: incremental history per layer, pure extraction.

`LayerHistory` is updated once per routing step of its layer (`observe`) and per session; it keeps
only O(n_experts) arrays plus three pair-count matrices. Every feature is then a pure function of
that state (`expert_features`, `activation_signature`, `window_histogram`), which is what the
policy scores and what training records.

The per-step update and the feature extraction are compiled loops (numba): they run on every
routing step and every rescoring, over a dozen or so experts, where numpy would spend its time in
per-call overhead (about fifty array operations a step, ~100 µs on this machine) rather than
arithmetic. Compiled once per machine and cached beside this file.

Features never depend on an expert's id or on how many experts a model has: rates are divided by
the uniform rate top_k / n_experts seen so far, so one network serves OLMoE (64 experts, top-8),
Qwen (60, top-4) and DeepSeek (64, top-6) alike.
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import numba
import numpy as np

HISTORY_BITS = 32          # last tokens kept as a bit per token: the expert's activation signature
WINDOWS = (4, 16, 64)      # sliding windows (in tokens of this layer) for windowed frequency
HIST_WINDOW = 16           # window of the activation histogram that triggers rescoring
PAIR_DECAY = 0.5 ** (1 / 256)  # pair counts halve every 256 tokens: routing drifts
LONG_DECAY = 1 - 1 / 256   # the long-run usage rate: an exponential average over ~256 steps
SOON = 4                   # successor_4 looks this many steps ahead
NEVER = 1 << 20            # age of an expert never used
# Rows of LayerHistory.stats, per expert: uses; exponential average of use per step (~256 steps);
# exponential average of reuse gaps; uses in this session; sessions it was used in; its share of
# the last (batched) step.
TOTAL, LONG_RATE, GAP, SESSION_COUNT, SESSIONS_USED, SHARE = range(6)
N_STATS = 6

FEATURES = ("recency", "rate_4", "rate_16", "rate_64", "rate_256", "rate_all", "gap", "overdue",
            "session_rate", "session_seen", "persistence", "coactivation", "successor", "batch_share", "density",
            "successor_4")


@dataclass
class LayerHistory:
    """Activation history of one layer's experts; arrays grow with the largest expert id seen."""
    t: int = 0                       # routing steps (tokens, or batches) seen on this layer
    top_k: int = 1                   # largest routed-set size seen
    n_seen: int = 1                  # largest expert id seen + 1: the expert count, as far as we know
    bits: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))   # bit i: used i steps ago
    last: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))    # step of last use, -1 never
    # per-expert counters, one row each (TOTAL, LONG_RATE, ...): one array, so a compiled call
    # takes one argument for them all (numba checks every argument's type on each call)
    stats: np.ndarray = field(default_factory=lambda: np.zeros((N_STATS, 0), np.float32))
    # decayed pair counts: pairs[0, e, f] e and f chosen together (the diagonal: f's own count),
    # pairs[1, e, f] e chosen in the step right after f, pairs[2, e, f] e chosen 1..SOON steps after f
    pairs: np.ndarray = field(default_factory=lambda: np.zeros((3, 0, 0), np.float32))
    session_t: int = 0               # steps in the current session
    sessions: int = 0                # completed sessions
    current: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the last routed set

    @property
    def n(self) -> int:
        return len(self.bits)

    def _grow(self, n: int) -> None:
        old = self.n
        size = max(n, 2 * old, 8)
        pad = size - old
        self.bits = np.concatenate([self.bits, np.zeros(pad, np.uint64)])
        self.last = np.concatenate([self.last, np.full(pad, -1, np.int64)])
        self.stats = np.concatenate([self.stats, np.zeros((N_STATS, pad), np.float32)], axis=1)
        pairs = np.zeros((3, size, size), np.float32)
        pairs[:, :old, :old] = self.pairs
        self.pairs = pairs

    def observe(self, experts: Collection[int]) -> None:
        """One routing step of this layer chose `experts` (a set, or a batch's multiset)."""
        if len(experts) and max(experts) >= self.n:
            self._grow(int(max(experts)) + 1)
        self.current = _observe(self.bits, self.last, self.stats, self.pairs, self.current,
                                np.fromiter(experts, np.int64, len(experts)), self.t, self.session_t)
        self.top_k = max(self.top_k, len(self.current))
        self.n_seen = max(self.n_seen, int(self.current.max()) + 1 if len(self.current) else 0)
        self.t += 1
        self.session_t += 1

    def new_session(self) -> None:
        if self.session_t:
            self.stats[SESSIONS_USED] += self.stats[SESSION_COUNT] > 0
            self.sessions += 1
        self.stats[SESSION_COUNT] = 0
        self.session_t = 0


@numba.njit(cache=True)
def _observe(bits, last, stats, pairs, current, routed, t, session_t):
    """Update every counter for one step that routed `routed` (ids, repeats allowed); returns the
    distinct ids, in first-seen order: the new `current`."""
    total, long_rate, gap, session_count, share = (stats[TOTAL], stats[LONG_RATE], stats[GAP], stats[SESSION_COUNT],
                                                   stats[SHARE])
    for f in current:
        share[f] = 0.0
    ids = np.empty(len(routed), np.int64)
    n = 0
    for e in routed:  # share is zero everywhere now, so a zero share marks an id not seen yet this step
        if share[e] == 0.0:
            ids[n] = e
            n += 1
        share[e] += 1.0 / len(routed)
    ids = ids[:n]
    for e in range(len(bits)):
        bits[e] <<= np.uint64(1)
        long_rate[e] *= LONG_DECAY
    for e in ids:
        bits[e] |= np.uint64(1)
        if last[e] < 0:
            gap[e] = 0.0
        elif gap[e] > 0:
            gap[e] = 0.7 * gap[e] + 0.3 * (t - last[e])
        else:
            gap[e] = t - last[e]
        last[e] = t
        total[e] += 1
        session_count[e] += 1
        long_rate[e] += 1 - LONG_DECAY
    if t % 16 == 0:  # decay in batches: same result up to rounding, 1/16 of the cost
        pairs *= PAIR_DECAY ** 16
    for e in ids:
        for f in ids:
            pairs[0, e, f] += 1
        if session_t:  # the previous steps of this session led to this one
            for f in current:
                pairs[1, e, f] += 1
            soon = np.uint64(((1 << min(SOON, session_t)) - 1) << 1)  # used 1..SOON steps ago, this session
            for f in range(len(bits)):
                if bits[f] & soon:
                    pairs[2, e, f] += 1
    return ids


def uniform_rate(h: LayerHistory) -> float:
    """The share of steps an expert would be used in if routing were uniform: top_k / n_experts."""
    return h.top_k / max(h.n_seen, h.top_k)


def expert_features(h: LayerHistory, experts: np.ndarray) -> np.ndarray:
    """Features of `experts` (ids) at the current step, as a float32 array [len(experts), len(FEATURES)]."""
    experts = np.asarray(experts, np.int64)
    if len(experts) and experts.max() >= h.n:
        h._grow(int(experts.max()) + 1)
    out = np.empty((len(experts), len(FEATURES)), np.float32)
    _features(out, experts, h.bits, h.last, h.stats, h.pairs, h.current, h.t, h.session_t, h.sessions,
              uniform_rate(h))
    return out


@numba.njit(cache=True)
def _popcount(x, width):
    """Set bits among the low `width` bits of x."""
    n = 0
    for i in range(width):
        n += (x >> np.uint64(i)) & np.uint64(1)
    return n


@numba.njit(cache=True)
def _features(out, experts, bits, last, stats, pairs, current, t, session_t, sessions, u):
    total, long_rate, gap, session_count, sessions_used, share = (stats[TOTAL], stats[LONG_RATE], stats[GAP],
                                                                  stats[SESSION_COUNT], stats[SESSIONS_USED],
                                                                  stats[SHARE])
    steps = max(1, t)
    for i, e in enumerate(experts):
        age = t - last[e] if last[e] >= 0 else NEVER
        out[i, 0] = math.log2(1 + age) / 10
        # usage rates (sliding windows, the long-run average, all history, this session) relative to
        # uniform routing; log-scaled: the hot experts of a top-4-of-60 model stay distinct
        for j, w in enumerate(WINDOWS):
            out[i, 1 + j] = math.log2(1 + _popcount(bits[e], w) / min(w, steps) / u) / 4
        out[i, 4] = math.log2(1 + long_rate[e] / (1 - LONG_DECAY ** steps) / u) / 4
        out[i, 5] = math.log2(1 + total[e] / steps / u) / 4
        out[i, 6] = math.log2(1 + gap[e]) / 10
        out[i, 7] = min(age / max(gap[e], 1.0), 16.0) / 16 if gap[e] > 0 else 1.0  # overdue vs its usual gap
        out[i, 8] = math.log2(1 + session_count[e] / max(1, session_t) / u) / 4
        out[i, 9] = 1.0 if session_count[e] > 0 else 0.0
        out[i, 10] = sessions_used[e] / max(1, sessions)
        # P(e used | f used) and P(e used next | f used), averaged over the experts f chosen now
        together = following = soon = 0.0
        for f in current:
            seen = max(pairs[0, f, f], 1e-6)
            together += pairs[0, e, f] / seen
            following += pairs[1, e, f] / seen
            soon += pairs[2, e, f] / seen / SOON
        out[i, 11] = together / max(1, len(current))
        out[i, 12] = following / max(1, len(current))
        out[i, 13] = share[e]
        out[i, 14] = u
        # e's usage rate over the SOON steps after the experts chosen now, relative to uniform
        out[i, 15] = math.log2(1 + soon / max(1, len(current)) / u) / 4


def activation_signature(h: LayerHistory, experts: np.ndarray) -> np.ndarray:
    """The last HISTORY_BITS steps of each expert as 0/1, most recent first: [len(experts), HISTORY_BITS]."""
    experts = np.asarray(experts, np.int64)
    if len(experts) and experts.max() >= h.n:
        h._grow(int(experts.max()) + 1)
    out = np.empty((len(experts), HISTORY_BITS), np.float32)
    _signature(out, experts, h.bits)
    return out


@numba.njit(cache=True)
def _signature(out, experts, bits):
    for i, e in enumerate(experts):
        for j in range(out.shape[1]):
            out[i, j] = (bits[e] >> np.uint64(j)) & np.uint64(1)


def window_histogram(h: LayerHistory) -> np.ndarray:
    """Share of the activations of the last HIST_WINDOW steps that went to each expert."""
    out = np.empty(h.n, np.float32)
    _window_histogram(out, h.bits)
    return out


def window_shift(h: LayerHistory, since: np.ndarray) -> float:
    """Total-variation distance from the histogram `since` (an earlier window_histogram) to now."""
    return _window_shift(h.bits, since)


@numba.njit(cache=True)
def _window_histogram(out, bits):
    total = 0.0
    for e in range(len(bits)):
        out[e] = _popcount(bits[e], HIST_WINDOW)
        total += out[e]
    if total:
        out /= total


@numba.njit(cache=True)
def _window_shift(bits, since):
    now = np.empty(len(bits), np.float32)
    _window_histogram(now, bits)
    tv = 0.0
    for e in range(max(len(now), len(since))):  # an expert missing from one side has share 0 there
        p = now[e] if e < len(now) else 0.0
        q = since[e] if e < len(since) else 0.0
        tv += abs(p - q)
    return 0.5 * tv
