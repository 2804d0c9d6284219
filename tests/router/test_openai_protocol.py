"""OpenAI request parsing and response building, without a server."""

from __future__ import annotations

import re

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import given, settings
from hypothesis import strategies as st

from pagemesh.api.options import fields
from pagemesh.api.options.validation import (
    ModelLimits,
    ValidationError,
    check_identity,
    resume_offsets,
    validate,
)
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from router import convert
from router import openai_protocol as oai
from router.types import FinishReason, Submission, TokenChunk, TokenLogprob, TopLogprob, Usage


def test_completion_defaults_and_fields() -> None:
    parsed = oai.parse_completion({"model": "m", "prompt": "Hi"})
    request = parsed.generate
    assert request.prompt == "Hi" and request.model == "m"
    assert request.stopping.max_tokens == oai.DEFAULT_COMPLETION_MAX_TOKENS
    assert request.sampling.temperature is None and request.sampling.seed is None
    assert not parsed.stream and parsed.num_top_logprobs is None and request.num_logprobs is None

    parsed = oai.parse_completion(
        {
            "prompt": [[1, 2, 3]],
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "n": 2,
            "stop": "x",
            "seed": 3,
            "logprobs": 0,
            "presence_penalty": 1,
            "top_k": -1,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [7],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    request = parsed.generate
    assert request.prompt == [1, 2, 3]
    assert request.sampling.temperature is not None and request.sampling.temperature == 0
    assert request.sampling.top_k == 0 and request.sampling.seed == 3
    assert list(request.stopping.stop) == ["x"] and list(request.stopping.stop_token_ids) == [7]
    assert request.stopping.ignore_eos and request.stopping.min_tokens == 2 and request.n == 2
    # logprobs=0 still needs the chosen token's logprob: ask for one alternative, show none.
    assert parsed.num_top_logprobs == 0 and request.num_logprobs == 1
    assert parsed.stream and parsed.include_usage


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "a", "max_tokens": "4"}, "max_tokens"),
        ({"prompt": "a", "temperature": True}, "temperature"),
        ({"prompt": "a", "stop": [1]}, "stop"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "a", "n": 1.0}, "n"),
        ({"prompt": "a", "seed": True}, "seed"),
        ({"prompt": "a", "temperature": 10**400}, "temperature"),
        ({"prompt": "a", "temperature": float("nan")}, "temperature"),
        ({"prompt": "a", "resume_from": "3"}, "resume_from"),
        ({"prompt": "a", "resume_from": []}, "resume_from"),
        ({"prompt": "a", "request_id": 7}, "request_id"),
        ({"prompt": "a", "return_token_ids": 1}, "return_token_ids"),
        ([1, 2], None),
        (None, None),
        ("{}", None),
    ],
)
def test_bad_completion_requests_name_the_field(body: object, param: str | None) -> None:
    with pytest.raises(oai.ProtocolError) as info:
        oai.parse_completion(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_messages_and_logprobs() -> None:
    parsed = oai.parse_chat(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_tokens": 3,
            "max_completion_tokens": 4,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    assert parsed.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert parsed.generate.stopping.max_tokens == 4  # max_completion_tokens wins
    assert parsed.num_top_logprobs == 2 and parsed.generate.num_logprobs == 2
    unset = oai.parse_chat({"messages": [{"role": "user", "content": "Hi"}]})
    assert unset.generate.stopping.max_tokens is None and unset.num_top_logprobs is None


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]},
    ],
)
def test_bad_chat_requests(body: dict) -> None:
    with pytest.raises(oai.ProtocolError):
        oai.parse_chat(body)


def _chunk(
    index: int, token_ids: list[int], text: str, finish: FinishReason | None = None
) -> TokenChunk:
    logprobs = [
        TokenLogprob(token_id, -0.5, [TopLogprob(token_id, -0.5, "x"), TopLogprob(99, -1.5, "y")])
        for token_id in token_ids
    ]
    return TokenChunk("r", index, token_ids, text, logprobs, finish)


def test_response_shapes() -> None:
    delta = oai.choice_delta(_chunk(1, [4, 5], "ab", FinishReason.LENGTH), 1)
    assert delta.index == 1 and delta.finish_reason == "length" and delta.text == "ab"
    assert delta.logprobs[0] == {"token_id": 4, "logprob": -0.5, "top": [(4, -0.5)]}
    texts = {4: "a", 5: "bc"}
    completion = oai.completion_logprobs(delta.logprobs, texts, text_offset=3)
    assert completion == {
        "tokens": ["a", "bc"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"a": -0.5}, {"bc": -0.5}],
        "text_offset": [3, 4],
    }
    chat = oai.chat_logprobs(delta.logprobs, texts)["content"]
    assert chat[1] == {
        "token": "bc",
        "logprob": -0.5,
        "bytes": [98, 99],
        "top_logprobs": [{"token": "bc", "logprob": -0.5, "bytes": [98, 99]}],
    }
    assert oai.choice_delta(_chunk(0, [4], "a"), None).logprobs == []

    usage = oai.usage(Usage(num_prompt_tokens=3, num_completion_tokens=4))
    assert usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    body = oai.chat_object("chatcmpl-1", 10, "m", [oai.chat_choice(0, "hi", None, "stop")], usage)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hi"
    chunk = oai.completion_object("cmpl-1", 10, "m", [], None, chunk=True)
    assert "usage" not in chunk and chunk["object"] == "text_completion"


# ---------------------------------------------------------------- integers on the wire


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"top_k": 2**40}, "top_k", "top_k must be in [-2**31, 2**31 - 1], got 1099511627776"),
        ({"priority": -(2**31) - 1}, "priority", "priority must be in [-2**31, 2**31 - 1]"),
        ({"seed": 2**70}, "seed", "seed must be at most 2**64 - 1, got 1180591620717411303424"),
        ({"seed": 2**64}, "seed", "seed must be at most 2**64 - 1"),
        ({"max_tokens": 2**32}, "max_tokens", "max_tokens must be at most 2**32 - 1"),
        ({"n": 2**70}, "n", "n must be at most 2**32 - 1"),
        (
            {"stop_token_ids": [1, 2**32]},
            "stop_token_ids",
            "stop_token_ids[1] must be at most 2**32 - 1",
        ),
        (
            {"prompt": [5, 2**40]},
            "prompt",
            "prompt token id at position 1 must be at most 2**32 - 1",
        ),
        ({"resume_from": [0, 2**32]}, "resume_from", "resume_from[1] must be at most 2**32 - 1"),
        ({"seed": 10**4000}, "seed", "..."),  # quoted back in a few characters
    ],
)
def test_integers_no_message_could_carry_are_refused_at_the_edge(
    body: dict, param: str, message: str
) -> None:
    with pytest.raises(oai.ProtocolError) as info:
        oai.parse_completion({"prompt": "Hi", **body})
    assert info.value.status == 400 and info.value.param == param
    assert message in info.value.message and len(info.value.message) < 200


def test_negatives_and_narrower_ranges_are_the_data_planes_in_grpcs_words() -> None:
    """An unsigned field's negative passes the edge: the data plane names its real range."""
    for body, message in [
        ({"max_tokens": -1}, "max_tokens must be at least 1, got -1"),
        ({"seed": -5}, "seed must be in [0, 2**64 - 1], got -5"),
        ({"n": 0}, "n must be in 1..16"),
        ({"n": 2**31}, "n must be in 1..16"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"prompt": [-1]}, "prompt token id -1 at position 0 is out of range"),
        ({"resume_from": -1}, "resume_from must be >= 0"),
    ]:
        parsed = oai.parse_completion({"prompt": "Hi", **body})
        with pytest.raises(ValidationError, match=re.escape(message)):
            admit(parsed)


WIRE_FIELDS = {  # HTTP name -> the protobuf fields it travels in (router -> scheduler too)
    "max_tokens": [generate_pb2.StoppingCriteria, "max_tokens"],
    "max_completion_tokens": [generate_pb2.StoppingCriteria, "max_tokens"],
    "min_tokens": [generate_pb2.StoppingCriteria, "min_tokens"],
    "stop_token_ids": [generate_pb2.StoppingCriteria, "stop_token_ids"],
    "seed": [generate_pb2.SamplingParams, "seed"],
    "top_k": [generate_pb2.SamplingParams, "top_k"],
    "n": [generate_pb2.GenerateRequest, "n", scheduler_pb2.SubmitRequest, "n"],
    "logprobs": [generate_pb2.GenerateRequest, "logprobs", scheduler_pb2.SubmitRequest, "logprobs"],
    "top_logprobs": [generate_pb2.GenerateRequest, "logprobs"],
    "priority": [generate_pb2.GenerateRequest, "priority", scheduler_pb2.SubmitRequest, "priority"],
    "prompt": [generate_pb2.TokenIds, "ids", scheduler_pb2.SubmitRequest, "prompt_token_ids"],
    "resume_from": [generate_pb2.GenerateRequest, "resume_from"],
}


def test_wire_ints_are_the_protos_field_types() -> None:
    assert set(fields.WIRE_INTS) == set(WIRE_FIELDS)
    for name, pairs in WIRE_FIELDS.items():
        for message, field_name in zip(pairs[::2], pairs[1::2]):
            field = message.DESCRIPTOR.fields_by_name[field_name]
            proto_type = {
                FD.TYPE_INT32: "int32",
                FD.TYPE_UINT32: "uint32",
                FD.TYPE_UINT64: "uint64",
            }[field.type]
            assert fields.WIRE_INTS[name].proto_type == proto_type, (name, message, field_name)
    assert (
        fields.INT32.max == 2**31 - 1
        and fields.UINT32.max == 2**32 - 1
        and fields.UINT64.max == 2**64 - 1
    )


# ---------------------------------------------------------------- request ids and resumes


def test_request_id_and_resume_from_headers_win_over_the_body() -> None:
    body = {
        "prompt": "Hi",
        "request_id": "from-body",
        "resume_from": [4, 5],
        "n": 2,
        "return_token_ids": True,
    }
    parsed = oai.parse_completion(body)
    assert (
        parsed.client_request_id == "from-body" and parsed.generate.request_id == "cmpl-from-body"
    )
    assert parsed.generate.resume_from == [4, 5] and parsed.return_token_ids
    assert not parsed.generate.new_request  # a resume looks its checkpoint up
    headers = {"x-request-id": " job-42 ", "x-resume-from": "12, 11"}
    parsed = oai.parse_completion(body, headers)
    assert parsed.client_request_id == "job-42" and parsed.generate.resume_from == [12, 11]
    chat = oai.parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, headers)
    assert chat.generate.request_id == "chatcmpl-job-42"  # vLLM's ids, one namespace per API
    assert (
        oai.parse_chat(
            {"messages": [{"role": "user", "content": "Hi"}]}, {"x-resume-from": "7"}
        ).generate.resume_from
        == 7
    )
    unset = oai.parse_completion({"prompt": "Hi"}, {"x-request-id": ""})
    assert unset.generate.request_id == unset.client_request_id == ""
    assert unset.generate.resume_from == 0 and unset.generate.new_request
    # An id alone (a proxy's, say) is a new request, as in vLLM: no checkpoint is looked up.
    assert oai.parse_completion({"prompt": "Hi"}, {"x-request-id": "j"}).generate.new_request
    assert not oai.parse_completion(
        {"prompt": "Hi"}, {"x-request-id": "j", "x-resume-from": "0"}
    ).generate.new_request
    assert not unset.return_token_ids


@pytest.mark.parametrize("value", ["", "x", "-1", "1.5", "1,,2", "١", "9" * 21, "4294967296"])
def test_a_bad_resume_from_header_says_its_format(value: str) -> None:
    with pytest.raises(oai.ProtocolError) as info:
        oai.parse_completion({"prompt": "Hi"}, {"x-resume-from": value})
    assert info.value.param == "X-Resume-From" and info.value.message.startswith(
        "X-Resume-From must"
    )


def test_request_ids_are_checked_by_the_data_planes_rule_with_room_for_the_prefix() -> None:
    """The prefixed id (`chatcmpl-<id>`) must pass the data plane's 256 characters."""
    for headers, body, param, message in [
        (
            {"x-request-id": "a" * 248},
            {},
            "X-Request-Id",
            "X-Request-Id has 248 characters; use at most 247",
        ),
        ({}, {"request_id": "tab\there"}, "request_id", "request_id must be printable ASCII"),
        ({"x-request-id": "caf\xc3\xa9"}, {}, "X-Request-Id", "printable ASCII"),
    ]:
        with pytest.raises(oai.ProtocolError) as info:
            oai.parse_chat({**BASES["chat"], **body}, headers)
        assert info.value.param == param and message in info.value.message
    admit(oai.parse_chat(BASES["chat"], {"x-request-id": "a" * 247}))


# ---------------------------------------------------------------- no input is a 500


LIMITS = ModelLimits(name="m", max_model_len=4096, vocab_size=50_000)


def admit(parsed: oai.ParsedRequest) -> scheduler_pb2.SubmitRequest:
    """What the router's data plane does with a parsed request before any I/O
    (router/generation.py): its identity checks, validation, the seed, the protobuf."""
    request = parsed.generate
    check_identity(request.request_id, request.resume_from, request.n)
    if request.request_id and request.resume_from:
        resume_offsets(request.resume_from, request.n)
    prompt_ids = request.prompt if isinstance(request.prompt, list) else [1, 2, 3]
    validated = validate(
        prompt_ids,
        request.sampling,
        request.stopping,
        request.num_logprobs,
        request.model,
        LIMITS,
        n=request.n,
        priority=request.priority,
    )
    submit = convert.submit_request(Submission.fresh("r", validated, 5))
    submit.SerializeToString()
    return submit


def parse_and_admit(parse: object, body: object, headers: dict[str, str]) -> None:
    """Succeeds, or raises what the HTTP API answers with a 4xx; nothing else."""
    try:
        admit(parse(body, headers))
    except oai.ProtocolError as exc:
        assert 400 <= exc.status < 500 and exc.message
    except ValidationError as exc:  # the HTTP API answers INVALID_ARGUMENT with a 400
        assert str(exc)


BOUNDARY_INTS = st.sampled_from(
    [
        0,
        1,
        -1,
        2,
        16,
        17,
        20,
        21,
        2**31 - 1,
        2**31,
        -(2**31),
        -(2**31) - 1,
        2**32 - 1,
        2**32,
        2**63,
        2**64 - 1,
        2**64,
        2**70,
        -(2**70),
        10**400,
    ]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | BOUNDARY_INTS
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELD_NAMES = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "priority",
    "echo",
    "suffix",
    "best_of",
    "logit_bias",
    "tools",
    "tool_choice",
    "response_format",
    "request_id",
    "resume_from",
    "return_token_ids",
    "user",
    "use_beam_search",
    "length_penalty",
    "early_stopping",
]
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from([*oai.CHAT_ROLES, "wizard"]),
            "content": st.text(max_size=8) | JSON_VALUES,
        }
    ),
    max_size=3,
)
# Mostly values of the right kind (integers at the edges of every range, numbers, flags),
# so that most bodies get past parsing to validation and the protobuf.
FIELD_VALUES = st.one_of(
    BOUNDARY_INTS,
    BOUNDARY_INTS,
    st.integers(-3, 40),
    st.floats(-3, 3),
    st.booleans(),
    st.lists(BOUNDARY_INTS, min_size=1, max_size=3),
    MESSAGES,
    JSON_VALUES,
)
HEADERS = st.just({}) | st.fixed_dictionaries(
    {},
    optional={
        "x-request-id": st.text(max_size=12),
        "x-resume-from": st.from_regex(r"\A[0-9]{1,11}(,[0-9]{1,11}){0,2}\Z") | st.text(max_size=8),
    },
)
BASES = {
    "completion": {"model": "m", "prompt": "Hi"},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
}


PARSERS = {"completion": oai.parse_completion, "chat": oai.parse_chat}


@pytest.mark.parametrize("name", FIELD_NAMES)
@pytest.mark.parametrize("kind", PARSERS)
@settings(max_examples=80, deadline=None)
@given(value=FIELD_VALUES)
def test_any_value_of_any_field_parses_and_validates_or_is_a_4xx(
    kind: str, name: str, value: object
) -> None:
    """A valid body with one of the real fields (the prompt or messages too) set to anything."""
    parse_and_admit(PARSERS[kind], {**BASES[kind], name: value}, {})


@pytest.mark.parametrize("kind", PARSERS)
@settings(max_examples=500, deadline=None)
@given(
    extra=st.dictionaries(st.sampled_from(FIELD_NAMES), FIELD_VALUES, max_size=4), headers=HEADERS
)
def test_any_fields_and_headers_parse_and_validate_or_are_a_4xx(
    kind: str, extra: dict, headers: dict[str, str]
) -> None:
    parse_and_admit(PARSERS[kind], {**BASES[kind], **extra}, headers)


@settings(max_examples=300, deadline=None)
@given(body=JSON_VALUES, headers=HEADERS)
def test_any_json_value_is_parsed_or_refused(body: object, headers: dict[str, str]) -> None:
    for parse in PARSERS.values():
        parse_and_admit(parse, body, headers)


def test_usage_carries_the_speculative_counts_only_when_there_were_drafts() -> None:
    from router.openai_protocol import usage
    from router.types import Usage

    assert usage(Usage(5, 7)) == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert usage(Usage(5, 7, 12, 9))["spec_decode"] == {
        "num_draft_tokens": 12,
        "num_accepted_tokens": 9,
    }
