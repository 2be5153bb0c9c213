"""An HTTP answer read whole within one deadline and up to a size. httpx's timeout is per read: an answer
dripping a byte a second never timed out (a Fleet push, `warmup`, `traffic` waited for it for ever), and one of
gigabytes was held whole (10 GB of the dashboard's memory for a 4 GB answer). The agent's answers are kilobytes,
so every client of it (the dashboard, warmup, traffic) reads through here."""
from __future__ import annotations

import time
from typing import Any

import httpx

MAX_ANSWER_BYTES = 4 << 20


class AnswerTooLarge(Exception):
    """More than the reader's limit: another server's answer, not the agent's."""


def read_whole(client: httpx.Client, method: str, url: str, timeout: float, max_bytes: int = MAX_ANSWER_BYTES,
               **kwargs: Any) -> httpx.Response:
    """`method url` on `client`, its answer read whole within `timeout` seconds (else httpx.ReadTimeout) and
    up to `max_bytes` (else AnswerTooLarge); the headers themselves still wait on httpx's per-read timeout."""
    deadline = time.monotonic() + timeout
    with client.stream(method, url, timeout=timeout, **kwargs) as response:
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise AnswerTooLarge(f"more than {max_bytes >> 20} MiB, where the agent's answers are kilobytes")
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout("the answer did not arrive whole in time", request=response.request)
        decoded = [(k, v) for k, v in response.headers.multi_items() if k.lower() != "content-encoding"]
        return httpx.Response(response.status_code, headers=decoded, content=bytes(body), request=response.request)
