"""FlashMoE: a learned retention score per cached expert, recomputed only when routing drifts.

Every routing step updates the layer's activation history (agent.learned.features: a compiled loop
over the routed experts). On an eviction the policy rescores a layer's resident experts only if that
layer's windowed activation histogram (last 16 steps) moved more than `recompute_threshold`
(total-variation distance) since the layer was last scored, or a monitoring sample arrived;
otherwise the cached scores are a dictionary lookup. Only a layer's own routing changes its experts'
features, so a global cache rescores the layer that just routed, not the whole model. The default
threshold is 0 (rescore whenever the window moved at all): one token already moves the 16-step
window by up to 1/16, and stale scores cost hit rate (a threshold of 0.1 halved the rescorings and
lost 1-3 points on the decode report traces); stationary routing (loops, repeated prompts) still
costs no rescoring. An expert brought in since its layer was last scored is scored when it is first
a candidate, from its layer's history as it stands, which the other residents' scores also read
unless the layer routed since (then the whole layer is rescored). That matters when a batch's step
outgrows its partition and its own earlier arrivals become candidates: counted as the freshest, an
expert one request used once outlived the experts every request uses, and the policy trailed LFU
from four requests a step on (bench/batching.py).

Decision. `decision="score"` (default) evicts the lowest score (the network's guess of Belady's
victim). `decision="lfu"` is the design's two-stage rule: keep what scores at or above
`keep_percentile` of the scores of the experts it may evict; among the rest evict the least
frequently used over the long run (usage averaged over ~256 steps), least recently used on ties. The
network shortlists, frequency picks. Its default percentile is 30 (the top 70% are kept, frequency
decides among the lowest 30%); 20 (keep the top 80%, the design note's reading) is close behind, and
80 (keep the top 20%) lets frequency choose among most of the set and falls behind windowed LFU.
Every setting is chosen on the validation split (bench/policies.py, agent.learned.splits), never on
the report traces: there `score` led (BENCHMARKS.md has the numbers); both rules are a live knob.

Online learning: with a `learner` (agent.learned.online) the policy reports every routing step to
it and adopts the weights it swaps in at its next eviction, rescoring every layer with them.

torch is imported on the first construction (agent.learned.scorer), never by the registry.
Weights: agent/policies/weights/flashmoe.safetensors (the train split, all three architectures);
flashmoe-no-<arch>.safetensors leave that architecture's traces out of training.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from pathlib import Path

import numpy as np

from agent.knob import Knob
from agent.policies.base import Key, Policy

WEIGHTS_DIR = Path(__file__).parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "flashmoe.safetensors"
DECISIONS = ("score", "lfu")
DECISION = Knob("decision", str, "score", choices=DECISIONS,
                help="learned policy: evict the lowest score (score), or the least frequently used among the "
                     "lowest-scored keep_percentile (lfu)")
KEEP_PERCENTILE = Knob("keep_percentile", float, 30.0, 0.0, 100.0,
                       help="learned policy, decision lfu: keep experts scoring at or above it")
RECOMPUTE_THRESHOLD = Knob("recompute_threshold", float, 0.0, 0.0, 1.0,
                           help="learned policy: activation-distribution shift (total variation) that triggers "
                                "rescoring")
ONLINE_LEARNING = Knob("online_learning", bool, False,
                       help="learned policy: keep learning from this device's own routing, in a background process "
                            "at lowest priority and at most 5% of one core (agent/learned/online.py)")


class FlashMoE(Policy):
    name = "flashmoe"
    knobs = (DECISION, KEEP_PERCENTILE, RECOMPUTE_THRESHOLD, ONLINE_LEARNING)

    def __init__(self, model_path: str | Path | None = None, keep_percentile: float = KEEP_PERCENTILE.default,
                 recompute_threshold: float = RECOMPUTE_THRESHOLD.default, decision: str = DECISION.default,
                 online_learning: bool = ONLINE_LEARNING.default, net=None, learner=None) -> None:
        """`net` (a scorer.SharedNet) replaces the weights file. With `learner` (an
        online.OnlineLearner shared by the cache's partitions) the weights are the learner's and
        every routing step is reported to it: whoever owns the cache supplies it (the agent, for the
        `online_learning` knob: agent.learned.service; the simulator, for simulate --online); the
        knob alone changes nothing here."""
        ONLINE_LEARNING.check(online_learning)
        keep_percentile = KEEP_PERCENTILE.check(keep_percentile)
        recompute_threshold = RECOMPUTE_THRESHOLD.check(recompute_threshold)
        decision = DECISION.check(decision)
        from agent.learned import features, scorer  # torch loads here, on first use only

        self._f, self._s = features, scorer
        self.learner = learner
        if learner is not None:
            net, self._version = learner.net, learner.version
        self.scorer = scorer.Scorer(net or scorer.shared_net(str(Path(model_path or DEFAULT_WEIGHTS).resolve())))
        scorer.compile_loops(self.scorer)  # here, not at the first route() under the expert cache's lock
        self.keep_percentile, self.recompute_threshold = keep_percentile, recompute_threshold
        self.decision = decision
        self.layers: dict[int, features.LayerHistory] = {}
        self._scores: dict[Key, float] = {}
        self._scored_hist: dict[int, np.ndarray] = {}
        self._series: deque[tuple[float, float]] = deque(maxlen=scorer.SERIES_LEN)
        self._system_changed = False
        self._keep = float("inf")  # the keep_percentile of the scores at the last scoring
        self._moved: set[int] = set()  # layers routed since the last shift check
        self.recomputes = 0  # how often the network ran: the event-driven cost, observable

    # -- hooks ----------------------------------------------------------------------------------
    def session(self) -> None:
        for h in self.layers.values():
            h.new_session()
        if self.learner is not None:
            self.learner.session()

    def prepare(self, layer: int, sample: Mapping[str, float]) -> None:
        """Run the system tower (torch) on the series `sample` will make, with the weights in use and
        with the online learner's new ones that the next eviction adopts: the rescoring finds it
        memoized. Under memory thrash torch's code pages fault back in for seconds each call, which
        the cache's lock must not wait for."""
        series = (*self._series, self._s.system_input(sample))[-self._s.SERIES_LEN:] if sample else tuple(self._series)
        if sample:
            self.scorer.prepare(series)
        if self.learner is not None and (net := self.learner.upcoming(layer)) is not self.scorer.shared:
            net.readout(tuple(series))  # _adopt's scorer starts on this series

    def system(self, sample: Mapping[str, float]) -> None:
        self._series.append(self._s.system_input(sample))
        self._system_changed = True

    def route(self, layer: int, experts: Collection[int]) -> None:
        if self.learner is not None:
            self.learner.observe(layer, experts)
        self._history(layer).observe(experts)
        self._moved.add(layer)

    def remove(self, key: Key) -> None:
        self._scores.pop(key, None)

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        candidates = [k for k in resident if k not in pinned]
        if not candidates:
            raise ValueError("every resident expert is pinned by the current step; nothing can be evicted")
        if self.learner is not None:
            if self.learner.version != self._version:
                self._adopt(self.learner.net, self.learner.version)
            if self.learner.sampled():
                self._report(candidates)
        stale = self._stale_layers()
        if stale:
            self._rescore(stale, resident, candidates)
        self._score_arrivals(candidates)
        scores = [self._scores[k] for k in candidates]
        if self.decision == "score":  # the lowest score is below any percentile: keep_percentile is moot
            return candidates[min(range(len(candidates)), key=scores.__getitem__)]
        rest = [i for i, s in enumerate(scores) if s < self._keep] or range(len(candidates))  # empty: all of them
        return candidates[min(rest, key=lambda i: self._frequency(candidates[i]))]

    def _report(self, candidates: list[Key]) -> None:
        """Hand the learner this decision's candidates with their inputs as scored now, to label later."""
        by_layer: dict[int, list[Key]] = {}
        for k in candidates:
            by_layer.setdefault(k[0], []).append(k)
        inputs = [self._s.layer_inputs(self._history(layer), np.array([e for _, e in keys], np.int64))
                  for layer, keys in by_layer.items()]
        self.learner.record([k for keys in by_layer.values() for k in keys], np.concatenate([i[0] for i in inputs]),
                            np.concatenate([i[1] for i in inputs]))

    def _adopt(self, net, version: int) -> None:
        """New weights from the online learner: every layer is rescored with them before the next choice."""
        self.scorer = self._s.Scorer(net, self._series)
        self._version = version
        self._system_changed = True  # rescores every layer with the new weights

    # -- scoring --------------------------------------------------------------------------------
    def _history(self, layer: int):
        history = self.layers.get(layer)
        if history is None:
            history = self.layers[layer] = self._f.LayerHistory()
        return history

    def _frequency(self, key: Key) -> tuple[float, int]:
        """(long-run usage rate, step of last use): LFU order with LRU to break ties."""
        h = self._history(key[0])
        return float(h.stats[self._f.LONG_RATE, key[1]]), int(h.last[key[1]])

    def _stale_layers(self) -> list[int]:
        """Layers to score now. Every layer after a monitoring sample; else, once per routing step,
        the layers routed since the last check whose activation window moved past the threshold
        since they were scored. Only a layer's own routing changes its experts' features, so a
        global cache never rescores the whole model."""
        if self._system_changed:
            self.scorer.set_series(list(self._series))
            self._system_changed = False
            return list(self.layers)
        moved, self._moved = self._moved, set()
        if not moved:  # several evictions in one step: nothing moved in between
            return []
        return [layer for layer in moved if layer not in self._scored_hist
                or self._f.window_shift(self.layers[layer], self._scored_hist[layer]) > self.recompute_threshold]

    def _rescore(self, stale: list[int], resident: Collection[Key], candidates: list[Key]) -> None:
        """Score every resident expert of the stale layers, the pinned ones too: in a global cache they
        are candidates at the next layer's step, and their layer's features will not change till then."""
        by_layer: dict[int, list[Key]] = {layer: [] for layer in stale}
        for key in resident:
            if key[0] in by_layer:
                by_layer[key[0]].append(key)
        for layer, keys in by_layer.items():
            self._score(layer, keys)
            self._scored_hist[layer] = self._f.window_histogram(self.layers[layer])
        scores = [self._scores[k] for k in candidates if k in self._scores]
        if self.decision == "lfu" and scores:
            self._keep = percentile(scores, self.keep_percentile)
        self.recomputes += 1

    def _score_arrivals(self, candidates: list[Key]) -> None:
        """Score the candidates brought in since their layer was last scored."""
        by_layer: dict[int, list[Key]] = {}
        for key in candidates:
            if key not in self._scores:
                by_layer.setdefault(key[0], []).append(key)
        for layer, keys in by_layer.items():
            self._score(layer, keys)

    def _score(self, layer: int, keys: list[Key]) -> None:
        experts = np.array([e for _, e in keys], np.int64)
        self._scores.update(zip(keys, self.scorer.score(self._history(layer), experts).tolist()))


def percentile(values: list[float], q: float) -> float:
    """numpy.percentile's default (linear) for a short list, without its per-call overhead."""
    ranked = sorted(values)
    pos = (len(ranked) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ranked) - 1)
    return ranked[low] + (ranked[high] - ranked[low]) * (pos - low)
