"""The prefetch ledger: unused prefetches turn wasted when their layer routes without them; wasted
ones are offered as victims oldest first, never one that must be kept."""
from __future__ import annotations

from agent.prefetch_ledger import PrefetchLedger


def test_a_prefetch_its_layer_did_not_route_is_wasted_and_offered_first():
    ledger = PrefetchLedger()
    for key in [(0, 1), (0, 2), (0, 3), (1, 1)]:
        ledger.admitted(key)
    resident = {(0, 1), (0, 2), (0, 3), (1, 1)}
    assert ledger.wasted(resident, keep=()) is None          # nothing routed yet: no guess was wrong
    ledger.routed(0, [2])                                      # layer 0 used 2: 1 and 3 were wrong guesses
    assert ledger.wasted(resident, keep=()) == (0, 1)          # the oldest wasted first
    assert ledger.wasted(resident, keep={(0, 1)}) == (0, 3)    # never one that must be kept
    assert ledger.wasted(resident - {(0, 1), (0, 3)}, keep=()) is None  # only resident ones count


def test_clear_says_whether_prefetch_brought_the_key_in():
    ledger = PrefetchLedger()
    ledger.admitted((2, 5))
    ledger.routed(2, [])
    assert ledger.clear((2, 5)) is True                        # wasted, still a prefetch
    assert ledger.clear((2, 5)) is False                       # forgotten
    assert ledger.clear((3, 0)) is False                       # never prefetched
    assert ledger.wasted({(2, 5)}, keep=()) is None
