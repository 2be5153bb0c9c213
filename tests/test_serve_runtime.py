"""The runtime in-process on the small demo model: the memory guard acts and says why; a busy disk leaves the
batch limit alone."""
from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from agent.serve.guard import GuardConfig
from agent.serve.runtime import Runtime, ServeOptions
from store import queries
from store.db import Store
from store.disk_diagnosis import EXPERT_READS
from test_serve import demo_model


@pytest.fixture
def runtime(tmp_path_factory, tmp_path):
    store = Store(tmp_path / "flashmoe.db", autoflush_s=0)
    rt = Runtime(ServeOptions(demo_model(tmp_path_factory), cache_cap="50%"), CollectorRegistry())
    rt.start(store)
    yield rt
    rt.stop()
    store.close()


def test_sustained_memory_pressure_shrinks_the_cache_step_by_step_and_records_why(runtime, tmp_path):
    psi = tmp_path / "memory"
    psi.write_text("some avg10=60.00 avg60=40.00 avg300=10.00 total=1\n"
                   "full avg10=42.00 avg60=30.00 avg300=5.00 total=1\n")
    runtime.monitor.psi_root = tmp_path
    runtime.monitor.meminfo = tmp_path / "meminfo"     # and the machine as a whole short of memory
    runtime.monitor.meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 240000 kB\n")
    runtime.guard_config = GuardConfig(psi_full_avg10=10.0, intervals=3, step=0.10)
    cap = runtime.cache.cap_bytes
    for _ in range(3):
        runtime.tick()
    assert runtime.cache.cap_bytes == cap  # auto_shrink is off by default: pressure alone changes nothing
    runtime.set_knobs({"auto_shrink": True}, "api")
    for _ in range(2):
        runtime.tick()
    assert runtime.cache.cap_bytes == cap
    runtime.tick()  # the third consecutive pressured interval
    assert runtime.cache.cap_bytes == int(cap * 0.9) and runtime.knobs["cache_cap_bytes"] == int(cap * 0.9)
    events = queries.events(runtime.recorder.store.path, kind="memory_guard")
    assert len(events) == 1 and "PSI memory full avg10 42.0% > 10% with 3% of memory available" in events[0]["message"]
    assert ("cache_cap_bytes", int(cap * 0.9), "guard") in {
        (h["knob"], h["new"], h["source"]) for h in queries.knob_history(runtime.recorder.store.path)}
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")
    for _ in range(4):
        runtime.tick()
    assert runtime.cache.cap_bytes == int(cap * 0.9)  # calm again: no further step


def test_the_agent_records_what_its_reads_measure_when_it_starts(runtime, tmp_path_factory):
    """The disk verdict's baseline is of these reads alone (store.disk_diagnosis.measuring_since)."""
    [event] = queries.events(runtime.recorder.store.path, kind=EXPERT_READS)
    model = demo_model(tmp_path_factory).resolve()
    assert event["message"].startswith(f"direct reads of {runtime.cache.index.nbytes} B expert blocks of {model} on ")


def test_a_busy_ssd_read_from_the_collector_leaves_the_batch_limit_at_max_batch_size(runtime):
    """For an MoE a smaller batch reads more per token (a step reads the union of its requests' experts),
    so a busy disk is no reason to shrink it (BENCHMARKS.md, "The batch limit under a busy disk")."""
    runtime.monitor.disk = "testdisk"  # no /sys/block/testdisk: the collector's series for it in the store
    store = runtime.recorder.store
    for _ in range(3):
        store.append("block.testdisk.util", time.time(), 0.97)
        store.flush()
        runtime.tick()
    status = runtime.status()
    assert status["ssd_util"] == pytest.approx(0.97, abs=0.01)
    assert status["ssd_util_source"] == "collector block.testdisk.util"
    assert status["batch_limit"] == runtime.scheduler.max_batch == runtime.knobs["max_batch_size"]


def test_the_model_runs_with_the_engines_thread_count_on_the_scheduler_thread(tmp_path_factory):
    """OpenMP/MKL keep the intra-op thread count per thread: the engine must set it on the thread that
    steps, or that thread runs a default-size team (whose idle members spin on a busy machine and made
    LRU serving ~10x slower than flashmoe, whose construction happened to run torch on the main thread)."""
    import threading

    import torch

    from agent.experts.cache import ExpertCache
    from agent.serve.engine import ModelEngine
    from agent.serve.scheduler import Request

    model = demo_model(tmp_path_factory)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what an unset thread would otherwise inherit on a multi-core machine
    cache = ExpertCache(model, 10**9, policy="lru")
    try:
        engine = ModelEngine(model, cache, threads=1)
        seen = []
        get = cache.get

        def spy(layer, expert):
            seen.append(torch.get_num_threads())  # on the stepping thread, inside the model's MoE
            return get(layer, expert)

        cache.get = spy
        request = Request("r", [1, 2, 3], 1, 0.0, lambda event: None)

        def serve():
            request.state = engine.begin(request)
            engine.step([request])

        thread = threading.Thread(target=serve)
        thread.start()
        thread.join()
        assert seen and set(seen) == {1}
    finally:
        cache.close()
        torch.set_num_threads(before)


def test_a_step_admitting_prompts_runs_on_the_prefill_threads_and_decode_steps_on_one(tmp_path_factory):
    """At seed scale the admission step is compute-bound (large matmuls, the disk idle most of it):
    it takes prefill_threads; the decode steps, small per-expert matmuls beside the reads, keep one."""
    import torch

    from agent.experts.cache import ExpertCache
    from agent.serve.engine import PREFILL_TOKENS, ModelEngine
    from agent.serve.scheduler import Request

    model = demo_model(tmp_path_factory)
    before = torch.get_num_threads()
    cache = ExpertCache(model, 10**9, policy="lru")
    try:
        engine = ModelEngine(model, cache, threads=1, prefill_threads=2)
        seen = []
        get = cache.get

        def spy(layer, expert):
            seen.append(torch.get_num_threads())  # inside the model's MoE
            return get(layer, expert)

        cache.get = spy
        short, long_ = (Request(n, list(range(1, size + 1)), 2, 0.0, lambda event: None)
                        for n, size in (("short", 3), ("long", PREFILL_TOKENS)))
        threads = []
        for batch in ([short], [long_], [short, long_]):  # short prefill, the admission of a long one, decode
            for r in batch:
                r.state = r.state or engine.begin(r)
            seen.clear()
            tokens, _ = engine.step(batch)
            for r, t in zip(batch, tokens):
                r.generated.append(t)
            threads.append(set(seen))
        assert threads == [{1}, {2}, {1}]
        assert [p.prompt_tokens for p in engine.profiles] == [3, PREFILL_TOKENS, 0]
    finally:
        cache.close()
        torch.set_num_threads(before)


def test_a_slow_knob_change_is_logged_with_where_its_time_went(runtime, monkeypatch, caplog):
    import agent.serve.runtime as module
    cap = runtime.knobs.values["cache_cap_bytes"]
    runtime.set_knobs({"cache_cap_bytes": cap}, "api")   # no change: nothing to time
    monkeypatch.setattr(module, "SLOW_KNOB_S", 0.0)
    runtime.set_knobs({"cache_cap_bytes": cap // 2}, "api")
    slow = [r.getMessage() for r in caplog.records if r.getMessage().startswith("knob change took")]
    assert len(slow) == 1 and all(p in slow[0] for p in ("waiting for another knob change", "applying", "recording"))


def test_a_memory_limit_that_cannot_be_read_keeps_the_cap_bounds_and_refuses_a_cap_change(runtime, monkeypatch):
    """Under the pressure it bounds, reading the cgroup's limit can fail (ENOMEM, seen in the squeeze scenario):
    that is no reason to believe there is no limit and let the cap's maximum jump to 70% of the machine's RAM."""
    import errno

    from agent.experts import cap as cap_module
    from agent.serve import runtime as runtime_module
    from agent.serve.knobs import KnobError

    def unreadable() -> int:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    limits, cap = runtime.knobs.limits, runtime.cache.cap_bytes
    monkeypatch.setattr(runtime_module, "memory_limit_bytes", unreadable)
    monkeypatch.setattr(cap_module, "memory_limit_bytes", unreadable)
    tick = runtime.tick()                        # the tick is not lost either
    assert tick is not None and runtime.knobs.limits == limits
    smaller = (limits.cap_min + cap) // 2
    with pytest.raises(KnobError, match="memory limit could not be read"):
        runtime.set_knobs({"cache_cap_bytes": smaller}, "api")
    assert runtime.cache.cap_bytes == cap and runtime.knobs["cache_cap_bytes"] == cap


def test_serve_workers_reach_the_model(tmp_path_factory):
    """serve --workers: the threads every step's experts run on (agent/model/routed.py)."""
    rt = Runtime(ServeOptions(demo_model(tmp_path_factory), cache_cap="50%", workers=2), CollectorRegistry())
    rt.start()
    try:
        assert rt.engine.model.workers.workers == 2 and rt.engine.model.experts.workers is rt.engine.model.workers
    finally:
        rt.stop()
