"""The dashboard's side of the agent's control API: status, knobs, completions.

Every call carries `X-FlashMoE-Source: dashboard` so the agent records who turned a knob; control
calls (PUT /v1/knobs) carry the agent's bearer token when the dashboard has one (FLASHMOE_TOKEN,
the variable `flashmoe-cli serve` reads too). An unreachable agent raises AgentOffline (an
AgentError), which pages turn into a plain "agent offline" notice. One Agent keeps one connection
pool: a new httpx client per call would build a TLS context each time (~0.2 s here), more than the
page's whole render budget allows. Every Agent shares one TLS context (tls()): the Fleet page's push
builds one Agent per device, and a context each cost ~20 ms of CPU, even for http://.
"""
from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx

from access.address import url_problem
from access.answer_shape import KNOB_VALUE, NUMBER, shape_problem
from access.whole_answer import AnswerTooLarge, read_whole
from dashboard.transforms import literal

SOURCE_HEADER = {"X-FlashMoE-Source": "dashboard"}
TOKEN_ENV = "FLASHMOE_TOKEN"
TIMEOUT_S = 3.0
KNOBS_TIMEOUT_S = 75.0        # the agent waits for the running step to end and gives up after 60 s
COMPLETION_TIMEOUT_S = 120.0

# What the dashboard reads of each answer, checked once here rather than by every page: another JSON service at
# the agent's address (or a Fleet target) was a KeyError's box wherever a page read a field it lacked.
STATUS_SHAPE = {"policy": str, "uptime_s": NUMBER, "cache": {"expert_bytes": int, "prefetch_accuracy": NUMBER}}
KNOB_BOUNDS = {"bool": {}, "int": {"min": NUMBER, "max": NUMBER}, "float": {"min": NUMBER, "max": NUMBER},
               "str": {"choices": list}}
COMPLETION_SHAPE = {"usage": {"completion_tokens": int},
                    "flashmoe": {"expert_hits": NUMBER, "expert_misses": NUMBER}}


class AgentError(RuntimeError):
    """The agent answered with a failure the dashboard cannot act on."""


class AgentMisaddressed(AgentError):
    """The agent's address is no URL it could answer at (FLASHMOE_AGENT_URL mistyped)."""


class AgentOffline(AgentError):
    """The agent did not answer at its URL."""


class AgentBusy(AgentOffline):
    """The agent took the connection but did not answer in time: it runs, slowly (memory thrash, a long
    step), which is no reason to tell the user to start it."""


@dataclass(frozen=True)
class KnobAnswer:
    accepted: bool
    status_code: int
    knobs: dict[str, Any]     # the agent's knobs after the call (empty when refused)
    detail: str               # the agent's validation error when refused

    def message(self) -> str:
        return "accepted" if self.accepted else f"refused ({self.status_code}): {self.detail}"


@cache
def tls() -> ssl.SSLContext:
    """The TLS context every Agent's client uses, built once: httpx builds one per client by default, loading
    the trust store (~20 ms of CPU). A context may serve many connections and threads at once."""
    return httpx.create_ssl_context()


class Agent:
    """A client of one agent at `base_url` (thread-safe: the sweep thread shares it)."""

    def __init__(self, base_url: str, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._misaddressed = url_problem(self.base_url)
        self._http = httpx.Client(headers=SOURCE_HEADER, timeout=TIMEOUT_S, verify=tls())
        self._control = {"Authorization": f"Bearer {token}"} if token else {}

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client's connections (an Agent made for one call; the pages' cached ones live on)."""
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if self._misaddressed:
            raise AgentMisaddressed(f"{self.base_url!r} is not an agent's address: {self._misaddressed}; set "
                                    f"FLASHMOE_AGENT_URL to the address `flashmoe-cli serve` listens on (default "
                                    f"http://127.0.0.1:8600)")
        waited = kwargs.pop("timeout", self._http.timeout.read)
        try:
            return read_whole(self._http, method, f"{self.base_url}{path}", waited, **kwargs)
        except AnswerTooLarge as err:
            raise self._not_agent(method, path, f"with {err}") from None
        except (httpx.ReadTimeout, httpx.WriteTimeout) as err:
            raise AgentBusy(f"the agent at {self.base_url} took the request but did not answer within "
                            f"{waited:g} s: it is running but busy (memory thrash or a long step)") from err
        except httpx.TransportError as err:
            raise AgentOffline(f"the agent at {self.base_url} did not answer ({type(err).__name__}); "
                               "start it with `flashmoe-cli serve` or set FLASHMOE_AGENT_URL") from err

    def _json(self, method: str, path: str, problem: Callable[[dict[str, Any]], str | None],
              **kwargs: Any) -> dict[str, Any]:
        response = self._request(method, path, **kwargs)
        if response.status_code >= 400:
            raise AgentError(f"the agent answered {response.status_code} to {method} {path}: "
                             f"{error_detail(response)}")
        return self._object(response, method, path, problem)

    def _object(self, response: httpx.Response, method: str, path: str,
                problem: Callable[[dict[str, Any]], str | None]) -> dict[str, Any]:
        """The answer's JSON object, of the shape `problem` finds nothing wrong with. Anything else is not the
        agent's: FLASHMOE_AGENT_URL set to the dashboard's own port answered HTML, and every page showed a
        JSONDecodeError's traceback; another JSON service's {"x": 1} was a KeyError's box on three pages."""
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            kind = response.headers.get("content-type", "no content type").split(";")[0]
            raise self._not_agent(method, path, f"with {literal(kind)}, not the agent's JSON")
        if wrong := problem(body):
            raise self._not_agent(method, path, wrong)
        return body

    def _not_agent(self, method: str, path: str, answer: str) -> AgentError:
        return AgentError(f"{self.base_url} is not a FlashMoE agent: it answered {method} {path} {answer}; set "
                          f"FLASHMOE_AGENT_URL to the address `flashmoe-cli serve` listens on (default "
                          f"http://127.0.0.1:8600)")

    def status(self) -> dict[str, Any]:
        """/v1/status without its step profiles: no page shows them, and every live fragment polls this."""
        return self._json("GET", "/v1/status", status_problem, params={"step_profiles": 0})

    def knobs(self) -> dict[str, Any]:
        """Each knob's value, default and bounds, as GET /v1/knobs describes them."""
        return self._json("GET", "/v1/knobs", knobs_problem)

    def put_knobs(self, changes: dict[str, Any]) -> KnobAnswer:
        """Push `changes`; a 4xx is an answer (the agent's validation error), not an exception."""
        response = self._request("PUT", "/v1/knobs", json=changes, headers=self._control, timeout=KNOBS_TIMEOUT_S)
        if response.status_code < 400:
            return KnobAnswer(True, response.status_code, self._object(response, "PUT", "/v1/knobs", knobs_problem), "")
        if response.status_code >= 500 and response.status_code != 503:     # 503: busy, nothing applied
            raise AgentError(f"the agent failed with {response.status_code}: {error_detail(response)}")
        detail = error_detail(response)
        if response.status_code == 401:
            detail += (f"; start the dashboard with {TOKEN_ENV} set to the agent's token" if not self._control
                       else f"; the dashboard's {TOKEN_ENV} is not the agent's token")
        return KnobAnswer(False, response.status_code, {}, detail)

    def push(self, changes: dict[str, Any]) -> str:
        """Push `changes` and describe the agent's answer in one line, an unreachable agent included."""
        try:
            answer = self.put_knobs(changes)
        except AgentError as err:
            return unsent(err)
        if not answer.accepted:
            return answer.message()
        return "accepted: " + ", ".join(f"{k} = {answer.knobs[k]['value']}" for k in changes if k in answer.knobs)

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """One non-streaming completion; returns the agent's OpenAI-style JSON."""
        return self._json("POST", "/v1/completions", completion_problem, timeout=COMPLETION_TIMEOUT_S,
                          json={"prompt": prompt, "max_tokens": max_tokens, "stream": False})


def status_problem(status: dict[str, Any]) -> str | None:
    return shape_problem(status, STATUS_SHAPE, literal)


def knobs_problem(knobs: dict[str, Any]) -> str | None:
    """Each knob named as Python names are, an object with its value, a type KNOB_BOUNDS knows and its bounds."""
    for name, spec in knobs.items():
        if not name.isidentifier():      # pages write it into widget labels, which are Markdown
            return f"with a knob named {literal(name)}"
        if not isinstance(spec, dict):
            return f"with {literal(name)} not an object"
        bounds = KNOB_BOUNDS.get(spec.get("type"))
        if bounds is None:
            return f"with {literal(name + '.type')} not one of {', '.join(KNOB_BOUNDS)}"
        if problem := shape_problem(spec, {"value": KNOB_VALUE, **bounds}, literal, f"{name}."):
            return problem
    return None


def completion_problem(completion: dict[str, Any]) -> str | None:
    return shape_problem(completion, COMPLETION_SHAPE, literal)


def error_detail(response: httpx.Response) -> str:
    """FastAPI puts the reason in "detail": a string, or a list of {loc, msg} for schema errors."""
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        return response.text
    if isinstance(detail, list):
        return "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg', d)}" for d in detail)
    return str(detail)


def unsent(err: AgentError) -> str:
    """A knob change that got no answer, in one line: a busy agent has it and may still apply it."""
    return f"{'sent, no answer' if isinstance(err, AgentBusy) else 'not sent'}: {err}"
