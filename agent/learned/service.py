"""Online learning in the agent: the runtime's one handle on the online loop (agent.learned.online).

The learned policy's `online_learning` knob turns it on. The runtime passes the policy options it
builds the cache's policy with through `policy_options`, which swaps the knob for the learner
itself: one learner per cache, shared by its partitions, kept across other knob changes, closed
when the knob goes off or another policy takes over. Its jobs run in a low-priority child process
under a CPU budget (agent.learned.background). Once a second `tick` keeps the learner's picture
of the cache in step with the cap, counts new updates in Prometheus and records each as a store
event; `status` is what /v1/status shows (and the dashboard's Cache page reads).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.learned.background import CPU_SHARE, Background
from agent.learned.online import CacheShape, OnlineConfig, OnlineLearner, Update

log = logging.getLogger(__name__)

KNOB = "online_learning"
SHOWN_UPDATES = 20  # the most recent updates /v1/status lists


class OnlineLearning:
    def __init__(self, cache, registry: CollectorRegistry, config: OnlineConfig = OnlineConfig(),
                 cpu_share: float = CPU_SHARE) -> None:
        self.cache, self.config, self.cpu_share = cache, config, cpu_share
        self.learner: OnlineLearner | None = None
        self._exported = 0  # the number of the last update of the current learner counted and recorded
        self.updates = Counter("flashmoe_online_updates", "online-learning updates swapped in", registry=registry)
        self.rollbacks = Counter("flashmoe_online_rollbacks",
                                 "online updates rolled back: worse in hindsight than the weights before",
                                 registry=registry)
        self.decisions = Counter("flashmoe_online_decisions",
                                 "eviction decisions labelled in hindsight and learned from", registry=registry)
        self.cpu = Gauge("flashmoe_online_cpu_seconds", "CPU time of the online-learning worker since it was turned on",
                         registry=registry)
        self.enabled = Gauge("flashmoe_online_enabled", "1 while the learned policy learns online", registry=registry)
        self.hindsight = Gauge("flashmoe_online_hindsight_hit_ratio", "hit ratio of the last judged update on the "
                               "steps since it took effect, replayed with its weights (new) and the ones before (old)",
                               ["weights"], registry=registry)

    def policy_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """A policy's options with the online_learning knob (if it has one) replaced by the shared learner."""
        options = dict(options)
        wanted = options.pop(KNOB, False)
        if not wanted:
            self._stop()
            return options
        if self.learner is None:
            from agent.learned.scorer import shared_net
            from agent.policies.flashmoe import DEFAULT_WEIGHTS
            self.learner = OnlineLearner(shared_net(str(DEFAULT_WEIGHTS.resolve())), self._shape(), self.config,
                                         Background(self.cpu_share))
            self._exported = 0
            self.enabled.set(1)
            log.info("online learning on (%s)", self.config)
        return {**options, "learner": self.learner}

    def tick(self, recorder=None) -> None:
        """Once a second: follow the cap, export and record the updates swapped in since the last tick."""
        if self.learner is None:
            return
        self.learner.shape = self._shape()
        self.cpu.set(self.learner.executor.cpu_used())
        new = [u for u in self.learner.updates if u.number > self._exported]
        for u in new:
            self._exported = u.number
            self.updates.inc()
            self.decisions.inc(u.decisions)
            if u.judgement is not None:
                self.rollbacks.inc(u.judgement.rolled_back)
                self.hindsight.labels(weights="old").set(u.judgement.old_hit_rate)
                self.hindsight.labels(weights="new").set(u.judgement.new_hit_rate)
            if recorder is not None:
                recorder.event(u.time, "online_update", describe(u))

    def status(self) -> dict[str, Any]:
        learner = self.learner
        if learner is None:
            return {"enabled": False}
        totals = dict(learner.summary())
        totals["updates_cpu_s"] = totals.pop("cpu_s")   # the jobs' CPU alone; cpu_s is the worker's, start-up included
        return {"enabled": True, "steps_seen": learner.steps, "cpu_s": learner.executor.cpu_used(),
                "cpu_share_limit": self.cpu_share, "worker_failures": learner.executor.failures,
                **totals, "recent": [update_row(u) for u in list(learner.updates)[-SHOWN_UPDATES:]]}

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.learner is not None:
            self.learner.close()
            self.learner = None
            self.enabled.set(0)
            log.info("online learning off")

    def _shape(self) -> CacheShape:
        s, index = self.cache.stats(), self.cache.index
        return CacheShape(s.capacity, index.n_layers, index.n_experts, s.scope, self.cache.min_per_layer,
                          self.cache.read_ahead)


def update_row(u: Update) -> dict[str, Any]:
    j = u.judgement
    return {"number": u.number, "time": u.time, "step": u.step, "decisions": u.decisions, "cpu_s": u.cpu_s,
            "judged_steps": j.steps if j else None, "old_hit_rate": j.old_hit_rate if j else None,
            "new_hit_rate": j.new_hit_rate if j else None, "rolled_back": j.rolled_back if j else None}


def describe(u: Update) -> str:
    j = u.judgement
    judged = "" if j is None else (f"; update {u.number - 1} on the {j.steps} steps since: hit rate "
                                   f"{j.old_hit_rate:.4f} with the weights before, {j.new_hit_rate:.4f} with it"
                                   f"{' (rolled back)' if j.rolled_back else ''}")
    return f"update {u.number} at step {u.step}: learned from {u.decisions} decisions, {u.cpu_s:.1f} s CPU{judged}"
