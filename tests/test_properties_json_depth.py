"""Hypothesis: the agent's nesting check (agent.serve.limits.nests_deeper) reads the depth of any JSON text
as a parser does: brackets inside strings, escaped quotes and backslashes included, do not count."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.serve.limits import nests_deeper

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
