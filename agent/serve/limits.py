"""Bounds on the work one request may cause, checked before the work starts.

A text prompt longer than `max_prompt_bytes` (serve --max-prompt-bytes) is refused before it is
tokenized: tokenizing is superlinear in the text (64 KiB ~0.15 s here, 256 KiB ~1.3 s, 5 MB 13-28 s)
and every model's context is far shorter than 64 KiB of text. A request body longer than
`body_limit(max_prompt_bytes)` is refused before it is read whole, and one whose arrays and objects nest
deeper than MAX_JSON_DEPTH before it is parsed: Python's parser fails near 1,000 levels (RecursionError),
which FastAPI answered "There was an error parsing the body".
"""
from __future__ import annotations

import numpy as np

MAX_PROMPT_BYTES = 64 * 1024
BODY_BYTES_PER_PROMPT_BYTE = 8   # JSON may spell one prompt byte in up to 6 (\u0000); a token id takes ~7
BODY_SLACK = 4096                # the other fields of a completion request


def body_limit(max_prompt_bytes: int) -> int:
    return BODY_BYTES_PER_PROMPT_BYTE * max_prompt_bytes + BODY_SLACK


MAX_JSON_DEPTH = 32    # this API's requests nest 3 deep (preload's {"experts": [[layer, expert]]})
_STEP = np.zeros(256, np.int32)   # what each byte does to the depth outside strings
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def nests_deeper(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `body` nests arrays and objects more than `limit` deep (brackets inside
    strings do not count). It runs on the event loop, before the token is checked, so in linear time and in
    C (numpy): a string is what lies between two quotes that no odd run of backslashes escapes. (A regular
    expression for JSON strings took time quadratic in an unclosed string of escaped quotes: 6 s for 32 KB.)
    A body with fewer opening brackets than `limit` is not scanned."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    b = np.frombuffer(body, np.uint8)
    at = np.arange(len(b))
    last_plain = np.maximum.accumulate(np.where(b != ord("\\"), at, -1))   # the last byte at or before i not a \
    backslashes_before = np.concatenate(([0], at[:-1] - last_plain[:-1]))    # the run of \ just before each byte
    quotes = (b == ord('"')) & (backslashes_before % 2 == 0)
    outside = np.cumsum(quotes) % 2 == 0                   # after an even number of quotes: not in a string
    return bool(np.cumsum(_STEP[b] * outside).max() > limit)
