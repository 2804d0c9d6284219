"""Tool calls: each family's format parsed whole and as it streams (the same calls, no
markup in the content), the grammar that forces a call compiles against a real vocabulary
and what it accepts parses back to the call, the requests the chat API refuses, and the
messages that carry calls and results rendered by a tools-aware chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher

from pagemesh.runtime.service_flags import option
from pagemesh.runtime.tokenizer import Tokenizer, load_tokenizer
from router import openai_protocol as oai
from router.openai_tools import forced_call_constraint, tool_request
from router.structured import GrammarCompiler
from router.tool_calls import (
    CALL_FORMATS,
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    CallFormat,
    ToolCallStream,
    choose_format,
    parse,
)
from tests.support.bpe_folder import write_bpe_folder
from tests.support.tool_templates import LLAMA3_TOOLS_TEMPLATE, QWEN2_TOOLS_TEMPLATE

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Now"}},
]
ARGS = '{"city": "Pa}ris \\"x\\"", "unit": "celsius"}'  # a brace and quotes inside a string

# Per format: a reply, its content, and its calls (name, arguments text).
REPLIES: dict[str, tuple[CallFormat, str, str | None, list[tuple[str, str]]]] = {
    "hermes one": (
        HERMES,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
        None,
        [("get_weather", ARGS)],
    ),
    "hermes text before, two calls": (
        HERMES,
        (
            f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        ),
        "Let me look.\n",
        [("get_weather", ARGS), ("get_time", "{}")],
    ),
    "llama3 tagged": (
        LLAMA3_JSON,
        f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}',
        None,
        [("get_weather", ARGS)],
    ),
    "llama3 two": (
        LLAMA3_JSON,
        (
            f'{{"name": "get_weather", "parameters": {ARGS}}}; '
            '{"name": "get_time", "parameters": {}}'
        ),
        None,
        [("get_weather", ARGS), ("get_time", "{}")],
    ),
    "mistral": (
        MISTRAL,
        (
            f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, '
            '{"name": "get_time", "arguments": {}}]'
        ),
        None,
        [("get_weather", ARGS), ("get_time", "{}")],
    ),
    "mistral marker dropped": (
        MISTRAL,
        f'[{{"name": "get_weather", "arguments": {ARGS}}}]',
        None,
        [("get_weather", ARGS)],
    ),
}
MALFORMED = {
    "hermes bad JSON": (HERMES, 'Hi <tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'),
    "hermes unclosed": (HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": 1}'),
    "hermes no name": (HERMES, '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    "llama3 arguments not an object": (LLAMA3_JSON, '{"name": "f", "parameters": [1]}'),
    "mistral unclosed list": (MISTRAL, '[TOOL_CALLS] [{"name": "f", "arguments": {}}'),
}
PLAIN = {
    "hermes": (HERMES, "The weather is <b>fine</b> < tool"),
    "llama3": (LLAMA3_JSON, 'Use {"name": "x"} later'),
    "mistral": (MISTRAL, "A list: [1, 2] and [TOOL"),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(
        str(write_bpe_folder(tmp_path_factory.mktemp("bpe"), QWEN2_TOOLS_TEMPLATE))
    )


def streamed(fmt: CallFormat, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """Feeds `pieces` one by one: the content, the calls reassembled, every tool call delta."""
    stream = ToolCallStream(fmt)
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    entries = [entry for d in deltas for entry in d.tool_calls]
    calls: dict[int, list[str]] = {}
    for entry in entries:
        if "id" in entry:  # a call's first delta: id, type, name; no arguments yet
            assert entry["index"] not in calls and entry["type"] == "function"
            assert entry["id"].startswith("call_") and entry["function"]["arguments"] == ""
            calls[entry["index"]] = [entry["function"]["name"], ""]
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            calls[entry["index"]][1] += entry["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    return content, [(name, arguments) for name, arguments in calls.values()], entries


@pytest.mark.parametrize("case", list(REPLIES))
def test_each_format_parses_whole(case: str) -> None:
    fmt, text, content, calls = REPLIES[case]
    parsed_content, parsed = parse(fmt, text)
    assert parsed_content == content
    assert [(c.name, c.arguments) for c in parsed] == calls
    assert all(json.loads(c.arguments) is not None for c in parsed)
    assert len({c.id for c in parsed}) == len(parsed)


@pytest.mark.parametrize("case", list(REPLIES))
def test_streaming_token_by_token_gives_the_same_calls_and_no_markup(
    case: str, tokenizer: Tokenizer
) -> None:
    fmt, text, content, calls = REPLIES[case]
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    by_token = [tokenizer.decode([i]) for i in ids]
    assert "".join(by_token) == text
    for pieces in (by_token, list(text), [text]):
        streamed_content, streamed_calls, entries = streamed(fmt, pieces)
        assert streamed_content == (content or "")
        assert streamed_calls == calls
        if len(pieces) > len(calls) * 10:  # arguments come in pieces, not whole
            assert len(entries) > 2 * len(calls)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_calls_are_content(case: str) -> None:
    fmt, text = MALFORMED[case]
    assert parse(fmt, text) == (text, [])


@pytest.mark.parametrize("case", list(PLAIN))
def test_text_without_calls_streams_whole_as_content(case: str) -> None:
    fmt, text = PLAIN[case]
    assert parse(fmt, text) == (text, [])
    content, calls, _ = streamed(fmt, list(text))
    assert (content, calls) == (text, [])


def test_text_that_may_be_a_marker_is_held_back_until_it_is_not() -> None:
    stream = ToolCallStream(HERMES)
    assert stream.feed("Hello <tool").content == "Hello "
    assert stream.feed("box>").content == "<toolbox>"
    assert stream.feed(" <tool_ca").content == " "
    delta = stream.feed('ll>\n{"name": "f", "arguments": {"a"')
    assert delta.content == "" and delta.tool_calls[0]["function"]["name"] == "f"
    assert delta.tool_calls[1]["function"]["arguments"] == '{"a"'


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_forced_call_grammar_compiles_and_what_it_accepts_parses(
    fmt: CallFormat, choice: str, tokenizer: Tokenizer
) -> None:
    tool_choice: Any = (
        choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    )
    request = tool_request({"tools": TOOLS, "tool_choice": tool_choice})
    constraint = forced_call_constraint(request, fmt)
    assert constraint is not None and constraint.kind == "grammar"
    grammar = GrammarCompiler(tokenizer).compile(
        constraint, tokenizer.vocab_size, tokenizer.eos_token_ids
    )
    key = "parameters" if fmt is LLAMA3_JSON else "arguments"
    weather = f'{{"name": "get_weather", "{key}": {{"city": "Paris", "unit": "celsius"}}}}'
    time = f'{{"name": "get_time", "{key}": {{}}}}'
    calls = [weather, time] if choice == "required" else [weather]
    text = {
        HERMES: lambda cs: "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in cs),
        LLAMA3_JSON: lambda cs: "; ".join(cs),
        MISTRAL: lambda cs: "[TOOL_CALLS][" + ", ".join(cs) + "]",
    }[fmt](calls)
    matcher = LLMatcher(
        GrammarCompiler(tokenizer).vocabulary(tokenizer.vocab_size, tuple(tokenizer.eos_token_ids)),
        grammar,
    )
    assert matcher.consume_tokens(tokenizer.hf.encode(text, add_special_tokens=False))
    assert matcher.is_accepting(), matcher.get_error()
    _, parsed = parse(fmt, text)
    assert [c.name for c in parsed] == [json.loads(c)["name"] for c in calls]
    # A named call, or a call of another function or with other arguments, is refused.
    matcher.reset()
    wrong = weather.replace("celsius", "kelvin")
    assert (
        not matcher.consume_tokens(
            tokenizer.hf.encode(text.replace(weather, wrong), add_special_tokens=False)
        )
        or not matcher.is_accepting()
    )


def test_one_call_only_without_parallel_tool_calls() -> None:
    request = tool_request(
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    )
    assert ")*" not in forced_call_constraint(request, HERMES).value
    assert (
        ")*"
        in forced_call_constraint(
            tool_request({"tools": TOOLS, "tool_choice": "required"}), HERMES
        ).value
    )
    assert forced_call_constraint(tool_request({"tools": TOOLS}), HERMES) is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": {"get_weather": {}}}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                "guided_regex": "a+",
            },
            "guided_regex",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "strin"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{x"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c1"}]}]},
            "messages[0].tool_calls[0]",
        ),
        (
            {"messages": [{"role": "tool", "content": "1", "tool_call_id": 7}]},
            "messages[0].tool_call_id",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(oai.ProtocolError) as caught:
        oai.parse_chat({"messages": [{"role": "user", "content": "Hi"}], **body})
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message


def test_tool_choice_decides_parsing_and_constraint() -> None:
    base = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS}
    auto = oai.parse_chat(base, tool_format=MISTRAL)
    assert auto.tool_format is MISTRAL and auto.generate.constraint is None
    assert auto.tools is not None and auto.tools.tools[1]["function"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    none = oai.parse_chat(
        {**base, "tool_choice": "none", "response_format": {"type": "json_object"}}
    )
    assert none.tool_format is None and none.tools is not None  # still shown to the model
    assert none.generate.constraint is not None and none.generate.constraint.kind == "json_object"
    named = oai.parse_chat(
        {**base, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    )
    assert (
        named.generate.constraint is not None
        and '"const": "get_time"' in named.generate.constraint.value
    )
    assert '"get_weather"' not in named.generate.constraint.value
    assert oai.parse_chat({"messages": base["messages"]}).tools is None


def test_a_conversation_with_calls_and_results_renders_through_the_template(
    tokenizer: Tokenizer,
) -> None:
    parsed = oai.parse_chat(
        {
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": '{"city": "Paris", "unit": "celsius"}',
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
            ],
        }
    )
    assert parsed.messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris",
        "unit": "celsius",
    }  # a dict, as Hugging Face templates take it
    assert parsed.messages[2] == {
        "role": "tool",
        "content": "sunny, 21 degrees",
        "tool_call_id": "call_1",
    }
    assert parsed.tools is not None
    ids = tokenizer.apply_chat_messages(parsed.messages, parsed.tools.tools)
    prompt = tokenizer.decode(ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "maxLength" in prompt  # the tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_the_llama3_template_renders_calls_as_the_llama3_format_parses(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(write_bpe_folder(tmp_path / "bpe", LLAMA3_TOOLS_TEMPLATE)))
    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    parsed = oai.parse_chat(
        {
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "Time?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "noon"},
            ],
        }
    )
    prompt = tokenizer.decode(
        tokenizer.apply_chat_messages(parsed.messages, parsed.tools.tools),
        skip_special_tokens=False,
    )
    assert "ipython<|end_header_id|>\n\nnoon" in prompt
    rendered = prompt.split("assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    assert [c.name for c in parse(LLAMA3_JSON, rendered)[1]] == ["get_time"]


def test_auto_picks_the_format_by_architecture_then_template() -> None:
    assert choose_format("auto", "qwen2", "") is HERMES
    assert choose_format("auto", "qwen3", QWEN2_TOOLS_TEMPLATE) is HERMES
    assert choose_format("auto", "llama", "") is LLAMA3_JSON
    assert choose_format("auto", "mistral", "") is MISTRAL
    assert choose_format("auto", "", "{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert choose_format("auto", "", "no tools here") is HERMES
    assert choose_format("mistral", "qwen2", "") is MISTRAL
    # The flag's choices are this module's formats (pagemesh.runtime.service_flags_router cannot
    # import it).
    assert option("--tool-call-parser").choices == ("auto", *FORMATS)
    assert tuple(CALL_FORMATS) == FORMATS
