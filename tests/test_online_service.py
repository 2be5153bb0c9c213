"""Online learning in the agent: the knob starts a low-priority worker whose updates are swapped in, logged,
exported in /metrics and recorded in the store; turning it off stops the worker. In-process runtime, real
demo model, real child process."""
from __future__ import annotations

import os
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from agent.learned.background import Background, cpu_seconds
from agent.learned.online import OnlineConfig
from agent.serve.knobs import KnobError
from agent.serve.runtime import Runtime, ServeOptions
from agent.serve.scheduler import Request
from store import queries
from store.db import Store
from test_serve import demo_model

SMALL = OnlineConfig(window=32, every=16, warmup=4, decisions=100, epochs=1)


@pytest.fixture
def runtime(tmp_path_factory, tmp_path):
    store = Store(tmp_path / "flashmoe.db", autoflush_s=0)
    rt = Runtime(ServeOptions(demo_model(tmp_path_factory), cache_cap="30%", policy="flashmoe"),
                 CollectorRegistry())
    rt.online.config = SMALL
    rt.start(store)
    yield rt
    rt.stop()
    store.close()


def complete(runtime: Runtime, tokens: int) -> None:
    done = threading.Event()
    runtime.submit(Request(f"r{time.monotonic()}", [5, 6, 7, 8], tokens, 1.0,
                           lambda e: e.kind != "token" and done.set()))
    assert done.wait(120)


def test_the_knob_starts_learning_and_every_update_is_swapped_in_exported_and_recorded(runtime):
    assert runtime.status()["online_learning"] == {"enabled": False}
    runtime.set_knobs({"online_learning": True}, "api")
    learner = runtime.online.learner
    deadline = time.monotonic() + 600
    while learner.totals["updates"] < 1 and time.monotonic() < deadline:
        complete(runtime, 12)
    assert learner.totals["updates"] >= 1, "no update arrived from the worker"
    runtime.tick()
    status = runtime.status()["online_learning"]
    assert status["enabled"] and status["updates"] >= 1 and status["recent"][0]["decisions"] > 0
    assert 0 < status["cpu_s"] and status["worker_failures"] == 0
    assert status["updates_cpu_s"] < status["cpu_s"]   # the worker's start-up is not in its jobs' CPU
    assert runtime.metrics.registry.get_sample_value("flashmoe_online_updates_total") == status["updates"]
    assert runtime.metrics.registry.get_sample_value("flashmoe_online_enabled") == 1
    runtime.recorder.store.flush()
    events = queries.events(runtime.recorder.store.path, kind="online_update")
    assert len(events) == status["updates"] and "learned from" in events[0]["message"]
    policies = {p.policy.learner for p in runtime.cache._residency._parts}
    assert policies == {learner}  # every partition learns through the one learner

    worker = learner.executor._proc
    runtime.set_knobs({"online_learning": False}, "api")
    assert runtime.online.learner is None and runtime.status()["online_learning"] == {"enabled": False}
    assert worker is None or not worker.is_alive()
    assert {p.policy.learner for p in runtime.cache._residency._parts} == {None}


def test_other_knob_changes_keep_the_learner_and_a_bad_value_is_refused(runtime):
    runtime.set_knobs({"online_learning": True}, "api")
    learner = runtime.online.learner
    runtime.set_knobs({"keep_percentile": 40.0}, "api")
    assert runtime.online.learner is learner
    with pytest.raises(KnobError, match="online_learning must be true or false"):
        runtime.set_knobs({"online_learning": "yes"}, "api")
    runtime.set_knobs({"policy": "lru"}, "api")  # another policy: the learner goes
    assert runtime.online.learner is None


def test_the_worker_runs_at_the_lowest_priority_within_its_cpu_budget():
    from agent.learned.background import _child  # noqa: F401  (the worker's entry point must import)

    executor = Background(cpu_share=0.05)
    try:
        executor._spawn()
        pid = executor._proc.pid
        deadline = time.monotonic() + 60
        while os.getpriority(os.PRIO_PROCESS, pid) != 19 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        assert cpu_seconds(pid) >= 0
        executor._since = time.monotonic() - 1.0  # one second on: a budget of 0.05 s, which the start-up exceeds
        while cpu_seconds(pid) < 0.1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert executor.busy()  # over budget: the learner must wait for a later step boundary
        executor._since = time.monotonic() - 100 * cpu_seconds(pid)  # used: 1% of the time since
        assert not executor.busy()
        executor._last_job = 5 * cpu_seconds(pid)   # the next job, costing what the last did, would pass 5%
        assert executor.busy()
    finally:
        executor.close()
    assert not executor._proc or not executor._proc.is_alive()
