"""The agent as a hostile or careless client meets it: every bad input a clean 4xx with a message,
bounded work per request, a client that leaves stops its request, a damaged block fails alone.

Real processes on loopback (tests/agents.py), raw bodies where a JSON library would refuse to write
them (NaN, Infinity, lone surrogates)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from fastapi import HTTPException

from access.guesses import FREE_GUESSES
from agent.experts.layout import EXPERTS, INDEX, Index
from agent.generate import run_generate
from agent.serve.app import _controlled
from agent.serve.knobs import KnobError
from agent.serve.limits import MAX_JSON_DEPTH, MAX_PROMPT_BYTES, body_limit
from agent.serve.scheduler import SchedulerBusy
from agent.serve.server import MIN_TOKEN_CHARS
from agents import CLI, demo_model, start_agent, wait_for

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_model(tmp_path_factory)


@pytest.fixture(scope="module")
def agent(model, tmp_path_factory):
    a = start_agent(model, tmp_path_factory.mktemp("hardening"), "--policy", "lru")
    yield a
    a.stop()


def post(agent, path: str, raw: str | bytes, method: str = "POST", **headers) -> httpx.Response:
    return httpx.request(method, agent.url + path, content=raw, headers={**JSON, **headers}, timeout=60)


def assert_clean_4xx(r: httpx.Response, status: int, *words: str) -> None:
    """A 4xx whose body says what was wrong, in both FastAPI's and OpenAI's error shapes."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["message"] and body["detail"]
    assert all(w in body["error"]["message"] for w in words), body


@pytest.mark.parametrize("raw, words", [
    ('{"prompt": "hi", "temperature": NaN}', ["temperature", "finite"]),
    ('{"prompt": "hi", "max_tokens": Infinity}', ["max_tokens", "integer"]),
    ('{"prompt": "hi", "max_tokens": 1e400}', ["max_tokens", "integer"]),
    ('{"prompt": [1, 2, NaN]}', ["prompt", "integer"]),
    ('{"prompt": "a\\ud800b"}', ["prompt", "lone surrogate", "character 1"]),
    # past Python's int-parsing limit: FastAPI's "There was an error parsing the body", which says no more
    ('{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", ["a number of more than 4300 digits"]),
    (b'{"prompt": "caf\xe9"}', ["not UTF-8", "byte 15 is b'\\xe9'"]),
    ('{"prompt": "hi", "max_tokens": 1' + "0" * 40 + "}", ["max_tokens"]),
    ("[1, 2]", ["body"]),
    ("{", ["not valid JSON at character 1"]),
    ("nonsense", ["not valid JSON at character 0: Expecting value"]),
])
def test_bad_completion_bodies_are_a_4xx_that_says_why(agent, raw, words):
    r = post(agent, "/v1/completions", raw)
    assert r.status_code in (400, 422), r.text
    assert_clean_4xx(r, r.status_code, *words)


INTEGERS = {"max_tokens": 3, "n": 1, "seed": 3, "logprobs": None, "best_of": 1}


@pytest.mark.parametrize("value", [True, False, "3", 3.5, [3]], ids=repr)
@pytest.mark.parametrize("field", INTEGERS)
def test_an_integer_field_takes_integers_only(agent, field, value):
    """Lax parsing read true as 1 (best_of: true passed as 1) and "3" as 3."""
    r = httpx.post(agent.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value}, timeout=60)
    assert_clean_4xx(r, 422, f"{field}: Input should be a valid integer")


def test_the_integer_fields_take_integers_written_either_way(agent):
    """JSON has numbers, not integers apart (JSON Schema's integer is 3.0 too): 3.0 is 3, as for a knob."""
    as_ints = agent.complete(prompt=[72, 105], **INTEGERS)
    as_floats = agent.complete(prompt=[72.0, 105.0], **{k: v if v is None else float(v) for k, v in INTEGERS.items()})
    assert as_ints["usage"]["prompt_tokens"] == 2 and as_ints["usage"]["completion_tokens"] >= 1
    assert as_floats["choices"] == as_ints["choices"] and as_floats["usage"] == as_ints["usage"]


@pytest.mark.parametrize("body, words", [
    ({"prompt": [72, True]}, "prompt.list[int].1: Input should be a valid integer"),
    ({"prompt": "hi", "stream": 1}, "stream: Input should be a valid boolean"),
    ({"prompt": "hi", "temperature": "0.5"}, "temperature: Input should be a valid number"),
    ({"prompt": "hi", "top_p": True}, "top_p: Input should be a valid number"),
])
def test_token_ids_booleans_and_numbers_are_not_read_from_other_types(agent, body, words):
    assert_clean_4xx(httpx.post(agent.url + "/v1/completions", json=body, timeout=60), 422, words)


def test_an_empty_knob_change_is_refused(agent):
    """It was a 200 that changed nothing: a client's mistake (a form sent before a field was set) went unsaid."""
    assert_clean_4xx(httpx.put(agent.url + "/v1/knobs", json={}, timeout=60), 400, "send a JSON object of knob")


@pytest.mark.parametrize("refusal, status", [(KnobError("experts", "no such expert"), 400),
                                             (SchedulerBusy("the running step did not finish"), 503)])
def test_a_refused_control_call_answers_its_status(refusal, status):
    """Both control calls answer through one handler: a preload whose wait for the running step timed out
    was a 500 (only PUT /v1/knobs said 503). A step that outlasts the 60 s wait is not made in a test."""
    def change():
        raise refusal

    with pytest.raises(HTTPException) as refused:
        _controlled(change)
    assert (refused.value.status_code, refused.value.detail) == (status, str(refusal))


def test_a_preloaded_expert_is_two_integers(agent):
    r = httpx.post(agent.url + "/v1/cache/preload", json={"experts": [[0, 1], [True, 0]]}, timeout=60)
    assert_clean_4xx(r, 422, "experts.1.0: Input should be a valid integer")


@pytest.mark.parametrize("knob", ["recompute_threshold", "max_batch_size", "cache_cap_bytes", "prefetch_depth",
                                  "keep_percentile"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_knobs_are_refused_and_change_nothing(agent, knob, value):
    before = agent.get("/v1/knobs").json()
    r = post(agent, "/v1/knobs", f'{{"{knob}": {value}}}', method="PUT")
    assert_clean_4xx(r, 400, knob, "finite")
    assert agent.get("/v1/knobs").json() == before


def test_a_prompt_over_the_byte_cap_is_refused_before_tokenizing(agent):
    r = post(agent, "/v1/completions", json.dumps({"prompt": "é" * (MAX_PROMPT_BYTES // 2 + 1)}))  # 2 bytes each
    assert_clean_4xx(r, 413, f"{MAX_PROMPT_BYTES + 2} bytes", f"at most {MAX_PROMPT_BYTES}", "--max-prompt-bytes")
    ok = agent.complete(prompt="é" * 8, max_tokens=1)
    assert ok["usage"]["prompt_tokens"] == 16


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_refused_unread(agent, chunked):
    raw = json.dumps({"prompt": [1] * (body_limit(MAX_PROMPT_BYTES) // 3)}).encode()
    content = iter([raw[i:i + 65536] for i in range(0, len(raw), 65536)]) if chunked else raw
    r = httpx.post(agent.url + "/v1/completions", content=content, headers=JSON, timeout=60)
    assert_clean_4xx(r, 413, f"limit of {body_limit(MAX_PROMPT_BYTES)} bytes")


@pytest.mark.parametrize("path, method", [("/v1/completions", "POST"), ("/v1/knobs", "PUT"),
                                          ("/v1/cache/preload", "POST")])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_a_body_nested_too_deeply_is_refused_before_it_is_parsed_naming_the_limit(agent, path, method, depth):
    """Past ~1,000 levels Python's parser raised RecursionError: "There was an error parsing the body"."""
    r = post(agent, path, '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}", method)
    assert_clean_4xx(r, 400, f"nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")


def test_an_unclosed_string_of_escaped_quotes_at_the_body_limit_is_refused_as_json(agent):
    """The nesting check's regular expression took time quadratic in such a string, on the event loop before
    the token check: one such body from anyone held every request for most of an hour."""
    quotes = (body_limit(MAX_PROMPT_BYTES) - 2 * MAX_JSON_DEPTH - 1) // 2
    r = post(agent, "/v1/completions", "[" * MAX_JSON_DEPTH + '"' + '\\"' * quotes + "[" * MAX_JSON_DEPTH)
    assert_clean_4xx(r, 422, "not valid JSON")
    assert agent.get("/v1/status").status_code == 200


def test_brackets_in_the_text_are_no_nesting(agent):
    assert agent.complete(prompt="[{" * 3 * MAX_JSON_DEPTH + '\\"]', max_tokens=1)["choices"]
    assert_clean_4xx(post(agent, "/v1/cache/preload", '{"experts": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" *
                          (MAX_JSON_DEPTH - 1) + "}"), 422, "experts")   # at the limit: parsed, then refused


@pytest.mark.parametrize("path, method, raw", [("/v1/knobs", "PUT", '{"prefetch_depth": 1}'),
                                               ("/v1/completions", "POST", '{"prompt": "hi"}')])
@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded"])
def test_json_sent_as_another_media_type_is_told_to_say_json(agent, path, method, raw, media):
    before = agent.get("/v1/knobs").json()
    r = post(agent, path, raw, method, **{"Content-Type": media})
    assert_clean_4xx(r, 422, "Content-Type: application/json", f"not {media}")   # was "should be a valid dictionary"
    assert agent.get("/v1/knobs").json() == before


def test_unknown_paths_and_methods_keep_the_error_shape(agent):
    assert_clean_4xx(httpx.get(agent.url + "/v2/nothing"), 404, "Not Found")
    assert_clean_4xx(httpx.delete(agent.url + "/v1/knobs"), 405, "Method Not Allowed")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_no_page_needs_the_network_and_the_api_is_described_at_openapi_json(agent, page):
    """FastAPI's /docs and /redoc load Swagger UI and ReDoc from a CDN: blank on an offline edge box."""
    r = httpx.get(agent.url + page, timeout=60)
    assert_clean_4xx(r, 404, "/openapi.json")
    assert "http" not in r.text
    assert agent.get("/openapi.json").json()["paths"].keys() >= {"/v1/completions", "/v1/knobs"}


def answered_and_abandoned(agent) -> tuple[float | None, float | None]:
    return agent.metric("flashmoe_requests_total"), agent.metric("flashmoe_requests_unserved_total", reason="abandoned")


def idle(agent) -> bool:
    """Nothing runs or waits: no request of an earlier test can still end and move the counts."""
    status = agent.get("/v1/status").json()
    return status["batch_size"] == 0 and status["queue_depth"] == 0


def test_a_client_that_leaves_stops_its_non_streaming_request(agent):
    wait_for(lambda: idle(agent), what="the agent idle")
    before, (answered, abandoned) = agent.get("/v1/status").json()["tokens_generated"], answered_and_abandoned(agent)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(agent.url + "/v1/completions", json={"prompt": "go on and on", "max_tokens": 4000}, timeout=1.0)
    wait_for(lambda: agent.get("/v1/status").json()["batch_size"] == 0, what="the request to stop")
    generated = agent.get("/v1/status").json()["tokens_generated"] - before
    assert 0 < generated < 4000  # it ran, and was cancelled long before its end
    # counted as abandoned, not as an answer (its cut-short latency was one in the histograms)
    wait_for(lambda: answered_and_abandoned(agent) == (answered, abandoned + 1), what="the abandoned count")


def test_a_completion_its_stop_string_ends_is_counted_as_answered(agent):
    wait_for(lambda: idle(agent), what="the agent idle")
    answered, abandoned = answered_and_abandoned(agent)
    done = agent.complete(prompt="Hello", max_tokens=64, temperature=0)["choices"][0]["text"]
    stop = done[len(done) // 2:][:3]                 # a string the same greedy completion generates midway
    assert agent.complete(prompt="Hello", max_tokens=64, temperature=0, stop=[stop])["choices"][0][
        "finish_reason"] == "stop"
    wait_for(lambda: answered_and_abandoned(agent) == (answered + 2, abandoned),
             what=f"two answers counted after {answered, abandoned}: {answered_and_abandoned(agent)}")


def test_a_client_that_leaves_a_stream_with_stop_strings_stops_its_request(agent):
    before = agent.get("/v1/status").json()["tokens_generated"]
    body = {"prompt": "go on and on", "max_tokens": 4000, "stream": True, "stop": ["\u2603 never generated"]}
    with httpx.stream("POST", agent.url + "/v1/completions", json=body, timeout=60) as r:
        assert next(r.iter_lines()).startswith("data: {")
    wait_for(lambda: agent.get("/v1/status").json()["batch_size"] == 0, what="the request to stop")
    generated = agent.get("/v1/status").json()["tokens_generated"] - before
    assert 0 < generated < 4000


# -- damaged stores ---------------------------------------------------------------------------------------
def damaged_copy(model: Path, tmp_path: Path, key: tuple[int, int]) -> Path:
    """A copy of the model with one byte of expert block `key` flipped (its CRC32 no longer matches)."""
    copy = tmp_path / "damaged"
    shutil.copytree(model, copy)
    block = Index.load(copy / INDEX).block(*key)
    with open(copy / EXPERTS, "r+b") as f:
        f.seek(block.offset + 100)
        byte = f.read(1)
        f.seek(block.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    return copy


def first_layer_route(model: Path, token: int, tmp_path: Path) -> tuple[int, set[int]]:
    """The store layer and experts the first MoE layer routes a one-token prompt to."""
    trace = tmp_path / f"route-{token}.jsonl"
    run_generate(model, prompt_ids=[token], max_new_tokens=1, greedy=True, policy="lru", record_trace=trace)
    routed = json.loads(trace.read_text().splitlines()[1])["routed"]
    layer = min(routed, key=int)
    return int(layer), set(routed[layer])


def test_a_request_that_hits_a_damaged_block_fails_alone(model, tmp_path):
    routes = {t: first_layer_route(model, t, tmp_path) for t in range(ord("a"), ord("a") + 12)}
    victim, (layer, experts) = next(iter(routes.items()))
    damaged = min(experts)
    clean = [t for t, (_, e) in routes.items() if damaged not in e][:3]
    assert len(clean) == 3, "no three tokens avoid the damaged expert"
    # a batch limit of 4 with a long admission window: the four requests share their first step
    agent = start_agent(damaged_copy(model, tmp_path, (layer, damaged)), tmp_path, "--policy", "lru",
                        "--max-batch-size", "4", "--admit-window-ms", "1000")
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda t: httpx.post(agent.url + "/v1/completions", timeout=60, json={
                "prompt": [t], "max_tokens": 1, "temperature": 0}), [victim, *clean]))
        assert answers[0].status_code == 500 and "CRC32" in answers[0].json()["error"]["message"]
        assert [a.status_code for a in answers[1:]] == [200, 200, 200], [a.text for a in answers]
        assert "decode step failed for 4 requests" in agent.log.read_text()  # they did share the failed step
        status = agent.get("/v1/status").json()
        assert status["requests_unserved"] == {"failed": 1, "refused": 0, "abandoned": 0}   # counted, not only logged
        wait_for(lambda: agent.metric("flashmoe_requests_unserved_total", reason="failed") == 1, 10,
                 "the failure in /metrics (a tick a second)")
        store = status["store"]
        assert store["damaged"] == 1 and store["damaged_blocks"][0]["layer"] == layer
        assert store["damaged_blocks"][0]["expert"] == damaged and "CRC32" in store["damaged_blocks"][0]["reason"]
    finally:
        assert agent.stop() == 0


def test_verify_finds_a_damaged_block_no_request_has_read(model, tmp_path):
    agent = start_agent(damaged_copy(model, tmp_path, (1, 5)), tmp_path, "--policy", "lru", "--verify")
    try:
        store = wait_for(lambda: (s := agent.get("/v1/status").json()["store"])["verify"]["state"] == "done" and s,
                         what="the scrub to finish")
        assert store["verify"]["checked_blocks"] == store["blocks"] > 0
        assert [(b["layer"], b["expert"]) for b in store["damaged_blocks"]] == [(1, 5)]
        assert "store verified" in agent.log.read_text() and "1 damaged" in agent.log.read_text()
    finally:
        assert agent.stop() == 0


def test_a_truncated_store_is_reported_at_start(model, tmp_path):
    copy = tmp_path / "truncated"
    shutil.copytree(model, copy)
    index = Index.load(copy / INDEX)
    last = max(index.blocks, key=lambda b: b.offset)
    with open(copy / EXPERTS, "r+b") as f:
        f.truncate(last.offset + 10)
    agent = start_agent(copy, tmp_path, "--policy", "lru")
    try:
        store = agent.get("/v1/status").json()["store"]
        assert store["verify"] is None
        assert [(b["layer"], b["expert"]) for b in store["damaged_blocks"]] == [(last.layer, last.expert)]
        assert "truncated" in store["damaged_blocks"][0]["reason"]
    finally:
        assert agent.stop() == 0


@pytest.mark.parametrize("token", [" s3cret-of-sixteen", "s3cret-of-sixteen\n", "s3 cret-of-sixteen\t",
                                   "sécret-of-sixteen"])
def test_a_token_no_header_can_carry_is_refused_at_start(tmp_path, token):
    """HTTP strips a header's ends and carries no control or non-ASCII characters: an agent started with
    such a token could never be unlocked (every control call 401)."""
    out = subprocess.run([*CLI, "serve", "--model", str(tmp_path), "--port", "0", "--token", token],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "the token must be printable ASCII" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_token_too_short_to_withstand_guessing_is_refused_at_start(tmp_path):
    out = subprocess.run([*CLI, "serve", "--model", str(tmp_path), "--port", "0", "--token", "s3cret"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"is 6 characters; give at least {MIN_TOKEN_CHARS}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "s3cret" not in out.stderr


GUARD_TOKEN = "hardening-control-token"


def test_a_token_on_the_command_line_is_warned_about_and_the_environment_is_not(tmp_path):
    """--token shows in `ps` to every user of the box; FLASHMOE_TOKEN in /proc/PID/environ to the owner only."""
    serve = [*CLI, "serve", "--model", str(tmp_path / "absent"), "--port", "0"]
    flag = subprocess.run([*serve, "--token", GUARD_TOKEN], capture_output=True, text=True, timeout=120)
    env = subprocess.run(serve, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "FLASHMOE_TOKEN": GUARD_TOKEN})
    assert flag.returncode == env.returncode == 2
    assert "every user of this box can read in `ps`; set FLASHMOE_TOKEN or pass --token-file instead" in flag.stderr
    assert "`ps`" not in env.stderr and GUARD_TOKEN not in flag.stderr + env.stderr


def test_wrong_tokens_lock_their_address_out_for_a_while_and_say_so(model, tmp_path):
    """Wrong tokens were heard without end at full speed: a guesser had as many tries as it could send."""
    agent = start_agent(model, tmp_path, "--token", GUARD_TOKEN)

    def put(token: str) -> httpx.Response:
        return httpx.put(agent.url + "/v1/knobs", json={"auto_shrink": True},
                         headers={"Authorization": f"Bearer {token}"}, timeout=60)
    try:
        assert [put(f"guess-{i}").status_code for i in range(FREE_GUESSES + 1)] == [401] * (FREE_GUESSES + 1)
        locked = put(GUARD_TOKEN)          # the right token, unheard while the address is locked out
        assert_clean_4xx(locked, 429, "too many wrong tokens from this address", "locked out for 1 s more")
        assert locked.headers["Retry-After"] == "1"
        assert agent.get("/v1/knobs").json()["auto_shrink"]["value"] is False
        assert (f"wrong token on PUT /v1/knobs from 127.0.0.1 ({FREE_GUESSES + 1} in a row); locked out for 1 s"
                in agent.log.read_text())
        wait_for(lambda: put(GUARD_TOKEN).status_code == 200, timeout=30, what="the lock-out to end")
        assert put("guess").status_code == 401    # the right token cleared the count: a free guess again
        assert put(GUARD_TOKEN).status_code == 200
        missing = [httpx.put(agent.url + "/v1/knobs", json={}, timeout=60).status_code for _ in range(FREE_GUESSES + 2)]
        assert missing == [401] * (FREE_GUESSES + 2) and put(GUARD_TOKEN).status_code == 200  # no token: no guess
    finally:
        assert agent.stop() == 0


def test_no_header_names_another_client_and_a_repeated_wrong_token_is_no_new_guess(model, tmp_path):
    """uvicorn took a client's address from X-Forwarded-For on any connection from loopback: a local process, or
    a client through a proxy on the box, got 5 new guesses with every address it named (and could fill the table
    of clients, pushing the operator into the shared, locked-out entry). And a dashboard pushing a stale
    FLASHMOE_TOKEN locked out the box (the operator's own tools, the dashboard for every user) after 5 pushes."""
    agent = start_agent(model, tmp_path, env={"FLASHMOE_TOKEN": GUARD_TOKEN})

    def put(token: str, **headers: str) -> int:
        return httpx.put(agent.url + "/v1/knobs", json={"auto_shrink": True}, timeout=60,
                         headers={"Authorization": f"Bearer {token}", **headers}).status_code
    try:
        stale = [put("stale-dashboard-token", **{"X-FlashMoE-Source": "dashboard"}) for _ in range(3 * FREE_GUESSES)]
        assert stale == [401] * (3 * FREE_GUESSES) and put(GUARD_TOKEN) == 200
        named = [put(f"guess-{i}", **{"X-Forwarded-For": f"203.0.113.{i}"}) for i in range(FREE_GUESSES + 1)]
        assert named == [401] * (FREE_GUESSES + 1)
        assert put(GUARD_TOKEN, **{"X-Forwarded-For": "203.0.113.200"}) == 429   # the box is locked out
        log = agent.log.read_text()
        assert "203.0.113." not in log and log.count("(one it sent before: no new guess)") == 3 * FREE_GUESSES - 1
    finally:
        assert agent.stop() == 0


def test_requests_beyond_the_waiting_bound_get_429_and_the_rest_are_served(model, tmp_path):
    """The queue of requests waiting for a place in the batch was unbounded: every one held its prompt,
    and a flood lengthened every wait. One runs, one waits, the next is refused with OpenAI's 429."""
    agent = start_agent(model, tmp_path, "--max-batch-size", "1", "--max-waiting", "1", "--admit-window-ms", "0")
    status = lambda: agent.get("/v1/status?step_profiles=0").json()   # noqa: E731
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(agent.complete, prompt="a long one", max_tokens=2000, temperature=0)
            wait_for(lambda: status()["batch_size"] == 1, 60, "the first to run")   # greedy, it runs all 2000
            waiting = pool.submit(agent.complete, prompt="waits its turn", max_tokens=2)
            wait_for(lambda: status()["queue_depth"] == 1, 60, "the second to wait")
            refused = httpx.post(agent.url + "/v1/completions", json={"prompt": "one too many"}, timeout=60)
            assert not running.done(), "the first request ended before the third was sent: nothing was tested"
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and "serve --max-waiting" in error["message"]
            assert running.result(300)["usage"]["completion_tokens"] == 2000
            assert waiting.result(300)["usage"]["completion_tokens"] >= 1
        assert agent.complete(prompt="room again", max_tokens=2)["usage"]["completion_tokens"] >= 1
        assert status()["requests_unserved"] == {"failed": 0, "refused": 1, "abandoned": 0}   # the 429 is counted
        wait_for(lambda: agent.metric("flashmoe_requests_unserved_total", reason="refused") == 1, 10,
                 "the refusal in /metrics (a tick a second)")
    finally:
        assert agent.stop() == 0
