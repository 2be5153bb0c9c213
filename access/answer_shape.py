"""Whether an answer has the shape a client of the agent reads. Another service at the agent's address (the
dashboard's own port, another model server, a Fleet target of another kind) answers JSON of another shape, which
was a KeyError or TypeError wherever a field was read: in the dashboard's pages, in `warmup` and in `traffic`.
Each client declares what it reads and asks here once."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

NUMBER = (int, float)
KNOB_VALUE = (bool, int, float, str)
KINDS = {str: "a string", int: "a whole number", NUMBER: "a number", list: "a list", KNOB_VALUE: "a knob's value"}
Shape = Mapping[str, Any]   # field -> a kind of KINDS, or the Shape of the object it holds


def shape_problem(body: Any, shape: Shape, quote: Callable[[str], str] = "`{}`".format, where: str = "") -> str | None:
    """What of `shape` `body` lacks, in words ("without `cache.expert_bytes`"), or None; `quote` writes a field's
    name (the dashboard's Markdown needs a code span that no name can break out of)."""
    if not isinstance(body, dict):
        return "with something other than a JSON object"
    for key, kind in shape.items():
        name = f"{where}{key}"
        if key not in body:
            return f"without {quote(name)}"
        nested = isinstance(kind, Mapping)
        if not (isinstance(body[key], dict) if nested else is_kind(body[key], kind)):
            return f"with {quote(name)} not {'an object' if nested else KINDS[kind]}"
        if nested and (problem := shape_problem(body[key], kind, quote, f"{name}.")):
            return problem
    return None


def is_kind(value: Any, kind: type | tuple[type, ...]) -> bool:
    """isinstance, except that JSON's true and false are no numbers unless `kind` names bool."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and (not isinstance(value, bool) or bool in kinds)
