"""A batched step's lookahead guess: which experts it reads, in what order, and what it never evicts.

A served step routes, per layer, the union of its requests' top-k (OLMoE at 8 requests: ~23 of 64
experts through 16 slots), and the guess at the next layer names as many. Residents it names are
never evicted, so only the few it does not name make room, and the guess's order decides which
experts get those slots: most likely first. No timing here: a replay of real routing through the
cache core (agent.residency) with the lookahead, counted exactly.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.model.lookahead import CoActivation, Lookahead
from agent.model.routed import Routing
from agent.policies import policy_factory
from agent.residency import Residency
from agent.simulator import SystemReplay, cache_for, replay
from agent.traces import load
from bench.batching import batched
from bench.lookahead import TwoLayersOn
from bench.prefetch_guess import Ascending

TRACES = Path(__file__).parent / "data" / "traces"


def test_a_guess_reads_its_likeliest_experts_into_the_room_its_unnamed_residents_leave():
    residency = Residency(4 * 2, 2, policy_factory("lru"), "layer", 1)   # 4 slots a layer
    for e in (0, 1, 2, 3):
        residency.access((1, e))
    admitted = residency.guess(1, [7, 1, 6, 0, 5])   # 1 and 0 would be hits: only 2 and 3 may go
    assert [key for key, _ in admitted] == [(1, 7), (1, 6)]
    assert sorted(victim for _, victim in admitted) == [(1, 2), (1, 3)]
    assert sorted(residency.resident()) == [(1, 0), (1, 1), (1, 6), (1, 7)]


def test_the_router_ranks_its_guess_by_tokens_then_gate_weight():
    routing = Routing(weights=torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]]),
                      ids=torch.tensor([[2, 5], [5, 1], [3, 2]]))
    assert routing.ranked == [5, 2, 3, 1]   # 5 and 2 by two tokens each (weights 1.1, 0.7), then 3 (0.9), 1 (0.3)
    assert routing.experts == [1, 2, 3, 5]  # what the provider is routed stays ascending


def test_co_activation_guesses_the_experts_likely_enough_to_follow_likeliest_first():
    look = Lookahead(CoActivation(n_layers=2, n_experts=8))
    for following in ([3, 6], [6, 7], [3, 6]):
        look.after_route(0, [1, 2], residual=None)
        look.after_route(1, following, residual=None)
    assert look.after_route(0, [1, 2], residual=None) == (1, [6, 3, 7])  # chances 1, 2/3, 1/3: all >= GUESS_AT
    look.after_route(1, [6, 5], residual=None)
    look.after_route(0, [1, 2], residual=None)
    look.after_route(1, [6, 4], residual=None)
    # after 1 and 2 five times: 6 five, 3 twice (0.4), 7, 5 and 4 once (0.2, under GUESS_AT = 0.3: not read)
    assert look.after_route(0, [1, 2], residual=None) == (1, [6, 3])


def test_co_activation_averages_over_the_experts_routed_now():
    look = Lookahead(CoActivation(n_layers=2, n_experts=8))
    for routed, following in (([1], [5]), ([2], [6]), ([2], [6])):
        look.after_route(0, routed, residual=None)
        look.after_route(1, following, residual=None)
    # 5 always followed 1, 6 always followed 2: each has chance (1 + 0) / 2 given both; 3 never seen: left out
    assert look.after_route(0, [1, 2, 3], residual=None) == (1, [5, 6])


def test_co_activation_two_layers_on_counts_what_came_two_layers_later_across_steps():
    """bench/lookahead.py's second guess: layer L's routing -> layer L+2's (past the last: the next step's)."""
    two = TwoLayersOn(n_layers=3, n_experts=8)
    for layer, routed in enumerate(([1], [2], [3], [4], [5])):       # one step's layers 0..2, the next's 0..1
        assert two.predict(layer % 3, routed, residual=None) is None  # nothing seen two layers on yet
    assert two.predict(2, [3], residual=None) == (1, [5])            # 3 at layer 2 -> 5 at the next step's layer 1
    assert two.predict(0, [4], residual=None) == (2, [3])            # 4 at layer 0 -> 3 at layer 2, just now
    assert two.predict(2, [6], residual=None) is None                # 6 never seen at layer 2 before
    assert two.predict(0, [4], residual=None) == (2, [3, 6])         # 4 at 0 -> 3 once, 6 once: chance 1/2 each


def batched_replay(name: str, policy: str, ascending: bool = False) -> tuple[int, int, int, int]:
    """8 requests a step, 12 decode steps each, 4 waves of real OLMoE routing through a 25% cache,
    with the lookahead's guess after every layer's step (`ascending`: in ascending ids, as before it
    was ranked): (hits, misses, prefetches, prefetch hits)."""
    trace = batched(load(TRACES / f"{name}.jsonl"), batch=8, tokens=12, waves=4)
    residency, _ = cache_for(trace, policy, 0.25)
    predictor = CoActivation(trace.n_layers, trace.n_experts)
    replay(trace, residency, SystemReplay.synthetic(),
           lookahead=Lookahead(Ascending(predictor) if ascending else predictor))
    s = residency.stats
    return (sum(x.hits for x in s), sum(x.misses for x in s), sum(x.prefetches for x in s),
            sum(x.prefetch_hits for x in s))


@pytest.mark.parametrize("name", ["olmoe_math", "olmoe_dialogue"])
@pytest.mark.parametrize("policy", ["lru", "flashmoe"])
def test_a_ranked_guess_wastes_fewer_reads_and_costs_no_hits(name, policy):
    # when written: the ranked guess left 4-12% of its reads unused, ascending ids 19-31%; hits +3-4%
    hits, misses, prefetches, used = batched_replay(name, policy)
    old_hits, old_misses, old_prefetches, old_used = batched_replay(name, policy, ascending=True)
    assert prefetches - used < 0.5 * (old_prefetches - old_used)          # wasted reads
    assert hits > old_hits and misses + prefetches < old_misses + old_prefetches


def test_the_bench_splits_a_tiny_burst_s_disk_idle_and_counts_both_guesses(tmp_path):
    from hf_models import tiny_checkpoint
    from test_route_trace import records, write_trace

    from agent.cli import main as cli
    from bench.prefetch_guess import VARIANTS, burst
    from bench.serve import request_mix
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf", num_hidden_layers=3, eos_token_id=None)
    assert cli(["convert", str(ckpt.path), str(tmp_path / "store")]) == 0
    trace = write_trace(tmp_path / "t.jsonl", records(64))
    runs = {v: burst(tmp_path / "store", [trace], 3, "lru", v, cap="50%") for v in VARIANTS}
    for run in runs.values():
        # the first token: admission
        assert run["decode_steps"] == max(c[0]["max_tokens"] for c in request_mix(3, 1)) - 1
        assert 0 <= sum(run["decode_idle_s"].values()) <= run["decode_wall_s"]
        assert run["decode_hits"] + run["decode_misses"] > 0 and run["prefetch_hits"] <= run["prefetches"]
