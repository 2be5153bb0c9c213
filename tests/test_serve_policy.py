"""Pure decisions of the service: the memory guard."""
from __future__ import annotations

from agent.monitor import SystemSample
from agent.serve.guard import GuardConfig, decide

CFG = GuardConfig(psi_full_avg10=10.0, major_faults_per_s=200.0, intervals=3, step=0.10)
CALM = SystemSample(psi_full_avg10=1.0, major_faults_per_s=5.0)
PSI_HIGH = SystemSample(psi_full_avg10=25.0, major_faults_per_s=5.0)
FAULTS_HIGH = SystemSample(psi_full_avg10=None, major_faults_per_s=900.0)


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
