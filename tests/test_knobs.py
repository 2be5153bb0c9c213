"""Knob validation: all-or-nothing, errors name the knob and its allowed range."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from agent.knob import Knob
from agent.policies import DEFAULT_POLICY, live_policies, policy_options
from agent.policies.base import REGISTRY, Policy
from agent.policies.flashmoe import DECISION, KEEP_PERCENTILE, ONLINE_LEARNING, RECOMPUTE_THRESHOLD, FlashMoE
from agent.serve.api_schema import Knobs as Documented
from agent.serve.knobs import KnobError, Knobs, Limits

LIMITS = Limits(cap_min=1000, cap_max=50_000, policies=("lfu", "lru", "flashmoe"), max_prefetch_depth=1)


@pytest.fixture
def knobs() -> Knobs:
    return Knobs(LIMITS)


def test_defaults_and_bounds_are_described(knobs):
    d = knobs.describe()
    assert set(d) == {"cache_cap_bytes", "policy", "decision", "keep_percentile", "recompute_threshold",
                      "online_learning", "prefetch", "prefetch_adaptive", "prefetch_depth", "max_batch_size",
                      "auto_shrink"}
    # the learned policy's knobs are the ones its class declares
    assert FlashMoE.knobs == (DECISION, KEEP_PERCENTILE, RECOMPUTE_THRESHOLD, ONLINE_LEARNING)
    assert d["decision"]["value"] == "score" and d["decision"]["choices"] == ["score", "lfu"]
    assert d["online_learning"] == {"value": False, "default": False, "type": "bool", "help": ONLINE_LEARNING.help}
    assert d["keep_percentile"]["value"] == KEEP_PERCENTILE.default and d["keep_percentile"]["max"] == 100.0
    assert d["recompute_threshold"] == {"value": 0.0, "default": 0.0, "type": "float", "min": 0.0, "max": 1.0,
                                        "help": RECOMPUTE_THRESHOLD.help}
    assert d["cache_cap_bytes"]["min"] == 1000 and d["cache_cap_bytes"]["max"] == 50_000
    assert d["policy"]["choices"] == ["lfu", "lru", "flashmoe"]
    assert d["prefetch"] == {"value": True, "default": True, "type": "bool", "help": d["prefetch"]["help"]}
    assert all(spec.get("help") for spec in d.values())          # the dashboard shows every knob's help


def test_the_documented_listing_is_what_describe_lists_and_no_more(knobs):
    """GET /v1/knobs' schema in /openapi.json is made from the TypedDict describe() returns, closed: it takes every
    knob listed, and a field describe() would add without typing it there is refused (so the fuzz test fails)."""
    listed = knobs.describe()
    Documented.model_validate(listed)     # raises where a knob is listed otherwise than documented
    with pytest.raises(ValidationError, match="unit"):
        Documented.model_validate({name: {**state, "unit": "bytes"} for name, state in listed.items()})


def test_new_bounds_keep_the_values_even_one_now_outside_them(knobs):
    knobs.commit({"cache_cap_bytes": 40_000})
    knobs.rebound(Limits(cap_min=1000, cap_max=30_000, policies=LIMITS.policies, max_prefetch_depth=1))
    d = knobs.describe()["cache_cap_bytes"]
    assert (d["value"], d["max"]) == (40_000, 30_000)
    with pytest.raises(KnobError, match="between 1000 and 30000"):
        knobs.validate({"cache_cap_bytes": 35_000})


def test_valid_changes_are_converted(knobs):
    got = knobs.validate({"cache_cap_bytes": 2000.0, "keep_percentile": 90, "policy": "lfu", "auto_shrink": True})
    assert got == {"cache_cap_bytes": 2000, "keep_percentile": 90.0, "policy": "lfu", "auto_shrink": True}
    assert isinstance(got["cache_cap_bytes"], int) and isinstance(got["keep_percentile"], float)
    assert knobs["policy"] == DEFAULT_POLICY  # validate never mutates


def test_negative_zero_is_zero(knobs):
    """-0.0 is within [0, 100] and was kept: GET /v1/knobs and the dashboard showed keep_percentile -0.0."""
    got = knobs.validate({"keep_percentile": -0.0, "recompute_threshold": -0.0})
    assert json.dumps(got) == '{"keep_percentile": 0.0, "recompute_threshold": 0.0}'


@pytest.mark.parametrize("changes, knob, words", [
    ({"cache_cap_bytes": 999}, "cache_cap_bytes", ["between 1000 and 50000", "got 999"]),
    ({"cache_cap_bytes": 60_000}, "cache_cap_bytes", ["70%"]),
    ({"recompute_threshold": 1.5}, "recompute_threshold", ["between 0 and 1"]),
    ({"max_batch_size": 0}, "max_batch_size", ["between 1 and 256"]),
    ({"max_batch_size": 2.5}, "max_batch_size", ["whole number"]),
    ({"prefetch": "yes"}, "prefetch", ["true or false"]),
    ({"prefetch_depth": 2}, "prefetch_depth", ["between 0 and 1"]),
    ({"policy": "fifo"}, "policy", ["lfu, lru, flashmoe", "'fifo'"]),
    ({"keep_percentile": True}, "keep_percentile", ["number"]),
    ({"cache_size": 5}, "cache_size", ["unknown knob", "cache_cap_bytes"]),
    ({"policy": ["lru"]}, "policy", ["one of"]),
    ({"policy": "x" * 10_000}, "policy", ["xxx..."]),  # the refused value is quoted short
    ({"max_batch_size": 10 ** 400}, "max_batch_size", ["between 1 and 256"]),
    ({"recompute_threshold": 10 ** 400}, "recompute_threshold", ["finite number"]),  # no float holds it
])
def test_bad_value_names_the_knob_and_the_range(knobs, changes, knob, words):
    with pytest.raises(KnobError) as err:
        knobs.validate(changes)
    assert err.value.knob == knob
    assert knob in str(err.value) and all(w in str(err.value) for w in words)


def test_one_bad_knob_refuses_the_whole_change(knobs):
    before = dict(knobs.values)
    with pytest.raises(KnobError, match="max_batch_size"):
        knobs.validate({"policy": "lfu", "max_batch_size": -1})
    assert knobs.values == before


def test_empty_or_non_object_is_refused(knobs):
    for bad in ({}, [], "policy=lru"):
        with pytest.raises(KnobError, match="JSON object"):
            knobs.validate(bad)


def test_diff_and_commit(knobs):
    validated = knobs.validate({"policy": DEFAULT_POLICY, "max_batch_size": 8})
    assert knobs.diff(validated) == {"max_batch_size": (16, 8)}  # an unchanged value is no change
    knobs.commit(validated)
    assert knobs["max_batch_size"] == 8


@pytest.mark.parametrize("knob", ["cache_cap_bytes", "max_batch_size", "prefetch_depth", "keep_percentile",
                                  "recompute_threshold"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_refused(knobs, knob, value):
    """NaN passes every bound check (it compares false) and Infinity has no int: both were accepted or a 500."""
    with pytest.raises(KnobError, match=f"{knob} must be a finite number") as err:
        knobs.validate({knob: value})
    assert err.value.knob == knob


class Toy(Policy):  # not registered by name: the test installs it for its own duration
    knobs = (Knob("toy_depth", int, 2, 1, 8, help="how deep the toy looks"),)

    def __init__(self, toy_depth: int = 2) -> None:
        self.toy_depth = Toy.knobs[0].check(toy_depth)


def test_a_policy_declares_its_own_knobs(monkeypatch):
    """Adding a policy knob is an edit in the policy's own file: the agent offers it, checks it, passes it on."""
    monkeypatch.setitem(REGISTRY, "toy", Toy)
    assert "toy" in live_policies()
    knobs = Knobs(Limits(1000, 50_000, ("lru", "toy"), max_prefetch_depth=1))
    assert knobs.describe()["toy_depth"] == {"value": 2, "default": 2, "type": "int", "min": 1, "max": 8,
                                             "help": "how deep the toy looks"}
    with pytest.raises(KnobError, match="toy_depth must be between 1 and 8"):
        knobs.validate({"toy_depth": 9})
    assert policy_options("toy", {**knobs.values, "toy_depth": 5}) == {"toy_depth": 5}
    assert policy_options("lru", knobs.values) == {}
