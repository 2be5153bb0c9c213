"""Hypothesis: the knob validator answers any JSON a client can send with the new values or a
KnobError naming the knob; values it accepts are of the knob's type, within bounds, and finite."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from agent.knob import KnobError
from agent.serve.knobs import Knobs, Limits

LIMITS = Limits(cap_min=1000, cap_max=50_000, policies=("lfu", "lru", "flashmoe"), max_prefetch_depth=1)
NAMES = sorted(Knobs(LIMITS).specs)

# JSON values as Python's json module reads them, NaN, Infinity and 400-digit integers included
scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10**300, max_value=10**400)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.sampled_from(LIMITS.policies))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)


@given(st.sampled_from(NAMES), json_values)
def test_any_value_is_accepted_in_bounds_or_refused_by_name(name, value):
    knobs = Knobs(LIMITS)
    spec = knobs.specs[name]
    try:
        got = knobs.validate({name: value})[name]
    except KnobError as err:
        assert err.knob == name and name in str(err) and len(str(err)) < 500
        return
    assert type(got) is spec.kind
    if spec.kind in (int, float):
        assert math.isfinite(got) and spec.lo <= got <= spec.hi
    elif spec.kind is str:
        assert got in spec.choices


@given(st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=8), json_values, max_size=5))
def test_a_change_is_all_or_nothing(changes):
    knobs = Knobs(LIMITS)
    before = dict(knobs.values)
    try:
        validated = knobs.validate(changes)
    except KnobError:
        assert knobs.values == before
        return
    assert validated.keys() == changes.keys() and knobs.values == before  # validate never mutates
