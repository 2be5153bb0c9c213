"""flashmoe-cli generate over a real converted store: O_DIRECT / mmap expert cache, stats, recorded traces."""
from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
from agents import fill
from hf_models import tiny_checkpoint
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)

from agent import generate as generate_module
from agent.cli import main as cli
from agent.experts import cache as cache_module
from agent.experts.layout import INDEX, Index
from agent.experts.provider import InMemoryExperts
from agent.model.generation import generate
from agent.model.loading import load_model
from agent.policies import policy_factory
from agent.residency import Residency
from agent.simulator import SystemReplay, replay
from agent.traces import read_jsonl

PROMPT = "5,17,42,7,99,3,250,11"
N_NEW = 10


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A tiny OLMoE-shaped checkpoint (3 layers, 8 experts, top-2) converted to an expert store."""
    tmp = tmp_path_factory.mktemp("generate")
    ckpt = tiny_checkpoint("olmoe", tmp / "hf", num_hidden_layers=3, eos_token_id=None)
    assert cli(["convert", str(ckpt.path), str(tmp / "store")]) == 0
    return tmp / "store"


@pytest.fixture(scope="module")
def reference(store) -> list[int]:
    """Greedy tokens with every expert in RAM."""
    model = load_model(store, InMemoryExperts(store))
    return generate(model, [int(t) for t in PROMPT.split(",")], N_NEW, greedy=True).token_ids


def slot_cap(store: Path, per_layer: int) -> str:
    index = Index.load(store / INDEX)
    return str(per_layer * index.n_layers * index.slot_bytes)


def run_json(capsys, *args: str) -> dict:
    assert cli(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("backend, per_layer", [("direct", 2), ("mmap", 2), ("direct", 8)])
def test_tokens_do_not_depend_on_cache_size_or_backend(store, reference, capsys, backend, per_layer):
    out = run_json(capsys, "--model", str(store), "--prompt-ids", PROMPT, "--max-new-tokens", str(N_NEW), "--greedy",
                   "--cache-cap", slot_cap(store, per_layer), "--backend", backend)
    assert out["token_ids"] == reference and out["prompt_ids"] == [int(t) for t in PROMPT.split(",")]
    s = out["stats"]
    assert s["hits"] + s["misses"] > 0 and s["hit_rate"] == pytest.approx(s["hits"] / (s["hits"] + s["misses"]))
    assert s["tokens_per_s"] > 0 and 0 <= s["prefetch_accuracy"] <= 1 and s["prefetch_predicted"] > 0
    if backend == "direct":  # every miss and every prefetch is one block read
        assert s["bytes_read"] == (s["misses"] + s["prefetches"]) * Index.load(store / INDEX).nbytes
    if per_layer == 8:  # the whole model fits: only cold misses, at most one per expert
        assert s["misses"] <= 3 * 8


@pytest.mark.parametrize("policy", ["lru", "flashmoe"])
def test_recorded_trace_replays_to_the_same_hits(store, capsys, tmp_path, monkeypatch, policy):
    # the cache feeds its policy a measured read latency at most once a second; at every route here,
    # so the learned policy (which reacts to them) sees many, and the trace must carry them all
    monkeypatch.setattr(cache_module, "SYSTEM_SAMPLE_INTERVAL_S", 0.0)
    trace_path = tmp_path / "run.jsonl"
    out = run_json(capsys, "--model", str(store), "--prompt-ids", PROMPT, "--max-new-tokens", str(N_NEW), "--greedy",
                   "--cache-cap", slot_cap(store, 5), "--policy", policy, "--no-prefetch",
                   "--record-trace", str(trace_path))
    s = out["stats"]
    assert s["prefetches"] == 0 and s["prefetch_accuracy"] is None
    meta = json.loads(trace_path.read_text().splitlines()[0])["meta"]
    assert (meta["layers"], meta["top_k"], meta["n_experts"], meta["prefill"]) == (3, 2, 8, "sequential")
    trace = read_jsonl(trace_path)
    # Sequential prefill: one record per prompt token, then one per decode step; each set is one token's top-k.
    assert trace.n_tokens == meta["steps"] == 8 + N_NEW - 1 and trace.max_set == 2
    assert trace.n_accesses == s["hits"] + s["misses"]
    assert len(trace.system) > trace.n_tokens  # samples from the first read on, one per route
    residency = Residency(s["capacity_slots"], 3, policy_factory(policy), "layer", min_per_layer=2)
    replay(trace, residency, SystemReplay.synthetic())  # the recorded samples, not this series
    assert (sum(x.hits for x in residency.stats), sum(x.misses for x in residency.stats)) == (s["hits"], s["misses"])


def test_batched_prefill_records_the_prompt_union(store, reference, capsys, tmp_path):
    trace_path = tmp_path / "batched.jsonl"
    out = run_json(capsys, "--model", str(store), "--prompt-ids", PROMPT, "--max-new-tokens", str(N_NEW), "--greedy",
                   "--prefill", "batched", "--cache-cap", slot_cap(store, 8), "--no-prefetch",
                   "--record-trace", str(trace_path))
    assert out["token_ids"] == reference
    lines = trace_path.read_text().splitlines()
    assert json.loads(lines[0])["meta"]["prefill"] == "batched" and len(lines) == 1 + N_NEW
    first = json.loads(lines[1])["routed"]
    assert all(2 <= len(first[str(layer)]) <= 8 for layer in range(3))
    assert sum(len(e) for line in lines[1:] for e in json.loads(line)["routed"].values()) == \
        out["stats"]["hits"] + out["stats"]["misses"]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_batched_prefill_larger_than_the_cache_slides_its_window(store, reference, capsys, workers):
    """Two slots a layer for a prompt routing up to eight experts at each: the cache takes the step in a
    window that slides on as the experts are used, on one worker or two, and the tokens are the same."""
    out = run_json(capsys, "--model", str(store), "--prompt-ids", PROMPT, "--max-new-tokens", str(N_NEW), "--greedy",
                   "--prefill", "batched", "--cache-cap", slot_cap(store, 2), "--no-prefetch", "--workers", workers)
    assert out["token_ids"] == reference
    assert out["stats"]["capacity_slots"] < 8 and out["stats"]["misses"] > out["stats"]["capacity_slots"]


def test_text_prompt_goes_through_the_tokenizer(store, capsys):
    out = run_json(capsys, "--model", str(store), "--prompt", "hi", "--max-new-tokens", "2", "--greedy")
    assert out["prompt_ids"] == [104, 105] and len(out["token_ids"]) == 2 and isinstance(out["text"], str)


@pytest.mark.parametrize("args, words", [
    (["--prompt-ids", "5,999"], "outside the vocabulary"),
    (["--prompt-ids", "5", "--policy", "nope"], "unknown policy 'nope'"),
    (["--prompt-ids", "5", "--policy", "belady"], "policy 'belady' needs the future of a whole trace"),  # a TypeError
    (["--prompt", "caf\udce9"], "lone surrogate '\\udce9' at character 3"),   # argv bytes not UTF-8: a TypeError
    (["--prompt-ids", "5", "--cache-cap", "1"], "outside the allowed range"),
    (["--prompt-ids", "5", "--cache-cap", "lots"], "is not understood"),
    (["--prompt-ids", "5", "--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
    (["--prompt-ids", "5", "--max-new-tokens", "1000000000000"], "exceed the model's context of"),
    (["--prompt-ids", "5", "--record-trace", "TMP"], "it is a directory; pass another --record-trace"),
    (["--prompt-ids", "5", "--record-trace", "/proc/never.jsonl"], "cannot write the routing trace /proc/never.jsonl"),
])
def test_bad_input_is_a_clear_error_and_writes_no_trace(store, tmp_path, caplog, args, words):
    args = [a.replace("SMALL", slot_cap(store, 2)).replace("TMP", str(tmp_path)) for a in args]
    trace_path = tmp_path / "never.jsonl"
    assert cli(["generate", "--model", str(store), "--greedy", "--record-trace", str(trace_path), *args]) == 2
    assert words in caplog.text
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("content", [b"SQLite format 3\0" + bytes(100), b'{"step": 0}\n', b"\xff\xfe"])
def test_a_trace_file_that_holds_something_else_is_left_as_it_is(store, tmp_path, caplog, content):
    """--record-trace MODEL/experts.bin destroyed the store, --record-trace data/flashmoe.db the SQLite store."""
    taken = tmp_path / "flashmoe.db"
    taken.write_bytes(content)
    assert cli(["generate", "--model", str(store), "--greedy", "--prompt-ids", "5", "--record-trace", str(taken)]) == 2
    assert f"--record-trace {taken} exists and holds something other than the routing trace" in caplog.text
    assert taken.read_bytes() == content and sorted(p.name for p in tmp_path.iterdir()) == ["flashmoe.db"]


def test_a_routing_trace_is_recorded_over_an_earlier_one(store, tmp_path, caplog):
    trace = tmp_path / "run.jsonl"
    for tokens in ("2", "3"):
        assert cli(["generate", "--model", str(store), "--greedy", "--prompt-ids", "5", "--max-new-tokens", tokens,
                    "--record-trace", str(trace)]) == 0
    assert read_jsonl(trace).n_tokens == 3


def test_a_full_disk_keeps_the_generated_text_and_says_its_trace_is_not_written(store, tmpfs, capsys, caplog):
    """The trace's size is known only at the end: the generation was lost with it, without a word of it."""
    disk = tmpfs("1m")
    fill(disk)
    trace = disk / "trace.jsonl"
    assert cli(["generate", "--model", str(store), "--greedy", "--prompt-ids", "5,6", "--max-new-tokens", "4",
                "--json", "--record-trace", str(trace)]) == 2
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
    assert (f"cannot write the routing trace {trace}: No space left on device; pass another --record-trace; "
            "the generation above ran, its trace was not written") in caplog.text
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_missing_model_dir_is_named(tmp_path, caplog):
    assert cli(["generate", "--model", str(tmp_path / "absent"), "--prompt-ids", "1"]) == 2
    assert f"--model {tmp_path / 'absent'} is not a directory" in caplog.text


def test_unparseable_prompt_ids_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli(["generate", "--model", "x", "--prompt-ids", "1,two"])
    assert "give integers separated by commas" in capsys.readouterr().err


def test_console_script_prints_one_json_object(store, reference):
    exe = Path(sys.executable).with_name("flashmoe-cli")
    proc = subprocess.run([str(exe), "generate", "--model", str(store), "--prompt-ids", PROMPT, "--max-new-tokens",
                           str(N_NEW), "--greedy", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == reference
    assert {"hit_rate", "hits", "misses", "bytes_read", "tokens_per_s", "prefetch_accuracy"} <= out["stats"].keys()


def test_a_finished_run_lets_go_of_its_cache_and_store_without_waiting_for_the_garbage_collector(store, monkeypatch):
    """No reference cycle through the model (its lookahead held its blocks' bound methods, which lead
    back to it), so an mmap store's mapping is released when the run returns. The first model built in
    a process is left out: torch's first meta-device init imports torch._dynamo, whose import keeps
    its frames, and with them their callers', in a cycle of its own."""
    caches = []

    class Watched(cache_module.ExpertCache):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            caches.append(weakref.ref(self))

    monkeypatch.setattr(generate_module, "ExpertCache", Watched)
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            generate_module.run_generate(store, prompt_ids=[5, 17, 42], max_new_tokens=2, backend="mmap")
        assert caches[-1]() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("args, words", [
    (["--threads", "0"], "--threads: a thread count is 1 to 256, got 0"),
    (["--threads", "100000"], "--threads: a thread count is 1 to 256, got 100000"),
    (["--seed", "-1"], "--seed: a seed is 0 to"), (["--seed", "1" + "0" * 30], "--seed: a seed is 0 to"),
])
def test_bad_numbers_are_usage_errors_naming_their_flag(store, capsys, args, words):
    with pytest.raises(SystemExit) as exit_:
        cli(["generate", "--model", str(store), "--prompt-ids", "5", *args])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_a_config_that_is_not_a_json_object_is_named(store, tmp_path, caplog):
    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    (damaged / "config.json").write_text("[1, 2]")
    assert cli(["generate", "--model", str(damaged), "--prompt-ids", "5"]) == 2
    assert f"{damaged / 'config.json'}: cannot read num_experts_per_tok" in caplog.text


def test_a_truncated_store_is_one_error_line(store, tmp_path, caplog):
    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    experts = damaged / "experts.bin"
    os.truncate(experts, experts.stat().st_size // 3)
    assert cli(["generate", "--model", str(damaged), "--prompt-ids", "5", "--max-new-tokens", "4"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and f"expert blocks are missing from the end of {experts}" in errors[0]
