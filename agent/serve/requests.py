"""The bodies the agent's HTTP routes take, validated strictly: a value is refused, with what was wrong,
rather than read as something else (true as 1, "3" as 3), and what /openapi.json says they take is what
passes (the schema is what clients and the fuzzer draw from)."""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationInfo, field_validator

from agent.serve.stops import MAX_STOP_CHARS, MAX_STOPS
from agent.tokenizer import check_text

# OpenAI's fields that this agent does not implement, and the values that ask for nothing (clients send them)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None,), "echo": (None, False), "suffix": (None,), "best_of": (None, 1), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0)}
NULL_IS_DEFAULT = ("max_tokens", "temperature", "top_p", "stream", "n")  # OpenAI's: null asks for the default


def _as_int(value: Any) -> Any:
    """JSON has no integer type apart from numbers (JSON Schema's integer is 3 and 3.0 alike): 3.0 is 3, as for
    a knob; 3.5, "3" and true are still no integers."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def whole(lo: int | None = None, hi: int | None = None) -> Any:
    """An integer field's type, 3.0 taken as 3, within [lo, hi] (bounds first: pydantic documents them so)."""
    return Annotated[int, Field(ge=lo, le=hi), BeforeValidator(_as_int), Strict()]


Whole = whole()


def _as_validated(schema: dict[str, Any]) -> None:
    """/openapi.json offers what the validators below accept: an unsupported field only the values that ask
    for nothing, `stop` only strings of the lengths it takes, null for a setting whose default it asks for."""
    fields = schema["properties"]
    for name in NULL_IS_DEFAULT:
        field = fields[name]
        kept = {key: field.pop(key) for key in ("title", "default", "description") if key in field}
        fields[name] = {"anyOf": [field, {"type": "null"}], **kept}
    for name, allowed in UNSUPPORTED.items():
        shown = " or ".join(json.dumps(a) for a in allowed)
        fields[name] = {"enum": list(allowed), "description": f"not supported: {shown} only"}
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    fields["stop"]["anyOf"] = [stop, {"type": "array", "items": stop, "maxItems": MAX_STOPS}, {"type": "null"}]


class CompletionRequest(BaseModel):
    # fields that change nothing in the answer pass (e.g. user); NaN and Infinity are no sampling settings;
    # strict: true, "3" and 3.5 are no integers (lax reads them as 1, 3 and a refusal), nor 1 a boolean
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True,
                              json_schema_extra=_as_validated)
    model: str | None = Field(None, description="the served model's id (GET /v1/models); null or left out: that model")
    prompt: str | list[int] = Field(description="text, or token ids")
    max_tokens: Whole = Field(16, ge=1, le=2**31 - 1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: draw from the most likely tokens "
                                                          "whose probabilities add up to top_p")
    stream: bool = False
    n: Whole = Field(1, ge=1, le=1, description="one choice per request")
    stop: str | list[str] | None = Field(None, validate_default=True, description=(
        f"up to {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters: the text ends before the first generated"))
    logprobs: Whole | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Whole | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: whole(-2**63, 2**64 - 1) | None = Field(None, description=(
        "the same seed and request give the same completion, whatever runs beside it; null: unrepeatable"))

    @field_validator(*NULL_IS_DEFAULT, mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """Clients send null for a setting left unset (the openai client, for an explicit None)."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        """A value asking for what this agent does not do is refused, not ignored: the answer would be wrong
        (their types are checked first, so that true is no 1)."""
        allowed = UNSUPPORTED[info.field_name]
        if value not in allowed:
            raise ValueError(f"{info.field_name} is not supported by this agent; leave it out or send "
                             f"{' or '.join(json.dumps(a) for a in allowed)}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
            lengths = ", ".join(str(len(s)) for s in stops)
            raise ValueError(f"stop takes a string or a list of at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} "
                             f"characters; got {len(stops)} of {lengths or 'none'}")
        return stops

    @field_validator("prompt", mode="before")
    @classmethod
    def _whole_ids(cls, prompt: Any) -> Any:
        """Token ids as Whole takes them (not list[Whole]: its type would name the list's in every message)."""
        return [_as_int(t) for t in prompt] if isinstance(prompt, list) else prompt

    @field_validator("prompt")
    @classmethod
    def _valid_unicode(cls, prompt: str | list[int]) -> str | list[int]:
        """JSON may carry a lone surrogate (\\ud800) that no tokenizer can encode: refused here, with the body's other
        issues and before its bytes are counted (the 413); the tokenizer checks only where its encoding fails."""
        return check_text(prompt) if isinstance(prompt, str) else prompt


class PreloadRequest(BaseModel):
    experts: list[tuple[Whole, Whole]] = Field(description="[[layer, expert], ...] to bring into the cache")
