"""The agent's HTTP routes (FastAPI): OpenAI-style completions, knobs, status, preload, /metrics.

Routes only translate HTTP to Runtime calls. Control calls (PUT /v1/knobs, POST /v1/cache/preload)
need the bearer token when the agent has one, and a Host header naming loopback when it has none
(access.loopback: DNS rebinding); the `X-FlashMoE-Source` header says who changed a
knob ("api" by default, "dashboard" from the dashboard) and goes into the store with the change.

Work per request is bounded before it starts (agent.serve.limits): a body over the limit is refused
unread (413), a text prompt over `max_prompt_bytes` is refused before it is tokenized (413), and
tokenizing runs on one worker thread (the tokenizer releases the GIL), so the event loop keeps
answering /v1/status meanwhile. A client that goes away cancels its request,
streaming or not. A completion that the agent's shutdown ends early is a 503 with Retry-After, not its
text so far as if it were the answer; a stream, which has sent its 200, ends with an error event (which
OpenAI's clients raise) and [DONE]; either is logged in one line. Every 503 carries Retry-After.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import reprlib
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Body, Depends, FastAPI, Header, HTTPException, Query, Request, Security
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from access.guesses import GuessLimit, lockout_message
from access.loopback import addressed_to_loopback
from agent.serve.api_schema import (KNOBS_AS_SET, METRICS, STREAMED, Knobs, ModelList, Preloaded, Status, answers,
                                    describe, errors)
from agent.serve.engine import STEP_PROFILES
from agent.serve.knobs import SOURCES, KnobError
from agent.serve.limits import MAX_JSON_DEPTH, MAX_PROMPT_BYTES, body_limit, nests_deeper
from agent.serve.metrics import DeviceLabelled
from agent.serve.requests import CompletionRequest, PreloadRequest
from agent.serve.runtime import Runtime
from agent.serve.scheduler import ControlRefused, Event, Overloaded
from agent.serve.scheduler import Request as Job
from agent.serve.stops import CompletionText
from machine.task_limit import AT_TASK_LIMIT, THREAD_REFUSED

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5   # a 503's: an agent restarted by its process manager is back in about this long
CLIENT_SOURCES = SOURCES[:2]  # "guard", "restore" and "cli" are the agent's own
BEARER_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="flashmoe-agent"'}   # RFC 9110: a 401 names its scheme
UNPARSED = "There was an error parsing the body"   # FastAPI's answer to a body its JSON parser raised on


def create_app(runtime: Runtime, tokenizer, device_name: str, token: str | None = None,
               max_prompt_bytes: int = MAX_PROMPT_BYTES) -> FastAPI:
    # no /docs nor /redoc: their pages load Swagger UI and ReDoc from a CDN, blank on an offline edge box
    app = FastAPI(title="FlashMoE agent", version="0.1.0", docs_url=None, redoc_url=None,
                  description="MoE inference with experts on the SSD behind a learned RAM cache.",
                  responses=errors(400, 413))   # any body: BodyLimit's, and FastAPI's for one not JSON
    app.add_exception_handler(StarletteHTTPException, _http_error)  # ours, and FastAPI's own (a body not JSON)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(RuntimeError, _thread_refused)
    app.add_middleware(BodyLimit, limit=body_limit(max_prompt_bytes))
    app.add_middleware(HeadAsGet)
    # one tokenizing thread: a burst of long prompts queues for one core and leaves the other to the event loop
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    model_name = runtime.opts.model_dir.name
    config = runtime.engine.config
    positions = _positions(config.max_seq_len, runtime.opts.kv_budget)
    stop_ids = frozenset([] if config.eos_token_id is None else [config.eos_token_id])
    exposed = DeviceLabelled(runtime.metrics.registry, device_name)
    guesses = GuessLimit()
    stopping = threading.Event()

    def stop_serving() -> None:
        """The server's shutdown: requests the scheduler then ends early are told so (503), not answered in part."""
        stopping.set()
        runtime.scheduler.close()

    app.state.stop_serving = stop_serving

    def control(request: Request) -> None:
        authorization = request.headers.get("authorization")
        if token is None:
            host = request.headers.get("host", "")
            if not addressed_to_loopback(host):
                raise HTTPException(403, f"this agent has no token, so it takes control calls only addressed to "
                                         f"a loopback host (127.0.0.1, [::1] or localhost), not Host: "
                                         f"{reprlib.repr(host)}; call it at http://127.0.0.1:<port>, or start it "
                                         f"with --token to control it under another name")
            return
        client = request.client.host if request.client else None
        if wait := guesses.wait_s(client):   # locked out: not even the right token is heard, or guessing goes on
            raise HTTPException(429, lockout_message(wait), headers={"Retry-After": str(math.ceil(wait))})
        scheme, _, given = (authorization or "").strip().partition(" ")
        if authorization and scheme.lower() != "bearer":     # RFC 7235: the scheme is case-insensitive
            raise HTTPException(401, "the Authorization header is without the Bearer scheme: send "
                                     "'Authorization: Bearer <token>'", headers=BEARER_CHALLENGE)
        if secrets.compare_digest(given.strip().encode(), token.encode()):
            guesses.right(client)
            return
        if given:   # a missing token is no guess (a dashboard without FLASHMOE_TOKEN, a forgotten header)
            wrong = guesses.wrong(client, given.strip())
            log.warning("wrong token on %s %s from %s (%s)%s", request.method, request.url.path, client,
                        "one it sent before: no new guess" if wrong.repeated else f"{wrong.in_a_row} in a row",
                        f"; locked out for {wrong.lock_s:.0f} s" if wrong.lock_s else "")
        raise HTTPException(401, "this control call needs the agent's token: send 'Authorization: Bearer <token>' "
                                 "(the one the agent was started with: FLASHMOE_TOKEN, --token-file or --token)",
                            headers=BEARER_CHALLENGE)

    # control calls' statuses, and their scheme in /openapi.json (control() reads the header itself, to say
    # what is wrong with one that is not a bearer token)
    bearer = HTTPBearer(auto_error=False, scheme_name="token",
                        description="the agent's token: serve --token, --token-file or FLASHMOE_TOKEN")
    controlled = [Depends(control), *([Security(bearer)] if token else [])]
    control_errors = errors(401, 429, 422, 503) if token else errors(403, 422, 503)

    def source(x_flashmoe_source: str = Header("api", json_schema_extra={"enum": list(CLIENT_SOURCES)})) -> str:
        if x_flashmoe_source not in CLIENT_SOURCES:
            raise HTTPException(400, f"X-FlashMoE-Source must be one of {', '.join(CLIENT_SOURCES)}; "
                                     f"got {x_flashmoe_source!r}")
        return x_flashmoe_source

    @app.get("/docs", include_in_schema=False)
    @app.get("/redoc", include_in_schema=False)
    def no_docs_page() -> JSONResponse:
        message = ("this agent serves no API page (Swagger UI and ReDoc load their scripts from the network); "
                   "its API is described at /openapi.json: open that in any OpenAPI viewer")
        return _error_body(404, message, message)

    # answers(X): the answer's shape in /openapi.json, unchecked at run time (a slip would be a 500 to a client);
    # the fuzz test checks every answer against it
    @app.get("/v1/models", **answers(ModelList))
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(runtime.started),
                                            "owned_by": "flashmoe"}]}

    @app.get("/v1/status", **answers(Status, errors(422)))
    def status(step_profiles: int = Query(STEP_PROFILES, ge=0, le=STEP_PROFILES, description=(
            f"how many of the most recent model steps' profiles to list, 0 to {STEP_PROFILES}: a poller that "
            f"shows none asks for 0 (all {STEP_PROFILES} are ~80 KB of JSON)"))) -> dict[str, Any]:
        return runtime.status(step_profiles)

    @app.get("/v1/knobs", **answers(Knobs))
    def get_knobs() -> dict[str, Any]:
        return runtime.knobs.describe()

    @app.put("/v1/knobs", dependencies=controlled, **answers(Knobs, control_errors, KNOBS_AS_SET))
    def put_knobs(changes: dict[str, Any] = Body(...), who: str = Depends(source)) -> dict[str, Any]:
        return _controlled(lambda: runtime.set_knobs(changes, who))

    @app.post("/v1/cache/preload", dependencies=controlled, **answers(Preloaded, control_errors))
    def preload(body: PreloadRequest) -> dict[str, Any]:
        loaded = _controlled(lambda: runtime.preload([tuple(k) for k in body.experts]))
        return {"requested": len(body.experts), "loaded": loaded, "status": runtime.status(0)["cache"]}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: METRICS})
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(exposed), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", responses={**errors(404, 422, 429, 500, 503), 200: STREAMED})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if body.model is not None and body.model != model_name:  # another model's answer would be a wrong one
            message = (f"the model {reprlib.repr(body.model)} is not served here: this agent serves {model_name!r} "
                       f"(GET /v1/models); send that, or leave model out")
            return _error_body(404, message, message, code="model_not_found", param="model")
        size = len(body.prompt.encode()) if isinstance(body.prompt, str) else 0
        if size > max_prompt_bytes:
            raise HTTPException(413, f"prompt is {size} bytes; this agent takes at most {max_prompt_bytes} "
                                     f"(serve --max-prompt-bytes)")
        loop = asyncio.get_running_loop()
        prompt_ids = await loop.run_in_executor(tokenizing, _prompt_ids, body, tokenizer, config.vocab_size,
                                                positions)
        queue: asyncio.Queue[Piece] = asyncio.Queue()
        completion = CompletionText(tokenizer.decode, body.stop)
        job = Job(id=f"cmpl-{uuid.uuid4().hex[:24]}", prompt_ids=prompt_ids, max_tokens=body.max_tokens,
                  temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop_ids=stop_ids,
                  sink=lambda ev: _pass_on(ev, job, completion, loop, queue))
        try:
            runtime.submit(job)
        except Overloaded as exc:
            response = _error_body(429, str(exc), str(exc), code="rate_limit_exceeded")
            response.headers["Retry-After"] = "1"   # OpenAI's clients wait and retry a 429
            return response
        except RuntimeError as exc:
            raise HTTPException(503, str(exc)) from None
        head = {"id": job.id, "object": "text_completion", "created": int(time.time()), "model": model_name}
        if body.stream:  # Starlette cancels the stream when its client goes away
            return _Stream(job, _stream(job, queue, head, stopping), media_type="text/event-stream")
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, job))
        try:
            return await _collect(job, queue, head, stopping)
        except asyncio.CancelledError:  # uvicorn's shutdown gave up on a step (memory thrash makes them that slow)
            return _stopped(job)
        finally:
            watcher.cancel()

    describe(app, model_name, config.vocab_size, positions[0],
             (runtime.cache.index.n_layers, runtime.cache.index.n_experts), lambda: runtime.knobs.specs.values())
    return app


def _controlled(change: Callable[[], Any]) -> Any:
    """A control call's change, or the HTTP error that says why it was refused: nothing changed either way."""
    try:
        return change()
    except KnobError as exc:
        raise HTTPException(400, str(exc)) from None
    except ControlRefused as exc:  # the running step did not end in time, or the agent is stopping
        raise HTTPException(503, str(exc)) from None


def _error_body(status: int, message: str, detail: Any, code: int | str | None = None,
                param: str | None = None) -> JSONResponse:
    """FastAPI's {"detail"} (the dashboard reads it) and OpenAI's {"error": {"message"}} (its clients raise it);
    `code` is OpenAI's where it has one (model_not_found), else the status."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = {"message": message, "type": kind, "param": param, "code": status if code is None else code}
    response = JSONResponse({"detail": detail, "error": error}, status_code=status)
    if status == 503:   # a client that may retry is told when (the shutdown, a step that did not end in time)
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def _thread_refused(request, exc: RuntimeError) -> JSONResponse:
    """A request's worker thread the kernel would not create is a 503 that says why (it was Starlette's bare 500);
    any other RuntimeError stays an error of the agent's."""
    if str(exc) != THREAD_REFUSED:
        raise exc
    log.warning("cannot answer %s %s: %s", request.method, request.url.path, AT_TASK_LIMIT)
    return _error_body(503, f"the agent cannot start a thread to answer: {AT_TASK_LIMIT}", THREAD_REFUSED)


async def _http_error(request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.detail == UNPARSED and exc.__cause__ is not None:
        exc = StarletteHTTPException(400, _unparsed(exc.__cause__))
    response = _error_body(exc.status_code, str(exc.detail), exc.detail)
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:   # Starlette names the methods of the first route at the path alone
        response.headers["Allow"] = ", ".join(_methods_at(request))
    return response


def _methods_at(request: Request) -> list[str]:
    """Every method some route takes at the request's path, HEAD wherever GET is (HeadAsGet)."""
    methods = {m for route in request.app.router.routes if route.matches(request.scope)[0] is not Match.NONE
               for m in getattr(route, "methods", None) or ()}
    return sorted(methods | ({"HEAD"} if "GET" in methods else set()))


def _why(error: dict) -> str:
    """pydantic's message; a body that is not JSON also says where and why (FastAPI's says "JSON decode error")."""
    if error["type"] == "json_invalid":
        return f"not valid JSON at character {error['loc'][-1]}: {error.get('ctx', {}).get('error', 'unreadable')}"
    return error["msg"]


def _unparsed(cause: BaseException) -> str:
    """Why the JSON parser gave up on a body (FastAPI's own message names no reason)."""
    if isinstance(cause, UnicodeDecodeError):
        byte = cause.object[cause.start:cause.start + 1]
        return f"the body is not UTF-8: byte {cause.start} is {byte!r}; send JSON in UTF-8"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return (f"the body has a number of more than {sys.get_int_max_str_digits()} digits, more than the JSON "
                f"parser reads; no field of this API takes one")
    return f"the body could not be parsed as JSON: {type(cause).__name__}: {cause}"


async def _validation_error(request, exc: RequestValidationError) -> JSONResponse:
    # Not the refused input itself: it may be NaN (no JSON can carry it back) or megabytes long.
    errors = [{"type": e["type"], "loc": list(e["loc"]), "msg": _why(e)} for e in exc.errors()]
    message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in errors)
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    json_body = not media or media == "application/json" or media.endswith("+json")
    if not json_body and any(e["loc"][:1] == ["body"] for e in errors):
        # FastAPI reads such a body as bytes, not JSON: "body: Input should be a valid dictionary" of a dictionary
        message = f"the body is read as JSON only with Content-Type: application/json, not {media}; {message}"
    return _error_body(422, message, jsonable_encoder(errors))


class HeadAsGet:
    """ASGI middleware: HEAD is answered wherever GET is, as RFC 9110 asks (curl -I, uptime checks): routed as GET;
    the server sends the head alone, as the request it holds is a HEAD."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is refused with 413 before it is read whole
    (by its Content-Length when it has one), so no handler parses or tokenizes it, and one nested deeper
    than MAX_JSON_DEPTH with 400 before it is parsed. A body within the limits is handed on, and the
    connection's later messages (a disconnect) too."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._refuse(send)
        if nests_deeper(body):
            message = (f"the JSON body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep, this agent's "
                       f"limit; its requests nest 3 at most")
            return await _error_body(400, message, message)({"type": "http"}, _no_body, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        message = (f"the request body is over this agent's limit of {self.limit} bytes; shorten the prompt "
                   f"(serve --max-prompt-bytes sets the limit)")
        await _error_body(413, message, message)({"type": "http"}, _no_body, send)


async def _no_body() -> dict:
    return {"type": "http.disconnect"}


async def _cancel_on_disconnect(receive: Callable[[], Awaitable[dict]], job: Job) -> None:
    """Once the body is read, the next message is the client's disconnect: its request stops."""
    while (await receive())["type"] != "http.disconnect":
        pass
    job.cancelled = True


def _positions(context: int, kv_budget: int) -> tuple[int, str]:
    """The positions a request may take, its prompt and max_tokens together, and which limit that is: the smaller
    of the model's context and this agent's KV budget (the context on a tie)."""
    return min((context, f"the model's context of {context} tokens"),
               (kv_budget, f"this agent's KV budget of {kv_budget} positions (serve --kv-budget)"),
               key=lambda pair: pair[0])


def _prompt_ids(body: CompletionRequest, tokenizer, vocab_size: int, positions: tuple[int, str]) -> list[int]:
    """The prompt as token ids, checked against the vocabulary and the `positions` a request may take (runs off
    the event loop)."""
    ids = list(tokenizer.encode(body.prompt)) if isinstance(body.prompt, str) else list(body.prompt)
    if not ids:
        raise HTTPException(400, "prompt is empty: give text or at least one token id")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise HTTPException(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    limit, named = positions
    if len(ids) + body.max_tokens > limit:
        raise HTTPException(400, f"prompt ({len(ids)} tokens) + max_tokens ({body.max_tokens}) exceeds {named}; "
                                 f"shorten one of them")
    return ids


Piece = tuple[Event, str]   # an event and the text it adds to the answer


def _pass_on(ev: Event, job: Job, completion: CompletionText, loop: asyncio.AbstractEventLoop,
             queue: asyncio.Queue[Piece]) -> None:
    """The job's sink (on the scheduler thread): decodes its tokens and cancels it at a stop string,
    before its next step, so it ends there (finish_reason "cancelled", told as "stop")."""
    if ev.kind == "token":
        piece = completion.add(ev.token)
        if completion.stopped:
            job.cancelled = job.stopped = True
    else:
        piece = completion.finish()
        if ev.kind == "done" and completion.stopped:
            ev = dataclasses.replace(ev, finish_reason="stop")
    try:
        loop.call_soon_threadsafe(queue.put_nowait, (ev, piece))
    except RuntimeError:  # the event loop is closed: the server stopped and no one waits for the answer
        job.cancelled = True


def _usage(ev: Event) -> dict[str, int]:
    s = ev.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens}


def _flashmoe(ev: Event) -> dict[str, float]:
    """Per-request timings and cache traffic (an extension field; OpenAI clients ignore it)."""
    s = ev.stats
    return {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s, "latency_s": s.latency_s, "expert_hits": s.hits,
            "expert_misses": s.misses, "bytes_read": s.bytes_read}


async def _pieces(job: Job, queue: asyncio.Queue[Piece]) -> AsyncIterator[Piece]:
    """The answer's text as it grows, one piece per token that adds some, then the last piece with
    the event that ended the request ("done" or "error")."""
    try:
        while True:
            ev, text = await queue.get()
            if ev.kind != "token":
                yield ev, text
                return
            if text:
                yield ev, text
    finally:
        job.cancelled = True  # a no-op once done; frees the slot if the client went away


def _shutdown_message(job: Job) -> str:
    """What a request the agent's shutdown ended early is told, logged once: not a part of its text as if it
    were whole."""
    log.info("the shutdown stopped %s after %d of its %d tokens", job.id, len(job.generated), job.max_tokens)
    return (f"the agent is shutting down: this completion was stopped after {len(job.generated)} of its "
            f"{job.max_tokens} tokens and is not returned; retry it against a running agent")


def _stopped(job: Job) -> JSONResponse:
    message = _shutdown_message(job)
    return _error_body(503, message, message)


def _shutdown_event(job: Job) -> str:
    """A stream's end when the shutdown stopped it: OpenAI's clients raise an event with "error"."""
    return _sse({"error": {"message": _shutdown_message(job), "type": "server_error", "code": 503}})


async def _collect(job: Job, queue: asyncio.Queue[Piece], head: dict, stopping: threading.Event) -> JSONResponse:
    text = ""
    async with contextlib.aclosing(_pieces(job, queue)) as pieces:  # closed (the job cancelled) on leaving
        async for ev, delta in pieces:
            text += delta
            if ev.kind == "error":
                raise HTTPException(500, f"generation failed: {ev.error}")
            if ev.kind == "done" and ev.finish_reason == "cancelled" and stopping.is_set():
                return _stopped(job)
            if ev.kind == "done":
                choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": ev.finish_reason}
                return JSONResponse({**head, "choices": [choice], "usage": _usage(ev), "flashmoe": _flashmoe(ev)})
    raise AssertionError("a request's events end with done or error")


async def _stream(job: Job, queue: asyncio.Queue[Piece], head: dict, stopping: threading.Event) -> AsyncIterator[str]:
    """SSE: one chunk per token that adds sendable text, a last chunk with finish_reason and usage, then [DONE]."""
    async with contextlib.aclosing(_pieces(job, queue)) as pieces:  # Starlette closes this one when the client goes
        async for ev, delta in pieces:
            if ev.kind == "token":
                yield _sse({**head, "choices": [{"text": delta, "index": 0, "logprobs": None, "finish_reason": None}]})
            elif ev.kind == "error":
                yield _sse({"error": {"message": f"generation failed: {ev.error}", "type": "server_error"}})
            elif ev.finish_reason == "cancelled" and stopping.is_set():
                yield _shutdown_event(job)
            else:
                yield _sse({**head, "choices": [{"text": delta, "index": 0, "logprobs": None,
                                                 "finish_reason": ev.finish_reason}],
                            "usage": _usage(ev), "flashmoe": _flashmoe(ev)})
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Stream(StreamingResponse):
    """A stream that uvicorn's shutdown cancels (a step that outlasts its graceful timeout: memory thrash makes
    them that slow) ends as one the shutdown stopped, not in a cancellation traceback and a cut-off body."""

    def __init__(self, job: Job, content: AsyncIterator[str], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await super().__call__(scope, receive, sending)
        except asyncio.CancelledError:
            if not started:
                return await _stopped(self.job)(scope, receive, send)
            for event in (_shutdown_event(self.job), "data: [DONE]\n\n"):
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
