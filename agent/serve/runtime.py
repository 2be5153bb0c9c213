"""The agent's one runtime object: model, cache, scheduler, knobs, metrics, store, guard.

The HTTP routes (agent.serve.app) only call the methods here. A one-second ticker thread turns the
counters into a Tick (metrics, store), takes a monitoring sample (agent.monitor, the one the
cache's policy sees too) and runs the memory guard on it. Knob changes are applied on the scheduler thread between two
steps, so a shrink never frees a slot the running step still reads.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from agent.experts.cache import ExpertCache
from agent.experts.cap import KV_BUDGET_TOKENS, cap_bounds, memory_limit_bytes, parse_cap, resident_bytes
from agent.experts.layout import CONFIG, INDEX, Index
from agent.experts.quant import quantizes_activations
from agent.experts.reader import IO_THREADS
from agent.monitor import SystemSample, SystemSampler
from agent.model.config import MoEConfig
from agent.model.loading import check_dense
from agent.learned.service import OnlineLearning
from agent.policies import DEFAULT_POLICY, live_policies, policy_factory, policy_knobs, policy_options
from agent.prefetch_gate import check_mode, knobs_of, mode_of
from agent.serve import guard, scrub
from agent.serve.engine import STEP_PROFILES, ModelEngine
from agent.serve.knobs import KnobError, Knobs, Limits
from agent.serve.metrics import Metrics, Tick
from agent.serve.recorder import Recorder
from agent.serve.scheduler import ADMIT_WINDOW_S, MAX_WAITING, Request, Scheduler, check_admit_window
from store.disk_diagnosis import EXPERT_READS, reads_described

log = logging.getLogger(__name__)
SLOW_KNOB_S = 5.0   # a knob change taking longer is logged with where its time went

TICK_S = 1.0
DEFAULT_CAP = "25%"          # of expert bytes, when neither --cache-cap nor a stored value says otherwise
POLICY_KNOBS = frozenset(k.name for k in policy_knobs())


@dataclass(frozen=True)
class ServeOptions:
    model_dir: Path
    cache_cap: str | None = None     # bytes, a size or a percentage of expert bytes
    policy: str | None = None
    backend: str = "direct"
    prefetch: str | None = None      # on, off or auto (agent/prefetch_gate.py); None: the stored knobs' mode
    max_batch_size: int | None = None
    threads: int = 1                 # torch intra-op threads of the thread that steps the model
    io_threads: int = IO_THREADS     # expert reads in flight at once
    admit_window_s: float = ADMIT_WINDOW_S  # how long an idle scheduler waits for a burst to share its first step
    verify: bool = False             # check every block's CRC32 in the background while idle
    route_trace: tuple[Path, ...] = ()      # recorded routing that decides each token's experts (model/route_trace.py)
    prefill_threads: int | None = None      # torch threads of a step admitting prompts (engine.py); None: `threads`
    int8_activations: bool = True    # int8 experts quantize bf16 activations above 8 tokens an expert (W8A8)
    max_waiting: int = MAX_WAITING   # requests queued for a place in the batch; more get 429
    kv_budget: int = KV_BUDGET_TOKENS  # KV positions of all running requests together (the cap's rule counts them)
    dense: str = "stored"            # dense linears as stored or int8 (agent/model/dense_int8.py)
    workers: int = 1                 # threads a step's experts run on, the model's own one of them (agent/workers.py)

    def __post_init__(self) -> None:
        check_admit_window(self.admit_window_s)  # before the model loads, so a bad value fails at once
        if self.prefetch is not None:
            check_mode(self.prefetch)
        check_dense(self.dense)
        if self.kv_budget < 1:
            raise ValueError(f"kv_budget must be at least one position, got {self.kv_budget}")


class Runtime:
    """Built from the options, which it checks whole (model, cap, policy, knobs); `start(store)` then serves."""

    def __init__(self, opts: ServeOptions, registry: CollectorRegistry) -> None:
        self.opts, self.started = opts, time.time()
        self.recorder: Recorder | None = None   # start() connects the store: none is made for an agent that fails here
        self.monitor = SystemSampler.for_experts(opts.model_dir)
        self.cache = ExpertCache(opts.model_dir, _first_cap(opts), policy=opts.policy or DEFAULT_POLICY,
                                 backend=opts.backend, io_threads=opts.io_threads, monitor=self.monitor,
                                 int8_activations=opts.int8_activations, kv_positions=opts.kv_budget)
        try:
            self.engine = ModelEngine(opts.model_dir, self.cache, threads=opts.threads, route_trace=opts.route_trace,
                                      prefill_threads=opts.prefill_threads, dense=opts.dense,
                                      int8_activations=opts.int8_activations, workers=opts.workers)
        except BaseException:
            self.cache.close()
            raise
        lo, hi = cap_bounds(self.cache.index, self.cache.min_per_layer, reserved=self.cache.reserved_bytes)
        self.knobs = Knobs(Limits(lo, hi, live_policies(), max_prefetch_depth=1))
        self.knobs.commit({"cache_cap_bytes": self.cache.cap_bytes, "policy": self.cache.policy_name})
        self.metrics = Metrics(registry, self.cache.index.n_layers)
        self.online = OnlineLearning(self.cache, registry)
        self.scheduler = Scheduler(self.engine, self.knobs["max_batch_size"], self.metrics.request, opts.admit_window_s,
                                   max_waiting=opts.max_waiting, kv_budget=opts.kv_budget)
        self.truncated = scrub.truncated(opts.model_dir, self.cache.index)
        if self.truncated:
            log.error("the expert store is truncated: %d blocks end past the end of its file", len(self.truncated))
        self.scrub = scrub.Scrub(opts.model_dir, self.cache.index, opts.backend,
                                 busy=lambda: bool(self.scheduler.running or self.scheduler.waiting))
        self.guard_config, self._guard_streak = guard.GuardConfig(), 0
        self._knob_lock = threading.Lock()
        self._limit_unread = False   # the memory limit's last read failed (logged once a streak)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="ticker", daemon=True)
        self._cli_knobs = self._command_line_knobs()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, store=None) -> None:
        """Record into `store` (if given) and read the collector's series from it, bring knobs to their stored
        and command-line values, then start serving."""
        if store is not None:
            self.recorder, self.monitor.telemetry = Recorder(store), store.path
        self.scheduler.start()
        if self.recorder is not None:    # what its read latency measures, so no other reads' baseline judges it
            store = str(Path(self.opts.model_dir).resolve())
            self.recorder.event(time.time(), EXPERT_READS, reads_described(
                self.opts.backend, self.cache.index.nbytes, store, self.monitor.disk))
        self._initial_knobs()
        self._ticker.start()
        if self.opts.verify:
            self.scrub.start()

    def stop(self) -> None:
        self._stop.set()
        self.scrub.stop()
        self.scheduler.stop()
        if self._ticker.is_alive():
            self._ticker.join(5)
        self.tick()  # the last partial second and the last requests
        self.online.close()
        self.cache.close()

    def _command_line_knobs(self) -> dict[str, Any]:
        """The knobs the command line sets, checked now (KnobError): a bad one fails before start() opens a store."""
        cap = self.opts.cache_cap
        cli = {"cache_cap_bytes": parse_cap(cap, self.cache.expert_bytes) if cap else None,
               "policy": self.opts.policy, "max_batch_size": self.opts.max_batch_size}
        cli = {k: v for k, v in cli.items() if v is not None}
        if self.opts.prefetch is not None:
            cli |= knobs_of(self.opts.prefetch)
        if cli:
            self.knobs.validate(cli)
        return cli

    def _initial_knobs(self) -> None:
        """What the command line says (source "cli"), and the store's last value (source "restore") of
        every other knob: a flag given at start wins over history."""
        stored = {k: v for k, v in self._stored_knobs().items() if k not in self._cli_knobs}
        if stored:
            self.set_knobs(stored, "restore", partial=True)
        if self._cli_knobs:
            self.set_knobs(self._cli_knobs, "cli")

    def _stored_knobs(self) -> dict[str, Any]:
        """The store's last value of each knob this agent has (values come back typed, from JSON)."""
        if self.recorder is None:
            return {}
        from store.queries import latest_knobs
        return {k: v for k, v in latest_knobs(self.recorder.store.path).items() if k in self.knobs.specs}

    # -- knobs ------------------------------------------------------------------------------------
    def set_knobs(self, changes: dict[str, Any], source: str, partial: bool = False) -> dict[str, Any]:
        """Validate all, apply between two steps (the cache cap alone: at once), record each change. With
        `partial` (restore), a value that no longer fits the bounds (e.g. less memory now) is skipped
        with a warning instead of refused."""
        asked = time.monotonic()
        with self._knob_lock:
            locked = time.monotonic()
            if partial:
                changes = self._fitting(changes)
                if not changes:     # nothing stored fits any more
                    return self.knobs.describe()
            validated = self.knobs.validate(changes)   # an empty change is refused: a client's mistake
            diff = self.knobs.diff(validated)
            self._check_policy({k: new for k, (_, new) in diff.items()})
            if diff:
                wanted = {k: value for k, (_, value) in diff.items()}
                if wanted.keys() == {"cache_cap_bytes"}:  # the cache resizes under its own lock, mid-step
                    self._apply(wanted)
                else:
                    self.scheduler.call(lambda: self._apply(wanted))
                applied, t = time.monotonic(), time.time()
                self.metrics.knob_changes.inc(len(diff))
                for knob, (old, new) in diff.items():
                    log.info("knob %s: %r -> %r (%s)", knob, old, new, source)
                    if self.recorder is not None:
                        self.recorder.knob_change(t, knob, old, new, source)
                _log_if_slow({"waiting for another knob change": locked - asked, "applying": applied - locked,
                              "recording": time.monotonic() - applied})
            return self.knobs.describe()

    def _check_policy(self, new: dict[str, Any]) -> None:
        """Build the policy a change asks for once before applying anything: a policy that cannot load
        (e.g. the learned one without its weights file) is refused like an out-of-range value."""
        if "policy" not in new and not new.keys() & POLICY_KNOBS:
            return
        merged = {**self.knobs.values, **new}
        try:
            policy_factory(merged["policy"], **policy_options(merged["policy"], merged))()
        except (ValueError, OSError) as exc:
            raise KnobError("policy", f"policy {merged['policy']!r} cannot run: {exc}") from None

    def _fitting(self, changes: dict[str, Any]) -> dict[str, Any]:
        ok = {}
        for name, value in changes.items():
            try:
                ok.update(self.knobs.validate({name: value}))
            except KnobError as exc:
                log.warning("not restoring %s: %s", name, exc)
        return ok

    def _apply(self, new: dict[str, Any]) -> None:
        """Runs on the scheduler thread between two steps, or for the cache cap alone on the caller's (the
        cache resizes under its own lock). Commits knob by knob, so a failure leaves the knobs true to the runtime."""
        if "cache_cap_bytes" in new:
            try:
                self.cache.resize(new["cache_cap_bytes"])
            except ValueError as exc:  # e.g. too small for the memory it must lock
                raise KnobError("cache_cap_bytes", str(exc)) from None
            except OSError as exc:     # the memory limit to check it against could not be read
                raise KnobError("cache_cap_bytes", f"the memory limit could not be read to check the cap ({exc}); "
                                                   f"nothing changed, try again") from None
            self.knobs.commit({"cache_cap_bytes": new["cache_cap_bytes"]})
        policy_change = {k: v for k, v in new.items() if k == "policy" or k in POLICY_KNOBS}
        merged = {**self.knobs.values, **policy_change}
        options = policy_options(merged["policy"], merged)
        if "policy" in policy_change or options.keys() & policy_change.keys():
            self.cache.set_policy(merged["policy"], **self.online.policy_options(options))
        self.knobs.commit(policy_change)
        if "max_batch_size" in new:
            self.scheduler.max_batch = new["max_batch_size"]
        rest = {k: v for k, v in new.items() if k not in policy_change and k != "cache_cap_bytes"}
        self.knobs.commit(rest)
        self.engine.model.prefetch = self.knobs["prefetch"] and self.knobs["prefetch_depth"] >= 1
        self.cache.set_prefetch(mode_of(self.engine.model.prefetch, self.knobs["prefetch_adaptive"]))

    # -- control calls ------------------------------------------------------------------------------
    def preload(self, keys: list[tuple[int, int]]) -> int:
        n_layers, n_experts = self.cache.index.n_layers, self.cache.index.n_experts
        for layer, expert in keys:
            if not (0 <= layer < n_layers and 0 <= expert < n_experts):
                raise KnobError("experts", f"expert [{layer}, {expert}] does not exist: layers are 0..{n_layers - 1}, "
                                           f"experts 0..{n_experts - 1}")
        return self.scheduler.call(lambda: self.cache.preload(keys))

    def submit(self, request: Request) -> None:
        self.scheduler.submit(request)

    def status(self, step_profiles: int = STEP_PROFILES) -> dict[str, Any]:
        """What /v1/status shows, with the `step_profiles` most recent model steps' profiles."""
        s = self.cache.stats()
        profiles = list(self.engine.profiles)  # one C call, safe beside appends
        return {
            "model": str(self.opts.model_dir), "uptime_s": time.time() - self.started,
            "routing": trace.describe() if (trace := self.engine.model.route_trace) else "the model's router",
            "policy": s.policy, "backend": s.backend, "scope": s.scope, "experts": self.experts_compute(),
            "dense": self.opts.dense,
            "cache": {"resident_experts": s.resident, "capacity_experts": s.capacity,
                      "cache_bytes": s.resident * s.slot_bytes, "cap_bytes": s.cap_bytes,
                      "occupancy": s.resident / s.capacity if s.capacity else 0.0,
                      "expert_bytes": self.cache.expert_bytes,
                      "hits": s.hits, "misses": s.misses, "hit_rate": s.hit_rate, "bytes_read": s.bytes_read,
                      "prefetch_accuracy": s.prefetch_accuracy, "prefetch": s.prefetch},
            "recent_hit_rate": self.metrics.recent_hit_rate(),
            "batch_size": self.scheduler.batch_size, "batch_limit": self.scheduler.max_batch,
            "queue_depth": len(self.scheduler.waiting), "kv_positions": self.scheduler.kv_positions,
            "kv_budget": self.scheduler.kv_budget, "tokens_generated": self.scheduler.tokens_total,
            "requests_unserved": dict(self.scheduler.unserved),
            "model_steps": self.scheduler.steps,
            "ssd_util": self.monitor.last.ssd_util, "ssd_util_source": self.monitor.last.sources.get("ssd_util"),
            "store": self.store_health(), "online_learning": self.online.status(),
            "step_profiles": [asdict(p) for p in profiles[max(0, len(profiles) - step_profiles):]],
        }

    def experts_compute(self) -> dict[str, Any]:
        """What the store's experts hold and how they are computed: int8_activations is whether int8
        experts quantize bf16 activations too (W8A8), None where it does not apply (not int8, or not bf16)."""
        index = self.cache.index
        return {"quant": index.quant, "dtype": index.dtype,
                "int8_activations": self.opts.int8_activations if quantizes_activations(index) else None}

    def store_health(self) -> dict[str, Any]:
        """Damaged blocks found by the size check at start, by reads while serving and by the scrub."""
        damaged = {**self.truncated, **self.scrub.damaged, **self.cache.damaged}
        return {"blocks": len(self.cache.index.blocks), "damaged": len(damaged),
                "damaged_blocks": [{"layer": layer, "expert": expert, "reason": reason}
                                   for (layer, expert), reason in sorted(damaged.items())],
                "verify": self.scrub.describe() if self.opts.verify else None}

    # -- the one-second tick -----------------------------------------------------------------------------
    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tick()
            except Exception:
                log.exception("statistics tick failed; retrying next second")

    def tick(self) -> Tick:
        sched = self.scheduler
        tick = self.metrics.tick(time.time(), self.cache.stats(), sched.batch_size, len(sched.waiting), sched.max_batch,
                                 sched.tokens_total, self.engine.routes.take(), self._follow_memory_limit(),
                                 dict(self.engine.model.profile.seconds), dict(sched.unserved))
        if self.recorder is not None:
            self.recorder.write(tick, self.metrics.drain_requests())
        else:
            self.metrics.drain_requests()
        self.online.tick(self.recorder)
        if not self._stop.is_set():
            self._guard(self.monitor.sample())
        return tick

    def _follow_memory_limit(self) -> tuple[int, int]:
        """The cap's bounds, re-read every tick so they follow a memory limit set or changed while the
        agent runs (e.g. its cgroup's); a change is logged and recorded as an event. When the limit cannot
        be read (ENOMEM under the very pressure it bounds), the bounds stay as they were."""
        limits = self.knobs.limits
        try:
            memory = memory_limit_bytes()
        except OSError as exc:
            if not self._limit_unread:
                log.warning("cache cap bounds kept at %d .. %d bytes while the memory limit cannot be read (%s)",
                            limits.cap_min, limits.cap_max, exc)
            self._limit_unread = True
            return limits.cap_min, limits.cap_max
        self._limit_unread = False
        lo, hi = cap_bounds(self.cache.index, self.cache.min_per_layer, reserved=self.cache.reserved_bytes,
                            memory=memory)
        if (lo, hi) != (limits.cap_min, limits.cap_max):
            with self._knob_lock:
                self.knobs.rebound(replace(limits, cap_min=lo, cap_max=hi))
            message = (f"cache cap bounds now {lo} .. {hi} bytes (were {limits.cap_min} .. {limits.cap_max}): "
                       f"the memory limit is {memory} bytes, "
                       f"{self.cache.reserved_bytes} of it kept by the model besides the slots")
            log.warning("%s", message)
            if self.recorder is not None:
                self.recorder.event(time.time(), "knob_bounds", message)
        return lo, hi

    def _guard(self, pressure: SystemSample) -> None:
        if not self.knobs["auto_shrink"]:
            self._guard_streak = 0
            return
        floor = self.knobs.specs["cache_cap_bytes"].lo
        self._guard_streak, shrink = guard.decide(self._guard_streak, pressure, self.cache.cap_bytes, floor,
                                                  self.guard_config)
        if shrink is not None:
            log.warning("memory guard: %s", shrink.reason)
            if self.recorder is not None:
                self.recorder.event(time.time(), "memory_guard", shrink.reason)
            self.set_knobs({"cache_cap_bytes": shrink.new_cap}, "guard")


def _first_cap(opts: ServeOptions) -> int:
    """The cap to open the cache with: --cache-cap as given (the cache refuses one out of bounds), or
    the default clamped into the bounds. A stored value, if any, is applied by start()."""
    index = Index.load(Path(opts.model_dir) / INDEX)
    cap = parse_cap(opts.cache_cap or DEFAULT_CAP, index.nbytes * len(index.blocks))
    if opts.cache_cap:
        return cap
    lo, hi = cap_bounds(index, MoEConfig.from_file(Path(opts.model_dir) / CONFIG).top_k,
                        reserved=resident_bytes(opts.model_dir, index, opts.kv_budget))
    return min(max(cap, lo), hi)


def _log_if_slow(phases: dict[str, float]) -> None:
    """A knob change slower than SLOW_KNOB_S (e.g. under memory thrash) is logged with where its time went."""
    if sum(phases.values()) > SLOW_KNOB_S:
        log.warning("knob change took %.1f s: %s", sum(phases.values()),
                    ", ".join(f"{seconds:.1f} s {phase}" for phase, seconds in phases.items()))