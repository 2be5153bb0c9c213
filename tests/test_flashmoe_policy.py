"""The learned FlashMoE policy inside the cache core: contract, event-driven rescoring, knobs, weights."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from safetensors.torch import load_file, safe_open, save_file

from agent.learned.model import NetConfig, RetentionNet, save
from agent.learned.model import load as load_weights
from agent.policies import policy_factory, policy_names
from agent.policies.flashmoe import DEFAULT_WEIGHTS, FlashMoE
from agent.residency import Residency
from agent.simulator import simulate
from agent.traces import load, walk
from bench.batching import batched

TRACES = Path(__file__).parent / "data" / "traces"


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> Path:
    import torch
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "untrained.safetensors"
    save(RetentionNet(), path, {"note": "random init"})
    return path


def drive(cache: Residency, steps, layer: int = 0) -> None:
    for experts in steps:
        cache.route(layer, experts)
        for e in experts:
            cache.access((layer, e))


def test_registered_and_shipped_weights_load():
    assert "flashmoe" in policy_names()
    assert DEFAULT_WEIGHTS.is_file()
    policy = policy_factory("flashmoe")()
    assert (policy.decision, policy.keep_percentile) == ("score", 30.0)


def test_victim_is_resident_and_never_pinned(untrained):
    rng = np.random.default_rng(1)
    policy = policy_factory("flashmoe", model_path=untrained, recompute_threshold=0.0)()
    resident = {(0, e) for e in range(12)}
    for _ in range(200):
        policy.route(0, rng.choice(32, 4, replace=False).tolist())
        pinned = {k for k in resident if rng.random() < 0.6}
        pinned.discard(next(iter(resident)))
        victim = policy.victim(resident, pinned)
        assert victim in resident and victim not in pinned
    with pytest.raises(ValueError, match="pinned"):
        policy.victim(resident, resident)


def test_cache_with_flashmoe_never_evicts_the_current_step(untrained):
    trace = load(TRACES / "qwen_prose.jsonl")
    cache = Residency(15 * trace.n_layers, trace.n_layers, policy_factory("flashmoe", model_path=untrained),
                      "layer", trace.max_set)
    for i, (_, layer, experts) in enumerate(walk(trace)):
        if i > 24 * 64:
            break
        cache.route(layer, experts)
        for e in experts:
            _, victim = cache.access((layer, e))
            assert victim is None or victim[1] not in experts
        assert all((layer, e) in cache for e in experts)


def periodic(period: int, steps: int, k: int = 4, n: int = 32) -> list[list[int]]:
    rng = np.random.default_rng(period)
    cycle = [rng.choice(n, k, replace=False).tolist() for _ in range(period)]
    return [cycle[i % period] for i in range(steps)]


def test_scores_are_recomputed_only_when_the_distribution_shifts(untrained):
    # a period-4 routing cycle: once the 16-step window is full its histogram never changes
    def recomputes(threshold, steps):
        cache = Residency(8, 1, policy_factory("flashmoe", model_path=untrained, recompute_threshold=threshold))
        drive(cache, steps)
        return cache._parts[0].policy.recomputes, sum(s.evictions for s in cache.stats)

    stationary, evictions = recomputes(0.0, periodic(4, 400))
    assert evictions > 300 and stationary <= 16  # warm-up only, then cached scores
    drifting = periodic(4, 200) + periodic(5, 200)
    shifted, _ = recomputes(0.0, drifting)
    assert shifted > stationary
    assert recomputes(1.0, drifting)[0] == 1  # TV distance never exceeds 1: scored once, then cached
    assert recomputes(0.3, drifting)[0] < shifted


@pytest.mark.parametrize("name", ["olmoe_math", "olmoe_dialogue"])
def test_batched_steps_keep_up_with_lfu(name):
    # eight requests a step: a layer's union (~23-32 experts) outgrows its 16 slots, so the step's own
    # earlier arrivals become candidates. Counted as the freshest, an expert one request used once
    # outlived those every request uses, and the policy fell .023-.027 behind LFU here.
    trace = batched(load(TRACES / f"{name}.jsonl"), batch=8, tokens=12, waves=8)
    hit_rate = {p: (r := simulate(trace, p, 0.25, "layer")).hits / r.accesses for p in ("flashmoe", "lfu", "lru")}
    assert hit_rate["flashmoe"] >= hit_rate["lfu"] - 0.005 and hit_rate["flashmoe"] > hit_rate["lru"] + 0.03


class RescoreUnchangedToo(FlashMoE):
    """Whenever it rescores, also rescores every layer whose history has not changed since its last
    scoring: the work the real policy skips, on the claim that those scores would come out the same."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scored_at: dict[int, int] = {}

    def _stale_layers(self) -> list[int]:
        stale = super()._stale_layers()
        return stale + [layer for layer, h in self.layers.items()
                        if layer not in stale and self.scored_at.get(layer) == h.t] if stale else stale

    def _rescore(self, stale, resident, candidates) -> None:
        super()._rescore(stale, resident, candidates)
        self.scored_at.update((layer, self.layers[layer].t) for layer in stale)


def test_a_global_cache_rescores_only_the_layers_whose_features_changed(untrained):
    # a layer's features change only when it routes: scoring the unchanged layers too must pick the
    # same victims, so skipping them is free
    trace = load(TRACES / "olmoe_dialogue.jsonl")
    policies = [FlashMoE(untrained), RescoreUnchangedToo(untrained)]
    caches = [Residency(trace.n_experts * trace.n_layers // 4, trace.n_layers, lambda p=p: p, "global", trace.max_set)
              for p in policies]
    evictions, scored = [[], []], [count_scored(p) for p in policies]
    for i, (_, layer, experts) in enumerate(walk(trace)):
        if i > 40 * trace.n_layers:
            break
        for cache, evicted in zip(caches, evictions):
            cache.route(layer, experts)
            evicted += [cache.access((layer, e))[1] for e in experts]
    assert len({k for k in evictions[0] if k}) > 100 and evictions[0] == evictions[1]
    assert scored[0][0] < scored[1][0] / 5  # one or two layers scored per step, not all 16


def count_scored(policy) -> list[int]:
    """Make the policy's scorer count the experts it scores; returns the one-item counter."""
    count, score = [0], policy.scorer.score

    def counting(h, experts):
        count[0] += len(experts)
        return score(h, experts)
    policy.scorer.score = counting
    return count


def test_system_samples_trigger_one_rescore(untrained):
    cache = Residency(8, 1, policy_factory("flashmoe", model_path=untrained, recompute_threshold=1.0))
    drive(cache, periodic(4, 40))
    policy = cache._parts[0].policy
    before = policy.recomputes
    cache.system({"read_latency_s": 4e-4, "mem_pressure": 0.9})
    drive(cache, periodic(4, 40))
    assert policy.recomputes == before + 1


def test_compiled_scoring_equals_the_torch_network():
    import torch

    from agent.learned.features import LayerHistory
    from agent.learned.model import load as load_net
    from agent.learned.scorer import Scorer, layer_inputs, shared_net
    h = LayerHistory()
    for experts in load(TRACES / "qwen_dialogue.jsonl").dense()[:100, 3]:
        h.observe(experts.tolist())
    experts = np.arange(60)
    series = [(0.5, 0.2), (1.0, 0.7)]
    scorer = Scorer(shared_net(str(DEFAULT_WEIGHTS)))
    scorer.set_series(series)
    signature, features = layer_inputs(h, experts)
    with torch.inference_mode():
        want = load_net(DEFAULT_WEIGHTS)(torch.from_numpy(signature), torch.from_numpy(features),
                                         torch.tensor([series], dtype=torch.float32)).numpy()
    assert want.std() > 0.1  # the histories differ, so the scores must
    np.testing.assert_allclose(scorer.score(h, experts), want, rtol=1e-4, atol=1e-5)


def test_runs_on_an_expert_count_it_was_not_trained_on():
    # two OLMoE layers folded into one of 128 experts, top-16: a shape the shipped weights never saw
    trace = load(TRACES / "olmoe_math.jsonl").dense()[:256]
    folded = [sorted(trace[t, 0].tolist() + (trace[t, 1] + 64).tolist()) for t in range(len(trace))]
    rates = {}
    for name in ("lru", "flashmoe"):
        cache = Residency(32, 1, policy_factory(name), "layer", 16)
        drive(cache, folded)
        rates[name] = cache.stats[0].hits / (cache.stats[0].hits + cache.stats[0].misses)
    assert rates["flashmoe"] >= 0.95 * rates["lru"]


def test_trained_weights_beat_lru_on_a_report_trace(tmp_path):
    head = tmp_path / "olmoe_dialogue_192.jsonl"  # the first 192 tokens of a held-out trace
    head.write_text("\n".join((TRACES / "olmoe_dialogue.jsonl").read_text().splitlines()[:193]))
    lru = simulate(load(head), "lru", 0.25).hit_rate
    learned = simulate(load(head), "flashmoe", 0.25).hit_rate
    assert learned > lru


@pytest.mark.parametrize("options, message", [
    ({"keep_percentile": 120}, "keep_percentile"),
    ({"recompute_threshold": -0.1}, "recompute_threshold"),
    ({"decision": "random"}, "decision"),
])
def test_bad_knobs_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        policy_factory("flashmoe", **options)()


def test_missing_or_corrupt_weights_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="do not exist.*train-policy"):
        policy_factory("flashmoe", model_path=tmp_path / "none.safetensors")()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match="not a valid weights file"):
        policy_factory("flashmoe", model_path=bad)()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(DEFAULT_WEIGHTS.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a valid weights file"):
        policy_factory("flashmoe", model_path=truncated)()
    net = load_weights(DEFAULT_WEIGHTS)
    with torch.no_grad():
        next(net.parameters()).fill_(float("nan"))   # the policy ran on such weights, below LRU's hit rate
    save(net, tmp_path / "nan.safetensors", {})
    with pytest.raises(ValueError, match="not a valid weights file .*NaN or infinite"):
        policy_factory("flashmoe", model_path=tmp_path / "nan.safetensors")()


def test_weights_trained_on_other_inputs_are_refused_by_name(tmp_path):
    """Weights from before a feature was added (15 features, before successor_4) loaded, and the compiled
    scorer read past their first layer's rows: silently wrong scores; other system inputs: a traceback."""
    for config, said in ((NetConfig(n_features=15), "expert features 15 (this version computes 16)"),
                         (NetConfig(signature_bits=8), "signature bits 8 (this version computes 32)"),
                         (NetConfig(system_inputs=3), "system inputs 3 (this version computes 2)")):
        save(RetentionNet(config), tmp_path / "other.safetensors", {})
        with pytest.raises(ValueError, match=re.escape(f"trained on other inputs: {said}")):
            policy_factory("flashmoe", model_path=tmp_path / "other.safetensors")()


def test_weights_whose_metadata_claims_a_huge_network_are_refused_without_building_it(tmp_path):
    """The network was built (allocated and initialised) at the size the metadata claims, before its tensors
    were read: 40 GB for a hidden width of 10**5."""
    path = tmp_path / "claims.safetensors"
    save(RetentionNet(), path, {})
    state = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    save_file(state, str(path), metadata={**meta, "config": json.dumps({**json.loads(meta["config"]),
                                                                          "hidden": 10 ** 5})})
    with pytest.raises(ValueError, match=r"\(expert\.mlp\.0\.bias is \[64\] where its config makes it \[100000\]\);"):
        load_weights(path)


def test_experts_admitted_before_their_layer_routed_can_be_evicted():
    # a preload (warm-up) admits experts of layers that have not routed yet: they are scored from an
    # empty history when the cache fills, not a KeyError
    cache = Residency(8, 2, policy_factory("flashmoe"), "global")
    for e in range(12):
        cache.access((e % 2, e))
    assert len(cache) == 8
