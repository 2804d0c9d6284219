"""OpenAI request parsing and response building, without a server."""

from __future__ import annotations

import pytest

from router import openai_protocol as oai
from router.types import FinishReason, TokenChunk, TokenLogprob, TopLogprob, Usage


def test_completion_defaults_and_fields() -> None:
    parsed = oai.parse_completion({"model": "m", "prompt": "Hi"})
    request = parsed.generate
    assert request.prompt == "Hi" and request.model == "m"
    assert request.stopping.max_tokens == oai.DEFAULT_COMPLETION_MAX_TOKENS
    assert request.sampling.temperature is None and request.sampling.seed is None
    assert not parsed.stream and parsed.num_top_logprobs is None and request.num_logprobs is None

    parsed = oai.parse_completion({
        "prompt": [[1, 2, 3]], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "n": 2,
        "stop": "x", "seed": 3, "logprobs": 0, "presence_penalty": 1, "top_k": -1, "min_p": 0.1,
        "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [7],
        "stream": True, "stream_options": {"include_usage": True},
    })
    request = parsed.generate
    assert request.prompt == [1, 2, 3]
    assert request.sampling.temperature is not None and request.sampling.temperature == 0
    assert request.sampling.top_k == 0 and request.sampling.seed == 3
    assert list(request.stopping.stop) == ["x"] and list(request.stopping.stop_token_ids) == [7]
    assert request.stopping.ignore_eos and request.stopping.min_tokens == 2 and request.n == 2
    # logprobs=0 still needs the chosen token's logprob: ask for one alternative, show none.
    assert parsed.num_top_logprobs == 0 and request.num_logprobs == 1
    assert parsed.stream and parsed.include_usage


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "a", "max_tokens": "4"}, "max_tokens"),
    ({"prompt": "a", "temperature": True}, "temperature"),
    ({"prompt": "a", "stop": [1]}, "stop"),
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "n": 0}, "n"),
    ([1, 2], None),
])
def test_bad_completion_requests_name_the_field(body: object, param: str | None) -> None:
    with pytest.raises(oai.ProtocolError) as info:
        oai.parse_completion(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_messages_and_logprobs() -> None:
    parsed = oai.parse_chat({
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
        "max_tokens": 3, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2,
    })
    assert parsed.messages == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi there"}]
    assert parsed.generate.stopping.max_tokens == 4  # max_completion_tokens wins
    assert parsed.num_top_logprobs == 2 and parsed.generate.num_logprobs == 2
    unset = oai.parse_chat({"messages": [{"role": "user", "content": "Hi"}]})
    assert unset.generate.stopping.max_tokens is None and unset.num_top_logprobs is None


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "Hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]},
])
def test_bad_chat_requests(body: dict) -> None:
    with pytest.raises(oai.ProtocolError):
        oai.parse_chat(body)


def _chunk(index: int, token_ids: list[int], text: str,
           finish: FinishReason | None = None) -> TokenChunk:
    logprobs = [TokenLogprob(token_id, -0.5, [TopLogprob(token_id, -0.5, "x"), TopLogprob(99, -1.5, "y")])
                for token_id in token_ids]
    return TokenChunk("r", index, token_ids, text, logprobs, finish)


def test_response_shapes() -> None:
    delta = oai.choice_delta(_chunk(1, [4, 5], "ab", FinishReason.LENGTH), 1)
    assert delta.index == 1 and delta.finish_reason == "length" and delta.text == "ab"
    assert delta.logprobs[0] == {"token_id": 4, "logprob": -0.5, "top": [(4, -0.5)]}
    texts = {4: "a", 5: "bc"}
    completion = oai.completion_logprobs(delta.logprobs, texts, text_offset=3)
    assert completion == {"tokens": ["a", "bc"], "token_logprobs": [-0.5, -0.5],
                          "top_logprobs": [{"a": -0.5}, {"bc": -0.5}], "text_offset": [3, 4]}
    chat = oai.chat_logprobs(delta.logprobs, texts)["content"]
    assert chat[1] == {"token": "bc", "logprob": -0.5, "bytes": [98, 99],
                       "top_logprobs": [{"token": "bc", "logprob": -0.5, "bytes": [98, 99]}]}
    assert oai.choice_delta(_chunk(0, [4], "a"), None).logprobs == []

    usage = oai.usage(Usage(num_prompt_tokens=3, num_completion_tokens=4))
    assert usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    body = oai.chat_object("chatcmpl-1", 10, "m", [oai.chat_choice(0, "hi", None, "stop")], usage)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hi"
    chunk = oai.completion_object("cmpl-1", 10, "m", [], None, chunk=True)
    assert "usage" not in chunk and chunk["object"] == "text_completion"
