"""Warm-up: the prompt file, the hot set, and preloading into a running agent."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from agent.warmup import WarmupError, hot_set, load_prompts
from test_serve import CLI, demo_model, start_agent

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "benchmark_input.json"


def test_the_shipped_example_is_valid():
    prompts = load_prompts(EXAMPLE)
    assert len(prompts.prompts) >= 4 and prompts.max_tokens >= 1


@pytest.mark.parametrize("content, words", [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ('{"prompts": []}', "at least one prompt"),
    ('{"prompts": ["ok", 3]}', "prompts[1]"),
    ('{"prompts": [[1, "a"]]}', "prompts[0]"),
    ('{"prompts": ["ok"], "max_tokens": 0}', "max_tokens"),
    (b"\xa5\x00SQLite", "is not a text file (not UTF-8)"),       # a traceback before
    ("DIRECTORY", "prompts.json: Is a directory"),                # a traceback before
])
def test_bad_prompt_files_say_what_is_wrong(tmp_path, content, words):
    path = tmp_path / "prompts.json"
    if content == "DIRECTORY":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(WarmupError) as raised:
        load_prompts(path)
    assert words in str(raised.value)


def test_hot_set_takes_the_most_routed_experts_of_each_layer():
    counts = Counter({(0, 5): 9, (0, 2): 9, (0, 7): 1, (0, 1): 4, (1, 3): 2, (1, 0): 8})
    assert hot_set(counts, n_layers=2, per_layer=2) == [(0, 2), (0, 5), (1, 0), (1, 3)]  # ties by expert id
    assert hot_set(counts, n_layers=3, per_layer=1) == [(0, 2), (1, 0)]  # a layer never routed adds nothing


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_model(tmp_path_factory)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """A short file in the example's format, so the test stays quick."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps({"prompts": ["Warm the cache, please.", [72, 101, 121]], "max_tokens": 4}))
    return path


def test_report_only_with_a_model_directory(model, prompts):
    r = subprocess.run([*CLI, "warmup", str(prompts), "--model", str(model), "--per-layer", "8", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["per_layer"] == 8 and len(report["experts"]) == 16
    assert {layer for layer, _ in report["experts"]} == {0, 1}
    assert len({tuple(k) for k in report["experts"]}) == 16 and all(0 <= e < 64 for _, e in report["experts"])
    assert 0 < report["covered"] <= report["routed"] and 0 < report["tokens"] <= 8 and report["prompts"] == 2
    assert "preloaded" not in report


def test_preloads_the_hot_set_into_a_running_agent(model, prompts, tmp_path):
    agent = start_agent(model, tmp_path, "--cache-cap", "25%")
    try:
        capacity = agent.get("/v1/status").json()["cache"]["capacity_experts"]
        r = subprocess.run([*CLI, "--warmup", str(prompts), "--agent-url", agent.url, "--json"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert len(report["experts"]) == capacity and report["per_layer"] == capacity // 2
        assert report["preloaded"] == capacity  # a fresh cache: every hot expert was read in
        assert agent.get("/v1/status").json()["cache"]["resident_experts"] == capacity
    finally:
        agent.stop()


def test_the_token_is_taken_as_serve_takes_it_and_on_the_command_line_with_a_warning(model, prompts, tmp_path):
    """warmup --token showed the token in `ps` without a word, and took it no other way than FLASHMOE_TOKEN."""
    token = "warmup-token-of-sixteen"
    agent = start_agent(model, tmp_path, env={"FLASHMOE_TOKEN": token})
    env = {k: v for k, v in os.environ.items() if k != "FLASHMOE_TOKEN"}
    private, shared = tmp_path / "token", tmp_path / "shared-token"
    private.write_text(token + "\n")
    private.chmod(0o600)
    shared.write_text(token)
    shared.chmod(0o644)

    def warmup(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, "warmup", str(prompts), "--agent-url", agent.url, "--per-layer", "1", *args],
                              capture_output=True, text=True, timeout=300, env=env)
    try:
        by_flag, by_file, by_shared_file = warmup("--token", token), warmup("--token-file", str(private)), \
            warmup("--token-file", str(shared))
        unreadable = warmup("--token-file", str(tmp_path / "absent"))
        without = warmup()
    finally:
        agent.stop()
    assert by_flag.returncode == by_file.returncode == by_shared_file.returncode == 0, by_flag.stderr + by_file.stderr
    assert "every user of this box can read in `ps`; set FLASHMOE_TOKEN or pass --token-file" in by_flag.stderr
    assert "WARNING" not in by_file.stderr
    assert f"--token-file {shared} is readable by other users" in by_shared_file.stderr
    assert unreadable.returncode == 2 and unreadable.stderr.splitlines()[-1].endswith(
        f"cannot read --token-file {tmp_path / 'absent'}: No such file or directory; give a file holding the token "
        f"on its first line"), unreadable.stderr
    assert token not in by_flag.stderr + by_file.stderr + by_shared_file.stderr + unreadable.stderr
    # the agent's reason, whole: it was the raw JSON body cut at 300 characters, the reason twice and its end lost
    assert without.returncode == 2 and without.stderr.splitlines()[-1].endswith(
        "/v1/cache/preload with 401: this control call needs the agent's token: send 'Authorization: Bearer <token>' "
        "(the one the agent was started with: FLASHMOE_TOKEN, --token-file or --token)"), without.stderr


def test_an_absent_agent_is_a_clear_error():
    r = subprocess.run([*CLI, "warmup", str(EXAMPLE), "--agent-url", "http://127.0.0.1:9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "did not answer" in r.stderr and "--model" in r.stderr


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:abc", "http://"])
def test_an_agent_url_that_is_no_address_is_one_line(url):
    """httpx raised InvalidURL, which is no transport error: a traceback."""
    r = subprocess.run([*CLI, "warmup", str(EXAMPLE), "--agent-url", url], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "is not an agent's address" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("server, answered", [
    ("html_server", "with something other than JSON (text/html)"),   # the dashboard's port: a JSONDecodeError
    ("json_server", "without `model`"),   # another service's JSON (round 8): a KeyError traceback
])
def test_an_address_that_is_not_the_agent_is_a_clear_error(request, server, answered):
    """An address that answers what no agent does ended warm-up in a traceback."""
    url = request.getfixturevalue(server)
    r = subprocess.run([*CLI, "warmup", str(EXAMPLE), "--agent-url", url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{url}/v1/status is not a FlashMoE agent: it answered GET {answered}; pass the agent's address as " \
           "--agent-url" in r.stderr


def test_an_answer_that_drips_or_floods_is_cut_off_in_time_and_size(hostile_target, monkeypatch):
    """httpx's timeout is per read: an agent address answering a byte every 0.1 s kept warm-up waiting for ever, and
    one answering gigabytes was read whole."""
    from agent import warmup

    url, sent = hostile_target
    monkeypatch.setattr(warmup, "AGENT_TIMEOUT_S", 1.0)
    with pytest.raises(WarmupError, match=f"the agent at {url}/v1/status did not answer GET whole within 1 s"):
        warmup.agent_status(url)
    with pytest.raises(WarmupError, match=f"{url}/v1/cache/preload is not a FlashMoE agent: it answered POST with "
                                          "more than 4 MiB"):
        warmup.preload(url, [(0, 0)], None)
    assert sent[0] < 16 << 20          # the rest was never asked for


@pytest.mark.parametrize("damage, words", [
    (lambda d: shutil.rmtree(d), "does not exist, so"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json holds a JSON list"),
])
def test_a_model_that_is_not_a_store_is_one_line(model, prompts, tmp_path, damage, words):
    damaged = tmp_path / "model"
    shutil.copytree(model, damaged)
    damage(damaged)
    r = subprocess.run([*CLI, "warmup", str(prompts), "--model", str(damaged)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and f"cannot find the hot experts of {damaged}" in r.stderr and words in r.stderr
    assert "Traceback" not in r.stderr
