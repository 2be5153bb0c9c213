"""bench/common.py (machine facts, results files) and every bench script that uses it, as a real process."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from agent.traces import from_sets
from agents import ROOT, demo_model

sys.path.insert(0, str(ROOT))
from bench import batching, common  # noqa: E402

SCRIPTS = ("batching", "codec", "collector_cost", "dashboard", "decode", "fleet", "loader", "online_agent", "policies",
           "policy_cost", "prefill_gap", "prefill_workers", "prompt_bound", "quant_error", "quant_kernels",
           "quant_scale", "queries", "serve", "warmup")


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_imports_and_parses_its_arguments(script):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script}.py")


@pytest.mark.parametrize(("script", "args", "says"), [
    ("decode", ["--tokens", "0"], "--tokens: must be at least 1, got 0"),
    ("fleet", ["--agents", "3"], "--agents must be more than the 3 of the small fleet"),
    ("warmup", ["--max-tokens", "x"], "expected a whole number, got 'x'"),
    ("serve", ["--rounds", "0"], "--rounds: must be at least 1, got 0"),
    ("scale", ["--threads", "0"], "--threads: must be at least 1, got 0"),
    ("scale", ["--configs", "a2,zz"], "unknown configuration 'zz'; known: a, b, c"),
    ("quant_scale", ["--tokens", "0"], "--tokens: must be at least 1"),
    ("batching", ["--results", "../../x"], "expected a file name"),
    ("batching", ["--batches", "1,a"], "got 'a'"),
    ("quant_kernels", ["--tokens", "1,x"], "got 'x'"),
    ("quant_kernels", ["--threads", "0"], "--threads: must be at least 1"),
    ("quant_error", ["--tokens", "4", "--prefill", "8"], "--prefill 8 is more than --tokens 4"),
    ("policies", ["--results", ""], "expected a file name"),
    ("dense_check", ["--model", "/nonexistent", "--rounds", "2"], "--model must be an expert store"),
    ("dense_check", ["--model", ".", "--rounds", "0"], "--rounds: must be at least 1, got 0")])
def test_a_bad_count_is_one_usage_line_not_a_traceback(script, args, says):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_machine_facts_and_those_of_a_stores_filesystem(tmp_path_factory):
    facts = common.machine()
    assert facts["cores"] >= 1 and facts["ram_bytes"] > 0 and facts["cpu"] and facts["kernel"]
    assert "filesystem" not in facts
    store = common.machine(demo_model(tmp_path_factory))
    assert store.keys() == facts.keys() | {"filesystem", "dio_alignment"}
    assert len(store["filesystem"].split()) == 2        # device and type, as df -T names them
    assert store["dio_alignment"]["memory"] > 0 and store["dio_alignment"]["offset"] > 0


def test_results_go_to_one_json_file_per_benchmark(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    path = common.write_results("codec", {"rows": [1, 2], "machine": {"cores": 2}})
    assert path == tmp_path / "results" / "codec.json"
    assert json.loads(path.read_text()) == {"rows": [1, 2], "machine": {"cores": 2}}
    assert f"wrote {path}" in capsys.readouterr().out


def test_a_batched_step_routes_the_union_of_its_requests_at_their_positions():
    source = from_sets([[[t % 4, 4 + t % 3], [8 + t % 2, 9]] for t in range(20)], n_experts=12)
    trace = batching.batched(source, batch=3, tokens=4, waves=2, seed=1)
    assert (trace.n_tokens, trace.n_layers, trace.session_starts.tolist()) == (8, 2, [0, 4])   # a wave is a session
    starts = np.random.default_rng(1).integers(0, source.n_tokens - 4, 3)          # the first wave's requests
    for step in range(4):
        for layer in range(2):
            want = {e for s in starts for e in source.routed(s + step, layer).tolist()}
            got = trace.routed(step, layer).tolist()
            assert sorted(got) == sorted(want) and len(got) == len(set(got))
