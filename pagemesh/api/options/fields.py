"""Reading a request's fields from plain data (a JSON body, a `SamplingParams`'s fields):
each field's type, and that each integer fits the protobuf field it travels in.

Shared by the OpenAI HTTP API (router/openai_protocol.py) and the client API
(pagemesh/api/sampling_params.py), so that both refuse a wrong type with the same words; value
ranges (temperature >= 0, max_tokens >= 1, ...) are the data plane's (validation.py).
A wrong field raises `FieldError`, which names the field in `param`.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagemesh.api.options.validation import SamplingOptions, StoppingOptions


class FieldError(ValueError):
    """A field of the wrong type or too large for the wire; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class WireInt:
    """The integers a protobuf field can carry (protos/pagemesh/v1/generate.proto).

    Only what no message could carry is refused here. An unsigned field's negatives are
    left to the data plane, which names the field's real lower bound (max_tokens >= 1,
    seed >= 0, token ids in the vocabulary, ...) in gRPC's words."""

    bits: int
    signed: bool

    @property
    def proto_type(self) -> str:
        return f"{'' if self.signed else 'u'}int{self.bits}"

    @property
    def max(self) -> int:
        return 2 ** (self.bits - self.signed) - 1

    def refuses(self, value: int) -> bool:
        return value > self.max or (self.signed and value < -self.max - 1)

    def bounds(self) -> str:
        if self.signed:
            return f"in [-2**{self.bits - 1}, 2**{self.bits - 1} - 1]"
        return f"at most 2**{self.bits} - 1"


INT32 = WireInt(32, signed=True)
UINT32 = WireInt(32, signed=False)
UINT64 = WireInt(64, signed=False)

# Every integer a request can hold, as the wire carries it; list fields by element.
WIRE_INTS = {
    "max_tokens": UINT32,
    "max_completion_tokens": UINT32,
    "min_tokens": UINT32,
    "n": UINT32,
    "logprobs": UINT32,
    "top_logprobs": UINT32,
    "seed": UINT64,
    "top_k": INT32,
    "priority": INT32,
    "prompt": UINT32,
    "stop_token_ids": UINT32,
    "resume_from": UINT32,
}

SAMPLING_NUMBERS = (
    "temperature",
    "top_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
)


def _short_repr() -> reprlib.Repr:
    """Quotes a bad value back in an error message: short, whatever the client sent."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict = 2, 4, 4
    short.maxstring = short.maxlong = short.maxother = 40
    return short


shown = _short_repr().repr


def sampling_options(fields: Mapping[str, Any]) -> SamplingOptions:
    """How to pick each token, from vLLM's / OpenAI's field names (absent or None = the
    default); types checked, ranges left to `validation.check_sampling`."""
    # Read in the order the fields' errors should be reported.
    numbers = {name: number(fields, name) for name in SAMPLING_NUMBERS}
    top_k = integer(fields, "top_k")
    return SamplingOptions(
        temperature=numbers["temperature"],
        top_p=numbers["top_p"],
        top_k=0 if top_k in (None, -1) else top_k,  # vLLM's -1 = off; other negatives are rejected
        min_p=numbers["min_p"] or 0.0,
        repetition_penalty=numbers["repetition_penalty"],
        presence_penalty=numbers["presence_penalty"] or 0.0,
        frequency_penalty=numbers["frequency_penalty"] or 0.0,
        seed=integer(fields, "seed"),
    )


def stopping_options(fields: Mapping[str, Any], max_tokens: int | None) -> StoppingOptions:
    """When to stop: `stop`, `stop_token_ids`, `min_tokens`, `ignore_eos` from `fields`;
    `max_tokens` as the caller read it (the APIs name and default it differently)."""
    return StoppingOptions(
        max_tokens=max_tokens,
        stop=stop_strings(fields.get("stop")),
        stop_token_ids=integer_list(fields, "stop_token_ids"),
        min_tokens=integer(fields, "min_tokens") or 0,
        ignore_eos=bool(boolean(fields, "ignore_eos")),
    )


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(fields: Mapping[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise FieldError(f"{name} must be an integer, got {shown(value)}", name)
    return on_wire(name, value)


def on_wire(name: str, value: int, what: str | None = None, param: str | None = None) -> int:
    """`value` when its protobuf field (`WIRE_INTS[name]`) can carry it; `what` names it in
    the error (an element of a list, say), `param` (default `name`) is the error's param."""
    wire = WIRE_INTS[name]
    if wire.refuses(value):
        raise FieldError(
            f"{what or name} must be {wire.bounds()}, got {shown(value)}", param or name
        )
    return value


def integer_list(fields: Mapping[str, Any], name: str) -> list[int]:
    value = fields.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(is_int(v) for v in value):
        return [on_wire(name, v, f"{name}[{i}]") for i, v in enumerate(value)]
    raise FieldError(f"{name} must be a list of token ids (integers)", name)


def number(fields: Mapping[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and _is_finite(value):
        return float(value)
    raise FieldError(f"{name} must be a finite number, got {shown(value)}", name)


def _is_finite(value: int | float) -> bool:
    """Also False for an integer too large for a float (json reads 1e400 as inf, 10**400 as int)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def boolean(fields: Mapping[str, Any], name: str) -> bool | None:
    value = fields.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise FieldError(f"{name} must be true or false, got {shown(value)}", name)


def string(fields: Mapping[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is None or isinstance(value, str):
        return value
    raise FieldError(f"{name} must be a string, got {shown(value)}", name)


def stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise FieldError("stop must be a string or a list of strings", "stop")
