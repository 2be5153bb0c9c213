"""Adaptive prefetch: the rule (agent/prefetch_gate.py) on made-up scores, Residency's scoring of a
guess's reads, and generate on a tiny model whose routing a trace imposes: guesses that are right keep
their reads issued, guesses that are poor stop them. Counts and bytes, no timing."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hf_models import tiny_checkpoint
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)
from test_generate import slot_cap
from test_route_trace import write_trace

from agent.cli import main as cli
from agent.policies import policy_factory
from agent.prefetch_gate import MARGIN, MIN_SCORED, WINDOW, PrefetchGate, knobs_of, mode_of
from agent.residency import Residency


# -- the rule --------------------------------------------------------------------------------------
def test_nothing_is_judged_before_enough_reads_are_scored():
    gate = PrefetchGate()
    gate.score(0, MIN_SCORED - 1)                       # every read wrong, but too few to judge
    assert gate.issues and gate.accuracy == 0.0
    gate.score(0, 1)
    assert not gate.issues


def test_good_guesses_keep_issuing_and_poor_ones_stop():
    good, poor = PrefetchGate(), PrefetchGate()
    for _ in range(WINDOW // 4):
        good.score(3, 1)                                 # 75% right
        poor.score(1, 3)                                 # 25% right
    assert good.issues and not poor.issues
    assert poor.state() == {"mode": "auto", "issuing": False, "accuracy": 0.25, "scored": WINDOW, "break_even": 0.5}


def test_hysteresis_resumes_only_clear_of_the_break_even():
    gate = PrefetchGate()
    gate.score(0, WINDOW)                                # stopped
    gate.score(WINDOW // 2, 0)                           # the window at break-even (0.5): stays stopped
    assert gate.accuracy == 0.5 and not gate.issues
    gate.score(int(WINDOW * MARGIN) + 1, 0)              # just above 0.5 + MARGIN: resumes
    assert gate.accuracy > 0.5 + MARGIN and gate.issues
    gate.score(0, WINDOW // 2)                           # back to break-even: keeps issuing
    assert gate.accuracy == 0.5 and gate.issues


def test_evicting_blocks_the_policy_wants_back_more_than_a_miss_does_raises_the_break_even():
    gate = PrefetchGate()
    # 3 of 4 read back after a prefetch evicted them, 1 of 4 after a miss
    for by_prefetch, back in ((True, 3), (False, 1)):
        for n in range(4):
            gate.evicted(by_prefetch)
            if n < back:
                gate.reread(by_prefetch)
    assert gate.eviction_cost == 0.5 and gate.break_even == pytest.approx(1.5 / 2.5)
    gate.score(54, 46)                                   # 54% right: would pay without the evictions
    assert not gate.issues
    gate.evicted(False)
    gate.reread(False)                                   # 2 of 5 after a miss now
    assert gate.eviction_cost == pytest.approx(0.75 - 0.4)


def test_on_always_issues_off_never_and_the_agent_knobs_map_to_modes():
    on, off = PrefetchGate("on"), PrefetchGate("off")
    for gate in (on, off):
        gate.score(0, WINDOW)
    assert on.issues and not off.issues and on.state()["accuracy"] == 0.0
    assert [mode_of(False, True), mode_of(True, True), mode_of(True, False)] == ["off", "auto", "on"]
    assert all(mode_of(*knobs_of(mode).values()) == mode for mode in ("on", "off", "auto"))   # serve --prefetch
    with pytest.raises(ValueError, match="prefetch must be one of on, off, auto; got 'sometimes'"):
        PrefetchGate("sometimes")


# -- Residency scores a guess's reads --------------------------------------------------------------
def test_a_guess_is_scored_by_its_reads_when_its_layer_routes_issued_or_not():
    for mode in ("on", "off"):
        residency = Residency(2 * 2, 2, policy_factory("lru"), "layer", 1, prefetch=mode)   # 2 slots a layer
        residency.access((1, 0))
        admitted = residency.guess(1, [0, 4, 5])         # 0 is resident: the reads are 4 and 5, room for one
        assert [key for key, _ in admitted] == ([(1, 4)] if mode == "on" else [])
        residency.route(1, [4, 6])
        assert residency.gate.state()["accuracy"] == 1.0 and residency.gate.state()["scored"] == 1
        assert residency.stats[1].prefetches == (1 if mode == "on" else 0)


def test_the_policys_blocks_evicted_by_prefetch_and_by_misses_are_counted_and_so_are_their_rereads():
    residency = Residency(2 * 1, 1, policy_factory("lru"), "layer", 1, prefetch="on")
    gate = residency.gate
    for e in (0, 1):
        residency.access((0, e))
    residency.route(0, [])                               # nothing pinned
    assert [v for _, v in residency.guess(0, [2])] == [(0, 0)]  # the policy's block 0 goes
    residency.route(0, [3])                              # 2 was wrong: now a wasted prefetch
    residency.access((0, 3))                             # evicts the wasted 2 first: not the policy's, not counted
    residency.guess(0, [4])                              # evicts 1, the policy's block
    assert gate.evictions == {True: 2, False: 0} and gate.rereads == {True: 0, False: 0}
    residency.route(0, [0])                              # 4 wrong too
    residency.access((0, 0))                             # 0 read back on demand (the wasted 4 makes room)
    assert gate.rereads == {True: 1, False: 0} and gate.eviction_cost == 0.5
    residency.route(0, [5])
    residency.access((0, 5))                             # a miss evicts the policy's 3 ...
    residency.route(0, [3])
    residency.access((0, 3))                             # ... read back as well (evicting the policy's 0)
    assert gate.evictions == {True: 2, False: 2} and gate.rereads == {True: 1, False: 1}
    assert gate.eviction_cost == 0.0 and gate.break_even == 0.5  # as likely back as after a miss: no cost


# -- generate on a tiny model, routing imposed by a trace ------------------------------------------
LAYERS, EXPERTS, TOP_K, TOKENS = 4, 8, 2, 40


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("prefetch-gate")
    ckpt = tiny_checkpoint("olmoe", tmp / "hf", num_hidden_layers=LAYERS, num_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, eos_token_id=None)
    assert cli(["convert", str(ckpt.path), str(tmp / "store")]) == 0
    return tmp / "store"


def predictable(n: int) -> list[list[list[int]]]:
    """Every layer of token t routes the same pair, a new pair each token: once seen, layer L's pair
    names layer L+1's, and the cache (one pair a layer) never holds it."""
    return [[[2 * t % EXPERTS, (2 * t + 1) % EXPERTS]] * LAYERS for t in range(n)]


def unpredictable(n: int) -> list[list[list[int]]]:
    rng = random.Random(7)
    return [[sorted(rng.sample(range(EXPERTS), TOP_K)) for _ in range(LAYERS)] for _ in range(n)]


def run(store: Path, trace: Path, mode: str, capsys) -> dict:
    assert cli(["generate", "--model", str(store), "--prompt-ids", "3,1,4", "--max-new-tokens", str(TOKENS),
                "--greedy", "--cache-cap", slot_cap(store, TOP_K), "--prefetch", mode, "--route-trace", str(trace),
                "--json"]) == 0
    return json.loads(capsys.readouterr().out)["stats"]


def test_poor_guesses_stop_the_reads_good_ones_keep_them(store, tmp_path, capsys):
    poor = write_trace(tmp_path / "poor.jsonl", unpredictable(64), LAYERS, TOP_K, EXPERTS)
    on, auto, off = (run(store, poor, mode, capsys) for mode in ("on", "auto", "off"))
    gate = auto["prefetch_gate"]
    assert gate["mode"] == "auto" and not gate["issuing"] and gate["accuracy"] < gate["break_even"] - MARGIN
    assert gate["scored"] >= MIN_SCORED and on["prefetch_gate"]["accuracy"] < 0.45
    assert off["prefetches"] < auto["prefetches"] < on["prefetches"]   # it issued, then stopped
    assert off["bytes_read"] < auto["bytes_read"] < on["bytes_read"]

    good = write_trace(tmp_path / "good.jsonl", predictable(64), LAYERS, TOP_K, EXPERTS)
    on, auto = (run(store, good, mode, capsys) for mode in ("on", "auto"))
    gate = auto["prefetch_gate"]
    assert gate["issuing"] and gate["accuracy"] > 0.9 and gate["scored"] >= MIN_SCORED
    assert auto["prefetches"] == on["prefetches"] > 0 and auto["prefetch_hits"] == on["prefetch_hits"]
    assert auto["bytes_read"] == on["bytes_read"] and auto["hits"] == on["hits"]
