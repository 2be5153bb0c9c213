"""One live setting: its type, default and bounds, and the check every value passes.

The agent's knobs (agent.serve.knobs) are a list of these; a policy declares its own (the
`knobs` of its class in agent/policies) and checks its constructor arguments with them, so a
value the agent accepts is one the policy accepts, and a new policy knob is an edit in one file.
"""
from __future__ import annotations

import math
import reprlib
import sys
from dataclasses import dataclass
from typing import Any, Literal, NotRequired

from typing_extensions import TypedDict   # pydantic reads typing's own only from Python 3.12


class KnobError(ValueError):
    """A knob change was refused; `knob` names it and the message says what is allowed."""

    def __init__(self, knob: str, message: str) -> None:
        super().__init__(message)
        self.knob = knob


class KnobState(TypedDict):
    """A knob as GET /v1/knobs lists it (agent.serve.knobs.Knobs.describe); /openapi.json documents that answer
    from this class (agent.serve.api_schema)."""
    value: bool | int | float | str
    default: bool | int | float | str
    type: Literal["bool", "int", "float", "str"]
    min: NotRequired[int | float | None]    # a number's inclusive bounds; null: unbounded
    max: NotRequired[int | float | None]
    choices: NotRequired[list[str]]         # a str knob's
    help: NotRequired[str]


@dataclass(frozen=True)
class Knob:
    name: str
    kind: type                      # bool, int, float or str
    default: Any
    lo: float | None = None         # inclusive bounds for numbers
    hi: float | None = None
    choices: tuple[str, ...] = ()   # allowed strings
    help: str = ""

    def bounds(self) -> dict[str, Any]:
        if self.kind is bool:
            return {"type": "bool"}
        if self.kind is str:
            return {"type": "str", "choices": list(self.choices)}
        return {"type": self.kind.__name__, "min": self.lo, "max": self.hi}

    def json_schema(self) -> dict[str, Any]:
        """The values `check` accepts, as JSON Schema (/openapi.json's knobs body): 3.0 is an integer to both."""
        if self.kind is bool:
            kind: dict[str, Any] = {"type": "boolean"}
        elif self.kind is str:
            kind = {"type": "string", "enum": list(self.choices)}
        else:
            bounds = {"minimum": self.lo, "maximum": self.hi}
            kind = {"type": "integer" if self.kind is int else "number",
                    **{k: v for k, v in bounds.items() if v is not None}}
        return {**kind, "description": self.help} if self.help else kind

    def check(self, value: Any) -> Any:
        """The value converted to the knob's type, or KnobError naming the knob and its range."""
        if self.kind is bool:
            if not isinstance(value, bool):
                raise KnobError(self.name, f"{self.name} must be true or false, got {_shown(value)}")
            return value
        if self.kind is str:
            if not isinstance(value, str) or value not in self.choices:
                raise KnobError(self.name, f"{self.name} must be one of {', '.join(self.choices)}; got {_shown(value)}")
            return value
        number = self._number(value)
        if (self.lo is not None and number < self.lo) or (self.hi is not None and number > self.hi):
            raise KnobError(self.name, f"{self.name} must be between {_fmt(self.lo)} and {_fmt(self.hi)}"
                                       f"{' (' + self.help + ')' if self.help else ''}; got {_shown(number)}")
        return number

    def _number(self, value: Any) -> int | float:
        # JSON has no int/float distinction a client can rely on: accept 3.0 for an int knob, refuse 3.5.
        # NaN compares false with every bound, Infinity has no int and a 400-digit int no float: refused here.
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, float) and not math.isfinite(value))
                or (self.kind is float and abs(value) > sys.float_info.max)):
            raise KnobError(self.name, f"{self.name} must be a finite number between {_fmt(self.lo)} and "
                                       f"{_fmt(self.hi)}; got {_shown(value)}")
        if self.kind is int:
            if value != int(value):
                raise KnobError(self.name, f"{self.name} must be a whole number; got {_shown(value)}")
            return int(value)
        return float(value) + 0.0       # -0.0 + 0.0 is 0.0: a -0.0 sent is in range and would be shown as "-0.0"


def _fmt(x: float | None) -> str:
    if x is None:
        return "unbounded"
    return f"{x:g}" if isinstance(x, float) else str(x)


def _shown(value: Any) -> str:
    """A refused value as the error quotes it: short, whatever a client sent (a 5 MB string, a 400-digit int)."""
    return reprlib.repr(value)
