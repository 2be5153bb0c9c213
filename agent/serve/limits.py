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

MAX_PROMPT_BYTES = 64 * 1024
BODY_BYTES_PER_PROMPT_BYTE = 8   # JSON may spell one prompt byte in up to 6 (\u0000); a token id takes ~7
BODY_SLACK = 4096                # the other fields of a completion request


def body_limit(max_prompt_bytes: int) -> int:
    return BODY_BYTES_PER_PROMPT_BYTE * max_prompt_bytes + BODY_SLACK


MAX_JSON_DEPTH = 32    # this API's requests nest 3 deep (preload's {"experts": [[layer, expert]]})
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)   # a JSON string, escapes and all
_NESTING = re.compile(rb"[\[\]{}]")


def nests_deeper(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `body` nests arrays and objects more than `limit` deep (brackets inside
    strings do not count); linear in the body, and a body with fewer opening brackets is not scanned."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for bracket in _NESTING.finditer(_STRING.sub(b'""', body)):
        depth += 1 if bracket[0] in b"[{" else -1
        if depth > limit:
            return True
    return False
