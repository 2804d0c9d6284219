"""Tool calling through the mesh with the official `openai` client: a forced call (named, or
`required`) is grammar-constrained, so its arguments always validate against the function's
schema, streamed or not; a conversation carrying the call and its result is rendered by the
model's chat template. A tiny Qwen2 model with a hermes template (`auto` picks hermes), and a
second router reading the same tokenizer with a Llama 3 template (`auto` picks llama3_json)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.tokenizer import load_tokenizer
from pagemesh.tools.testing.tiny_models import write_tiny_model
from tests.support.eventually import eventually
from tests.support.mesh_harness import Mesh, router_process
from tests.support.tool_templates import (
    LLAMA3_TOOLS_TEMPLATE,
    QWEN2_TOOLS_TEMPLATE,
    set_chat_template,
    tokenizer_folder,
)

MODEL = "tiny-qwen2"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
HOUR = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": HOUR}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": HOUR}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]
GREEDY = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 96}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A context past the tiny default of 512: the tools in the prompt are ~540 tokens.
    path = write_tiny_model(
        tmp_path_factory.mktemp("tools") / MODEL, "qwen2", seed=3, max_position_embeddings=2048
    )
    return set_chat_template(path, QWEN2_TOOLS_TEMPLATE)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def mesh(
    model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Mesh, str]]:
    port = reserve_port()
    mesh = Mesh(
        str(model_dir),
        tmp_path_factory.mktemp("logs") / "tools-mesh.log",
        redis_url=redis_url,
        cluster="e2e-tools",
        extra_args=["--num-kv-blocks", "128", "--http-port", str(port)],
    )
    try:
        yield mesh.wait_ready(), f"http://127.0.0.1:{port}"
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def client(mesh: tuple[Mesh, str]) -> openai.OpenAI:
    return _client(mesh[1])


def _calls(message: object) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed(client: openai.OpenAI, **kwargs: object) -> tuple[str, list[tuple[str, str]], str]:
    """Content, calls reassembled from the deltas, and the finish reason of a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:  # the first delta of a call: its id and name
                assert call.index not in calls and call.type == "function"
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


def _parses(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_a_forced_call_validates_streamed_or_not(client: openai.OpenAI, tool_choice: str) -> None:
    kwargs = {
        **GREEDY,
        "tool_choice": NAMED if tool_choice == "named" else "required",
        "parallel_tool_calls": False,
    }
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _check_calls(
        _calls(choice.message), {"get_weather"} if tool_choice == "named" else set(SCHEMAS)
    )
    assert _streamed(client, **kwargs) == ("", _calls(choice.message), "tool_calls")


def test_several_calls_when_required(client: openai.OpenAI) -> None:
    # The tiny model never stops calling: each call is whole until max_tokens cuts one off.
    kwargs = {**GREEDY, "max_tokens": 160, "tool_choice": "required"}
    reply = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = _streamed(client, **kwargs)
    assert content == "" and finish == reply.finish_reason == "length"
    whole = [call for call in calls if _parses(call[1])]
    assert len(whole) >= 2 and whole == calls[: len(whole)] and len(calls) - len(whole) <= 1
    _check_calls(whole, set(SCHEMAS))
    # Cut off, the reply is content (its calls do not all parse): the same calls, as text.
    for name, arguments in whole:
        assert f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>' in (
            reply.message.content
        )
    assert reply.message.tool_calls is None


def test_a_follow_up_with_the_call_and_its_result_is_rendered(
    client: openai.OpenAI, model_dir: Path
) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(
        **{**GREEDY, "max_tokens": 4, "messages": messages},
        tool_choice="none",
        extra_body={"ignore_eos": True},
    )
    assert (
        reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
    )
    # The mesh saw the prompt the template renders, with the tool result.
    tokenizer = load_tokenizer(str(model_dir))
    expected = tokenizer.apply_chat_messages(
        [
            *messages[:1],
            {
                **messages[1],
                "content": "",
                "tool_calls": [
                    {
                        **messages[1]["tool_calls"][0],
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris", "unit": "c"},
                        },
                    }
                ],
            },
            messages[2],
        ],
        TOOLS,
    )
    assert "<tool_response>\nsunny\n</tool_response>" in tokenizer.decode(expected)
    assert reply.usage.prompt_tokens == len(expected)


def test_bad_tool_requests_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            **GREEDY, tool_choice={"type": "function", "function": {"name": "book_flight"}}
        )
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            **GREEDY, tool_choice="required", response_format={"type": "json_object"}
        )
    assert info.value.body["param"] == "response_format"


def test_a_llama3_router_forces_calls_in_its_format(
    mesh: tuple[Mesh, str],
    model_dir: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # Another router on the same engine group, whose tokenizer folder says Llama.
    folder = tokenizer_folder(
        model_dir, tmp_path_factory.mktemp("llama3") / MODEL, LLAMA3_TOOLS_TEMPLATE, "llama"
    )
    port = reserve_port()
    log_path = tmp_path_factory.mktemp("logs") / "llama3-router.log"
    with router_process(folder, redis_url, "e2e-tools", log_path, "--http-port", str(port)):
        url = f"http://127.0.0.1:{port}"
        eventually(
            lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200,
            60,
            log_path.read_text,
            interval_s=0.3,
            ignoring=(httpx.HTTPError,),
        )
        client = _client(url)
        kwargs = {**GREEDY, "tool_choice": NAMED}
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "tool_calls"
        calls = _calls(reply.choices[0].message)
        assert len(calls) == 1
        _check_calls(calls, {"get_weather"})
        assert _streamed(client, **kwargs) == ("", calls, "tool_calls")
        assert "tool calls parsed as llama3_json" in log_path.read_text()
