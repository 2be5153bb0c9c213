"""access/guesses.py: wrong tokens per client, each lock-out twice the last, bounded memory. A fake clock;
the agent's and the dashboard's use of it against real processes: tests/test_serve_hardening.py,
tests/test_dashboard_auth.py."""
from __future__ import annotations

from access.guesses import FORGET_S, FREE_GUESSES, MAX_LOCK_S, GuessLimit, client_key


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
        locks.append(limit.wrong("10.0.0.1")[1])
        clock.now += locks[-1]
    assert locks == [0] * FREE_GUESSES + [1, 2, 4, 8, 16, 32, MAX_LOCK_S, MAX_LOCK_S, MAX_LOCK_S]
    assert limit.wait_s("10.0.0.2") == 0                    # another address is not locked out


def test_a_locked_out_client_waits_and_the_right_token_clears_its_count():
    clock = Clock()
    limit = GuessLimit(clock)
    for _ in range(FREE_GUESSES + 1):
        limit.wrong("10.0.0.1")
    assert limit.wait_s("10.0.0.1") == 1
    clock.now += 1
    limit.right("10.0.0.1")
    assert limit.wrong("10.0.0.1") == (1, 0)


def test_a_client_is_forgotten_after_a_while_without_wrong_guesses():
    clock = Clock()
    limit = GuessLimit(clock)
    for _ in range(FREE_GUESSES + 3):
        limit.wrong("10.0.0.1")
    clock.now += FORGET_S
    assert limit.wrong("10.0.0.2") == (1, 0)                # forgetting happens as others guess
    assert limit.wrong("10.0.0.1") == (1, 0)


def test_past_the_most_clients_new_ones_share_one_entry_so_memory_stays_bounded():
    clock = Clock()
    limit = GuessLimit(clock, max_clients=3)
    for i in range(3):
        limit.wrong(f"10.0.0.{i}")
    for i in range(3, 3 + FREE_GUESSES + 1):                # many addresses: the shared entry locks out
        limit.wrong(f"10.0.0.{i}")
    assert len(limit._clients) == 4 and limit.wait_s("10.0.1.1") == 1 and limit.wait_s("10.0.0.0") == 0
    limit.right("10.0.1.1")                                 # one right token does not unlock the others
    assert limit.wait_s("10.0.1.2") == 1


def test_an_ipv6_client_is_its_64_and_an_ipv4_mapped_one_its_ipv4():
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert client_key(None) == "unknown" and client_key("testclient") == "testclient"
