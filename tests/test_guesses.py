"""access/guesses.py: wrong tokens per client, each lock-out twice the last, bounded memory. A fake clock;
the agent's and the dashboard's use of it against real processes: tests/test_serve_hardening.py,
tests/test_dashboard_auth.py."""
from __future__ import annotations

import itertools

from access.guesses import FORGET_S, FREE_GUESSES, MAX_LOCK_S, THIS_BOX, GuessLimit, Wrong, client_key

TOKENS = (f"guess-{i}" for i in itertools.count())   # a new wrong token each time: repeats are no guess


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_free_guesses_then_each_wrong_one_doubles_the_lock_out_up_to_the_most():
    clock = Clock()
    limit = GuessLimit(clock)
    locks = []
    for _ in range(FREE_GUESSES + 9):
        assert limit.wait_s("10.0.0.1") == 0
        locks.append(limit.wrong("10.0.0.1", next(TOKENS))[1])
        clock.now += locks[-1]
    assert locks == [0] * FREE_GUESSES + [1, 2, 4, 8, 16, 32, MAX_LOCK_S, MAX_LOCK_S, MAX_LOCK_S]
    assert limit.wait_s("10.0.0.2") == 0                    # another address is not locked out


def test_a_locked_out_client_waits_and_the_right_token_clears_its_count():
    clock = Clock()
    limit = GuessLimit(clock)
    for _ in range(FREE_GUESSES + 1):
        limit.wrong("10.0.0.1", next(TOKENS))
    assert limit.wait_s("10.0.0.1") == 1
    clock.now += 1
    limit.right("10.0.0.1")
    assert limit.wrong("10.0.0.1", next(TOKENS)) == Wrong(1, 0)


def test_a_client_is_forgotten_after_a_while_without_wrong_guesses():
    clock = Clock()
    limit = GuessLimit(clock)
    for _ in range(FREE_GUESSES + 3):
        limit.wrong("10.0.0.1", next(TOKENS))
    clock.now += FORGET_S
    assert limit.wrong("10.0.0.2", next(TOKENS)) == Wrong(1, 0)                # forgetting happens as others guess
    assert limit.wrong("10.0.0.1", next(TOKENS)) == Wrong(1, 0)


def test_past_the_most_clients_new_ones_share_one_entry_so_memory_stays_bounded():
    clock = Clock()
    limit = GuessLimit(clock, max_clients=3)
    for i in range(3):
        limit.wrong(f"10.0.0.{i}", next(TOKENS))
    for i in range(3, 3 + FREE_GUESSES + 1):                # many addresses: the shared entry locks out
        limit.wrong(f"10.0.0.{i}", next(TOKENS))
    assert len(limit._clients) == 4 and limit.wait_s("10.0.1.1") == 1 and limit.wait_s("10.0.0.0") == 0
    limit.right("10.0.1.1")                                 # one right token does not unlock the others
    assert limit.wait_s("10.0.1.2") == 1


def test_a_wrong_token_the_client_sent_before_is_no_new_guess():
    """A dashboard or script configured with a wrong token locked out every client at its address (the dashboard,
    on the box, the operator's own tools) after 5 pushes, though repeating a token tells a guesser nothing."""
    limit = GuessLimit(Clock())
    assert [limit.wrong("10.0.0.1", "stale-token") for _ in range(3 * FREE_GUESSES)] == \
        [Wrong(1, 0)] + [Wrong(1, 0, repeated=True)] * (3 * FREE_GUESSES - 1)
    assert limit.wait_s("10.0.0.1") == 0
    assert [limit.wrong("10.0.0.1", next(TOKENS)).in_a_row for _ in range(FREE_GUESSES)] == \
        list(range(2, FREE_GUESSES + 2))                    # every new token still counts
    assert limit.wait_s("10.0.0.1") == 1 and limit.wrong("10.0.0.2", "stale-token") == Wrong(1, 0)


def test_every_loopback_address_is_this_box_which_keeps_its_own_entry_past_the_most_clients():
    """127.0.0.0/8 gave a local guesser 16 million addresses, 5 guesses each, until the table was full; then a
    full table put the operator on the box into the shared entry those guesses had locked out."""
    limit = GuessLimit(Clock(), max_clients=3)
    for i in range(3 + FREE_GUESSES + 1):                   # fill the table, then lock the shared entry
        limit.wrong(f"10.0.0.{i}", next(TOKENS))
    assert limit.wait_s("10.0.1.1") == 1                    # a new address: the shared, locked-out entry
    assert limit.wait_s("127.0.0.1") == 0 and limit.wait_s("::1") == 0    # the box has its own
    for i in range(FREE_GUESSES):
        limit.wrong(f"127.0.{i}.1", next(TOKENS))
    assert limit.wrong("::1", next(TOKENS)) == Wrong(FREE_GUESSES + 1, 1)   # one client, however addressed


def test_an_ipv6_client_is_its_64_and_an_ipv4_mapped_one_its_ipv4():
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert client_key("127.0.0.1") == client_key("127.9.9.9") == client_key("::1") == client_key("::ffff:127.0.0.1") \
        == THIS_BOX
    assert client_key(None) == "unknown" and client_key("testclient") == "testclient"
