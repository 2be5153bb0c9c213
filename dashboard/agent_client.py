"""The dashboard's side of the agent's control API: status, knobs, completions.

Every call carries `X-FlashMoE-Source: dashboard` so the agent records who turned a knob. An
unreachable agent raises AgentOffline (an AgentError), which pages turn into a plain "agent offline" notice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

SOURCE_HEADER = {"X-FlashMoE-Source": "dashboard"}
TIMEOUT_S = 3.0
COMPLETION_TIMEOUT_S = 120.0


class AgentError(RuntimeError):
    """The agent answered with a failure the dashboard cannot act on."""


class AgentOffline(AgentError):
    """The agent did not answer at its URL."""


@dataclass(frozen=True)
class KnobAnswer:
    accepted: bool
    status_code: int
    knobs: dict[str, Any]     # the agent's knobs after the call (empty when refused)
    detail: str               # the agent's validation error when refused

    def message(self) -> str:
        return "accepted" if self.accepted else f"refused ({self.status_code}): {self.detail}"


def _request(method: str, url: str, timeout: float = TIMEOUT_S, **kwargs: Any) -> httpx.Response:
    try:
        return httpx.request(method, url, headers=SOURCE_HEADER, timeout=timeout, **kwargs)
    except httpx.TransportError as err:
        raise AgentOffline(f"the agent at {url} did not answer ({type(err).__name__}); "
                           "start it with `flashmoe-cli serve` or set FLASHMOE_AGENT_URL") from err


def _json_ok(response: httpx.Response) -> dict[str, Any]:
    if response.status_code >= 400:
        raise AgentError(f"the agent answered {response.status_code} at {response.url}: {response.text[:200]}")
    return response.json()


def get_status(base_url: str) -> dict[str, Any]:
    return _json_ok(_request("GET", f"{base_url}/v1/status"))


def get_knobs(base_url: str) -> dict[str, Any]:
    return _json_ok(_request("GET", f"{base_url}/v1/knobs"))


def put_knobs(base_url: str, changes: dict[str, Any]) -> KnobAnswer:
    """Push `changes`; a 4xx is an answer (the agent's validation error), not an exception."""
    response = _request("PUT", f"{base_url}/v1/knobs", json=changes)
    if response.status_code < 400:
        return KnobAnswer(True, response.status_code, response.json(), "")
    if response.status_code >= 500:
        raise AgentError(f"the agent failed with {response.status_code}: {response.text[:200]}")
    return KnobAnswer(False, response.status_code, {}, error_detail(response))


def push(base_url: str, changes: dict[str, Any]) -> str:
    """Push `changes` and describe the agent's answer in one line, an unreachable agent included."""
    try:
        answer = put_knobs(base_url, changes)
    except AgentError as err:
        return f"not sent: {err}"
    changed = ", ".join(f"{k} = {answer.knobs[k]['value']}" for k in changes if k in answer.knobs)
    return f"accepted: {changed}" if answer.accepted else answer.message()


def error_detail(response: httpx.Response) -> str:
    """FastAPI puts the reason in "detail": a string, or a list of {loc, msg} for schema errors."""
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        return response.text
    if isinstance(detail, list):
        return "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg', d)}" for d in detail)
    return str(detail)


def complete(base_url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One non-streaming completion; returns the agent's OpenAI-style JSON."""
    response = _request("POST", f"{base_url}/v1/completions", timeout=COMPLETION_TIMEOUT_S,
                        json={"prompt": prompt, "max_tokens": max_tokens, "stream": False})
    return _json_ok(response)
