"""Pure decisions of the service: the dynamic batch limit and the memory guard."""
from __future__ import annotations

from agent.monitor import SystemSample
from agent.serve import batching
from agent.serve.guard import GuardConfig, decide

CFG = GuardConfig(psi_full_avg10=10.0, major_faults_per_s=200.0, intervals=3, step=0.10)
CALM = SystemSample(psi_full_avg10=1.0, major_faults_per_s=5.0)
PSI_HIGH = SystemSample(psi_full_avg10=25.0, major_faults_per_s=5.0)
FAULTS_HIGH = SystemSample(psi_full_avg10=None, major_faults_per_s=900.0)


def test_batch_limit_shrinks_by_a_fifth_while_the_ssd_is_busy_and_recovers():
    limits, limit = [], 16
    for util in [0.95] * 5 + [0.5] * 8:
        limit = batching.next_limit(limit, 16, util, 0.9)
        limits.append(limit)
    assert limits[:5] == [12, 9, 7, 5, 4]          # floor(0.8 x limit) each interval
    assert limits[5:] == [5, 6, 7, 8, 10, 12, 15, 16]  # back up to max_batch_size, never beyond


def test_batch_limit_never_below_one_and_follows_a_lower_max():
    assert batching.next_limit(1, 16, 1.0, 0.9) == 1
    assert batching.next_limit(16, 4, 0.95, 0.9) == 3  # the knob was lowered to 4 meanwhile
    assert batching.next_limit(16, 4, 0.1, 0.9) == 4
    assert batching.next_limit(8, 16, None, 0.9) == 10  # no measurement yet counts as not busy
    assert batching.next_limit(8, 16, 0.9, 0.9) == 10   # at the threshold is not over it


def test_guard_waits_for_consecutive_intervals_then_steps_down():
    streak, cap, floor = 0, 1000, 300
    streak, act = decide(streak, PSI_HIGH, cap, floor, CFG)
    assert (streak, act) == (1, None)
    streak, act = decide(streak, CALM, cap, floor, CFG)  # one calm sample resets the count
    assert (streak, act) == (0, None)
    for _ in range(2):
        streak, act = decide(streak, PSI_HIGH, cap, floor, CFG)
        assert act is None
    streak, act = decide(streak, PSI_HIGH, cap, floor, CFG)
    assert streak == 0 and act.new_cap == 900
    assert "PSI memory full avg10 25.0% > 10%" in act.reason and "1000 -> 900" in act.reason


def test_guard_reacts_to_major_faults_and_stops_at_the_working_set():
    streak, cap, caps = 0, 400, []
    for _ in range(12):
        streak, act = decide(streak, FAULTS_HIGH, cap, 300, CFG)
        if act:
            assert "major faults 900/s > 200/s" in act.reason
            cap = act.new_cap
            caps.append(cap)
    assert caps == [360, 324, 300]  # 10% steps, clamped at the floor, then nothing more to give


def test_guard_leaves_a_stall_alone_while_the_machine_has_memory_to_spare():
    """Another process stalling inside its own memory limit: the agent's cache would not relieve it."""
    elsewhere = SystemSample(psi_full_avg10=25.0, major_faults_per_s=5.0, mem_available_share=0.6)
    short = SystemSample(psi_full_avg10=25.0, major_faults_per_s=5.0, mem_available_share=0.04)
    streak = 0
    for _ in range(10):
        streak, act = decide(streak, elsewhere, 1000, 300, CFG)
        assert (streak, act) == (0, None)
    for _ in range(3):
        streak, act = decide(streak, short, 1000, 300, CFG)
    assert act.new_cap == 900 and "PSI memory full avg10 25.0% > 10% with 4% of memory available" in act.reason
