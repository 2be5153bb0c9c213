"""The demo traffic command against a real agent on loopback."""
from __future__ import annotations

import subprocess

import pytest

from agent.experts.layout import EXPERTS, INDEX, Index
from agents import small_demo, spawn, stop
from store import queries
from test_serve import CLI, demo_model, start_agent, wait_for


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = start_agent(demo_model(tmp_path_factory), tmp_path_factory.mktemp("traffic-agent"), "--cache-cap", "50%")
    yield a
    a.stop()


def test_clients_send_the_requested_completions(agent):
    done = subprocess.run([*CLI, "traffic", "--agent-url", agent.url, "--clients", "2", "--requests", "3",
                           "--pause", "0", "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "HTTP Request" not in done.stderr      # httpx's line per request drowned the demo's output
    rows = wait_for(lambda: len(queries.requests(agent.db)) == 6 and queries.requests(agent.db),
                    what="six request rows in the store")
    assert all(1 <= r["completion_tokens"] <= 4 for r in rows)


def test_a_request_the_agent_refuses_stops_the_clients_with_its_answer(agent):
    # more tokens than the model's context: every retry would be refused the same way
    done = subprocess.run([*CLI, "traffic", "--agent-url", agent.url, "--clients", "2", "--max-tokens", "1000000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "the agent refused a request with 4" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_server_error_is_logged_on_one_line_with_the_agents_reason(tmp_path):
    """httpx's message named only the status ("Server error '500 Internal Server Error' for url ..."), on two
    lines with a link to a web page: why the agent failed (here a damaged expert block) was not said."""
    model = small_demo(tmp_path / "damaged")
    index = Index.load(model / INDEX)
    with open(model / EXPERTS, "r+b") as f:   # a byte of every block of the first layer: every request meets one
        for block in (b for b in index.blocks if b.layer == index.blocks[0].layer):
            f.seek(block.offset + 100)
            byte = f.read(1)[0]
            f.seek(block.offset + 100)
            f.write(bytes([byte ^ 0xFF]))
    agent = start_agent(model, tmp_path, "--policy", "lru")
    log = tmp_path / "traffic.log"
    traffic = spawn([*CLI, "traffic", "--agent-url", agent.url, "--clients", "1", "--max-tokens", "2"], log)
    try:
        line = wait_for(lambda: next((x for x in log.read_text().splitlines() if "retrying" in x), None),
                        what="the traffic client's first retry")
    finally:
        stop(traffic)
        agent.stop()
    assert "client 0: the agent answered 500: generation failed:" in line and "CRC32" in line, line
    assert "developer.mozilla.org" not in log.read_text()


def test_a_bad_prompt_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "prompts.json"
    bad.write_text('{"prompts": []}')
    done = subprocess.run([*CLI, "traffic", "--prompts", str(bad), "--requests", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "at least one prompt" in done.stderr


@pytest.mark.parametrize("args, words", [
    (["--pause", "nan"], "--pause a finite number"), (["--pause", "inf"], "--pause a finite number"),
    (["--requests", "-1"], "--requests must be >= 0"), (["--clients", "0"], "--clients: must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens: must be at least 1"), (["--agent-url", "notaurl"], "is not an http://"),
    # httpx.InvalidURL in every client thread (tracebacks, then exit 0), or a port that was retried for ever
    (["--agent-url", "http://[::1"], "--agent-url 'http://[::1' is not an agent's address: it does not parse"),
    (["--agent-url", "http://127.0.0.1:99999"], "(Port out of range 0-65535)"),
])
def test_bad_arguments_are_refused_before_any_request(args, words):
    done = subprocess.run([*CLI, "traffic", "--agent-url", "http://127.0.0.1:9", "--requests", "1", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr


def test_an_address_that_answers_json_of_another_shape_stops_the_clients_in_one_line(json_server):
    """Each client's thread ended in a KeyError traceback on another service's answer, and traffic exited 0."""
    r = subprocess.run(CLI + ["traffic", "--agent-url", json_server, "--clients", "2", "--requests", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert (f"{json_server}/v1/completions is not a FlashMoE agent: it answered POST without `choices`; pass"
            in r.stderr)


def test_an_address_that_floods_its_answer_stops_the_clients_in_one_line(hostile_target):
    """Each client read the answer whole, however large: 64 MiB a request here, gigabytes from a hostile server."""
    url, sent = hostile_target
    r = subprocess.run(CLI + ["traffic", "--agent-url", url, "--clients", "2", "--requests", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{url} is not a FlashMoE agent: it answered with more than 4 MiB" in r.stderr
    assert sent[0] < 32 << 20          # two clients, one answer each cut at 4 MiB (and what the socket held)
