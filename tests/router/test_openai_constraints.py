"""Structured output as OpenAI clients and vLLM's ask for it, mapped to one constraint."""

from __future__ import annotations

import json

import pytest

from pagemesh.api.options.constraint import OutputConstraint, constraint_from_body
from router.openai_errors import ProtocolError
from router.openai_protocol import parse_chat, parse_completion

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CASES = {
    "text": ({"response_format": {"type": "text"}}, None),
    "json_object": ({"response_format": {"type": "json_object"}}, OutputConstraint("json_object")),
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
            }
        },
        OutputConstraint("json_schema", json.dumps(SCHEMA)),
    ),
    "guided_json object": (
        {"guided_json": SCHEMA},
        OutputConstraint("json_schema", json.dumps(SCHEMA)),
    ),
    "guided_json text": (
        {"guided_json": '{"type": "string"}'},
        OutputConstraint("json_schema", '{"type": "string"}'),
    ),
    "guided_regex": ({"guided_regex": "a+"}, OutputConstraint("regex", "a+")),
    "guided_choice": ({"guided_choice": ["x", "y"]}, OutputConstraint("choice", ("x", "y"))),
    "guided_grammar": (
        {"guided_grammar": 'root ::= "a"'},
        OutputConstraint("grammar", 'root ::= "a"'),
    ),
    "structured_outputs json": (
        {"structured_outputs": {"json": SCHEMA}},
        OutputConstraint("json_schema", json.dumps(SCHEMA)),
    ),
    "structured_outputs choice": (
        {"structured_outputs": {"choice": ["p", "q"]}},
        OutputConstraint("choice", ("p", "q")),
    ),
    "structured_outputs json_object": (
        {"structured_outputs": {"json_object": True}},
        OutputConstraint("json_object"),
    ),
    "nothing": ({}, None),
}
ERRORS = {
    "two at once": (
        {"guided_regex": "a", "response_format": {"type": "json_object"}},
        "one output constraint, not several",
    ),
    "unknown type": (
        {"response_format": {"type": "xml"}},
        "must be text, json_object or json_schema",
    ),
    "no schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "has no `schema`",
    ),
    "strict not a bool": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {}, "strict": "yes"},
            }
        },
        "strict must be a boolean",
    ),
    "choice not a list": ({"guided_choice": "x"}, "list of strings"),
    "regex not a string": ({"guided_regex": 3}, "must be a string"),
    "schema not an object": ({"guided_json": [1]}, "must be a JSON schema"),
    "structured_outputs unknown": ({"structured_outputs": {"xml": "<a/>"}}, "unknown field"),
    "response_format not an object": ({"response_format": "json"}, "must be an object"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_form_is_one_constraint(name: str) -> None:
    body, expected = CASES[name]
    assert constraint_from_body(body) == expected
    messages = [{"role": "user", "content": "hi"}]
    assert parse_chat({**body, "messages": messages}).generate.constraint == expected
    assert parse_completion({**body, "prompt": "hi"}).generate.constraint == expected


@pytest.mark.parametrize("name", list(ERRORS))
def test_a_malformed_constraint_is_a_400_naming_it(name: str) -> None:
    body, words = ERRORS[name]
    with pytest.raises(ProtocolError, match=words) as info:
        parse_completion({**body, "prompt": "hi"})
    assert info.value.status == 400
