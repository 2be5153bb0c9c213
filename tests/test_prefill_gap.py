"""bench/prefill_gap.py's reference policies: rankings by a prompt's expert counts, and the within-prompt shuffle."""
import sys

import numpy as np

from agent.traces import from_sets
from agents import ROOT

sys.path.insert(0, str(ROOT))
from bench.prefill_gap import PromptCounts, earlier_rates, prompt_counts, shuffled_within_prompts  # noqa: E402

A, B, C = (0, 1), (0, 2), (0, 3)


def counts_policy(table, step):
    """PromptCounts over per-prompt dicts {key: count}."""
    policy = PromptCounts(lambda prompt, key: table[prompt].get(key, 0), step)
    policy.session()
    return policy


def test_final_counts_keep_the_prompts_most_used_expert_over_a_more_recent_one_and_rerank_at_a_new_prompt():
    policy = counts_policy([{A: 3, B: 1}, {A: 0, B: 5}], step=0)
    policy.insert(A)
    policy.insert(B)
    assert policy.victim({A, B}, {C}) == B      # LRU would evict A
    policy.session()                            # the next prompt uses B five times and A never
    assert policy.victim({A, B}, {C}) == A


def test_counts_left_fall_with_each_use_and_ties_go_least_recent_first():
    policy = counts_policy([{A: 2, B: 3}], step=-1)
    policy.insert(A)                            # 1 use of A left
    policy.insert(B)                            # 2 of B
    assert policy.victim({A, B}, set()) == A
    policy.hit(B)                               # 1 each: A is the older
    assert policy.victim({A, B}, set()) == A
    policy.hit(A)                               # A 0, B 1
    assert policy.victim({A, B}, {A}) == B      # pinned A stays


def test_the_estimate_adds_each_use_in_the_prompt_to_the_prior_and_forgets_them_at_the_next_prompt():
    policy = counts_policy([{A: 2.5, B: 0.5}, {A: 2.5, B: 0.5}], step=1)
    policy.insert(A)                            # 1 + 2.5
    policy.insert(B)                            # 1 + 0.5
    assert policy.victim({A, B}, set()) == B
    policy.hit(B)
    policy.hit(B)
    policy.hit(B)                               # 4 + 0.5 against 3.5
    assert policy.victim({A, B}, set()) == A
    policy.session()                            # uses start over: the prior alone, 2.5 against 0.5
    assert policy.victim({A, B}, set()) == B
    policy.remove(B)
    assert policy.victim({A}, set()) == A


def two_prompts():
    # two layers; prompt 0 is tokens 0..2, prompt 1 tokens 3..4; two experts per step
    sets = [[[0, 1], [2, 3]], [[0, 2], [2, 3]], [[1, 0], [3, 1]], [[3, 2], [0, 1]], [[3, 0], [1, 2]]]
    return from_sets(sets, n_experts=4, session_starts=[0, 3])


def test_prompt_counts_and_the_rates_of_earlier_prompts():
    trace = two_prompts()
    counts = prompt_counts(trace)
    assert counts.shape == (2, 2, 4)
    assert counts[0].tolist() == [[3, 2, 1, 0], [0, 1, 2, 3]]
    assert counts[1].tolist() == [[1, 0, 1, 2], [1, 2, 1, 0]]
    rates = earlier_rates(trace, counts)
    assert np.all(rates[0] == 0)                # nothing before the first prompt
    assert np.allclose(rates[1], counts[0] / 3)  # prompt 0's uses per token


def test_a_shuffle_keeps_each_prompts_tokens_whole_and_its_counts_and_moves_them():
    trace = two_prompts()
    moved = [shuffled_within_prompts(trace, seed) for seed in range(8)]
    rows = {tuple(map(tuple, t.dense().reshape(t.n_tokens, -1).tolist())) for t in [trace] + moved}
    assert len(rows) > 1                        # some seed changes the order
    for t in moved:
        assert np.array_equal(prompt_counts(t), prompt_counts(trace))
        tokens = t.dense().tolist()
        assert sorted(tokens[:3]) == sorted(trace.dense().tolist()[:3])  # a token's layers stay together
        assert t.session_starts.tolist() == [0, 3]
