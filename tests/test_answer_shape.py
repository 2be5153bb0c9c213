"""The shape an agent's client reads of an answer (access/answer_shape.py): what it lacks, in words."""
import pytest

from access.answer_shape import KNOB_VALUE, NUMBER, shape_problem

STATUS = {"model": str, "cache": {"capacity_experts": int, "hit_rate": NUMBER}}


@pytest.mark.parametrize("body, problem", [
    ({"model": "m", "cache": {"capacity_experts": 64, "hit_rate": 0.5}}, None),
    ({"model": "m", "cache": {"capacity_experts": 64, "hit_rate": 1}}, None),            # an int is a number
    ({"x": 1}, "without `model`"),
    ({"model": "m", "cache": 3}, "with `cache` not an object"),
    ({"model": "m", "cache": {"hit_rate": 0.5}}, "without `cache.capacity_experts`"),
    ({"model": "m", "cache": {"capacity_experts": 6.4, "hit_rate": 0.5}},
     "with `cache.capacity_experts` not a whole number"),
    ({"model": "m", "cache": {"capacity_experts": True, "hit_rate": 0.5}},             # JSON's true is no number
     "with `cache.capacity_experts` not a whole number"),
    ({"model": "m", "cache": {"capacity_experts": 64, "hit_rate": False}}, "with `cache.hit_rate` not a number"),
    ([1, 2], "with something other than a JSON object"),
])
def test_what_an_answer_lacks_is_said_by_its_dotted_name(body, problem):
    assert shape_problem(body, STATUS) == problem


def test_a_kind_that_names_bool_takes_it_and_names_are_quoted_as_asked():
    assert shape_problem({"value": True}, {"value": KNOB_VALUE}) is None
    assert shape_problem({}, {"value": KNOB_VALUE}, quote="<{}>".format, where="knob.") == "without <knob.value>"
