"""Property-based fuzzing of the whole HTTP API from the agent's own /openapi.json (schemathesis).

Every operation gets schema-valid and schema-violating inputs (schemathesis' positive and negative
generation, hypothesis underneath) against a real agent on loopback without a token, so control calls
reach validation. For each: no 5xx, an answer within HANG_S (CONTROL_HANG_S for a control call), every
4xx says what was wrong, and the answer is what /openapi.json says (schemathesis' conformance checks: a
documented status, content type, headers and body), a schema-violating input is refused and a schema-
valid one accepted, so the schema is the agent's contract and not a sketch of it. Afterwards the agent
still answers a known greedy completion exactly as before: nothing the fuzzer sent (knob changes
included) changed what the model computes. A second agent, started with a token, gets the control calls'
inputs as drawn, without a token and with a wrong one, and the first agent gets them addressed to
another host (DNS rebinding): none is answered 2xx, and the agent's knobs, cache and knob history are as
they were.

FLASHMOE_FUZZ_EXAMPLES sets the examples per operation (CI: 25); FLASHMOE_FUZZ_REPORT=FILE writes
the counts (RELIABILITY.md's table).
"""
from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks, engine
from schemathesis.engine import Status, events

from agent.serve.scheduler import CONTROL_WAIT_S
from agents import demo_model, start_agent
from store import queries

EXAMPLES = int(os.environ.get("FLASHMOE_FUZZ_EXAMPLES", "25"))
HANG_S = 5.0
CONTROL = {"PUT /v1/knobs", "POST /v1/cache/preload"}
# a control call may wait for the running step, and a switch to the learned policy loads it first (numba's
# compiled loops: seconds with a cold cache); the dashboard waits as long (KNOBS_TIMEOUT_S)
CONTROL_HANG_S = CONTROL_WAIT_S + HANG_S
CHEAP_TOKENS = 16      # see cheap()
CHEAP_PROMPT = 256
CONTEXT = 4096         # the demo model's; max_tokens beyond it are refused at once and kept as drawn
KNOWN = {"prompt": "The expert cache keeps", "max_tokens": 12, "temperature": 0}
CONFORMANCE = [checks.status_code_conformance, checks.content_type_conformance, checks.response_headers_conformance,
               checks.response_schema_conformance, checks.negative_data_rejection, checks.positive_data_acceptance]
# a call accepted with the token is sent again without it and with a wrong one: either must be refused (401 or 403)
CHECKS = [*CONFORMANCE, checks.ignored_auth]

seen: collections.Counter[str] = collections.Counter()


def cheap(case) -> None:
    """Valid but long work is lowered, as it is work and not a hang: max_tokens above CHEAP_TOKENS,
    prompts longer than CHEAP_PROMPT, within the context (which holds the prompt and a token at least).
    Values beyond it are sent as drawn."""
    if case.path != "/v1/completions" or not isinstance(case.body, dict):
        return
    tokens, prompt = _number(case.body.get("max_tokens")), case.body.get("prompt")
    if tokens is not None and CHEAP_TOKENS < tokens < CONTEXT:  # 4000.0 and "4000" are 4000 to the agent
        case.body["max_tokens"] = CHEAP_TOKENS
    if isinstance(prompt, (str, list)) and CHEAP_PROMPT < len(prompt) < CONTEXT:
        case.body["prompt"] = prompt[:CHEAP_PROMPT]


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = start_agent(demo_model(tmp_path_factory), tmp_path_factory.mktemp("fuzz"), "--policy", "lru")
    yield a
    a.stop()


@pytest.fixture(scope="module")
def before(agent) -> str:
    return agent.complete(**KNOWN)["choices"][0]["text"]


@pytest.fixture(scope="module")
def api(agent, before):
    return schemathesis.openapi.from_url(agent.url + "/openapi.json")


def test_no_input_is_a_5xx_a_hang_or_a_4xx_without_a_message(api):
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "PUT /v1/knobs", "GET /v1/status"}
    for operation in operations:
        takes_input = any(operation.definition.raw.get(k) for k in ("parameters", "requestBody"))
        for mode in schemathesis.GenerationMode:
            if takes_input or mode is schemathesis.GenerationMode.POSITIVE:  # no input, nothing to violate
                fuzz(operation, mode)


def fuzz(operation, mode, headers: dict[str, str] | None = None, refused: bool = False) -> collections.Counter[int]:
    """Drawn cases of `operation` (sent with `headers` over the drawn ones): no 5xx, no hang, a 4xx
    says why, the answer conforms to the schema and a call accepted with the token needed it; with
    `refused`, nothing is accepted either. Returns the statuses answered."""
    statuses: collections.Counter[int] = collections.Counter()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case):
        cheap(case)
        if headers is not None:
            replaced = {"authorization"} | {k.lower() for k in headers}
            case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() not in replaced} | headers
        hang_s = CONTROL_HANG_S if operation.label in CONTROL else HANG_S
        response = case.call(timeout=hang_s)  # a slower answer raises: a hang fails the test
        seen["inputs"] += 1
        seen[f"{response.status_code // 100}xx"] += 1
        seen["over 5 s"] += response.elapsed > HANG_S     # a control call's, within CONTROL_HANG_S: counted
        statuses[response.status_code] += 1
        assert response.status_code < 500, f"{case.method} {case.path} {case.body!r:.300}: {response.text[:300]}"
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"].strip(), response.text[:300]
        case.validate_response(response, checks=CHECKS, headers=headers)   # headers: what ignored_auth takes away
        assert not (refused and response.status_code < 400), f"{case.method} {case.path} {case.body!r:.300} accepted"

    check()
    return statuses


TOKEN = "fuzz-control-token"
WITH_TOKEN = {"Authorization": "Bearer " + TOKEN}
WITHOUT_TOKEN = {"as drawn": None, "none": {}, "its prefix": {"Authorization": "Bearer " + TOKEN[:-1]},
                 "latin-1": {"Authorization": "Bearer " + TOKEN + "é"}}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    a = start_agent(demo_model(tmp_path_factory), tmp_path_factory.mktemp("guarded"), "--token", TOKEN)
    yield a
    a.stop()


@pytest.mark.parametrize("headers", WITHOUT_TOKEN.values(), ids=WITHOUT_TOKEN.keys())
def test_no_control_call_without_the_token_changes_the_agent(guarded, headers):
    api = schemathesis.openapi.from_url(guarded.url + "/openapi.json")
    control = [op for op in (r.ok() for r in api.get_all_operations())
               if op.method.upper() not in ("GET", "HEAD") and op.path != "/v1/completions"]
    assert {op.label for op in control} == CONTROL
    knobs, cache = guarded.get("/v1/knobs").json(), guarded.get("/v1/status").json()["cache"]
    for operation in control:
        for mode in schemathesis.GenerationMode:
            fuzz(operation, mode, headers, refused=True)
    assert guarded.get("/v1/knobs").json() == knobs
    assert guarded.get("/v1/status").json()["cache"]["resident_experts"] == cache["resident_experts"]
    assert [h for h in queries.knob_history(guarded.db) if h["source"] != "restore"] == []


@pytest.fixture(scope="module")
def trusted(tmp_path_factory):
    """An agent with a token, sent it: not `guarded`, which the wrong tokens above lock this box out of for a while."""
    a = start_agent(demo_model(tmp_path_factory), tmp_path_factory.mktemp("trusted"), "--token", TOKEN)
    yield a
    a.stop()


def test_every_control_call_accepted_with_the_token_is_refused_without_it(trusted):
    """schemathesis' ignored_auth: each control call the agent accepts with its token is sent again without it
    and with a wrong one; both must be refused. It bites only where calls are accepted, so some must be."""
    api = schemathesis.openapi.from_url(trusted.url + "/openapi.json")
    control = [op for op in (r.ok() for r in api.get_all_operations()) if op.label in CONTROL]
    assert {op.label for op in control} == CONTROL
    for operation in control:
        accepted = sum(fuzz(operation, mode, WITH_TOKEN)[200] for mode in schemathesis.GenerationMode)
        assert accepted, f"{operation.label}: no call accepted with the token, so ignored_auth checked nothing"


def test_a_method_no_route_takes_is_a_405_that_names_the_ones_it_takes(trusted):
    """schemathesis' coverage phase sends every path each method the schema does not list there (with the token:
    a control path's too), and its unsupported_method check wants a 405 with Allow; Allow must also name exactly
    the methods /openapi.json lists there, and HEAD and OPTIONS where the agent answers them. Only that phase
    sends them."""
    api = schemathesis.openapi.from_url(trusted.url + "/openapi.json")
    api.config.update(headers=WITH_TOKEN, request_timeout=HANG_S)
    api.config.phases.update(phases=["coverage"])
    api.config.generation.update(modes=[schemathesis.GenerationMode.NEGATIVE])  # the undeclared methods' mode
    api.config.checks.update(included_check_names=["unsupported_method"])
    paths = api.raw_schema["paths"]
    taken = {path: {m.upper() for m in methods} | {m for m in ("HEAD", "OPTIONS") if _answered(trusted, m, path)}
             for path, methods in paths.items()}
    refused: collections.Counter[str] = collections.Counter()
    failures = []
    for event in engine.from_schema(api).execute():
        if isinstance(event, (events.NonFatalError, events.FatalError)):
            failures.append(f"{event.label}: {event.value!r}")
        elif isinstance(event, events.ScenarioFinished):
            for method, path, allowed in _refusals(event.recorder):
                refused[path] += 1
                if allowed != taken[path]:
                    failures.append(f"{method} {path}: Allow names {sorted(allowed)}, it takes {sorted(taken[path])}")
            failures += [f"{check.name}: {check.failure_info.failure.title}" for node in event.recorder.checks.values()
                         for check in node if check.status is Status.FAILURE]
    assert failures == []
    assert refused.keys() == paths.keys()


def _answered(agent, method: str, path: str) -> bool:
    return httpx.request(method, agent.url + path, headers=WITH_TOKEN, timeout=HANG_S).status_code != 405


def _refusals(recorder) -> Iterator[tuple[str, str, set[str]]]:
    """Each 405 of a schemathesis scenario: its method, its path and the methods its Allow names (schemathesis
    keeps a header as the list of its values)."""
    for case_id, interaction in recorder.interactions.items():
        if interaction.response is not None and interaction.response.status_code == 405:
            allow = interaction.response.headers.get("allow", [])
            yield (interaction.request.method, recorder.cases[case_id].value.path,
                   {m.strip().upper() for value in allow for m in value.split(",") if m.strip()})


def test_a_knobs_change_is_what_they_list_until_the_next_one(trusted):
    """Stateful: schemathesis follows /openapi.json's link from PUT /v1/knobs to GET /v1/knobs, in sequences
    of changes (some refused: drawn invalid, or without the token) and listings. An accepted change answers
    the values it was sent; a listing shows the last accepted change's values: a refused one changed nothing."""
    api = schemathesis.openapi.from_url(trusted.url + "/openapi.json").include(path="/v1/knobs")
    steps: collections.Counter[str] = collections.Counter()

    class KnobChanges(api.as_state_machine()):
        def setup(self) -> None:
            self.knobs = _values(trusted.get("/v1/knobs").json())

        def get_call_kwargs(self, case) -> dict:
            return {"headers": WITH_TOKEN, "timeout": CONTROL_HANG_S if case.method == "PUT" else HANG_S}

        def validate_response(self, response, case, **kwargs) -> None:
            steps[f"{case.method} {response.status_code}"] += 1
            case.validate_response(response, checks=CHECKS, headers=WITH_TOKEN)
            if case.method == "PUT" and response.status_code == 200:
                knobs = _values(response.json())
                assert {name: knobs[name] for name in case.body} == case.body
                self.knobs = knobs
            elif case.method == "GET":
                assert _values(response.json()) == self.knobs

    KnobChanges.run(settings=settings(max_examples=EXAMPLES, stateful_step_count=8, deadline=None, database=None,
                                      suppress_health_check=list(HealthCheck), derandomize=True))
    assert steps["PUT 200"] and steps["GET 200"], steps


def _values(knobs: dict) -> dict:
    return {name: knob["value"] for name, knob in knobs.items()}


def test_control_calls_declare_the_token_where_the_agent_has_one(agent, guarded):
    for served, schemes, refusals in ((agent, {}, {"403"}), (guarded, {"token"}, {"401", "429"})):
        schema = served.get("/openapi.json").json()
        assert set(schema["components"].get("securitySchemes", {})) == set(schemes)
        for path, method in (("/v1/knobs", "put"), ("/v1/cache/preload", "post")):
            operation = schema["paths"][path][method]
            assert operation.get("security", []) == ([{"token": []}] if schemes else [])
            assert set(operation["responses"]) >= refusals | {"200", "400", "413", "422", "503"}


def test_the_knobs_schema_is_what_the_agent_lists(agent):
    """The bounds PUT /v1/knobs is drawn from are the live ones GET /v1/knobs shows (they depend on the machine)."""
    described = agent.get("/openapi.json").json()["components"]["schemas"]["KnobChanges"]["properties"]
    knobs = agent.get("/v1/knobs").json()
    assert described.keys() == knobs.keys()
    for name, knob in knobs.items():
        drawn = described[name]
        assert {"bool": "boolean", "str": "string", "int": "integer", "float": "number"}[knob["type"]] == drawn["type"]
        assert (drawn.get("minimum"), drawn.get("maximum"), drawn.get("enum")) == (
            knob.get("min"), knob.get("max"), knob.get("choices")), name


def test_no_control_call_addressed_to_another_host_changes_a_token_less_agent(agent, before):
    """DNS rebinding: a web page's requests reach a loopback agent under the page's own host name."""
    api = schemathesis.openapi.from_url(agent.url + "/openapi.json")
    control = [op for op in (r.ok() for r in api.get_all_operations()) if op.label in CONTROL]
    assert {op.label for op in control} == CONTROL
    knobs, cache = agent.get("/v1/knobs").json(), agent.get("/v1/status").json()["cache"]
    changes = len(queries.knob_history(agent.db))
    for operation in control:
        for mode in schemathesis.GenerationMode:
            fuzz(operation, mode, {"Host": "attacker.example:8600"}, refused=True)
    assert agent.get("/v1/knobs").json() == knobs
    assert agent.get("/v1/status").json()["cache"]["resident_experts"] == cache["resident_experts"]
    assert len(queries.knob_history(agent.db)) == changes


def test_the_agent_answers_a_known_greedy_completion_as_before(agent, before):
    assert seen["inputs"] >= EXAMPLES  # the fuzzing above ran
    assert agent.complete(**KNOWN)["choices"][0]["text"] == before
    if report := os.environ.get("FLASHMOE_FUZZ_REPORT"):
        counts = {key: seen[key] for key in ("inputs", "2xx", "4xx", "5xx", "over 5 s")}
        Path(report).write_text(json.dumps({"examples_per_operation": EXAMPLES, **counts}, indent=1) + "\n")
