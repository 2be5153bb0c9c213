"""Bounds on the work one request may cause, checked before the work starts.

A text prompt longer than `max_prompt_bytes` (serve --max-prompt-bytes) is refused before it is
tokenized: tokenizing is superlinear in the text (64 KiB ~0.15 s here, 256 KiB ~1.3 s, 5 MB 13-28 s)
and every model's context is far shorter than 64 KiB of text. A request body longer than
`body_limit(max_prompt_bytes)` is refused before it is read whole, and one whose arrays and objects nest
deeper than MAX_JSON_DEPTH before it is parsed: Python's parser fails near 1,000 levels (RecursionError),
which FastAPI answered "There was an error parsing the body".
"""
from __future__ import annotations

import re

import numpy as np

MAX_PROMPT_BYTES = 64 * 1024
BODY_BYTES_PER_PROMPT_BYTE = 8   # JSON may spell one prompt byte in up to 6 (\u0000); a token id takes ~7
BODY_SLACK = 4096                # the other fields of a completion request


def body_limit(max_prompt_bytes: int) -> int:
    return BODY_BYTES_PER_PROMPT_BYTE * max_prompt_bytes + BODY_SLACK


MAX_JSON_DEPTH = 32    # this API's requests nest 3 deep (preload's {"experts": [[layer, expert]]})
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)   # a JSON string, escapes and all
_STEP = np.zeros(256, np.int32)   # what each byte does to the depth outside strings
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def nests_deeper(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `body` nests arrays and objects more than `limit` deep (brackets inside
    strings do not count). It runs on the event loop, so in C: ~10 ms for a body at the limit here (a Python
    loop took 50); a body with fewer opening brackets than `limit` is not scanned."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    steps = _STEP[np.frombuffer(_STRING.sub(b'""', body), np.uint8)]
    return bool(np.cumsum(steps).max() > limit)
