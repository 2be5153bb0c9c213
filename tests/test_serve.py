"""The agent as a real process on loopback: completions, batching, knobs, preload, metrics, store, restart."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from fastapi import HTTPException
from prometheus_client.parser import text_string_to_metric_families

from access.loopback import addressed_to_loopback
from agent.policies import DEFAULT_POLICY
from agent.serve.app import _positions, _prompt_ids
from agent.serve.requests import CompletionRequest
from agents import CLI, demo_model, fill, free_port, spawn, start_agent, stop, wait_for
from store import queries
from store.db import Store


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_model(tmp_path_factory)


@pytest.fixture(scope="module")
def agent(model, tmp_path_factory):
    a = start_agent(model, tmp_path_factory.mktemp("agent"), "--cache-cap", "25%", "--max-batch-size", "8")
    yield a
    a.stop()


def test_models_status_and_openapi(agent, model):
    assert agent.get("/v1/models").json()["data"][0]["id"] == model.name
    status = agent.get("/v1/status").json()
    assert status["model"] == str(model) and status["policy"] == DEFAULT_POLICY and status["backend"] == "direct"
    assert status["cache"]["capacity_experts"] > 0 and 0 <= status["cache"]["occupancy"] <= 1
    assert status["batch_limit"] == 8 and status["uptime_s"] > 0
    paths = agent.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/knobs", "/v1/status", "/v1/models", "/v1/cache/preload", "/metrics"} <= set(paths)
    assert int(agent.pid_file.read_text()) == agent.proc.pid
    assert "Warning" not in agent.log.read_text()       # e.g. FastAPI's duplicate operation id for GET+HEAD /metrics


def test_a_completion_for_another_model_is_404_model_not_found_naming_the_served_one(agent, model):
    """OpenAI's answer to an unknown model; the agent gave the demo's answer to "gpt-4"."""
    for stream in (False, True):
        r = httpx.post(agent.url + "/v1/completions", timeout=60,
                       json={"model": "gpt-4", "prompt": "Hello", "max_tokens": 2, "stream": stream})
        error = r.json()["error"]
        assert r.status_code == 404 and (error["code"], error["param"]) == ("model_not_found", "model")
        assert "'gpt-4' is not served here" in error["message"] and repr(model.name) in error["message"]
    named = agent.complete(model=model.name, prompt="Hello", max_tokens=2, temperature=0)
    unnamed = agent.complete(prompt="Hello", max_tokens=2, temperature=0)       # left out: the served model
    assert named["model"] == unnamed["model"] == model.name and named["choices"] == unnamed["choices"]
    field = agent.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert field["anyOf"] == [{"type": "string", "enum": [model.name]}, {"type": "null"}]     # what clients draw from
    huge = httpx.post(agent.url + "/v1/completions", timeout=60, json={"model": "m" * 100_000, "prompt": "Hello"})
    assert huge.status_code == 404 and len(huge.content) < 1000   # the name is quoted shortened, not echoed whole


def test_status_lists_as_many_step_profiles_as_asked(agent):
    agent.complete(prompt="a few model steps", max_tokens=4, temperature=0)
    every = agent.get("/v1/status").json()["step_profiles"]         # the default: all kept (bench/serve.py)
    assert len(every) >= 4
    assert agent.get("/v1/status?step_profiles=0").json()["step_profiles"] == []
    last_two = agent.get("/v1/status?step_profiles=2").json()["step_profiles"]
    assert last_two == every[-2:]                                    # the most recent (no step ran since)
    for bad in ("-1", "257", "two", "1.5"):
        r = httpx.get(agent.url + "/v1/status", params={"step_profiles": bad}, timeout=30)
        assert r.status_code == 422 and "step_profiles" in r.json()["error"]["message"], (bad, r.text)


def test_completion_by_text_and_by_token_ids(agent):
    by_text = agent.complete(prompt="Hello, edge box", max_tokens=6, temperature=0)
    assert by_text["object"] == "text_completion" and by_text["choices"][0]["finish_reason"] in ("length", "stop")
    usage = by_text["usage"]
    assert usage["prompt_tokens"] == len("Hello, edge box".encode()) and 1 <= usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = agent.complete(prompt=list("Hello, edge box".encode()), max_tokens=6, temperature=0)
    assert again["choices"][0]["text"] == by_text["choices"][0]["text"]  # greedy: same ids, same text
    stats = again["flashmoe"]
    assert stats["expert_hits"] + stats["expert_misses"] > 0 and stats["latency_s"] >= stats["ttft_s"] > 0


@pytest.mark.parametrize("body, words", [
    ({"prompt": "", "max_tokens": 4}, "prompt is empty"),
    ({"prompt": [1, 10**7], "max_tokens": 4}, "outside the vocabulary"),
    ({"prompt": "x", "max_tokens": 10**6}, "exceeds the model's context"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
])
def test_bad_completion_requests_are_refused_with_the_reason(agent, body, words):
    r = httpx.post(agent.url + "/v1/completions", json=body, timeout=30)
    assert 400 <= r.status_code < 500 and words in r.text


@pytest.mark.parametrize("context, kv_budget, named", [
    (4096, 400, "this agent's KV budget of 400 positions (serve --kv-budget)"),
    (300, 4096, "the model's context of 300 tokens"),
    (400, 400, "the model's context of 400 tokens"),
])
def test_a_prompt_past_both_limits_is_refused_naming_the_smaller(context, kv_budget, named):
    """One check against the smaller limit: past both, the context was named even where the KV budget was the
    one a shorter request would still have hit."""
    body = CompletionRequest(prompt=[1, 2, 3], max_tokens=5000)
    with pytest.raises(HTTPException) as refused:
        _prompt_ids(body, None, 10, _positions(context, kv_budget))
    assert refused.value.detail == f"prompt (3 tokens) + max_tokens (5000) exceeds {named}; shorten one of them"


def test_concurrent_requests_share_model_steps(agent):
    before = agent.get("/v1/status").json()
    prompts = [f"request number {i} asks something" for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: agent.complete(prompt=p, max_tokens=8, temperature=0.7), prompts))
    after = agent.get("/v1/status").json()
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    steps = after["model_steps"] - before["model_steps"]
    assert after["tokens_generated"] - before["tokens_generated"] == tokens
    assert steps < tokens  # one step at a time would take exactly `tokens` steps


def test_knobs_validate_all_or_nothing_apply_live_and_record_the_source(agent):
    knobs = agent.get("/v1/knobs").json()
    cap = knobs["cache_cap_bytes"]
    assert cap["min"] <= cap["value"] <= cap["max"] and knobs["recompute_threshold"]["value"] == 0.0
    bad = httpx.put(agent.url + "/v1/knobs", json={"max_batch_size": 4, "recompute_threshold": 1.7}, timeout=30)
    assert bad.status_code == 400 and "recompute_threshold" in bad.text and "between 0 and 1" in bad.text
    assert agent.get("/v1/knobs").json() == knobs  # the good knob in the bad request changed nothing
    new_cap = cap["min"] * 3
    ok = httpx.put(agent.url + "/v1/knobs", json={"cache_cap_bytes": new_cap, "policy": "lfu", "max_batch_size": 4},
                   headers={"X-FlashMoE-Source": "dashboard"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["policy"]["value"] == "lfu"
    status = agent.get("/v1/status").json()
    assert status["cache"]["cap_bytes"] == new_cap and status["policy"] == "lfu" and status["batch_limit"] <= 4
    assert status["cache"]["resident_experts"] <= status["cache"]["capacity_experts"]
    history = {(h["knob"], h["new"], h["source"]) for h in queries.knob_history(agent.db)}
    assert {("cache_cap_bytes", new_cap, "dashboard"), ("policy", "lfu", "dashboard"),
            ("max_batch_size", 4, "dashboard")} <= history
    spoofed = httpx.put(agent.url + "/v1/knobs", json={"prefetch": False}, headers={"X-FlashMoE-Source": "guard"})
    assert spoofed.status_code == 400 and "X-FlashMoE-Source" in spoofed.text


def test_prefetch_is_adaptive_by_default_and_its_knobs_set_its_mode(agent):
    assert agent.get("/v1/status").json()["cache"]["prefetch"]["mode"] == "auto"
    for change, mode in (({"prefetch_adaptive": False}, "on"), ({"prefetch": False}, "off"),
                         ({"prefetch": True, "prefetch_adaptive": True}, "auto")):
        assert httpx.put(agent.url + "/v1/knobs", json=change, timeout=30).status_code == 200
        gate = agent.get("/v1/status").json()["cache"]["prefetch"]
        assert gate["mode"] == mode and set(gate) == {"mode", "issuing", "accuracy", "scored", "break_even"}


@pytest.mark.parametrize("flags, mode", [(("--prefetch", "on"), "on"), (("--no-prefetch",), "off")])
def test_serve_prefetch_flags_set_the_mode_as_generates_do(model, tmp_path, flags, mode):
    agent = start_agent(model, tmp_path, *flags)
    try:
        assert agent.get("/v1/status").json()["cache"]["prefetch"]["mode"] == mode
    finally:
        stop(agent.proc)


def test_the_cap_goes_down_to_its_minimum_between_batched_steps(agent):
    # a batched step routes more experts per layer than the minimum cap holds; once it is over none
    # of them is in use, so the cap may go down to the minimum
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: agent.complete(prompt=f"client {i} asks about caches", max_tokens=2), range(8)))
    cap = agent.get("/v1/knobs").json()["cache_cap_bytes"]
    r = httpx.put(agent.url + "/v1/knobs", json={"cache_cap_bytes": cap["min"]}, timeout=30)
    assert r.status_code == 200, r.text
    status = agent.get("/v1/status").json()["cache"]
    assert status["cap_bytes"] == cap["min"] and status["resident_experts"] <= status["capacity_experts"]
    agent.complete(prompt="still serving", max_tokens=2)
    assert httpx.put(agent.url + "/v1/knobs", json={"cache_cap_bytes": cap["value"]}, timeout=30).status_code == 200


def test_preload_brings_experts_in_and_refuses_unknown_ones(agent):
    r = httpx.post(agent.url + "/v1/cache/preload", json={"experts": [[0, 0], [0, 1], [1, 0]]}, timeout=60)
    assert r.status_code == 200 and r.json()["requested"] == 3
    bad = httpx.post(agent.url + "/v1/cache/preload", json={"experts": [[0, 10**6]]}, timeout=30)
    assert bad.status_code == 400 and "does not exist" in bad.text


def unlabelled_samples(text: str) -> dict[str, float]:
    """The /metrics samples without labels of their own (every sample carries device_name)."""
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if set(s.labels) == {"device_name"}}


@pytest.mark.parametrize("path", ["/metrics", "/v1/status", "/v1/knobs", "/v1/models"])
def test_head_answers_as_get_without_a_body(agent, path):
    """curl -I and uptime checks send HEAD; the routes took GET only (405), /metrics aside."""
    head = httpx.head(agent.url + path, timeout=30)
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
    assert head.headers["content-type"] == agent.get(path).headers["content-type"]


@pytest.mark.parametrize("method, path, allow", [("DELETE", "/v1/knobs", "GET, HEAD, PUT"),
                                                 ("PUT", "/v1/status", "GET, HEAD"),
                                                 ("GET", "/v1/completions", "POST")])
def test_a_method_a_path_does_not_take_is_405_naming_every_one_it_does(agent, method, path, allow):
    """Starlette's Allow named the first route's methods alone: GET for /v1/knobs, which takes PUT too."""
    r = httpx.request(method, agent.url + path, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == allow and r.json()["error"]["message"]


def test_metrics_and_store_get_the_same_counts(agent):
    agent.complete(prompt="count me", max_tokens=4)
    def exported():
        text = agent.get("/metrics").text
        return text if unlabelled_samples(text)["flashmoe_requests_total"] >= 1 else None
    text = wait_for(exported, what="metrics")
    for name in ("flashmoe_expert_cache_misses_total", "flashmoe_expert_read_bytes_total",
                 "flashmoe_expert_read_latency_seconds_bucket", "flashmoe_request_ttft_seconds_bucket",
                 "flashmoe_request_tpot_seconds_bucket", "flashmoe_batch_size", "flashmoe_cache_bytes",
                 "flashmoe_prefetch_issuing", "flashmoe_prefetch_break_even"):
        assert name in text
    finished = wait_for(lambda: len(queries.requests(agent.db)), what="request rows")
    assert finished >= 1
    rows = queries.requests(agent.db)
    assert all(r["latency_s"] >= r["ttft_s"] > 0 and r["completion_tokens"] >= 1 for r in rows)
    total = wait_for(lambda: queries.cache_stats(agent.db)["total"], what="cache stats rows")
    assert total["hits"] + total["misses"] > 0
    assert queries.latest(agent.db, "agent.cache_cap_bytes") is not None


def test_sigterm_stops_cleanly_and_knobs_are_restored_on_restart(model, tmp_path):
    first = start_agent(model, tmp_path)
    cap = first.get("/v1/knobs").json()["cache_cap_bytes"]["min"] * 3
    changed = httpx.put(first.url + "/v1/knobs", json={"cache_cap_bytes": cap, "recompute_threshold": 0.5})
    assert changed.status_code == 200
    assert first.stop() == 0 and not first.pid_file.exists()
    second = start_agent(model, tmp_path, "--token", "s3cret-of-sixteen")
    try:
        knobs = second.get("/v1/knobs").json()
        assert knobs["cache_cap_bytes"]["value"] == cap and knobs["recompute_threshold"]["value"] == 0.5
        assert ("cache_cap_bytes", cap, "restore") in {(h["knob"], h["new"], h["source"])
                                                       for h in queries.knob_history(second.db)}
        denied = httpx.put(second.url + "/v1/knobs", json={"auto_shrink": True})
        assert denied.status_code == 401 and "Bearer" in denied.text
        assert denied.headers["www-authenticate"] == 'Bearer realm="flashmoe-agent"'   # RFC 9110 wants the scheme
        schemeless = httpx.put(second.url + "/v1/knobs", json={"auto_shrink": True},
                               headers={"Authorization": "s3cret-of-sixteen"})
        assert schemeless.status_code == 401, schemeless.text       # the token alone was accepted
        assert "without the Bearer scheme" in schemeless.text and "s3cret-of-sixteen" not in schemeless.text
        assert second.get("/v1/knobs").json()["auto_shrink"]["value"] is False
        allowed = httpx.put(second.url + "/v1/knobs", json={"auto_shrink": True},
                            headers={"Authorization": "Bearer s3cret-of-sixteen"})
        assert allowed.status_code == 200 and allowed.json()["auto_shrink"]["value"] is True
    finally:
        assert second.stop() == 0


HONCHO_KILL_S = 5  # honcho SIGKILLs what is still running this long after its SIGTERM


def test_sigterm_under_load_ends_the_running_requests_and_exits_before_honcho_kills(model, tmp_path):
    """The agent waited out uvicorn's 10 s graceful shutdown on streams with minutes to go, its scheduler
    thread died on the closed event loop, and Python's finalization took seconds after "agent stopped".
    A stream ended with finish_reason "cancelled", which OpenAI's clients read as a whole answer: now an error
    event they raise, then [DONE], and one line in the log for each."""
    agent = start_agent(model, tmp_path, "--kv-budget", "16384")    # room for four 4000-token streams at once
    try:
        with contextlib.ExitStack() as streams:
            lines = []
            for i in range(4):
                body = {"prompt": f"a long answer {i}", "max_tokens": 4000, "stream": True}
                r = streams.enter_context(httpx.stream("POST", agent.url + "/v1/completions", json=body, timeout=60))
                lines.append(r.iter_lines())
                next(lines[-1])  # its first token: it is running
            os.killpg(agent.proc.pid, signal.SIGTERM)
            assert agent.proc.wait(HONCHO_KILL_S) == 0
            rests = [[x for x in rest if x] for rest in lines]
        assert all(rest[-1] == "data: [DONE]" for rest in rests), rests
        ends = [json.loads(rest[-2][6:]) for rest in rests]
        assert all(end["error"]["message"].startswith("the agent is shutting down: this completion was stopped "
                                                      "after ") and "of its 4000 tokens" in end["error"]["message"]
                   for end in ends), ends
        log = agent.log.read_text()
        assert "agent stopped" in log and "Traceback" not in log and not agent.pid_file.exists()
        assert log.count("the shutdown stopped cmpl-") == 4, log
    finally:
        stop(agent.proc)


def test_sighup_stops_the_agent_as_sigterm_does(model, tmp_path):
    """SIGHUP (the terminal or SSH session that ran `flashmoe-cli serve` closed) ended the agent on the spot: a
    stream cut off without its error event or [DONE] (OpenAI's client: "Connection error."), the last second of
    statistics unwritten, the pid file left, and no word in the log."""
    agent = start_agent(model, tmp_path)
    try:
        body = {"prompt": "a long answer", "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", agent.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # its first token: it is running
            agent.proc.send_signal(signal.SIGHUP)
            assert agent.proc.wait(HONCHO_KILL_S) == 0
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["message"].startswith(
            "the agent is shutting down"), rest[-2:]
        log = agent.log.read_text()
        assert "agent stopped" in log and "Traceback" not in log and not agent.pid_file.exists()
    finally:
        stop(agent.proc)


def test_sigterm_during_a_completion_answers_503_with_retry_after_not_its_text_so_far(model, tmp_path):
    """A non-streamed completion the shutdown ended early was a 200 with the text so far (finish_reason
    "cancelled", which OpenAI's clients do not read), or a 500 when the step outlasted the shutdown."""
    agent = start_agent(model, tmp_path)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, agent.url + "/v1/completions",
                                 json={"prompt": "a long answer", "max_tokens": 4000}, timeout=60)
            wait_for(lambda: agent.get("/v1/status").json()["tokens_generated"] > 0, what="the completion to run")
            os.killpg(agent.proc.pid, signal.SIGTERM)
            r = answer.result(60)
        assert agent.proc.wait(HONCHO_KILL_S) == 0
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
        message = r.json()["error"]["message"]
        assert message.startswith("the agent is shutting down: this completion was stopped after ") and \
            "of its 4000 tokens" in message and "retry it against a running agent" in message
        assert "Traceback" not in agent.log.read_text()
    finally:
        stop(agent.proc)


@pytest.mark.parametrize("method, path, fields", [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                                                  ("PUT", "/v1/knobs", {"max_batch_size": 3}),
                                                  ("POST", "/v1/cache/preload", {"experts": [[0, 0]]})])
def test_a_request_that_arrives_once_the_shutdown_began_is_503_with_retry_after(model, tmp_path, method, path, fields):
    """The scheduler, closed by the shutdown, refused a completion with a 503 that did not say when to retry; a
    knob change or preload waited for the scheduler's ended thread until uvicorn's graceful timeout: a bare 500
    after 10 s and a CancelledError traceback in the log (round 8)."""
    agent = start_agent(model, tmp_path)
    body = json.dumps(fields).encode()
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", int(agent.url.rsplit(":", 1)[1])), timeout=60) as conn:
            conn.sendall(head + body[:1])     # in before the shutdown, whole only after it began
            wait_for(lambda: agent.get("/v1/status").status_code == 200, what="the agent to read the head")
            os.killpg(agent.proc.pid, signal.SIGTERM)
            wait_for(lambda: "Shutting down" in agent.log.read_text(), what="the shutdown to begin")
            conn.sendall(body[1:])
            answer = conn.makefile("rb").read().decode()
        assert answer.startswith("HTTP/1.1 503 ") and "\r\nretry-after: 5\r\n" in answer.lower(), answer
        assert "shutting down" in answer
        assert agent.proc.wait(HONCHO_KILL_S) == 0
        assert "Traceback" not in agent.log.read_text()
    finally:
        stop(agent.proc)


@pytest.mark.parametrize("host, loopback", [("127.0.0.1:8600", True), ("localhost", True), ("[::1]:8600", True),
                                             ("127.9.9.9", True), ("evil.example:8600", False), ("[::1", False),
                                             ("", False), ("127.0.0.1.evil.example", False), ("0.0.0.0:8600", False),
                                             ("LOCALHOST", True), ("127.0.0.1:", True),   # RFC 9110: port = *DIGIT
                                             # a URL parser finds 127.0.0.1 in these; no Host names it so
                                             ("evil.example@127.0.0.1", False), ("127.0.0.1/evil", False),
                                             ("127.0.0.1?x", False), ("[::1]extra", False),
                                             ("localhost:8792:1", False), ("127.0.0.1:abc", False)])
def test_a_host_header_is_loopback_only_when_it_names_a_loopback_host(host, loopback):
    assert addressed_to_loopback(host) is loopback


def test_a_token_less_agent_refuses_control_calls_addressed_to_another_host_as_dns_rebinding_sends(agent):
    """A web page whose host name was re-pointed at 127.0.0.1 is same-origin with the agent in the
    browser; its requests still carry the page's host name. It changed knobs and preloaded experts."""
    before = agent.get("/v1/knobs").json()["auto_shrink"]["value"]
    rebound = {"Host": "attacker.example:8600"}
    for method, path, body in (("PUT", "/v1/knobs", {"auto_shrink": not before}),
                               ("POST", "/v1/cache/preload", {"experts": [[0, 0]]})):
        r = httpx.request(method, agent.url + path, json=body, headers=rebound, timeout=30)
        assert r.status_code == 403, (path, r.text)
        assert "no token" in r.json()["error"]["message"] and "attacker.example" in r.json()["error"]["message"]
    assert httpx.get(agent.url + "/v1/knobs", headers=rebound, timeout=30).status_code == 200   # reading is open
    assert agent.get("/v1/knobs").json()["auto_shrink"]["value"] == before
    port = agent.url.rsplit(":", 1)[1]
    allowed = httpx.put(agent.url + "/v1/knobs", json={"auto_shrink": before}, headers={"Host": f"localhost:{port}"},
                        timeout=30)
    assert allowed.status_code == 200


def test_refuses_a_public_address_without_a_token(model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FLASHMOE_TOKEN"}
    r = subprocess.run([*CLI, "serve", "--model", str(model), "--host", "0.0.0.0", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--token" in r.stderr and "FLASHMOE_TOKEN" in r.stderr


@pytest.mark.parametrize("host, says", [
    ("999.1.1.1", "is not an IP address: an IPv4 address is four numbers of 0 to 255"),
    ("no-such-host.invalid", "is neither an IP address nor a name this box resolves"),
    ("203.0.113.9", "no interface of this box has that address")])
def test_a_host_it_cannot_bind_is_one_line_that_says_why(model, host, says):
    """999.1.1.1 was "refusing to bind 999.1.1.1: it is not a loopback address, so control calls need a token"."""
    r = subprocess.run([*CLI, "serve", "--model", str(model), "--host", host, "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "FLASHMOE_TOKEN": "t" * 16})
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and host in lines[0] and says in lines[0], r.stderr


def test_refuses_a_cache_cap_out_of_bounds(model, tmp_path):
    r = subprocess.run([*CLI, "serve", "--model", str(model), "--port", str(free_port()), "--cache-cap", "1",
                        "--pid-file", str(tmp_path / "agent.pid")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "outside the allowed range" in r.stderr
    assert not (tmp_path / "agent.pid").exists()  # nothing left behind


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    return errors[0]


@pytest.mark.parametrize("option, says", [
    (["--policy", "belady"], "policy 'belady' needs the future of a whole trace"),
    (["--cache-cap", "5000%"], "a percentage must be in (0, 100]"),
    (["--max-batch-size", "0"], "max_batch_size must be between 1 and 256"),
    (["--model", "{tmp}/not-a-model"], "is not an expert store")])
def test_an_agent_that_cannot_start_leaves_no_new_store_and_an_existing_one_as_it_was(model, tmp_path, option, says):
    """Each of these made the --db store before the error ended the agent: a new file no one asked for."""
    (tmp_path / "not-a-model").mkdir()
    args = ["--model", str(model), "--port", "0", *(word.format(tmp=tmp_path) for word in option)]  # the last wins
    r = subprocess.run([*CLI, "serve", *args, "--db", str(tmp_path / "new.db")], capture_output=True, text=True,
                       timeout=120)
    assert "cannot start the agent: " in _one_error_line(r) and says in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-model"]
    existing = tmp_path / "flashmoe.db"
    with Store(existing, autoflush_s=0) as store:
        store.append("block.vda.util", 1_700_000_000.0, 0.5)
    before = existing.read_bytes()
    r = subprocess.run([*CLI, "serve", *args, "--db", str(existing)], capture_output=True, text=True, timeout=120)
    assert says in _one_error_line(r)
    assert existing.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["flashmoe.db",
                                                                                                "not-a-model"]


def _serve_within(group: Path, limit: int, workdir: Path, db: Path) -> tuple[int | None, str, httpx.Response | None]:
    """`serve` in cgroup `group` limited to `limit` tasks: None if it started serving (then stopped), else its
    exit code; its output; and, if it served, its answer to GET /v1/status."""
    (group / "pids.max").write_text(str(limit))
    log = workdir / f"agent-{limit}.log"
    proc = spawn(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *CLI, "serve", "--model",
                  str(workdir / "model"), "--port", "0", "--db", str(db), "--pid-file", str(workdir / "agent.pid")],
                 log)
    try:   # serving, not answering: its requests' worker threads may be what the limit refuses
        wait_for(lambda: proc.poll() is not None or " serving " in log.read_text(), 120,
                 f"the agent limited to {limit} tasks to end or serve")
        if proc.poll() is not None:
            return proc.returncode, log.read_text(), None
        url = re.search(r" on (http://\S+)", log.read_text())[1]
        return None, log.read_text(), httpx.get(url + "/v1/status", timeout=60)
    finally:
        stop(proc)


def test_an_agent_at_its_limit_of_threads_says_so_in_one_line_and_removes_the_store_it_made(model, tmp_path,
                                                                                           pids_cgroup):
    """The store's flusher, the scheduler and the ticker start after the store is made: a thread the kernel would
    not create (a cgroup's limit of tasks, as systemd's TasksMax or a container's pids limit sets) ended the agent
    in a traceback ("RuntimeError: can't start new thread", exit 1) and left the new store behind, and then the
    directories made for it. Each limit from 2 tasks up refuses a later thread, until the agent starts; a store or
    a directory that was there before is kept."""
    (tmp_path / "model").symlink_to(model)
    db, made_and_removed = tmp_path / "made" / "for" / "new.db", []
    for limit in range(2, 40):
        code, out, _ = _serve_within(pids_cgroup, limit, tmp_path, db)
        if code is None:
            break
        errors = [line for line in out.splitlines() if " ERROR " in line]
        assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
        assert "can't start new thread" in errors[0] and "limit of tasks" in errors[0], out
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".log")) == ["model"], out
        if f"removed the store {db}" in out:
            made_and_removed.append(limit)
    assert code is None and len(made_and_removed) >= 2, made_and_removed   # the flusher's, the scheduler's...
    there = tmp_path / "there" / "new.db"
    there.parent.mkdir()
    code, out, _ = _serve_within(pids_cgroup, made_and_removed[-1], tmp_path, there)
    assert code == 2 and f"removed the store {there}" in out and list(there.parent.iterdir()) == [], out
    with Store(db, autoflush_s=0) as store:
        store.append("block.vda.util", 1_700_000_000.0, 0.5)
    code, out, _ = _serve_within(pids_cgroup, made_and_removed[-1], tmp_path, db)
    assert code == 2 and "removed the store" not in out, out
    assert queries.points(db, "block.vda.util")[1].tolist() == [0.5]


def test_a_store_it_cannot_create_on_a_full_disk_leaves_nothing_and_is_not_said_to_be_kept(model, tmpfs):
    """The agent said it "kept the store ... this run made" (there was none) and left the directories made for it."""
    disk = tmpfs("256k")
    fill(disk)
    db = disk / "made" / "for" / "new.db"
    r = subprocess.run([*CLI, "serve", "--model", str(model), "--port", "0", "--db", str(db)], capture_output=True,
                       text=True, timeout=120)
    assert f"cannot create {db} as a FlashMoE store: database or disk is full" in _one_error_line(r)
    assert "kept the store" not in r.stderr and [p.name for p in disk.iterdir()] == ["filler"], r.stderr


def test_an_agent_at_a_limit_of_one_task_says_so_in_one_line(model, tmp_path, pids_cgroup):
    """With the main thread the only task it may have, the agent ended in "ImportError: No library named udev":
    pyudev's lookup of libudev runs ldconfig in a child process, whose refusal ctypes keeps to itself (and past
    that, torch's OpenMP aborts the process on a thread it cannot create). OpenBLAS's four lines came first."""
    (tmp_path / "model").symlink_to(model)
    code, out, _ = _serve_within(pids_cgroup, 1, tmp_path, tmp_path / "new.db")
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert code == 2 and out.splitlines() == errors and len(errors) == 1, out     # nothing else, OpenBLAS's neither
    assert "flashmoe-cli serve cannot start: can't start new thread: " in errors[0] and "limit of tasks" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".log")) == ["model"], out


def test_a_store_it_cannot_open_ends_the_loaded_agent_in_one_line(model, tmp_path):
    """The store is opened once the model has loaded (above): the agent built by then stops without serving."""
    theirs = tmp_path / "theirs.db"
    with sqlite3.connect(theirs) as conn:
        conn.execute("CREATE TABLE t (x)")
    before = theirs.read_bytes()
    r = subprocess.run([*CLI, "serve", "--model", str(model), "--port", "0", "--db", str(theirs)],
                       capture_output=True, text=True, timeout=120)
    assert "it is an SQLite database of another application" in _one_error_line(r) and "expert cache:" in r.stderr
    assert theirs.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["theirs.db"]


def test_a_failed_start_removes_the_directories_it_made_for_its_pid_file(model, tmp_path):
    """The pid file was removed and `run/made/` left; a directory that was there before stays."""
    theirs = tmp_path / "theirs.db"
    with sqlite3.connect(theirs) as conn:
        conn.execute("CREATE TABLE t (x)")
    (tmp_path / "there").mkdir()
    for pid_file in (tmp_path / "run" / "made" / "agent.pid", tmp_path / "there" / "made" / "agent.pid"):
        r = subprocess.run([*CLI, "serve", "--model", str(model), "--port", "0", "--db", str(theirs), "--pid-file",
                            str(pid_file)], capture_output=True, text=True, timeout=120)
        assert "it is an SQLite database of another application" in _one_error_line(r)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["theirs.db", "there"]


def test_an_agent_serving_at_its_limit_of_threads_answers_503_naming_it(model, tmp_path, pids_cgroup):
    """At the lowest limits it serves at, a request's worker thread is refused: that was Starlette's bare 500
    ("Internal Server Error", to every synchronous call), and is a 503 with Retry-After naming the limit."""
    (tmp_path / "model").symlink_to(model)
    refused = []
    for limit in range(2, 40):
        code, out, answer = _serve_within(pids_cgroup, limit, tmp_path, tmp_path / f"{limit}.db")
        if answer is not None and answer.status_code == 200:
            break
        if answer is not None:
            assert answer.status_code == 503 and answer.headers["retry-after"], (answer.status_code, answer.text)
            assert "cannot start a thread to answer" in answer.json()["error"]["message"], answer.text
            assert "Traceback" not in out, out
            refused.append(limit)
    assert answer is not None and answer.status_code == 200 and refused, refused   # both seen, in that order


def test_a_store_whose_knob_changes_are_damaged_ends_the_loaded_agent_in_one_line_and_is_kept(model, tmp_path):
    """Restoring the knobs reads the store in start(), after it is opened: a damaged page there was a traceback."""
    db = tmp_path / "flashmoe.db"
    with Store(db, autoflush_s=0) as store:
        for i in range(50):
            store.record_knob_change(1_700_000_000.0 + i, "max_batch_size", 16, 8, "api")
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (page,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'knob_changes'").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    with db.open("r+b") as f:          # the table's root page: no b-tree page type
        f.seek((page - 1) * size)
        f.write(b"\xa5" * 8)
    r = subprocess.run([*CLI, "serve", "--model", str(model), "--port", "0", "--db", str(db), "--pid-file",
                        str(tmp_path / "agent.pid")], capture_output=True, text=True, timeout=120)
    assert f"{db} is damaged (database disk image is malformed)" in _one_error_line(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flashmoe.db"]


def test_a_place_no_store_can_be_written_is_refused_before_the_model_loads(model, tmp_path):
    """--db a directory was said only once the model had loaded, seconds (for a real model, a minute) later."""
    r = subprocess.run([*CLI, "serve", "--model", str(model), "--port", "0", "--db", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert f"cannot write the store {tmp_path}: it is a directory" in _one_error_line(r)
    assert "expert cache:" not in r.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag, value", [("--port", "-1"), ("--port", "65536"), ("--port", "x"),
                                         ("--io-threads", "0"), ("--io-threads", "100000000")])
def test_refuses_a_port_or_thread_count_out_of_range_in_one_line(model, flag, value):
    r = subprocess.run([*CLI, "serve", "--model", str(model), flag, value], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("content", [b"precious notes\n", b"SQLite format 3\0" + bytes(4080), b"\xff\xfe"])
def test_a_pid_file_that_holds_something_else_is_left_as_it_is(model, tmp_path, content):
    """A mistyped --pid-file (the store's path, a notes file) was overwritten with the pid and removed at exit."""
    taken = tmp_path / "flashmoe.db"
    taken.write_bytes(content)
    r = subprocess.run([*CLI, "serve", "--model", str(model), "--port", "0", "--pid-file", str(taken)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"--pid-file {taken} exists and is not a pid file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and taken.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flashmoe.db"]


def test_a_pid_file_whose_pid_another_process_took_since_is_taken_over(model, tmp_path):
    """An agent killed (SIGKILL, a reboot) leaves its pid file; a process started since with that pid made
    the next agent refuse to start: "… names a running process (…): another agent is up"."""
    with subprocess.Popen(["sleep", "120"]) as other:
        (tmp_path / "agent.pid").write_text(f"{other.pid}\n")
        os.utime(tmp_path / "agent.pid", (time.time() - 3600, time.time() - 3600))
        agent = start_agent(model, tmp_path)
        try:
            assert int(agent.pid_file.read_text()) == agent.proc.pid
        finally:
            assert agent.stop() == 0 and not agent.pid_file.exists()
            other.kill()


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_an_unwritable_pid_file_is_one_line_and_leaves_nothing(model, tmp_path, where):
    (tmp_path / "taken").mkdir() if where == "a directory" else (tmp_path / "taken").write_text("x")
    pid_file = tmp_path / "taken" if where == "a directory" else tmp_path / "taken" / "agent.pid"
    r = subprocess.run([*CLI, "serve", "--model", str(model), "--port", str(free_port()), "--pid-file", str(pid_file)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"cannot write the pid file {pid_file}" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no agent.pid.tmp or taken.tmp left


def test_requests_share_the_kv_budget_the_cap_counts_and_one_larger_than_it_is_refused(model, tmp_path):
    """The cap's memory rule counts --kv-budget positions of KV cache for all running requests together; the
    agent holds to it: a request that would overflow it waits for a running one to end, and one that could
    never fit is refused at once (before, 16 long streams held ~4x the KV the rule had counted)."""
    agent = start_agent(model, tmp_path, "--kv-budget", "400")
    try:
        knobs = agent.get("/v1/knobs").json()["cache_cap_bytes"]
        too_big = httpx.post(agent.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 399}, timeout=60)
        assert too_big.status_code == 400 and "KV budget of 400 positions (serve --kv-budget)" in too_big.text
        with httpx.stream("POST", agent.url + "/v1/completions", timeout=60,
                          json={"prompt": "a long answer", "max_tokens": 300, "stream": True}) as first:
            lines = first.iter_lines()
            next(lines)                                          # its first token: it is running
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                second = pool.submit(httpx.post, agent.url + "/v1/completions", timeout=60,
                                     json={"prompt": "a short one", "max_tokens": 100})
                status = wait_for(lambda: (s := agent.get("/v1/status").json())["queue_depth"] == 1 and s, 30,
                                  "the second request to wait")
                assert status["batch_size"] == 1 and status["kv_budget"] == 400
                # the first's; with the second's over
                assert 300 < status["kv_positions"] <= 400 < status["kv_positions"] + 100
                for _ in lines:                                  # the first runs to its end...
                    pass
                assert second.result().status_code == 200        # ...then the second runs
    finally:
        stop(agent.proc)
    (tmp_path / "default").mkdir()
    default = start_agent(model, tmp_path / "default")
    try:   # the budget is counted against the cap: a larger one leaves less room for the cache
        assert default.get("/v1/knobs").json()["cache_cap_bytes"]["max"] < knobs["max"]
    finally:
        stop(default.proc)
