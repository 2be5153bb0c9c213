"""bench/serve.py's statistics over rounds (pure functions on made-up runs) and its command line."""
from __future__ import annotations

import subprocess
import sys

import pytest

from agents import ROOT

sys.path.insert(0, str(ROOT))
from bench.serve import Result, round_ratios, summarize  # noqa: E402


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


def test_help_runs_without_an_agent():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--rounds" in done.stdout and "--admit-window-ms" in done.stdout
