"""Structured output as OpenAI-compatible clients ask for it, turned into one
`OutputConstraint` (router/structured.py compiles it), for the OpenAI API and the client
API (`SamplingParams.structured_outputs`) alike:

- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`
  (the schema is always enforced; `strict` is accepted either way);
- vLLM's extras: `guided_json` (a schema, as an object or JSON text), `guided_regex`,
  `guided_choice` (a list of strings), `guided_grammar` (Lark or GBNF), and their newer
  form `structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.

At most one may be given; several are a `FieldError` naming them (a 400 over HTTP).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagemesh.api.options.fields import FieldError

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class OutputConstraint:
    """What the output must be (structured output), as a client states it: `kind` is one of
    CONSTRAINT_KINDS; `value` is the schema's JSON text, the regex, the grammar (Lark or
    GBNF), the choices, or "" for json_object. router/structured.py compiles it."""

    kind: str
    value: str | tuple[str, ...] = ""


_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def constraint_from_body(body: dict[str, Any]) -> OutputConstraint | None:
    """The one output constraint a completion or chat body asks for, or None."""
    found: list[tuple[str, OutputConstraint]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    for field, kind in _GUIDED.items():
        if body.get(field) is not None:
            found.append((field, _constraint(kind, body[field], field)))
    structured = body.get("structured_outputs")
    if structured is not None:
        found.extend(_structured(structured))
    return _one(found)


def constraint_from_structured(structured: Any) -> OutputConstraint | None:
    """The constraint of vLLM's `structured_outputs` (a dict of `StructuredOutputsParams`'
    fields, or None): what `SamplingParams(structured_outputs=...)` asks for."""
    return None if structured is None else _one(_structured(structured))


def _structured(structured: Any) -> list[tuple[str, OutputConstraint]]:
    if not isinstance(structured, dict):
        raise FieldError("structured_outputs must be an object", "structured_outputs")
    given = {k: v for k, v in structured.items() if k in _STRUCTURED and v is not None}
    unknown = sorted(set(structured) - set(_STRUCTURED) - {"backend", "whitespace_pattern"})
    if unknown:
        raise FieldError(
            f"structured_outputs has unknown field(s) {unknown}; it takes "
            f"one of {sorted(_STRUCTURED)}",
            "structured_outputs",
        )
    return [
        (
            f"structured_outputs.{key}",
            _constraint(_STRUCTURED[key], value, f"structured_outputs.{key}"),
        )
        for key, value in given.items()
        if key != "json_object" or value is True
    ]


def _one(found: list[tuple[str, OutputConstraint]]) -> OutputConstraint | None:
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise FieldError(f"give one output constraint, not several ({names})", found[1][0])
    return found[0][1] if found else None


def _from_response_format(value: Any) -> OutputConstraint | None:
    if not isinstance(value, dict):
        raise FieldError("response_format must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise FieldError(
                "response_format json_schema needs a `json_schema` object holding the `schema`",
                "response_format",
            )
        if "schema" not in spec:
            raise FieldError("response_format.json_schema has no `schema`", "response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise FieldError(
                "response_format.json_schema.strict must be a boolean", "response_format"
            )
        return _constraint("json_schema", spec["schema"], "response_format.json_schema.schema")
    raise FieldError(
        f"response_format.type must be text, json_object or json_schema; got {kind!r}",
        "response_format",
    )


def _constraint(kind: str, value: Any, field: str) -> OutputConstraint:
    if kind == "json_object":
        return OutputConstraint("json_object")
    if kind == "json_schema":
        if isinstance(value, (dict, bool)):
            return OutputConstraint(kind, json.dumps(value))
        if isinstance(value, str):
            return OutputConstraint(kind, value)
        raise FieldError(f"{field} must be a JSON schema (an object, or its JSON text)", field)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise FieldError(f"{field} must be a list of strings", field)
        return OutputConstraint(kind, tuple(value))
    if not isinstance(value, str):
        raise FieldError(f"{field} must be a string", field)
    return OutputConstraint(kind, value)
