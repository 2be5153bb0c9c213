"""Per-expert features of the learned policy: incremental history per layer, pure extraction.

`LayerHistory` is updated once per routing step of its layer (`observe`) and per session; it keeps
only O(n_experts) arrays plus a co-activation matrix, so an access costs a few vector ops. Every
feature is then a pure function of that state (`expert_features`, `activation_signature`,
`window_histogram`), which is what the policy scores and what training records.

Features never depend on an expert's id or on how many experts a model has: rates are divided by
the uniform rate top_k / n_experts seen so far, so one network serves OLMoE (64 experts, top-8),
Qwen (60, top-4) and DeepSeek (64, top-6) alike.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

HISTORY_BITS = 32          # last tokens kept as a bit per token: the expert's activation signature
WINDOWS = (4, 16, 64)      # sliding windows (in tokens of this layer) for windowed frequency
HIST_WINDOW = 16           # window of the activation histogram that triggers rescoring
COACT_DECAY = 0.5 ** (1 / 256)  # co-activation counts halve every 256 tokens: routing drifts
NEVER = 1 << 20            # age of an expert never used

FEATURES = ("recency", "rate_4", "rate_16", "rate_64", "rate_all", "gap", "overdue",
            "session_rate", "session_seen", "persistence", "coactivation", "batch_share", "density")


def _popcount_low(bits: np.ndarray, width: int) -> np.ndarray:
    return np.bitwise_count(bits & np.uint64((1 << width) - 1)).astype(np.float32)


@dataclass
class LayerHistory:
    """Activation history of one layer's experts; arrays grow with the largest expert id seen."""
    t: int = 0                       # routing steps (tokens, or batches) seen on this layer
    top_k: int = 1                   # largest routed-set size seen
    n_seen: int = 1                  # largest expert id seen + 1: the expert count, as far as we know
    bits: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))   # bit i: used i steps ago
    last: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))    # step of last use, -1 never
    total: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    gap: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))   # EMA of reuse gaps
    session_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    sessions_used: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    coact: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    session_t: int = 0               # steps in the current session
    sessions: int = 0                # completed sessions
    current: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the last routed set
    share: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # its distribution

    @property
    def n(self) -> int:
        return len(self.bits)

    def _grow(self, n: int) -> None:
        size = max(n, 2 * self.n, 8)
        pad = size - self.n
        self.bits = np.concatenate([self.bits, np.zeros(pad, np.uint64)])
        self.last = np.concatenate([self.last, np.full(pad, -1, np.int64)])
        for name in ("total", "gap", "session_count", "sessions_used", "share"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(pad, np.float32)]))
        coact = np.zeros((size, size), np.float32)
        coact[: self.coact.shape[0], : self.coact.shape[1]] = self.coact
        self.coact = coact

    def observe(self, experts: Collection[int]) -> None:
        """One routing step of this layer chose `experts` (a set, or a batch's multiset)."""
        counts = Counter(int(e) for e in experts)
        ids = np.fromiter(counts, np.int64, len(counts))
        if len(ids) and ids.max() >= self.n:
            self._grow(int(ids.max()) + 1)
        self.bits <<= np.uint64(1)
        self.bits[ids] |= np.uint64(1)
        seen = self.last[ids] >= 0
        gaps = (self.t - self.last[ids]).astype(np.float32)
        self.gap[ids] = np.where(seen, np.where(self.gap[ids] > 0, 0.7 * self.gap[ids] + 0.3 * gaps, gaps),
                                 0.0)
        self.last[ids] = self.t
        self.total[ids] += 1
        self.session_count[ids] += 1
        if self.t % 16 == 0:  # decay in batches: same result up to rounding, 1/16 of the cost
            self.coact *= COACT_DECAY ** 16
        self.coact[np.ix_(ids, ids)] += 1.0
        self.share[self.current] = 0.0
        self.share[ids] = np.fromiter(counts.values(), np.float32, len(counts)) / max(1, sum(counts.values()))
        self.current = ids
        self.top_k = max(self.top_k, len(ids))
        self.n_seen = max(self.n_seen, int(ids.max()) + 1 if len(ids) else 0)
        self.t += 1
        self.session_t += 1

    def new_session(self) -> None:
        if self.session_t:
            self.sessions_used += self.session_count > 0
            self.sessions += 1
        self.session_count[:] = 0
        self.session_t = 0


def uniform_rate(h: LayerHistory) -> float:
    """The share of steps an expert would be used in if routing were uniform: top_k / n_experts."""
    return h.top_k / max(h.n_seen, h.top_k)


def expert_features(h: LayerHistory, experts: np.ndarray) -> np.ndarray:
    """Features of `experts` (ids) at the current step, as a float32 array [len(experts), len(FEATURES)]."""
    experts = np.asarray(experts, np.int64)
    if len(experts) and experts.max() >= h.n:
        h._grow(int(experts.max()) + 1)
    u = uniform_rate(h)
    last, bits = h.last[experts], h.bits[experts]
    age = np.where(last >= 0, h.t - last, NEVER).astype(np.float32)
    gap = h.gap[experts]
    rates = [_popcount_low(bits, w) / max(1, min(w, h.t)) / u for w in WINDOWS]
    cur = h.current
    # P(e used | f used), averaged over the experts f chosen now
    coact = (h.coact[experts][:, cur] / np.maximum(h.coact[cur, cur], 1e-6)).mean(axis=1) \
        if len(cur) else np.zeros(len(experts), np.float32)
    cols = [
        np.log2(1 + age) / 10,
        *[np.log2(1 + r) / 4 for r in rates],  # log: hot experts of a top-4-of-60 model stay distinct
        np.log2(1 + h.total[experts] / max(1, h.t) / u) / 4,
        np.log2(1 + gap) / 10,
        np.where(gap > 0, np.minimum(age / np.maximum(gap, 1), 16) / 16, 1.0),
        np.log2(1 + h.session_count[experts] / max(1, h.session_t) / u) / 4,
        (h.session_count[experts] > 0).astype(np.float32),
        h.sessions_used[experts] / max(1, h.sessions),
        coact,
        h.share[experts],
        np.full(len(experts), u, np.float32),
    ]
    return np.stack(cols, axis=1).astype(np.float32)


def activation_signature(h: LayerHistory, experts: np.ndarray) -> np.ndarray:
    """The last HISTORY_BITS steps of each expert as 0/1, most recent first: [len(experts), HISTORY_BITS]."""
    bits = h.bits[np.asarray(experts, np.int64)]
    shifts = np.arange(HISTORY_BITS, dtype=np.uint64)
    return ((bits[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.float32)


def window_histogram(h: LayerHistory) -> np.ndarray:
    """Share of the activations of the last HIST_WINDOW steps that went to each expert."""
    counts = _popcount_low(h.bits, HIST_WINDOW)
    total = counts.sum()
    return counts / total if total else counts


def tv_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Total-variation distance between two histograms (zero-padded to the same length)."""
    if len(p) == len(q):
        return 0.5 * float(np.abs(p - q).sum())
    n = max(len(p), len(q))
    return 0.5 * float(np.abs(np.pad(p, (0, n - len(p))) - np.pad(q, (0, n - len(q)))).sum())
