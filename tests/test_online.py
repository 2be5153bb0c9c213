"""The online loop: only the past reaches a decision, weights swap between steps, bad updates roll back."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.cli import main
from agent.learned.model import RetentionNet
from agent.learned.online import (CacheShape, Inline, Job, Judgement, LiveDecision, OnlineConfig, OnlineLearner,
                                  Result, label_live, prepare, run_job, to_net, to_weights)
from agent.learned.train import collect
from agent.learned.scorer import shared_net
from agent.policies import policy_factory
from agent.policies.flashmoe import DEFAULT_WEIGHTS, FlashMoE
from agent.residency import Residency
from agent.simulator import capacity_slots
from agent.traces import Trace, from_sets, load, session_ends, walk

TRACES = Path(__file__).parent / "data" / "traces"
SMALL = OnlineConfig(window=48, every=24, warmup=8, decisions=150, epochs=1)


@pytest.fixture(scope="module")
def qwen() -> Trace:
    """The first 120 tokens of a real Qwen decode trace (24 layers, top-4 of 60)."""
    full = load(TRACES / "qwen_code.jsonl")
    return from_sets([[full.routed(t, layer).tolist() for layer in range(full.n_layers)] for t in range(120)],
                     "qwen_code_120", full.n_experts)


def learner_for(trace: Trace, config: OnlineConfig = SMALL) -> OnlineLearner:
    shape = CacheShape(capacity_slots(trace, 0.25, "layer"), trace.n_layers, trace.n_experts, "layer", trace.max_set)
    return OnlineLearner(shared_net(str(DEFAULT_WEIGHTS)), shape, config, Inline())


def decisions(trace: Trace, learner: OnlineLearner) -> list[tuple[int, tuple[int, int]]]:
    """(token, victim) of every eviction of a replay with the learner's policy deciding."""
    cache = learner.shape.residency(policy_factory("flashmoe", learner=learner))
    out, token = [], -1
    for new_session, layer, experts in walk(trace):
        token += layer == 0
        if new_session:
            cache.session()
        cache.route(layer, experts)
        out += [(token, victim) for e in experts if (victim := cache.access((layer, e))[1]) is not None]
    return out


def test_permuting_the_future_changes_no_earlier_decision(qwen):
    cut = 80
    rng = np.random.default_rng(0)
    steps = [[qwen.routed(t, layer).tolist() for layer in range(qwen.n_layers)] for t in range(qwen.n_tokens)]
    future = [steps[cut + i] for i in rng.permutation(len(steps) - cut)]
    permuted = from_sets(steps[:cut] + future, "permuted", qwen.n_experts)
    learner_a, learner_b = learner_for(qwen), learner_for(permuted)
    a, b = decisions(qwen, learner_a), decisions(permuted, learner_b)
    assert [u.step for u in learner_a.updates if u.step < cut] == [24, 48, 72]  # learning happened before the cut
    assert [d for d in a if d[0] < cut] == [d for d in b if d[0] < cut]
    assert a != b  # the future did change: the test could fail


def test_every_step_is_decided_by_one_version_of_the_weights(qwen):
    learner = learner_for(qwen)
    seen: dict[int, set[int]] = {}
    victim = FlashMoE.victim

    def logged(policy, resident, pinned):
        choice = victim(policy, resident, pinned)
        if policy.learner is learner:  # not the policies the learner's own replays run
            seen.setdefault(learner.steps, set()).add(policy._version)
        return choice

    FlashMoE.victim = logged
    try:
        decisions(qwen, learner)
    finally:
        FlashMoE.victim = victim
    assert learner.version == 4 and {len(v) for v in seen.values()} == {1}
    assert [next(iter(seen[u.step + 1])) for u in learner.updates] == [1, 2, 3, 4]  # adopted at their first step


def job(trace: Trace, weights, parent, judge_from: int | None = 40, config: OnlineConfig = SMALL) -> Job:
    shipped = to_weights(shared_net(str(DEFAULT_WEIGHTS)).net)
    shape = CacheShape(capacity_slots(trace, 0.25, "layer"), trace.n_layers, trace.n_experts, "layer", trace.max_set)
    steps = [[trace.routed(t, layer).tolist() for layer in range(trace.n_layers)] for t in range(trace.n_tokens)]
    return Job(1, steps[:80], 0, [], [0], judge_from, shape, weights, parent, shipped, config)


def test_an_update_worse_in_hindsight_is_rolled_back(qwen):
    torch.manual_seed(0)
    random = to_weights(RetentionNet())
    shipped = to_weights(shared_net(str(DEFAULT_WEIGHTS)).net)
    result = run_job(job(qwen, weights=random, parent=shipped))
    judged = result.judgement
    assert judged.steps == 40 and judged.new_hit_rate < judged.old_hit_rate and judged.rolled_back
    assert result.parent is shipped  # the next weights are fine-tuned from the ones kept for rollback
    kept = run_job(job(qwen, weights=shipped, parent=random))
    assert not kept.judgement.rolled_back and kept.parent is shipped


def test_new_weights_worse_on_the_held_out_steps_are_not_taken(qwen):
    """With a holdout the job fine-tunes on the window before it and swaps in only what does better on it."""
    torch.manual_seed(0)
    random = to_weights(RetentionNet())
    shipped = to_weights(shared_net(str(DEFAULT_WEIGHTS)).net)
    held = OnlineConfig(window=48, every=24, warmup=8, decisions=150, epochs=1, holdout=30, anchor=0.0)
    improved = run_job(job(qwen, weights=random, parent=None, judge_from=None, config=held))
    check = improved.held_out  # a random network fine-tuned on 50 steps beats itself on the 30 after
    assert check.steps == 30 and check.new_hit_rate > check.old_hit_rate and improved.swaps
    assert improved.weights is not random
    learner = learner_for(qwen, held)
    version = learner.version
    shipped_net = learner.net
    learner._install(prepare(Result(1, random, shipped, 10, None, 0.0, Judgement(30, 0.5, 0.4, rolled_back=True))))
    assert (learner.version, learner.net, learner.totals["not_taken"], learner.totals["updates"]) == \
        (version, shipped_net, 1, 0)  # the weights in use stay


class OneJob:
    """An online learner's executor with one finished job, found by the poll after `late` that find it running."""

    def __init__(self, ready, late: int = 0) -> None:
        self.ready, self.late = ready, late

    def submit(self, job) -> None:
        raise AssertionError("no job is due")

    def poll(self):
        if self.late:
            self.late -= 1
            return None
        ready, self.ready = self.ready, None
        return ready

    def busy(self) -> bool:
        return self.ready is not None

    def close(self) -> None:
        pass


def test_a_step_boundary_installs_only_the_weights_its_policy_prepared(qwen):
    """The policy looks for finished weights outside the cache's lock (upcoming) to run their system tower
    there; a job finishing between that look and the boundary under the lock waits for the next step,
    or the eviction that adopts it would run the tower under the lock."""
    torch.manual_seed(0)
    result = Result(1, to_weights(RetentionNet()), None, 10, None, 0.0, None)
    learner = learner_for(qwen)
    learner.executor = OneJob(prepare(result), late=1)
    shipped = learner.net
    assert learner.upcoming(0) is shipped  # still running
    learner.observe(0, [1, 2])             # finished now: not what the policy prepared
    assert (learner.net, learner.version) == (shipped, 0)
    new = learner.upcoming(0)
    assert new is not shipped
    learner.observe(0, [3, 4])
    assert (learner.net, learner.version) == (new, 1)


def test_labels_within_sessions_stop_at_the_session_end():
    # accesses 0 1 2 3 | 0 2 1 3: a new session starts at step 2
    trace = from_sets([[[0, 1]], [[2, 3]], [[0, 2]], [[1, 3]]], n_experts=5, session_starts=[0, 2])
    zeros = np.zeros((3, 32), np.float32), np.zeros((3, 16), np.float32)
    at_step_0 = LiveDecision(2, [(0, 0), (0, 2), (0, 4)], *zeros)
    assert label_live(trace, [at_step_0], 0).distance[0, :3].tolist() == [2, 0, 6]
    assert label_live(trace, [at_step_0], 0, within_sessions=True).distance[0, :3].tolist() == [2, 0, 2]
    window, session = (collect(trace, 2, "lru", 100, np.random.default_rng(0), within_sessions=w)
                       for w in (False, True))
    assert (window.mask == session.mask).all()  # the same decisions (all of them), labelled two ways
    assert (session.distance <= window.distance).all() and (session.distance < window.distance).any()
    assert session_ends(trace).tolist() == [4, 4, 4, 4, 8, 8, 8, 8]


def test_fine_tuning_starts_from_the_weights_in_use_never_from_scratch(qwen):
    shipped = to_weights(shared_net(str(DEFAULT_WEIGHTS)).net)
    result = run_job(job(qwen, weights=shipped, parent=None, judge_from=None))
    assert result.judgement is None and result.decisions > 100
    moved = sum(float(np.abs(result.weights[k] - shipped[k]).sum()) for k in shipped)
    torch.manual_seed(0)
    fresh = to_weights(RetentionNet())
    from_scratch = sum(float(np.abs(fresh[k] - shipped[k]).sum()) for k in shipped)
    assert 0 < moved < from_scratch / 5  # far nearer the weights it started from than a fresh network
    to_net(result.weights)  # a valid network


def test_the_caches_own_decisions_are_labelled_with_their_next_use_in_the_window():
    trace = from_sets([[[0, 1]], [[2, 3]], [[0, 2]], [[1, 3]]], n_experts=5)  # accesses 0 1 2 3 0 2 1 3
    zeros = np.zeros((4, 32), np.float32), np.zeros((4, 16), np.float32)
    at_step_1 = LiveDecision(100 + 4, [(0, 0), (0, 1), (0, 3), (0, 4)], *zeros)  # the window starts at access 100
    data = label_live(trace, [at_step_1], first_access=100)
    assert data.distance[0, :4].tolist() == [0, 2, 3, 4]  # next access, two later, three later, never (the end)
    assert data.mask[0].tolist() == [True] * 4 + [False] * 12


def test_a_learning_cache_records_a_share_of_its_own_evictions(qwen):
    learner = learner_for(qwen, OnlineConfig(window=200, every=1000, warmup=8, live=0.25))
    evictions = len(decisions(qwen, learner))
    recorded = list(learner._window.live)
    assert 0.18 * evictions < len(recorded) < 0.32 * evictions
    assert all(1 < len(d.keys) <= 16 and d.signature.shape == (len(d.keys), 32) for d in recorded)
    assert [d.position for d in recorded] == sorted(d.position for d in recorded)
    assert recorded[-1].position <= learner.accesses


@pytest.mark.parametrize("options, message", [
    ({"window": 0}, "window"), ({"lr": float("nan")}, "lr"), ({"anchor": -1.0}, "anchor"),
    ({"warmup": 512}, "warmup"), ({"every": -3}, "every"), ({"live": 1.5}, "live"),
    ({"drivers": ("oracle",)}, "drivers"), ({"holdout": 500}, "holdout"),
    ({"drivers": (), "live": 0.0}, "something to learn from"),
])
def test_bad_settings_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        OnlineConfig(**options)


def test_simulate_online_beside_the_offline_policy(tmp_path, capsys):
    head = tmp_path / "qwen_code_80.jsonl"
    head.write_text("\n".join((TRACES / "qwen_code.jsonl").read_text().splitlines()[:81]) + "\n")
    assert main(["simulate", "--trace", str(head), "--policy", "flashmoe", "--online", "--json"]) == 0
    rows = {(r["policy"], r["online"] is not None): r for r in json.loads(capsys.readouterr().out)["results"]}
    assert list(rows) == [("lru", False), ("flashmoe", False), ("flashmoe", True), ("belady", False)]
    assert rows["flashmoe", True]["online"]["updates"] == 0  # 80 tokens: shorter than one update's 128
    assert main(["simulate", "--trace", str(head), "--policy", "lru", "--online"]) == 0
    assert "flashmoe online" in capsys.readouterr().out.splitlines()[1]


def test_a_window_of_batched_steps_larger_than_a_layers_slots_is_learned_from(qwen):
    """A batched step routes the union of its requests' experts: here four tokens' top-4, up to 16 experts
    in a layer of 15 slots. The window's replays take such steps as the cache does (Residency.take)."""
    unions = [[sorted({e for t in range(i, i + 4) for e in qwen.routed(t, layer).tolist()})
               for layer in range(qwen.n_layers)] for i in range(0, qwen.n_tokens - 4, 2)]
    slots = capacity_slots(qwen, 0.25, "layer")
    shape = CacheShape(slots, qwen.n_layers, qwen.n_experts, "layer", qwen.top_k)
    assert max(len(s) for step in unions for s in step) > slots // qwen.n_layers
    shipped = to_weights(shared_net(str(DEFAULT_WEIGHTS)).net)
    result = run_job(Job(2, unions, 0, [], [0], 30, shape, shipped, shipped, shipped, SMALL))
    assert result.decisions > 100 and result.judgement.steps == len(unions) - 30
    assert 0 < result.judgement.new_hit_rate < 1
