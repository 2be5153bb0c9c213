"""Feature extraction of the learned policy on hand-made routing sequences."""
import numpy as np
import pytest

from agent.learned.features import (FEATURES, HISTORY_BITS, NEVER, TOTAL, LayerHistory, activation_signature,
                                    expert_features, window_histogram, window_shift)


def history(steps, sessions=()):
    """A LayerHistory after `steps` (lists of expert ids); a new session starts before each index in `sessions`."""
    h = LayerHistory()
    for i, experts in enumerate(steps):
        if i in sessions:
            h.new_session()
        h.observe(experts)
    return h


def feature(h, expert, name):
    return float(expert_features(h, np.array([expert]))[0, FEATURES.index(name)])


def test_recency_counts_steps_since_last_use():
    h = history([[0, 1], [1, 2], [2, 3], [3, 0]])
    ages = {e: 2 ** (feature(h, e, "recency") * 10) - 1 for e in range(4)}
    assert ages == pytest.approx({0: 1, 1: 3, 2: 2, 3: 1})
    assert feature(h, 9, "recency") == pytest.approx(np.log2(1 + NEVER) / 10)  # never seen, even beyond n


def test_windowed_rates_forget_what_left_the_window():
    # expert 0 busy for 60 steps then idle for 8; expert 1 the reverse; 2 experts of 4 per step
    h = history([[0, 2]] * 60 + [[1, 2]] * 8 + [[3, 2]])
    h.observe([3, 2])
    uniform = 2 / 4
    assert feature(h, 0, "rate_4") == 0.0
    rate = lambda share: np.log2(1 + share / uniform) / 4  # noqa: E731
    assert feature(h, 0, "rate_64") == pytest.approx(rate(54 / 64))
    assert feature(h, 1, "rate_4") == pytest.approx(rate(2 / 4))
    assert feature(h, 1, "rate_16") == pytest.approx(rate(8 / 16))
    assert feature(h, 2, "rate_16") == pytest.approx(rate(16 / 16))


def test_coactivation_is_conditional_on_the_experts_chosen_now():
    # 4 came with 0 twice out of 0's three steps; 5 never did; the last step chose 0 and a new 2
    h = history([[0, 4], [1, 5], [0, 4], [1, 5], [0, 2]])
    assert feature(h, 4, "coactivation") > feature(h, 5, "coactivation")
    assert feature(h, 4, "coactivation") == pytest.approx((2 / 3 + 0 / 3) / 2, rel=0.01)


def test_successor_is_what_followed_the_experts_chosen_now():
    # 0 was followed by 4 in two of its three steps and never by 5; the last step chose 0
    h = history([[0], [4], [0], [4], [1], [5], [0]])
    assert feature(h, 4, "successor") == pytest.approx(2 / 3, rel=0.01)
    assert feature(h, 5, "successor") == 0.0
    assert feature(h, 4, "coactivation") == 0.0  # never chosen together with 0: only successor sees it


def test_successor_does_not_cross_a_session_boundary():
    h = history([[0], [4], [0]], sessions={1})  # 4 opened a new session: it did not follow 0
    assert feature(h, 4, "successor") == 0.0


def test_long_run_rate_outlives_the_windows():
    # expert 0 was hot for 192 steps, then 1 for 64: the 64-step window has forgotten 0, the long rate has not
    h = history([[0, 2]] * 192 + [[1, 2]] * 64)
    assert feature(h, 0, "rate_64") == 0.0
    assert feature(h, 0, "rate_256") > feature(h, 3, "rate_256") == 0.0
    assert feature(h, 1, "rate_256") < feature(h, 1, "rate_64")


def test_session_persistence_and_session_rate():
    h = history([[0], [1], [0], [2], [1]], sessions={2, 4})  # sessions: [0 1] [0 2] [1]
    assert feature(h, 0, "persistence") == pytest.approx(1.0)   # in both finished sessions
    assert feature(h, 2, "persistence") == pytest.approx(0.5)
    assert feature(h, 1, "session_seen") == 1.0 and feature(h, 0, "session_seen") == 0.0


def test_batch_share_is_the_distribution_of_the_current_multiset():
    h = history([[0, 1], [3, 3, 3, 2]])
    assert feature(h, 3, "batch_share") == pytest.approx(0.75)
    assert feature(h, 2, "batch_share") == pytest.approx(0.25)
    assert feature(h, 0, "batch_share") == 0.0
    assert h.current.tolist() == [3, 2] and h.stats[TOTAL, 3] == 1  # one use per step, however many tokens


def test_successor_4_sees_experts_that_follow_within_four_steps_not_just_the_next():
    # a six-step cycle: after 0 come 9, 1, 8, 7, then 2 (five steps on) and 0 again
    h = history([[0], [9], [1], [8], [7], [2]] * 5 + [[0]])
    assert feature(h, 1, "successor") == 0.0 and feature(h, 1, "successor_4") > 0.0
    assert feature(h, 2, "successor_4") == 0.0
    assert feature(h, 9, "successor_4") == pytest.approx(feature(h, 1, "successor_4"))  # once each per cycle


def test_activation_signature_is_most_recent_first():
    h = history([[0], [1], [0], [1], [1]])
    sig = activation_signature(h, np.array([0, 1]))
    assert sig.shape == (2, HISTORY_BITS)
    assert sig[0, :5].tolist() == [0, 0, 1, 0, 1] and sig[1, :5].tolist() == [1, 1, 0, 1, 0]
    assert sig[:, 5:].sum() == 0


def test_features_do_not_depend_on_expert_numbering_or_count():
    a = history([[0, 1], [1, 2], [0, 2]] * 10)
    b = history([[100, 101], [101, 102], [100, 102]] * 10)   # same routing, ids shifted, 103 "experts"
    # rates (successor_4 is one) are relative to top_k / experts-seen: they and the density feature
    # differ, nothing else of an expert's history
    fa, fb = expert_features(a, np.array([0, 1, 2])), expert_features(b, np.array([100, 101, 102]))
    keep = [i for i, n in enumerate(FEATURES) if n not in ("density", "successor_4") and "rate" not in n]
    np.testing.assert_allclose(fa[:, keep], fb[:, keep], rtol=1e-6)
    np.testing.assert_array_equal(activation_signature(a, np.array([0, 1, 2])),
                                  activation_signature(b, np.array([100, 101, 102])))


def test_histogram_and_total_variation():
    h = history([[0, 1]] * 16)
    np.testing.assert_allclose(window_histogram(h)[:2], [0.5, 0.5])
    for _ in range(8):
        h.observe([0, 2])
    p = window_histogram(h)
    assert p[:3].tolist() == pytest.approx([0.5, 0.25, 0.25])
    assert window_shift(h, np.array([0.5, 0.5], np.float32)) == pytest.approx(0.25)  # shorter: zero-padded
    assert window_shift(h, p) == 0.0

