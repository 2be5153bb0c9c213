"""bench/serve.py's statistics over rounds (pure functions on made-up runs) and its command line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents import ROOT, agents_serving, kill_agents_serving, small_demo

sys.path.insert(0, str(ROOT))
from bench.serve import WARM_UP, Result, disk_neighbour, results_json, round_ratios, summarize, table  # noqa: E402


def run(config: str, round_: int, latencies: list[float], wall_s: float = 10.0, gb: float = 1.0) -> Result:
    return Result(config, round_, len(latencies), 100, wall_s, latencies, 0.5, int(gb * 1e9), 20, 2**30, None)


def test_summary_is_the_median_and_range_over_rounds_and_pools_the_requests():
    runs = [run("a: x", 0, [1.0, 2.0]), run("a: x", 1, [3.0, 9.0], gb=3.0), run("a: x", 2, [2.0, 4.0], gb=2.0)]
    s = summarize(runs)["a: x"]
    assert s["rounds"] == 3
    assert s["p50_s"] == {"median": 3.0, "min": 1.5, "max": 6.0}
    assert s["gb_read"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert s["pooled"]["p50_s"] == pytest.approx(2.5)  # of all six requests, not a median of medians


def test_ratios_pair_configurations_within_a_round():
    runs = [run("a: x", 0, [1.0]), run("b: y", 0, [2.0]), run("c: z", 0, [4.0]),
            run("a: x", 1, [3.0], wall_s=5.0), run("b: y", 1, [3.0]), run("c: z", 1, [6.0]),
            run("a: x", 2, [1.0]), run("c: z", 2, [10.0])]  # round 2 lost (b): it has no ratios
    r = round_ratios(runs)
    assert r["p99_a_over_c"]["per_round"] == [0.25, 0.5]
    assert r["p99_a_over_b"] == {"median": 0.75, "min": 0.5, "max": 1.0, "per_round": [0.5, 1.0]}
    assert r["tokens_per_s_a_over_b"]["per_round"] == [1.0, 2.0]
    assert "p99_a_over_C" not in r                          # no round ran on a --reference store


def test_runs_on_the_reference_store_are_more_ratios_when_every_round_ran_them():
    runs = [run("a: x", n, [1.0]) for n in (0, 1)] + [run("b: y", n, [2.0]) for n in (0, 1)] + \
           [run("c: z", n, [4.0]) for n in (0, 1)] + [run("C: z, --reference", 0, [5.0]),
                                                      run("C: z, --reference", 1, [2.0]),
                                                      run("A: x, --reference", 0, [4.0])]
    r = round_ratios(runs)
    assert r["p99_a_over_C"]["per_round"] == [0.2, 0.5]
    assert "p99_a_over_A" not in r                          # A lost in one round: no median of one kind


def test_the_every_core_configurations_are_paired_with_each_other_and_with_mmap():
    runs = [run("p: x", n, [1.0]) for n in (0, 1)] + [run("q: y", n, [2.0 + n]) for n in (0, 1)] + \
           [run("c: z", n, [4.0]) for n in (0, 1)]
    r = round_ratios(runs)
    assert r["p99_p_over_q"]["per_round"] == [0.5, pytest.approx(1 / 3)] and r["p99_p_over_c"]["median"] == 0.25
    assert not any(k.startswith(("p99_a", "tokens")) for k in r)  # no (a), no (b): none of theirs


def test_the_warm_up_run_is_kept_apart_from_the_rounds_in_the_json():
    steps = [{"prompt_tokens": 40, "tokens": 40, "wall_s": 2.0, "io_busy_s": 1.0, "bytes_read": 10**9, "reads": 9,
              "read_s": 1.5, "phases_s": {"experts": 1.0}}]
    warm = run("b: y", WARM_UP, [30.0, 90.0])
    warm.steps = steps
    runs = [run("b: y", 0, [2.0]), run("a: x", 0, [1.0]), run("c: z", 0, [4.0])]
    got = results_json(runs, warm, [], [{"raw_mb_s": 500.0}])
    assert got["warm_up"]["measured"] is False and got["warm_up"]["p99_s"] == pytest.approx(89.4)
    assert got["warm_up"]["round"] == WARM_UP and got["warm_up"]["profile"]["admission"]["io_bound_s"] is None
    assert got["summary"]["b: y"]["rounds"] == 1 and got["summary"]["b: y"]["p99_s"]["max"] == 2.0  # not 90 s
    assert [r["round"] for r in got["runs"]] == [0, 0, 0] and got["ratios"]["p99_a_over_c"]["median"] == 0.25
    assert "b: y" in table(got["summary"]).splitlines()[2]
    assert results_json(runs, None, [], [])["warm_up"] is None


@pytest.mark.parametrize("argv,words", [
    (["--configs", "a,C"], "configs A,B,C and --reference go together"),
    (["--configs", "a,r"], "give letters among a,b,c,g,p,q,w,x and A,B,C,G,P,Q,W,X")])
def test_configs_on_a_reference_store_need_one(argv, words):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr


def test_help_runs_without_an_agent():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--rounds" in done.stdout and "--admit-window-ms" in done.stdout


def test_sigterm_stops_the_agent_it_started_and_removes_its_cgroup(tmp_path):
    model = small_demo(tmp_path / "demo")
    bench = subprocess.Popen([sys.executable, str(ROOT / "bench" / "serve.py"), "--model", str(model), "--rounds", "1",
                              "--configs", "b"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cgroup_line = bench.stdout.readline()      # the memory limit it set up (or why it could not)
        assert "warm-up, not measured: b: lru" in bench.stdout.readline()
        deadline = time.monotonic() + 60
        while not agents_serving(model) and time.monotonic() < deadline:  # it starts the agent just after; polled
            time.sleep(0.001)            # tightly, the signal often lands as the agent starts (Popen still returning)
        assert agents_serving(model), "the bench started no agent"
        bench.send_signal(signal.SIGTERM)
        output = bench.communicate(timeout=180)[0]
        assert bench.returncode != 0 and not agents_serving(model), (agents_serving(model), bench.pid, output)
        if " at /" in cgroup_line:
            assert not Path(cgroup_line.rsplit(" at ", 1)[1].strip()).exists()
    finally:                                     # a failure leaves neither the bench nor its agent running
        stop_all(bench, model)


def stop_all(bench: subprocess.Popen, model: Path) -> None:
    kill_agents_serving(model)
    bench.kill()
    bench.wait()


def test_sigterm_while_the_clients_wait_ends_the_run_at_once(tmp_path):
    """It waited for every client's answers (up to the whole run) before stopping the agent."""
    model = small_demo(tmp_path / "demo")
    log = ROOT / "bench" / "results" / "serve-logs" / "b-lru-direct-round0.log"
    log.unlink(missing_ok=True)
    bench = subprocess.Popen([sys.executable, str(ROOT / "bench" / "serve.py"), "--model", str(model), "--rounds", "1",
                              "--configs", "b", "--no-warm-up", "--requests-per-client", "400"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and "POST /v1/completions" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)                      # until the first answer: the clients are driving
        assert bench.poll() is None and "POST /v1/completions" in log.read_text()
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) != 0, "6400 requests would take many minutes"
        assert not agents_serving(model), (agents_serving(model), bench.pid)
        assert log.read_text().count("POST /v1/completions") < 6400
    finally:
        stop_all(bench, model)


def test_a_disk_neighbour_that_stopped_fails_the_run_and_one_that_ran_is_stopped(tmp_path):
    """Its dd failing (the file gone, a filesystem without O_DIRECT) ended the neighbour's loop at once, and the
    run was measured and written as one beside a neighbour."""
    path = tmp_path / "neighbour.bin"
    path.write_bytes(os.urandom(1 << 20))
    with disk_neighbour(path) as proc:
        assert proc.poll() is None                     # reading
    assert proc.returncode == -signal.SIGTERM          # stopped at the block's end
    with pytest.raises(SystemExit, match=f"the disk neighbour stopped during the run: dd could not read {path}"):
        with disk_neighbour(path) as proc:
            path.unlink()
            proc.wait(60)                              # its next dd finds no file
    with disk_neighbour(None) as proc:
        assert proc is None


def test_a_neighbour_file_is_a_big_file_outside_the_runs_stores(tmp_path):
    """A tiny file made the neighbour a loop of dd starts on the CPU, and a store's own file warmed the agent."""
    from bench.serve import NEIGHBOUR_MIN_BYTES, neighbour_refused
    store, small, big = tmp_path / "store", tmp_path / "small.bin", tmp_path / "big.bin"
    store.mkdir()
    small.write_bytes(b"x" * 4096)
    for path in (big, store / "experts.bin"):
        with open(path, "wb") as f:
            f.truncate(NEIGHBOUR_MIN_BYTES)
    assert neighbour_refused(tmp_path / "missing", (store,)) == "not a file"
    assert "at least 256 MiB" in neighbour_refused(small, (store,))
    assert "a store this run serves" in neighbour_refused(store / "experts.bin", (store,))
    assert neighbour_refused(big, (store,)) is None
