"""Hypothesis: the agent's nesting check (agent.serve.limits.nests_deeper) reads the depth of any JSON text
as a parser does: brackets inside strings, escaped quotes and backslashes included, do not count; and of
any bytes at all as its one-pass rule says, an unclosed string included."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.serve.limits import MAX_JSON_DEPTH, MAX_PROMPT_BYTES, body_limit, nests_deeper

texts = st.text(alphabet=st.sampled_from('[]{}"\\ab\n\u00e9'), max_size=8)
json_values = st.recursive(st.none() | st.integers() | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=30)


def depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


@settings(max_examples=500)
@given(json_values, st.integers(min_value=0, max_value=8), st.booleans())
def test_the_depth_is_read_as_a_parser_reads_it(value, limit, ascii_only):
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert nests_deeper(body, limit) == (depth(value) > limit)


def deepest(body: bytes) -> int:
    """The rule, byte by byte: a quote after an even run of backslashes opens or closes a string, and brackets
    outside strings count."""
    depth = best = backslashes = 0
    in_string = False
    for c in body.decode("latin-1"):
        if c == '"' and backslashes % 2 == 0:
            in_string = not in_string
        elif not in_string and c in "[{]}":
            depth += 1 if c in "[{" else -1
            best = max(best, depth)
        backslashes = backslashes + 1 if c == "\\" else 0
    return best


@settings(max_examples=500)
@given(st.binary().map(lambda b: bytes(b'[]{}"\\ a'[x % 8] for x in b)), st.integers(min_value=0, max_value=8))
def test_any_bytes_are_read_by_the_rule(body, limit):
    assert nests_deeper(body, limit) == (deepest(body) > limit)


def test_an_unclosed_string_of_escaped_quotes_as_long_as_a_body_may_be_is_read():
    """A regular expression for JSON strings took time quadratic in such a string, on the event loop and
    before the token check: 6-12 s for 32 KB, most of an hour at the body limit, every request waiting."""
    quotes = (body_limit(MAX_PROMPT_BYTES) - MAX_JSON_DEPTH) // 2
    assert nests_deeper(b"[" * MAX_JSON_DEPTH + b'"' + b'\\"' * quotes + b"[" * MAX_JSON_DEPTH) is False
    assert nests_deeper(b"[" * (MAX_JSON_DEPTH + 1) + b'"' + b'\\"' * quotes) is True
