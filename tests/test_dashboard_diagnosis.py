"""The thrash verdict, its evidence and the cap recommendation, as a pure function."""
from dashboard.diagnosis import MIB, Threshold, diagnose, evidence_for, recommend_cap

FULL = Threshold("psi.full", "PSI full", 5.0, "%")
SOME = Threshold("psi.some", "PSI some", 20.0, "%")
FAULTS = Threshold("faults", "major faults", 100.0, "/s")
THRESHOLDS = (FULL, SOME, FAULTS)
GIB = 1 << 30


def calm(n: int = 10) -> list[tuple[float, float]]:
    return [(float(t), 1.0) for t in range(n)]


def test_no_samples_says_no_data_and_how_to_get_some():
    d = diagnose({}, THRESHOLDS, "psi.full")
    assert d.verdict == "no data"
    assert "collector" in d.summary
    assert d.recommendation is None


def test_all_below_threshold_is_healthy_without_recommendation():
    d = diagnose({"psi.full": calm(), "psi.some": calm(), "faults": calm()}, THRESHOLDS, "psi.full",
                 mem_total=8 * GIB, mem_available=6 * GIB, cache_cap=2 * GIB)
    assert d.verdict == "healthy"
    assert d.evidence == ()
    assert d.recommendation is None


def test_evidence_names_when_and_how_far_a_signal_crossed():
    samples = [(10.0, 1.0), (11.0, 30.0), (12.0, 2.0), (13.0, 45.0), (14.0, 25.0)]
    e = evidence_for(SOME, samples)
    assert (e.first_t, e.last_t, e.peak, e.samples_over, e.samples) == (11.0, 14.0, 45.0, 3, 5)
    assert "PSI some above 20 %" in e.sentence() and "3 of 5" in e.sentence()


def test_a_single_spike_is_not_evidence():
    assert evidence_for(FAULTS, [(0.0, 500.0), (1.0, 3.0)]) is None


def test_one_signal_over_is_pressure_two_is_thrashing():
    over = [(float(t), 400.0) for t in range(5)]
    one = diagnose({"faults": over, "psi.some": calm()}, THRESHOLDS, "psi.full")
    two = diagnose({"faults": over, "psi.some": [(t, 50.0) for t, _ in over]}, THRESHOLDS, "psi.full")
    assert one.verdict == "under pressure"
    assert two.verdict == "thrashing"
    assert [e.threshold.signal for e in two.evidence] == ["psi.some", "faults"]


def test_psi_full_alone_is_thrashing():
    d = diagnose({"psi.full": [(0.0, 9.0), (1.0, 12.0)]}, THRESHOLDS, "psi.full")
    assert d.verdict == "thrashing"


def test_recommendation_keeps_memory_in_use_within_70_percent_of_ram():
    # 8 GiB RAM, 7 GiB in use of which the cache is 4 GiB: 3 GiB besides the cache.
    rec = recommend_cap("thrashing", mem_total=8 * GIB, mem_available=1 * GIB, cache_cap=4 * GIB)
    ceiling = 0.7 * 8 * GIB
    assert rec.cache_cap_bytes <= ceiling - 3 * GIB
    assert rec.cache_cap_bytes > ceiling - 3 * GIB - MIB
    assert rec.cache_cap_bytes % MIB == 0
    assert "70%" in rec.reason


def test_pressure_from_elsewhere_steps_the_cap_down():
    # Plenty of headroom by the arithmetic, yet pressure: shrink by a step rather than grow.
    rec = recommend_cap("under pressure", mem_total=16 * GIB, mem_available=12 * GIB, cache_cap=1 * GIB)
    assert rec.cache_cap_bytes < 1 * GIB


def test_healthy_but_cap_above_ceiling_is_brought_down():
    rec = recommend_cap("healthy", mem_total=8 * GIB, mem_available=4 * GIB, cache_cap=7 * GIB)
    assert rec.cache_cap_bytes <= 0.7 * 8 * GIB


def test_without_memory_facts_there_is_no_recommendation():
    assert recommend_cap("thrashing", None, None, 4 * GIB) is None
