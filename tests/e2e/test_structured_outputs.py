"""Structured output with the default model (SmolLM2-135M-Instruct) through `pagemesh up`
and the official `openai` client: every output of a set of JSON schemas validates (checked
with `jsonschema`), JSON mode, a regex, a choice and a Lark grammar hold, a stream gives the
non-stream text, n > 1 seeded samples all validate, constrained greedy tokens equal
transformers' with the same mask applied by a logits processor, and a schema that cannot be
applied is a 400 naming what is wrong, with the mesh serving on."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from pagemesh.api.options.constraint import OutputConstraint
from pagemesh.runtime.models import default_model_path
from pagemesh.runtime.tokenizer import load_tokenizer
from protos.pagemesh.v1 import generate_pb2
from router.structured import llguidance_tokenizer, to_grammar
from tests.support.hf_reference import assert_greedy_close
from tests.support.mesh_harness import Mesh
from tests.support.structured_reference import hf_constrained

MODEL = "SmolLM2-135M-Instruct.Q4_1"
MAX_TOKENS = 160
# (prompt, schema): what applications ask for, each bounded so that greedy output ends.
SCHEMAS = [
    (
        "Describe a fictional person.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
            },
            "required": ["name", "age", "email"],
            "additionalProperties": False,
        },
    ),
    (
        "Is the sky blue? Answer with your confidence.",
        {
            "type": "object",
            "properties": {
                "answer": {"enum": ["yes", "no"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["answer", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "Name three primary colours.",
        {
            "type": "object",
            "properties": {
                "colours": {
                    "type": "array",
                    "minItems": 3,
                    "maxItems": 3,
                    "items": {"enum": ["red", "green", "blue", "yellow"]},
                }
            },
            "required": ["colours"],
            "additionalProperties": False,
        },
    ),
    (
        "Give the capital of France and its population.",
        {
            "type": "object",
            "properties": {
                "city": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 20},
                        "country": {"type": "string", "maxLength": 20},
                    },
                    "required": ["name", "country"],
                    "additionalProperties": False,
                },
                "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
            },
            "required": ["city", "population"],
            "additionalProperties": False,
        },
    ),
    (
        "List two fruits with their colour.",
        {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "fruit": {"type": "string", "maxLength": 16},
                    "colour": {"type": "string", "maxLength": 12},
                    "ripe": {"type": "boolean"},
                },
                "required": ["fruit", "colour", "ripe"],
                "additionalProperties": False,
            },
        },
    ),
    (
        "What is the weather like?",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"sunny": {"const": True}, "temperature_c": {"type": "integer"}},
                    "required": ["sunny", "temperature_c"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"rain_mm": {"type": "number", "minimum": 0}},
                    "required": ["rain_mm"],
                    "additionalProperties": False,
                },
            ]
        },
    ),
]


@pytest.fixture(scope="module")
def client(smollm2_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{smollm2_mesh.http_url}/v1",  # type: ignore[attr-defined]
        api_key="x",
        max_retries=0,
        timeout=300,
    )


def chat(client: openai.OpenAI, prompt: str, **kwargs: object) -> object:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        **{"max_tokens": MAX_TOKENS, "temperature": 0, **kwargs},
    )


def schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


def test_every_schema_validates_alone_and_in_one_batch(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        together = list(
            pool.map(
                lambda case: chat(client, case[0], response_format=schema_format(case[1])), SCHEMAS
            )
        )
    for (prompt, schema), reply in zip(SCHEMAS, together):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    # The batch changed nothing: the first case alone, streamed, gives the same text.
    prompt, schema = SCHEMAS[0]
    stream = chat(client, prompt, response_format=schema_format(schema), stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == together[0].choices[0].message.content
    )


def test_json_mode_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    reply = chat(
        client,
        "Reply with a JSON object giving a cat's name and age.",
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)

    pattern = r"[A-Z][a-z]{2,9}, [0-9]{4}"
    reply = chat(client, "Name a city and a year.", extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, reply.choices[0].message.content)

    choices = ["positive", "negative", "neutral"]
    reply = chat(client, "Sentiment of: 'I love this!'", extra_body={"guided_choice": choices})
    assert reply.choices[0].message.content in choices

    grammar = 'start: num " " op " " num " = " num\nop: "+" | "-"\nnum: /[0-9]{1,3}/'
    reply = chat(client, "Write an addition.", extra_body={"guided_grammar": grammar})
    assert re.fullmatch(
        r"[0-9]{1,3} [+-] [0-9]{1,3} = [0-9]{1,3}", reply.choices[0].message.content
    )


def test_n_seeded_samples_all_validate_and_repeat(client: openai.OpenAI) -> None:
    prompt, schema = SCHEMAS[4]
    kwargs = dict(
        response_format=schema_format(schema), n=3, seed=7, temperature=0.9, max_tokens=MAX_TOKENS
    )
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], **kwargs
    )
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], **kwargs
    )
    texts = [c.message.content for c in first.choices]
    assert [c.message.content for c in again.choices] == texts
    for choice in first.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_constrained_greedy_equals_transformers_with_the_same_mask(
    smollm2_mesh: Mesh, smollm2_hf: tuple
) -> None:
    hf_model, hf_tokenizer = smollm2_hf
    ours = load_tokenizer(default_model_path())
    vocab_size = hf_model.config.vocab_size
    for prompt, schema in SCHEMAS[:3]:
        prompt_ids = ours.apply_chat_template(prompt)
        request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt_ids))
        request.constraint.json_schema = json.dumps(schema)
        request.sampling.temperature = 0.0
        request.stopping.max_tokens = MAX_TOKENS
        result = smollm2_mesh.generate(request)
        assert result.finish_reason == generate_pb2.FINISH_REASON_STOP
        grammar = to_grammar(OutputConstraint("json_schema", json.dumps(schema)))
        reference, scores = hf_constrained(
            hf_model,
            llguidance_tokenizer(hf_tokenizer, vocab_size, ours.eos_token_ids),
            grammar,
            prompt_ids,
            MAX_TOKENS,
            ours.eos_token_ids,
        )
        assert_greedy_close(list(result.token_ids), reference, scores)  # EOS included
        jsonschema.validate(json.loads(result.text), schema)


def test_a_schema_that_cannot_be_applied_is_a_400_naming_it(client: openai.OpenAI) -> None:
    bad = [
        ({"type": "object", "properties": {"a": {"type": "strng"}}}, "strng"),
        ({"type": "string", "pattern": "(unclosed"}, "regex"),
    ]
    for schema, named in bad:
        with pytest.raises(openai.BadRequestError) as error:
            chat(client, "Hi", response_format=schema_format(schema))
        assert named in str(error.value).lower(), error.value
    reply = chat(client, "Say hi.", max_tokens=4)  # still serving
    assert reply.choices[0].message.content


def test_forced_tool_calls_parse_and_validate(client: openai.OpenAI) -> None:
    """The default model's template does not render tools; a forced call is a call all the
    same (grammar-constrained in the hermes format `auto` picks for it), whose arguments
    validate, and a follow-up with the call and its result is answered."""
    parameters = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": parameters,
            },
        },
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "parameters": {
                    "type": "object",
                    "properties": {"zone": {"type": "string", "maxLength": 10}},
                    "required": ["zone"],
                    "additionalProperties": False,
                },
            },
        },
    ]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=tools,
            tool_choice=choice,
            temperature=0,
            max_tokens=MAX_TOKENS,
            parallel_tool_calls=False,
        )
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), parameters)
    followup = client.chat.completions.create(
        model=MODEL,
        tools=tools,
        temperature=0,
        max_tokens=16,
        messages=[
            *messages,
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ],
    )
    assert followup.choices[0].message.content
