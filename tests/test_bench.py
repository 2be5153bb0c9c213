"""bench/common.py (machine facts, results files) and every bench script that uses it, as a real process."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agents import ROOT, demo_model

sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

SCRIPTS = ("codec", "collector_cost", "dashboard", "decode", "loader", "online_agent", "policies", "policy_cost",
           "prompt_bound", "quant_error", "quant_kernels", "quant_scale", "queries", "serve", "warmup")


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_imports_and_parses_its_arguments(script):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script}.py")


@pytest.mark.parametrize(("script", "args", "says"), [("decode", ["--tokens", "0"], "--tokens: must be at least 1, got 0"),
                                                      ("warmup", ["--max-tokens", "x"], "expected a whole number, got 'x'")])
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
