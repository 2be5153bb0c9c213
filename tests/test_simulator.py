"""The simulator: the runtime's Residency replayed over real routing traces, and its CLI."""
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import main
from agent.policies.lru import LRU
from agent.residency import Residency
from agent.simulator import SystemReplay, capacity_slots, format_table, gap_closed, replay, simulate
from agent.traces import TraceError, from_sets, read_jsonl

DATA = Path(__file__).parent / "data" / "traces"
OLMOE, QWEN = DATA / "olmoe_math.jsonl", DATA / "qwen_dialogue.jsonl"
BASELINES = ["lru", "lfu", "lfu-window", "arc", "least-stale"]


@pytest.fixture(scope="module")
def olmoe():
    return read_jsonl(OLMOE)


def test_capacity_is_a_floored_fraction_never_below_one_step(olmoe):
    assert capacity_slots(olmoe, 0.25, "layer") == 16 * 16
    assert capacity_slots(olmoe, 0.01, "layer") == 8 * 16  # top-8 floor per layer
    assert capacity_slots(olmoe, 0.25, "global") == 256
    qwen = read_jsonl(QWEN)
    assert capacity_slots(qwen, 0.125, "layer") == 7 * 24  # 7.5 experts floors to 7
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"fraction of all experts in \(0, 1\]"):
            capacity_slots(olmoe, bad, "layer")


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_belady_bounds_every_policy_on_a_real_trace(olmoe, scope):
    results = {p: simulate(olmoe, p, 0.25, scope) for p in BASELINES + ["belady"]}
    assert all(r.accesses == 512 * 16 * 8 for r in results.values())
    best = results.pop("belady").hit_rate
    assert all(0.3 < r.hit_rate < best for r in results.values())


def test_cold_misses_count(olmoe):
    r = simulate(olmoe, "lru", 1.0, "layer")
    distinct = len({(l, e) for t in range(olmoe.n_tokens) for l in range(16) for e in olmoe.routed(t, l).tolist()})
    assert r.accesses - r.hits == distinct  # a cache that holds everything misses each expert once


class HookLog(LRU):
    """LRU that logs the session, route and system hooks it receives, as (hook, detail)."""
    name = ""  # not registered: "lru" stays the real one

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def session(self):
        self.seen.append(("session", None))

    def route(self, layer, experts):
        self.seen.append(("route", layer))

    def system(self, sample):
        self.seen.append(("system", sample["read_latency_s"]))


def test_sessions_and_system_samples_reach_the_policy():
    seen = []
    trace = from_sets([[[t % 4]] for t in range(5)], session_starts=[0, 3])
    replay(trace, Residency(2, 1, functools.partial(HookLog, seen), "layer", 1),
           SystemReplay(({"read_latency_s": 1.0}, {"read_latency_s": 2.0}), every=2))
    assert [e for e in seen if e[0] != "route"] == [("session", None), ("system", 1.0), ("system", 2.0),
                                                   ("session", None), ("system", 1.0)]


def test_a_recorded_trace_replays_its_own_samples_just_before_their_route(tmp_path):
    seen = []
    lines = [{"meta": {"layers": 2, "top_k": 1, "n_experts": 4}},
             {"step": 0, "routed": {"0": [0], "1": [1]}},
             {"step": 1, "routed": {"0": [2], "1": [3]}, "system": [{"layer": 1, "read_latency_s": 0.5}]},
             {"step": 2, "routed": {"0": [0], "1": [1]}, "system": [{"layer": 0, "read_latency_s": 0.25,
                                                                    "mem_pressure": 0.1}]}]
    path = tmp_path / "recorded.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    trace = read_jsonl(path)
    assert trace.system == {3: {"read_latency_s": 0.5}, 4: {"read_latency_s": 0.25, "mem_pressure": 0.1}}
    replay(trace, Residency(4, 2, functools.partial(HookLog, seen), "global", 1),
           SystemReplay.synthetic())  # not the synthetic series
    assert [e for e in seen if e[0] != "session"] == [("route", 0), ("route", 1), ("route", 0), ("system", 0.5),
                                                      ("route", 1),
                    ("system", 0.25), ("route", 0), ("route", 1)]
    lines[2]["system"] = [{"layer": 2, "read_latency_s": 0.5}]  # no layer 2 in this trace
    path.write_text("\n".join(json.dumps(line) for line in lines))
    with pytest.raises(TraceError, match=r"recorded.jsonl:3: \"system\" must be a list"):
        read_jsonl(path)


def test_system_series_file(tmp_path):
    good = tmp_path / "s.json"
    good.write_text(json.dumps({"every": 4, "samples": [{"read_latency_s": 1e-4, "mem_pressure": 0.2}]}))
    s = SystemReplay.load(good)
    assert s.at(0) == s.at(8) == {"read_latency_s": 1e-4, "mem_pressure": 0.2} and s.at(3) is None
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"samples": "nope"}))
    with pytest.raises(ValueError, match="expected"):
        SystemReplay.load(bad)
    assert SystemReplay.synthetic().at(0) == SystemReplay.synthetic().at(0)  # deterministic


BIG = "9" * 400  # a JSON integer with no float: float() raised OverflowError


@pytest.mark.parametrize("text, message", [
    ('{"every": 1e400, "samples": [{"read_latency_s": 1e-4}]}', "N a positive integer"),   # was OverflowError
    ('{"every": 0, "samples": [{"read_latency_s": 1e-4}]}', "N a positive integer"),
    ('{"every": 4.5, "samples": [{"read_latency_s": 1e-4}]}', "N a positive integer"),  # was taken as 4
    ('{"samples": []}', "at least one sample"),
    ('{"samples": [{}]}', r"sample 0: a monitoring sample must be .* with at least one value.*; got \{\}"),
    ('{"samples": [{"read_latency_s": NaN}]}', r"sample 0: .*each a finite number >= 0; got .*NaN"),
    ('{"samples": [{"read_latency_s": Infinity}]}', "sample 0: .*each a finite number >= 0"),
    ('{"samples": [{"read_latency_s": 1e-4}, {"mem_pressure": 1e400}]}', "sample 1: .*got .*Infinity"),
    ('{"samples": [{"read_latency_s": -1}]}', "sample 0: .*each a finite number >= 0"),
    ('{"samples": [{"read_latency_s": %s}]}' % BIG, "sample 0: .*each a finite number >= 0"),  # was OverflowError
    ('{"samples": [{"read_latency_s": "1e-4"}]}', "sample 0: .*each a finite number >= 0"),
    ("[" * 100_000, r"not JSON this reader takes \(RecursionError"),                               # was RecursionError
    ('{"samples": [{"read_latency_s": %s}]}' % ("9" * 5000), r"not JSON this reader takes \(ValueError"),
])
def test_a_system_series_of_bad_values_is_refused_naming_the_file(tmp_path, text, message):
    """Each of these replayed silently (NaN reached the learned policy's input) or ended in a traceback."""
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"s\.json: (.* )?{message}"):
        SystemReplay.load(path)


def test_a_system_series_that_is_not_a_file_is_one_line(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"series: cannot read as UTF-8 text \(.*Is a directory"):
        SystemReplay.load((tmp_path / "series").mkdir() or tmp_path / "series")   # was IsADirectoryError
    with pytest.raises(ValueError, match=r"absent\.json: no such system series file"):
        SystemReplay.load(tmp_path / "absent.json")
    assert main(["simulate", "--trace", str(OLMOE), "--policy", "lru", "--system-series", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_gap_closed():
    assert gap_closed(0.6, 0.5, 0.7) == pytest.approx(0.5)
    assert gap_closed(0.5, 0.5, 0.5) is None


def test_cli_json_and_table(capsys):
    assert main(["simulate", "--trace", str(OLMOE), str(QWEN), "--policy", "lfu,arc", "--capacity", "0.25",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["trace"], r["policy"]) for r in rows] == [
        (t, p) for t in ("olmoe_math", "qwen_dialogue") for p in ("lru", "lfu", "arc", "belady")]
    for r in rows:
        assert {"trace", "policy", "capacity", "scope", "hits", "accesses", "hit_rate"} <= set(r)
        assert r["hit_rate"] == pytest.approx(r["hits"] / r["accesses"])
        assert r["capacity"] == 0.25 and r["scope"] == "layer"
    lru = {r["trace"]: r["hit_rate"] for r in rows if r["policy"] == "lru"}
    assert lru["olmoe_math"] == pytest.approx(simulate(read_jsonl(OLMOE), "lru", 0.25).hit_rate)


def test_results_are_recorded_in_the_store_for_the_dashboard(tmp_path, capsys):
    from store import queries

    db = tmp_path / "flashmoe.db"
    assert main(["simulate", "--trace", str(OLMOE), "--policy", "lfu", "--capacity", "0.25", "--json",
                 "--db", str(db)]) == 0
    printed = {r["policy"]: r["hit_rate"] for r in json.loads(capsys.readouterr().out)["results"]}
    stored = queries.simulations(db)
    assert {r["policy"]: r["hit_rate"] for r in stored} == pytest.approx(printed)
    assert {(r["trace"], r["capacity"], r["scope"]) for r in stored} == {("olmoe_math", 0.25, "layer")}


def test_a_store_it_cannot_record_to_is_refused_before_the_replay(tmp_path, capsys):
    """It replayed every trace (minutes, with many policies) and only then found the store unreadable."""
    db = tmp_path / "flashmoe.db"
    db.write_bytes(b"not a database" * 100)
    assert main(["simulate", "--trace", str(OLMOE), "--policy", "lfu", "--db", str(db)]) == 2
    out, err = capsys.readouterr()
    assert f"cannot record to {db}" in err and out == ""     # no table: nothing was replayed
    assert db.read_bytes() == b"not a database" * 100


def test_table_reports_the_gap_of_the_means(olmoe):
    results = [simulate(olmoe, p, 0.5, "global") for p in ("lru", "lfu", "belady")]
    table = format_table(results)
    lfu_gap = gap_closed(results[1].hit_rate, results[0].hit_rate, results[2].hit_rate)
    assert table.splitlines()[-1].split() == ["gap", "closed", "0.0%", f"{lfu_gap:.1%}", "100.0%"]
    assert "global scope" in table.splitlines()[0]


def test_a_label_longer_than_a_column_keeps_its_own_column(capsys):
    """`simulate --online`'s "flashmoe online" ran into the column before it: "lruflashmoe online"."""
    assert main(["simulate", "--trace", str(OLMOE), "--policy", "lru", "--online"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()[1:]
    assert re.split(r"\s{2,}", header) == ["trace", "lru", "flashmoe online", "belady"]
    assert {len(row) for row in rows} == {len(header)}   # each number ends under its label


@pytest.mark.parametrize("argv, message", [
    (["--policy", "lru,nope"], "unknown policy nope"),
    (["--capacity", "1.5"], r"fraction of all experts in \(0, 1\]"),
    (["--capacity", "0"], r"fraction of all experts in \(0, 1\]"),
])
def test_cli_errors(capsys, argv, message):
    assert main(["simulate", "--trace", str(OLMOE), *argv]) == 2
    err = capsys.readouterr().err
    assert "flashmoe-cli simulate: error:" in err
    assert re.search(message, err)


def test_a_capacity_below_the_top_k_floor_says_what_the_cache_held(capsys, tmp_path):
    from store import queries

    db = tmp_path / "t.db"
    assert main(["simulate", "--trace", str(OLMOE), "--policy", "lru", "--capacity", "1e-9", "--json",
                 "--db", str(db)]) == 0
    (r, _belady) = json.loads(capsys.readouterr().out)["results"]
    assert (r["capacity"], r["slots"], r["experts"], r["capacity_used"]) == (1e-9, 8 * 16, 64 * 16, 0.125)
    assert {row["capacity"] for row in queries.simulations(db)} == {0.125}  # what the cache held
    assert main(["simulate", "--trace", str(OLMOE), "--policy", "lru", "--capacity", "1e-9"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header == ("olmoe_math: 1e-09 of experts is below one step's top-k per layer; "
                      "raised to 128 of 1024 expert slots (0.125)")
    assert main(["simulate", "--trace", str(OLMOE), "--policy", "lru", "--capacity", "0.25"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("trace")


@pytest.mark.parametrize("argv, message", [
    (["--policy", "lfu-window", "--window", "0"], "--window: must be at least 1, got 0"),  # was the default, silently
    (["--experts", "0"], "--experts: must be at least 1, got 0"),
    (["--experts", "-1"], "--experts: must be at least 1, got -1"),
])
def test_counts_below_one_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--trace", str(OLMOE), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cli_missing_trace_in_a_real_process(tmp_path):
    exe = Path(sys.executable).parent / "flashmoe-cli"
    proc = subprocess.run([str(exe), "simulate", "--trace", str(tmp_path / "gone.jsonl"), "--policy", "lru"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{tmp_path / 'gone.jsonl'}: no such trace file" in proc.stderr
    assert proc.stdout == ""
