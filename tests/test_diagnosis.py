"""The memory-thrash verdict (store.diagnosis) on stores written through the real Store, and its CLI."""
from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from agents import CLI
from bench import synthetic
from store import diagnosis
from store.disk_diagnosis import EXPERT_READS, reads_described
from store.db import Store
from store.errors import StoreError

T0 = 1_700_000_000.0
WINDOW = 300
GIB, MIB = 1 << 30, 1 << 20
KNOBS = {"cache_cap_bytes": {"value": 4 * GIB, "min": 512 * MIB, "max": 5 * GIB, "type": "int"}}


def write(path: Path, levels: dict[str, float], seconds: int = WINDOW, bursts: dict[str, tuple[int, float]] = {}
          ) -> Path:
    """1 Hz samples of each series at its level, ending at T0; `bursts` lifts a series to a value for
    its last n seconds."""
    with Store(path, autoflush_s=0) as store:
        for i in range(seconds):
            t = T0 - seconds + 1 + i
            for name, value in levels.items():
                n, high = bursts.get(name, (0, value))
                store.append(name, t, high if i >= seconds - n else value)
    return path


def judged(path: Path, knobs=KNOBS, **kwargs) -> diagnosis.Diagnosis:
    return diagnosis.diagnose(path, WINDOW, until=T0, knobs=knobs, **kwargs)


def calm(path: Path, **bursts: tuple[int, float]) -> diagnosis.Diagnosis:
    levels = synthetic.MEMORY["healthy"]
    return judged(write(path, levels, bursts={k.replace("__", "."): v for k, v in bursts.items()}))


def test_no_store_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(StoreError, match="no store at .*absent.db"):
        diagnosis.diagnose(tmp_path / "absent.db")


def test_no_memory_signal_is_no_data_without_a_recommendation(tmp_path):
    d = judged(write(tmp_path / "s.db", {"agent.reread_rate": 0.9}))      # the cache's own signal alone
    assert d.verdict == "no data" and "start the collector" in d.summary
    assert d.recommendation is None
    assert "mem.agent.majflt_per_s" in {th.series for th in d.unsampled}


def test_memory_samples_outside_the_window_are_no_data_that_says_when_they_are(tmp_path):
    """A store copied from another box, or whose collector stopped a day ago, was told to start the collector."""
    path = write(tmp_path / "s.db", synthetic.MEMORY["healthy"])
    d = diagnosis.diagnose(path, WINDOW, until=T0 + 86_400, knobs=KNOBS)
    last = diagnosis._utc(T0)
    assert d.verdict == "no data" and f"holds memory samples from {diagnosis._utc(T0 - WINDOW + 1)} to {last}" \
        in d.summary and f"diagnose --until {last}`" in d.summary, d.summary
    assert diagnosis.diagnose(path, WINDOW, until=datetime_of(last), knobs=KNOBS).verdict == "healthy"


def datetime_of(utc: str) -> float:
    return datetime.strptime(utc, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def test_calm_signals_are_healthy_and_each_says_its_threshold(tmp_path):
    d = calm(tmp_path / "s.db")
    assert d.verdict == "healthy" and d.evidence == () and d.recommendation is None
    faults = d.signal("mem.agent.majflt_per_s")
    assert (faults.peak, faults.mean, faults.seconds_over) == (2.0, 2.0, 0.0)
    assert faults.sentence() == "agent major faults: peak 2.0 /s, mean 2.0 /s, never over 50.0 /s"


def test_a_start_up_burst_of_faults_is_not_thrash(tmp_path):
    d = calm(tmp_path / "s.db", mem__agent__majflt_per_s=(10, 5000.0))   # 10 s of loading the model
    faults = d.signal("mem.agent.majflt_per_s")
    assert faults.peak == 5000.0 and 9 <= faults.seconds_over <= 11
    assert d.verdict == "healthy"


def test_the_agents_own_faults_sustained_are_agent_thrashing_and_the_cap_shrinks_by_a_quarter(tmp_path):
    d = calm(tmp_path / "s.db", mem__agent__majflt_per_s=(60, 800.0))
    assert d.verdict == "agent thrashing"
    assert [s.threshold.series for s in d.evidence] == ["mem.agent.majflt_per_s"]
    assert 55 <= d.evidence[0].seconds_over <= 65
    assert d.recommendation.changes == {"cache_cap_bytes": 3 * GIB}
    assert "from 4.0 GiB to 3.0 GiB" in d.recommendation.text and "Expect" in d.recommendation.text


def test_the_agents_cgroup_refaults_alone_are_agent_thrashing(tmp_path):
    d = calm(tmp_path / "s.db", cgroup__agent__workingset_refault_file_per_s=(30, 20_000.0))
    assert d.verdict == "agent thrashing"


def test_refaults_of_a_cgroup_the_agent_shares_are_not_blamed_on_it_unless_its_own_faults_rise(tmp_path):
    """With other processes in the agent's cgroup (e.g. a dashboard and a collector in one container),
    the cgroup's counters are theirs too: only the agent's own major faults make it the agent's fault."""
    levels = synthetic.MEMORY["healthy"] | {"cgroup.agent.other_processes": 0}
    crowded = {"cgroup.agent.workingset_refault_file_per_s": (30, 20_000.0), "cgroup.agent.other_processes": (1, 2)}
    d = judged(write(tmp_path / "s.db", levels, bursts=crowded))
    assert d.verdict == "pressure from another process" and d.recommendation.changes == {}
    assert [s.threshold.label for s in d.evidence] == ["agent cgroup file refaults (a cgroup shared with 2 other "
                                                       "processes)"]
    assert "give the agent a cgroup of its own" in d.recommendation.text
    faulting = judged(write(tmp_path / "t.db", levels, bursts=crowded | {"mem.agent.majflt_per_s": (60, 800.0)}))
    assert faulting.verdict == "agent thrashing"


def test_cache_thrashing_under_a_memory_verdict_is_shown_with_its_own_fix(tmp_path):
    """Both at once: the memory verdict leads, and the cache's re-reads, which its fix does not cure, are
    said with theirs (a larger cap once memory is calm; for a thrashing agent, more memory first)."""
    levels = synthetic.MEMORY["healthy"] | {"agent.reread_rate": 0.3, "agent.hit_rate": 0.3}
    rereads = {"agent.reread_rate": (120, 0.7)}
    pressed = judged(write(tmp_path / "p.db", levels, bursts=rereads | {"psi.memory.some_avg10": (120, 30.0)}))
    assert pressed.verdict == "pressure from another process" and pressed.recommendation.changes == {}
    text = pressed.recommendation.text
    assert text.startswith("The fix is outside the agent")
    assert "The cache thrashes too: expert lookups re-reading" in text
    assert "once memory is no longer short, raise the cap to 5.0 GiB" in text      # the machine's total not known
    roomy = judged(write(tmp_path / "r.db", levels | {"mem.total_bytes": 8 * GIB},
                         bursts=rereads | {"psi.memory.some_avg10": (120, 30.0)}))
    assert "raise the cap to 5.0 GiB now: the machine has 3.0 GiB of 8.0 GiB available" in roomy.recommendation.text
    agent = judged(write(tmp_path / "a.db", levels, bursts=rereads | {"mem.agent.majflt_per_s": (120, 800.0)}))
    assert agent.verdict == "agent thrashing" and agent.recommendation.changes == {"cache_cap_bytes": 3 * GIB}
    assert "a smaller cap costs more SSD reads; the lasting fix is more memory" in agent.recommendation.text
    alone = judged(write(tmp_path / "c.db", levels, bursts={"psi.memory.some_avg10": (120, 30.0)}))
    assert "cache thrashes" not in alone.recommendation.text


def test_a_shrink_never_goes_below_the_agents_minimum(tmp_path):
    knobs = {"cache_cap_bytes": {"value": 600 * MIB, "min": 512 * MIB, "max": 5 * GIB}}
    path = write(tmp_path / "s.db", synthetic.MEMORY["agent thrashing"])
    assert judged(path, knobs).recommendation.changes == {"cache_cap_bytes": 512 * MIB}
    at_min = {"cache_cap_bytes": {"value": 512 * MIB, "min": 512 * MIB, "max": 5 * GIB}}
    rec = judged(path, at_min).recommendation
    assert rec.changes == {} and "already at its minimum" in rec.text and "Raise its memory limit" in rec.text


def test_a_cap_above_the_bound_after_the_limit_fell_is_brought_to_the_bound(tmp_path):
    knobs = {"cache_cap_bytes": {"value": 4 * GIB, "min": 512 * MIB, "max": 3 * GIB + 12345}}
    rec = judged(write(tmp_path / "s.db", synthetic.MEMORY["agent thrashing"]), knobs).recommendation
    assert rec.changes == {"cache_cap_bytes": 3 * GIB + 12345}
    assert "the most the agent allows now" in rec.text


def test_system_pressure_with_the_agent_flat_is_someone_elses_and_never_shrinks_the_cache(tmp_path):
    d = judged(write(tmp_path / "s.db", synthetic.MEMORY["pressure from another process"]))
    assert d.verdict == "pressure from another process"
    assert {s.threshold.series for s in d.evidence} == {"psi.memory.some_avg10", "psi.memory.full_avg10",
                                                         "vm.workingset_refault_file_per_s"}
    assert d.recommendation.changes == {}
    assert "outside the agent" in d.recommendation.text and "agent major faults peak 2.0 /s" in d.recommendation.text


@pytest.mark.parametrize(("available", "says"), [
    (6 * GIB, "the machine has 6.0 GiB of 8.0 GiB available, so the shortage is inside another process's own"),
    (0.3 * GIB, "The machine as a whole is short too (307 MiB of 8.0 GiB available): a smaller cache cap would hand"),
    (None, "help only if the machine as a whole is short of memory (not sampled here)")])
def test_another_processs_pressure_says_whether_the_agents_memory_would_help(tmp_path, available, says):
    """Inside the other process's own limit the agent's slots would not help it; with the whole machine
    short they would, at the agent's cost; neither is a one-click shrink: the cause is elsewhere."""
    levels = {k: v for k, v in synthetic.MEMORY["pressure from another process"].items() if k != "mem.available_bytes"}
    levels |= {"mem.total_bytes": 8 * GIB} | ({"mem.available_bytes": available} if available is not None else {})
    rec = judged(write(tmp_path / "s.db", levels)).recommendation
    assert says in rec.text and rec.changes == {}


def test_the_agent_thrashing_under_system_pressure_is_the_agents(tmp_path):
    assert judged(write(tmp_path / "s.db", synthetic.MEMORY["agent thrashing"])).verdict == "agent thrashing"


def test_re_reads_with_memory_calm_are_cache_thrashing_and_the_cap_grows_within_memory(tmp_path):
    d = judged(write(tmp_path / "s.db", synthetic.MEMORY["cache thrashing"]
                     | {"agent.hit_rate": 0.3, "agent.read_bytes_per_s": 10 * MIB}))
    assert d.verdict == "cache thrashing"
    # four times the cap is 16 GiB; the bound is 5 GiB, half of the 3 GiB available is 1.5 GiB more: 5.5 GiB
    assert d.recommendation.changes == {"cache_cap_bytes": 5 * GIB}
    assert "from 4.0 GiB to 5.0 GiB (hit rate 0.30, SSD reads 10.0 MiB/s)" in d.recommendation.text
    small = {"cache_cap_bytes": {"value": 512 * MIB, "min": 512 * MIB, "max": 5 * GIB}}
    assert judged(tmp_path / "s.db", small).recommendation.changes == {"cache_cap_bytes": 2 * GIB}
    short = {"cache_cap_bytes": {"value": 1 * GIB, "min": 512 * MIB, "max": 5 * GIB}}   # 1 GiB + half of 3 GiB
    assert judged(tmp_path / "s.db", short).recommendation.changes == {"cache_cap_bytes": 2.5 * GIB}


def test_a_noisy_re_read_rate_is_judged_on_ten_second_averages(tmp_path):
    """The small demo at its default cap: a fifth of its seconds over the threshold, its 10 s averages
    under it. Judged second by second, a 5-minute window found a minute over, and "cache thrashing"."""
    noisy = [0.9 if i % 5 == 0 else 0.35 for i in range(WINDOW)]                     # mean 0.46
    with Store(tmp_path / "s.db", autoflush_s=0) as store:
        for i, value in enumerate(noisy):
            for name, level in (synthetic.CALM | {"agent.reread_rate": value}).items():
                store.append(name, T0 - WINDOW + 1 + i, level)
    d = judged(tmp_path / "s.db")
    rate = d.signal("agent.reread_rate")
    assert d.verdict == "healthy" and rate.seconds_over == 0 and rate.peak < 0.5
    assert len(rate.buckets) == WINDOW // 10
    assert rate.sentence().startswith("expert lookups re-reading a block the cache evicted (10 s averages): peak ")


def test_without_the_agent_the_bounds_are_the_ones_it_recorded(tmp_path):
    path = write(tmp_path / "s.db", synthetic.MEMORY["agent thrashing"] | {
        "agent.cache_cap_bytes": 600 * MIB, "agent.cache_cap_min_bytes": 500 * MIB,
        "agent.cache_cap_max_bytes": 2 * GIB})
    assert judged(path, knobs=None).recommendation.changes == {"cache_cap_bytes": 500 * MIB}


def test_a_window_must_be_positive_and_finite(tmp_path):
    path = write(tmp_path / "s.db", synthetic.CALM)
    for bad in (0, -5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="window must be a positive number"):
            diagnosis.diagnose(path, bad)


def test_cli_prints_the_same_verdict_as_the_library_in_text_and_json(tmp_path):
    path = write(tmp_path / "s.db", synthetic.MEMORY["pressure from another process"])
    args = [*CLI, "diagnose", "--db", str(path), "--window", "5m", "--until", str(T0)]
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert text.startswith("PRESSURE FROM ANOTHER PROCESS: ")
    assert "evidence: memory PSI some (avg10): peak 25.0 %, mean 25.0 %, over 10.0 % for 300 s" in text
    assert "recommendation: The fix is outside the agent" in text
    out = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, check=True).stdout)
    library = diagnosis.diagnose(path, 300, until=T0)
    assert out == json.loads(json.dumps(library.as_dict()))


@pytest.mark.parametrize("args, message", [
    (["--db", "absent.db"], "no store at absent.db"),
    (["--db", "x.db", "--window", "5 minutes"], "is not a duration"),
    (["--db", "x.db", "--window=-5m"], "is not a duration"),
    (["--db", "x.db", "--until", "yesterday"], "neither Unix seconds nor an ISO 8601 time"),
])
def test_cli_bad_input_is_one_line_not_a_traceback(tmp_path, args, message):
    result = subprocess.run([*CLI, "diagnose", *args], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_effect_compares_each_signal_before_and_after_a_change(tmp_path):
    # 800 faults/s until the change 100 s before T0, 3/s after it; PSI stays at 30 %
    path = write(tmp_path / "s.db", {"mem.agent.majflt_per_s": 800.0, "psi.memory.some_avg10": 30.0},
                 seconds=200, bursts={"mem.agent.majflt_per_s": (100, 3.0)})
    faults, psi = diagnosis.effect(path, T0 - 100, T0, ["mem.agent.majflt_per_s", "psi.memory.some_avg10"])
    assert (faults.before, faults.after, faults.improved) == (800.0, 3.0, True)
    assert faults.sentence() == "agent major faults: 800 /s before, 3.0 /s since (improved: under its threshold)"
    assert not psi.improved and "not yet under its threshold" in psi.sentence()
    (early,) = diagnosis.effect(path, T0 - 5, T0, ["mem.agent.majflt_per_s"])      # too soon to tell
    assert early.after is None and "no samples yet" in early.sentence()


def test_a_cap_above_the_bound_is_brought_to_it_even_when_another_process_is_to_blame(tmp_path):
    """The agent's limit fell under its cap while something else thrashes: the fix is still outside
    the agent, and the cap comes down to the bound so its own cache fits the limit once it fills."""
    knobs = {"cache_cap_bytes": {"value": 384 * MIB, "min": 192 * MIB, "max": 328 * MIB}}
    d = judged(write(tmp_path / "s.db", synthetic.MEMORY["pressure from another process"]), knobs)
    assert d.verdict == "pressure from another process"
    assert d.recommendation.changes == {"cache_cap_bytes": 328 * MIB}            # the bound, never a shrink below it
    assert d.recommendation.text.startswith("The fix is outside the agent")
    assert "cache cap of 384 MiB is above the most it allows now (328 MiB" in d.recommendation.text


# --- the disk verdict (store.disk_diagnosis), beside the memory one -----------------------------------
DISK = {"agent.read_latency_s": 0.8e-3, "io.vda.agent_read_bytes_per_s": 25e6, "io.vda.others_read_bytes_per_s": 0.0,
        "block.vda.util": 0.3, "agent.hit_rate": 0.55, "agent.reread_rate": 0.3, "agent.read_bytes_per_s": 25e6}


def on_disk(path: Path, seconds: int = WINDOW, readers: dict[str, tuple[int, int]] = {},
            **bursts: tuple[int, float]) -> diagnosis.Diagnosis:
    """The calm memory and disk levels, with `bursts` as in write(), and `readers` (name: (pid, seconds))
    recorded by name reading the disk at 800 MB/s for their last seconds."""
    write(path, synthetic.MEMORY["healthy"] | DISK, seconds, {k.replace("__", "."): v for k, v in bursts.items()})
    with Store(path, autoflush_s=0) as store:
        for name, (pid, n) in readers.items():
            for i in range(n):
                store.record_disk_readers(T0 - i, "vda", [(pid, name, 800e6, 0.0)])
    return judged(path)


CROWDED = {"agent__read_latency_s": (60, 25e-3), "io__vda__others_read_bytes_per_s": (60, 800e6),
           "io__vda__agent_read_bytes_per_s": (60, 20e6)}


def test_the_agents_reads_slowed_while_another_process_reads_its_disk_is_contention_naming_it(tmp_path):
    d = on_disk(tmp_path / "s.db", readers={"dd": (4242, 60)}, **CROWDED)
    disk = d.disk
    assert d.verdict == "healthy" and disk.verdict == "disk contention from another process"
    assert disk.device == "vda" and disk.baseline_s == pytest.approx(0.8e-3) and 55 <= disk.seconds <= 65
    assert [(r.name, r.pids, r.seconds, r.mean) for r in disk.readers] == [("dd", (4242,), 60, 800e6)]
    assert "slowed from 800 µs to 24.6 ms for 60 s while `dd` read vda" in disk.summary  # a bucket straddles its start
    assert "`ionice -c3 -p 4242`" in disk.recommendation
    # if dd cannot move: a 4x cap cuts at most the re-reads, 0.3 / (1 - 0.55) = 67% of the agent's reads
    assert "would cut at most 67% of its reads" in disk.recommendation and disk.changes == {"cache_cap_bytes": 5 * GIB}
    assert any("reader: `dd` (pid 4242): 763 MiB/s for 60 s" in e for e in disk.evidence())
    assert diagnosis.diagnose(tmp_path / "s.db", WINDOW, T0, KNOBS).as_dict()["disk"]["readers"][0]["name"] == "dd"


def test_a_readers_name_is_shown_as_code_and_printable_whatever_it_chose(tmp_path):
    """A process names itself: "[Apply](//x.co)" was a link on the Memory page (Markdown), and a name stored
    before the collector escaped it could carry terminal escapes to `diagnose`'s output."""
    d = on_disk(tmp_path / "s.db", readers={"[Apply](//x.co)": (4242, 60), "`x`\x1b[2J": (4243, 60)}, **CROWDED)
    text = "\n".join(d.lines())
    assert "while `[Apply](//x.co)`, `'x'\\x1b[2J` read vda" in d.disk.summary, d.disk.summary
    assert "Give `[Apply](//x.co)`, `'x'\\x1b[2J` less of vda" in d.disk.recommendation
    assert "\x1b" not in text and "reader: `[Apply](//x.co)` (pid 4242)" in text


def test_another_process_reading_while_the_agent_keeps_its_pace_is_healthy(tmp_path):
    d = on_disk(tmp_path / "s.db", readers={"dd": (4242, 60)}, io__vda__others_read_bytes_per_s=(60, 800e6))
    assert d.disk.verdict == "healthy" and d.disk.readers == ()


def test_a_slowdown_shorter_than_the_sustain_is_healthy(tmp_path):
    d = on_disk(tmp_path / "s.db", readers={"dd": (4242, 10)}, **{k: (10, v) for k, (_, v) in CROWDED.items()})
    assert d.disk.verdict == "healthy"


def test_no_calm_stretch_to_compare_with_is_no_slowdown(tmp_path):
    """A cold start: the agent's first reads are slow while another process reads, with no calm baseline."""
    d = on_disk(tmp_path / "s.db", seconds=60, readers={"dd": (4242, 60)}, **CROWDED)
    assert d.disk.verdict == "healthy" and d.disk.baseline_s is None and "no calm stretch" in d.disk.summary
    assert "Other processes used it hard meanwhile (`dd` (pid 4242): 763 MiB/s for 60 s" in d.disk.summary


def test_contention_longer_than_the_window_and_its_baseline_is_judged_on_the_calm_remembered_before(tmp_path):
    """dd has read for 10 minutes, the window (5) and BASELINE_S (5) all crowded: the agent's calm latency
    is remembered from the calm 5 minutes before that, and the evidence says so."""
    crowded = {k: (2 * WINDOW, v) for k, (_, v) in CROWDED.items()}
    d = on_disk(tmp_path / "s.db", seconds=3 * WINDOW, readers={"dd": (4242, 2 * WINDOW)}, **crowded)
    assert d.disk.verdict == "disk contention from another process" and d.disk.seconds >= WINDOW - 5
    assert d.disk.baseline_s == pytest.approx(0.8e-3) and [r.name for r in d.disk.readers] == ["dd"]
    assert d.disk.baseline.source.startswith("remembered: median of the last 60 calm 5 s averages in the store, "
                                             "ending 300 s before the window")
    assert any("(remembered: " in e for e in d.disk.evidence())
    assert on_disk(tmp_path / "t.db", seconds=3 * WINDOW).disk.baseline.source.startswith("median of 120 calm")


def reads_of(path: Path, *marks: tuple[float, str]) -> Path:
    """The agent's EXPERT_READS events: at each time, O_DIRECT reads of that expert store's blocks on vda."""
    with Store(path, autoflush_s=0) as store:
        for t, store_dir in marks:
            store.record_event(t, EXPERT_READS, reads_described("direct", 12_582_912, store_dir, "vda"))
    return path


def test_a_baseline_remembered_from_another_expert_store_is_not_used(tmp_path):
    """As above, but the agent began reading another model's store when dd began: the calm latency before
    was of other reads, so there is nothing to compare with; after a restart on the same store there is."""
    crowded = {k: (2 * WINDOW, v) for k, (_, v) in CROWDED.items()}
    other = reads_of(tmp_path / "s.db", (T0 - 3 * WINDOW, "/models/olmoe"), (T0 - 2 * WINDOW, "/models/qwen3"))
    d = on_disk(other, seconds=3 * WINDOW, readers={"dd": (4242, 2 * WINDOW)}, **crowded)
    assert d.disk.verdict == "healthy" and d.disk.baseline_s is None and "no calm stretch" in d.disk.summary
    same = reads_of(tmp_path / "t.db", (T0 - 3 * WINDOW, "/models/olmoe"), (T0 - 2 * WINDOW, "/models/olmoe"))
    d = on_disk(same, seconds=3 * WINDOW, readers={"dd": (4242, 2 * WINDOW)}, **crowded)
    assert d.disk.verdict == "disk contention from another process" and d.disk.baseline_s == pytest.approx(0.8e-3)


def test_calm_buckets_of_the_store_read_before_a_switch_are_left_out_of_the_baseline(tmp_path):
    """The agent switched to a model of larger blocks (calm at 10 ms, not 0.8) 5 minutes before the window:
    25 ms under dd is not 3x its calm latency. With the old store's buckets in the median it was 0.8 ms."""
    path = reads_of(tmp_path / "s.db", (T0 - 2 * WINDOW, "/models/olmoe"), (T0 - WINDOW, "/models/qwen3"))
    with Store(path, autoflush_s=0) as store:
        for t in range(int(T0) - 2 * WINDOW + 1, int(T0) + 1):
            levels = synthetic.MEMORY["healthy"] | DISK
            if t > T0 - WINDOW:
                levels |= {"agent.read_latency_s": 10e-3}
            if t > T0 - 60:
                levels |= {k.replace("__", "."): v for k, (_, v) in CROWDED.items()}
            for name, value in levels.items():
                store.append(name, t, value)
    disk = judged(path).disk
    assert disk.verdict == "healthy" and disk.baseline_s == pytest.approx(10e-3), disk.summary


def test_another_process_writing_the_agents_disk_while_its_reads_slow_is_contention_naming_the_writer(tmp_path):
    writes = {"agent__read_latency_s": (60, 25e-3), "io__vda__others_write_bytes_per_s": (60, 800e6),
              "io__vda__agent_read_bytes_per_s": (60, 20e6)}
    write(tmp_path / "s.db", synthetic.MEMORY["healthy"] | DISK | {"io.vda.others_write_bytes_per_s": 0.0}, WINDOW,
          {k.replace("__", "."): v for k, v in writes.items()})
    with Store(tmp_path / "s.db", autoflush_s=0) as store:
        for i in range(60):
            store.record_disk_readers(T0 - i, "vda", [(4343, "dd", 0.0, 800e6)])
    disk = judged(tmp_path / "s.db").disk
    assert disk.verdict == "disk contention from another process" and "while `dd` wrote vda" in disk.summary
    assert [(r.name, r.read, r.write) for r in disk.readers] == [("dd", 0.0, 800e6)]
    assert any("reader: `dd` (pid 4343): 763 MiB/s (0 B/s read, 763 MiB/s written) for 60 s" in e
               for e in disk.evidence())
    assert "io.max rbps and wbps" in disk.recommendation


def test_the_agents_own_reads_filling_the_disk_are_said_so_and_cache_thrashing_keeps_its_fix(tmp_path):
    own = {"agent__read_latency_s": (60, 25e-3), "block__vda__util": (60, 1.0),
           "io__vda__agent_read_bytes_per_s": (60, 200e6)}
    d = on_disk(tmp_path / "s.db", **own)
    assert d.disk.verdict == "the agent's own reads saturate the disk" and d.disk.readers == ()
    assert "would cut at most" in d.disk.recommendation
    thrash = on_disk(tmp_path / "t.db", agent__reread_rate=(60, 0.7), **own)
    assert thrash.verdict == "cache thrashing" and thrash.disk.verdict == "the agent's own reads saturate the disk"
    assert thrash.disk.recommendation.startswith("The cache-thrashing verdict's cap raise is the fix")
    assert thrash.disk.changes == {}


def test_a_store_without_the_collectors_split_of_the_disk_is_no_disk_data(tmp_path):
    d = calm(tmp_path / "s.db")
    assert d.disk.verdict == "no data" and "--pid-file" in d.disk.summary
    assert d.as_dict()["disk"]["verdict"] == "no data"
