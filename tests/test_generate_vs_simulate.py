"""The runtime and the simulator agree: `generate --record-trace --no-prefetch` on the small demo
model, then `simulate` of that trace under the same policy, capacity and scope, give the same hits.

Both run the same Residency and policy objects, so any disagreement means the recorded trace or
the replay order differs from what the runtime's cache saw. Real processes, real expert store.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.experts.layout import INDEX, Index
from agent.traces import read_jsonl

CLI = str(Path(sys.executable).parent / "flashmoe-cli")


def cli(*args: str) -> str:
    proc = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"flashmoe-cli {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "small"
    cli("init-demo", "--size", "small", "--out", str(out))
    return out


@pytest.mark.parametrize("policy, scope", [("lru", "layer"), ("arc", "global"), ("lfu-window", "layer")])
def test_generate_and_simulate_report_the_same_hits(demo, tmp_path, policy, scope):
    index = Index.load(demo / INDEX)
    per_layer = max(2, index.n_experts // 4)  # well below the experts a layer routes over the run
    slots = per_layer * index.n_layers
    trace = tmp_path / "run.jsonl"
    generated = json.loads(cli(
        "generate", "--model", str(demo), "--prompt-ids", ",".join(str(i) for i in range(3, 19)),
        "--max-new-tokens", "24", "--greedy", "--cache-cap", str(slots * index.slot_bytes),
        "--policy", policy, "--scope", scope, "--no-prefetch", "--record-trace", str(trace), "--json"))["stats"]
    assert generated["capacity_slots"] == slots
    recorded = read_jsonl(trace)
    assert recorded.n_tokens == generated["steps"]

    simulated = json.loads(cli("simulate", "--trace", str(trace), "--policy", policy,
                               "--capacity", repr(per_layer / index.n_experts), "--scope", scope, "--json"))
    row = next(r for r in simulated["results"] if r["policy"] == policy)
    assert row["slots"] == slots
    assert generated["misses"] > 0 and generated["hits"] > 0, "the run must exercise evictions"
    assert (row["hits"], row["accesses"]) == (generated["hits"], generated["hits"] + generated["misses"])
    assert row["hit_rate"] == pytest.approx(generated["hit_rate"])
