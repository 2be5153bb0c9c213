"""The agent stopping while a model step outlasts uvicorn's graceful shutdown (memory thrash makes steps
that slow): the step's events reach a closed event loop, and app._pass_on's guard must keep the
scheduler thread alive, so the agent still stops, and the client must get an answer that says so, not hang:
a 503, or for a stream (whose 200 is sent) an error event that OpenAI's client raises, then [DONE]."""
from __future__ import annotations

import logging
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from agent.serve import app as app_module
from agent.serve.app import create_app
from agent.serve.runtime import Runtime, ServeOptions
from agent.serve.server import _server_class, bind
from agent.tokenizer import load_tokenizer
from agents import demo_model

GRACE_S = 1  # uvicorn's graceful shutdown here (the agent's is 10 s)


def ask(url: str, stream: bool) -> dict:
    """A completion as httpx (a plain answer) or as OpenAI's client reading a stream sees it end."""
    if not stream:
        return {"response": httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 40}, timeout=60)}
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused-on-loopback", max_retries=0, timeout=60)
    try:
        for _ in client.completions.create(model=None, prompt="hi", max_tokens=40, stream=True):
            pass
    except openai.APIError as exc:
        return {"raised": exc}
    return {}


@pytest.mark.parametrize("stream", [False, True])
def test_a_step_that_outlasts_the_shutdown_ends_on_the_closed_loop_and_the_client_does_not_hang(
        tmp_path_factory, monkeypatch, caplog, stream):
    """A stream ended in uvicorn's "Exception in ASGI application" traceback (its CancelledError) and a body cut
    off without [DONE], which OpenAI's client did not raise."""
    caplog.set_level(logging.INFO, "agent.serve.app")
    model = demo_model(tmp_path_factory)
    rt = Runtime(ServeOptions(model, cache_cap="50%"), CollectorRegistry())
    rt.start()
    in_step, release, passed_on, died = threading.Event(), threading.Event(), [], []
    real_step, real_pass_on = rt.engine.step, app_module._pass_on

    def slow_step(batch):                  # the one stand-in: a step as slow as under memory thrash
        in_step.set()
        release.wait(60)
        return real_step(batch)

    def pass_on(ev, job, completion, loop, queue):  # the real one, noting whether its loop was closed
        passed_on.append((ev.kind, loop.is_closed()))
        real_pass_on(ev, job, completion, loop, queue)

    rt.engine.step = slow_step
    monkeypatch.setattr(app_module, "_pass_on", pass_on)
    monkeypatch.setattr(threading, "excepthook", died.append)
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = create_app(rt, load_tokenizer(model), "test")
    server = _server_class()(uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=GRACE_S),
                             app.state.stop_serving)
    outcome: dict = {}

    def client() -> None:
        try:
            outcome.update(ask(url, stream))
        except httpx.HTTPError as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    def stop_mid_step() -> None:
        in_step.wait(60)
        server.should_exit = True          # what SIGTERM does

    threads = [threading.Thread(target=client), threading.Thread(target=stop_mid_step)]
    try:
        for t in threads:
            t.start()
        server.run(sockets=[sock])         # returns when shut down: asyncio.run has closed its loop
        closed = time.monotonic()
        assert in_step.is_set() and not release.is_set()  # the step still runs
        threads[0].join(30)
        assert not threads[0].is_alive(), "the client hangs"
        # uvicorn cancels the handler, which answers 503 naming the shutdown (it was uvicorn's 500)
        if stream:
            assert isinstance(outcome.get("raised"), openai.APIError), outcome
            assert "the agent is shutting down" in outcome["raised"].message
        else:
            assert "error" not in outcome and outcome["response"].status_code == 503, outcome
            assert "the agent is shutting down" in outcome["response"].json()["error"]["message"]
            assert outcome["response"].headers["Retry-After"] == "5"
        assert outcome["at"] - closed < 10
        said = [r.getMessage() for r in caplog.records if r.name == "agent.serve.app"]
        assert len(said) == 1 and said[0].startswith("the shutdown stopped cmpl-"), said
        assert not [r for r in caplog.records if r.exc_info], "a traceback in the log"
    finally:
        release.set()
        rt.stop()
    assert not rt.scheduler._thread.is_alive() and not died  # the scheduler ended its request and stopped
    assert ("token", True) in passed_on and passed_on[-1] == ("done", True)  # the guard ran, on a closed loop
