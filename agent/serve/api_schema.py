"""What /openapi.json says beyond what FastAPI derives from the routes, so that it is what the agent answers.

FastAPI documents a route's 200 and, for a route with inputs, a 422 in its own body shape. The agent also
answers errors of its own (every one in `ErrorBody`: FastAPI's "detail" beside OpenAI's "error"), control
calls need a bearer token or a loopback Host, and the bounds of many inputs depend on the served model and
the machine: the model's id, its vocabulary and context, its layers and experts, and the knobs' ranges,
which change while the agent runs (a new memory limit). `answers` gives a route's 200 its shape, `errors`
the other statuses it answers; `describe` makes /openapi.json fill in those bounds each time it is asked.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, RootModel

from agent.experts.layout import QUANTS
from agent.knob import Knob, KnobState
from agent.model.dense_int8 import DENSE_MODES
from agent.prefetch_gate import MODES as PREFETCH_MODES
from agent.residency import SCOPES
from agent.serve.engine import StepProfile


class ErrorInfo(BaseModel):
    message: str = Field(description="what was wrong, and what to send instead")
    type: Literal["invalid_request_error", "server_error"]
    param: str | None = Field(description="the field at fault, where one is")
    code: int | str = Field(description="OpenAI's code where it has one (model_not_found), else the status")


class Issue(BaseModel):
    type: str
    loc: list[str | int] = Field(description="where: body, query or header, then the field")
    msg: str


class ErrorBody(BaseModel):
    detail: str | list[Issue] = Field(description="FastAPI's: the message, or a 422's issues")
    error: ErrorInfo = Field(description="OpenAI's, which its clients raise")


class Choice(BaseModel):
    text: str
    index: int
    logprobs: None
    finish_reason: Literal["stop", "length"] | None = Field(description="null in a stream's chunks but the last")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class RequestCost(BaseModel):
    """The request's timings and its share of its steps' expert traffic (an extension; OpenAI clients ignore it)."""
    ttft_s: float
    tpot_s: float
    latency_s: float
    expert_hits: float
    expert_misses: float
    bytes_read: float


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[Choice] = Field(min_length=1, max_length=1)
    usage: Usage
    flashmoe: RequestCost


class ServedModel(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ServedModel]


class Exact(BaseModel):
    """An object of the answer with these fields and no others (additionalProperties false): a field the agent adds
    to its answer without typing it here fails the fuzz test's schema check."""
    model_config = ConfigDict(extra="forbid")


class ListedKnob(KnobState):
    """A knob as GET /v1/knobs lists it: agent.knob.KnobState, what Knobs.describe() returns, closed as `Exact` is."""
    __pydantic_config__ = ConfigDict(extra="forbid")


Knobs = RootModel[dict[str, ListedKnob]]


class PrefetchState(Exact):
    """The adaptive prefetch (agent/prefetch_gate.py)."""
    mode: Literal[PREFETCH_MODES]
    issuing: bool = Field(description="whether the guessed reads are issued now")
    accuracy: float | None = Field(description="of the last `scored` guessed reads; null before any")
    scored: int
    break_even: float = Field(description="the accuracy below which the guessed reads do not pay")


class CacheState(Exact):
    resident_experts: int
    capacity_experts: int
    cache_bytes: int
    cap_bytes: int
    occupancy: float
    expert_bytes: int
    hits: int
    misses: int
    hit_rate: float
    bytes_read: int
    prefetch_accuracy: float
    prefetch: PrefetchState


class ExpertsCompute(Exact):
    """What the store's experts hold and how they are computed."""
    quant: Literal[QUANTS] | None = Field(description="null: the checkpoint's dtype")
    dtype: str = Field(description="the checkpoint's torch dtype, which the model computes in")
    int8_activations: bool | None = Field(description="whether int8 experts quantize bf16 activations too; null where "
                                                      "it does not apply (not int8, or not a bf16 model)")


class DamagedBlock(Exact):
    layer: int
    expert: int
    reason: str


class Verify(Exact):
    """serve --verify's check of every block's CRC32 while the agent is idle."""
    state: Literal["running", "done", "stopped"]
    checked_blocks: int
    started: float = Field(description="Unix time; 0 before it starts")
    finished: float | None


class StoreHealth(Exact):
    """Damaged blocks found by the size check at start, by reads while serving and by serve --verify."""
    blocks: int
    damaged: int
    damaged_blocks: list[DamagedBlock]
    verify: Verify | None = Field(description="null without serve --verify")


class OnlineUpdate(Exact):
    """An update swapped in, and how the one before it did in hindsight (null before it is judged)."""
    number: int
    time: float
    step: int
    decisions: int
    cpu_s: float
    judged_steps: int | None
    old_hit_rate: float | None
    new_hit_rate: float | None
    rolled_back: bool | None


class OnlineOff(Exact):
    enabled: Literal[False]


class OnlineOn(Exact):
    """The learned policy learning online (its online_learning knob)."""
    enabled: Literal[True]
    steps_seen: int
    cpu_s: float = Field(description="CPU time of the learning worker since it was turned on, start-up included")
    cpu_share_limit: float
    worker_failures: int
    updates: int
    rollbacks: int
    not_taken: int
    decisions: int
    updates_cpu_s: float = Field(description="CPU time of the updates' jobs alone")
    recent: list[OnlineUpdate] = Field(description="the most recent updates, oldest first")


class Status(Exact):
    """What GET /v1/status answers (agent/serve/runtime.py, Runtime.status)."""
    model: str = Field(description="the model directory")
    uptime_s: float
    routing: str = Field(description="the model's router, or the routing trace that decides (serve --route-trace)")
    policy: str
    backend: str
    scope: Literal[SCOPES]
    experts: ExpertsCompute
    dense: Literal[DENSE_MODES]
    cache: CacheState
    recent_hit_rate: float | None = Field(description="of the last 30 s's lookups; null without any")
    batch_size: int
    batch_limit: int
    queue_depth: int
    kv_positions: int
    kv_budget: int
    tokens_generated: int
    requests_unserved: dict[str, int]
    model_steps: int
    ssd_util: float | None = Field(description="0 to 1: the share of time the disk had reads in flight")
    ssd_util_source: str | None
    store: StoreHealth
    online_learning: OnlineOff | OnlineOn
    step_profiles: list[StepProfile]


class Preloaded(BaseModel):
    requested: int
    loaded: int
    status: CacheState


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                               "schema": {"type": "integer", "minimum": 0}}}
WHY: dict[int, dict[str, Any]] = {
    400: {"description": "the body is not UTF-8 JSON or nests too deep, or it asks for what is not there "
                         "(the message says which)"},
    401: {"description": "a control call without the agent's bearer token, or with another one",
          "headers": {"WWW-Authenticate": {"description": "the scheme: Bearer", "required": True,
                                           "schema": {"type": "string"}}}},
    403: {"description": "a control call to a token-less agent, addressed to a host other than loopback "
                         "(DNS rebinding)"},
    404: {"description": "model_not_found: `model` names a model this agent does not serve"},
    413: {"description": "the body, or a text prompt, is over this agent's limit (serve --max-prompt-bytes)"},
    422: {"description": "an input fails validation: each issue names it and why"},
    429: {"description": "as many requests wait as serve --max-waiting (completions), or this client sent wrong "
                         "tokens too often (control calls)", "headers": RETRY_AFTER},
    500: {"description": "generation failed (the message says why)"},
    503: {"description": "the agent is shutting down, or the model's running step did not end in time; nothing "
                         "changed", "headers": RETRY_AFTER},
}


# 200s the routes' return types do not say: a completion and its stream (OpenAPI 3.1's schema of one event),
# and /metrics
STREAMED = {"model": Completion, "description": "the completion; with stream: true, its server-sent events",
            "content": {"text/event-stream": {"schema": {
                "type": "object", "required": ["data"],
                "properties": {"data": {"type": "string", "description": "a chunk as JSON; the last: [DONE]"}}}}}}
METRICS = {"description": "Prometheus' text exposition format",
           "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}


# OpenAPI links: the call that reads what a 200 left (schemathesis' stateful test follows them)
KNOBS_AS_SET = {"GetKnobs": {"operationRef": "#/paths/~1v1~1knobs/get",
                             "description": "GET /v1/knobs lists the values this change left, until the next one"}}


def answers(answer: type[BaseModel], responses: dict[int | str, dict[str, Any]] | None = None,
            links: dict[str, Any] | None = None) -> dict[str, Any]:
    """A route's arguments that document its 200 as `answer` (and its `links`) besides `responses`, without
    checking it at run time."""
    ok = {"model": answer, **({"links": links} if links else {})}
    return {"response_model": None, "responses": {200: ok, **(responses or {})}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route that may answer these error statuses, each with ErrorBody."""
    return {status: {"model": ErrorBody, **WHY[status]} for status in statuses}


def describe(app: FastAPI, model_name: str, vocab_size: int, max_positions: int, experts: tuple[int, int],
             knobs: Callable[[], Iterable[Knob]]) -> None:
    """/openapi.json with the served model's bounds: `model` is its id or null; a prompt is non-empty, of
    ids in the vocabulary; max_tokens leaves a position for the prompt; a preloaded expert is
    [layer, expert] of the store's (`experts`: layers, experts a layer); a knobs change is a non-empty
    object of the knobs as they are bounded when asked."""
    built = app.openapi  # FastAPI's: derives the schema once, then returns it

    def openapi() -> dict[str, Any]:
        schema = built()
        parts = schema["components"]["schemas"]
        completion = parts["CompletionRequest"]["properties"]
        completion["model"]["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]
        ids = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
        completion["prompt"]["anyOf"] = [{"type": "string", "minLength": 1},
                                         {"type": "array", "items": ids, "minItems": 1, "maxItems": max_positions - 1}]
        completion["max_tokens"]["anyOf"][0]["maximum"] = max_positions - 1   # (or null: the default)
        layers, per_layer = experts
        parts["PreloadRequest"]["properties"]["experts"]["items"]["prefixItems"] = [
            {"type": "integer", "minimum": 0, "maximum": layers - 1},
            {"type": "integer", "minimum": 0, "maximum": per_layer - 1}]
        parts["KnobChanges"] = {"type": "object", "minProperties": 1, "additionalProperties": False,
                                "properties": {k.name: k.json_schema() for k in knobs()},
                                "description": "the knobs to change (GET /v1/knobs lists them): all or none"}
        body = schema["paths"]["/v1/knobs"]["put"]["requestBody"]["content"]["application/json"]
        body["schema"] = {"$ref": "#/components/schemas/KnobChanges"}
        return schema

    app.openapi = openapi
