"""Bounds on the work one request may cause, checked before the work starts.

A text prompt longer than `max_prompt_bytes` (serve --max-prompt-bytes) is refused before it is
tokenized: tokenizing is superlinear in the text (64 KiB ~0.15 s here, 256 KiB ~1.3 s, 5 MB 13-28 s)
and every model's context is far shorter than 64 KiB of text. A request body longer than
`body_limit(max_prompt_bytes)` is refused before it is read whole.
"""
from __future__ import annotations

MAX_PROMPT_BYTES = 64 * 1024
BODY_BYTES_PER_PROMPT_BYTE = 8   # JSON may spell one prompt byte in up to 6 (\u0000); a token id takes ~7
BODY_SLACK = 4096                # the other fields of a completion request


def body_limit(max_prompt_bytes: int) -> int:
    return BODY_BYTES_PER_PROMPT_BYTE * max_prompt_bytes + BODY_SLACK
