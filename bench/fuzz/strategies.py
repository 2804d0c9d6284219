"""Hypothesis strategies for every kind of hostile input the fuzzer sends.

Each field mixes values a client may well send (weighted up, so that many requests run)
with the edges and the nonsense: protobuf integer limits, NaN and infinities, negative
counts, wrong JSON types, empty and oversized strings. `drawing.draw` draws them from a
seed. The field lists follow protos/pagemesh/v1/generate.proto's GenerateRequest and the
OpenAI completion and chat bodies the router accepts (router/openai_protocol.py), plus
OpenAI fields it refuses.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from bench.fuzz.specs import GrpcGenerate, HttpJson, ModelFacts

INT32 = (-(2**31), 2**31 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PRINTABLE = st.characters(codec="ascii", categories=["L", "N", "P", "S", "Zs"])
DUPLICATE_IDS = ("fuzz-dup-1", "fuzz-dup-2")  # ids many requests share, in flight at once


def mix(*weighted: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each `weight` times as likely as a weight of 1."""
    return st.one_of([strategy for weight, strategy in weighted for _ in range(weight)])


def ints(bounds: tuple[int, int], common: tuple[int, int], hostile: bool) -> st.SearchStrategy[int]:
    """`common` values; hostile: sometimes anywhere in `bounds` or at its ends."""
    if not hostile:
        return st.integers(*common)
    low, high = bounds
    return mix(
        (2, st.integers(*common)), (1, st.integers(low, high)), (1, st.sampled_from([low, high]))
    )


def floats(common: tuple[float, float], hostile: bool) -> st.SearchStrategy[float]:
    """`common` values; hostile: sometimes any float32, NaN and the infinities included."""
    if not hostile:
        return st.floats(*common, width=32)
    return mix((2, st.floats(*common, width=32)), (1, st.floats(width=32)))


def benign_or_hostile(make: Callable[[bool], st.SearchStrategy]) -> st.SearchStrategy:
    """Half the requests well-meaning (values a client may well send, so that many run),
    half hostile (edges, nonsense and wrong types in any field)."""
    return st.one_of(make(False), make(True))


# ------------------------------------------------------------------ gRPC GenerateRequest


def prompt(facts: ModelFacts, hostile: bool) -> st.SearchStrategy[tuple | None]:
    """("text", str), ("ids", [...]) or ("ids_repeat", id, count); None leaves it unset."""
    valid_id = st.integers(1, facts.vocab_size - 1)
    benign = mix(
        (3, st.tuples(st.just("ids"), st.lists(valid_id, min_size=1, max_size=24))),
        (2, st.tuples(st.just("text"), st.text(min_size=1, max_size=40))),
    )
    if not hostile:
        return benign
    near_context = st.integers(facts.max_model_len - 8, facts.max_model_len + 8)
    return mix(
        (2, benign),
        (1, st.tuples(st.just("text"), st.just(""))),
        (1, st.tuples(st.just("ids"), st.lists(st.integers(*UINT32), max_size=6))),
        (1, st.tuples(st.just("ids_repeat"), valid_id, near_context)),
        (1, st.none()),
    )


def request_id(hostile: bool) -> st.SearchStrategy[str]:
    benign = mix((2, st.just("")), (1, st.text(PRINTABLE, min_size=8, max_size=24)))
    if not hostile:
        return benign
    return mix(
        (2, benign),
        (1, st.sampled_from(DUPLICATE_IDS)),
        (1, st.text(max_size=12)),
        (1, st.text(PRINTABLE, min_size=250, max_size=270)),
    )


def grpc_sampling(hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {},
        optional={
            "temperature": floats((0.0, 2.0), hostile),
            "top_p": floats((0.0625, 1.0), hostile),
            "top_k": ints(INT32, (0, 40), hostile),
            "min_p": floats((0.0, 1.0), hostile),
            "repetition_penalty": floats((0.5, 2.0), hostile),
            "presence_penalty": floats((-2.0, 2.0), hostile),
            "frequency_penalty": floats((-2.0, 2.0), hostile),
            "seed": st.integers(*UINT64),
        },
    )


def stop_strings(hostile: bool) -> st.SearchStrategy[list[str]]:
    benign = st.lists(st.text(min_size=1, max_size=4), max_size=3)
    return mix((2, benign), (1, st.lists(st.text(max_size=3), max_size=20))) if hostile else benign


def grpc_stopping(facts: ModelFacts, hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
    max_tokens = st.integers(1, 16)
    if hostile:
        max_tokens = mix(
            (2, max_tokens), (1, st.integers(0, facts.max_model_len + 8)), (1, st.integers(*UINT32))
        )
    return st.fixed_dictionaries(
        {"max_tokens": max_tokens},
        optional={
            "min_tokens": ints(UINT32, (0, 8), hostile),
            "stop": stop_strings(hostile),
            "stop_token_ids": st.lists(
                ints(UINT32, (1, facts.vocab_size - 1), hostile), max_size=4
            ),
            "ignore_eos": st.booleans(),
        },
    )


def grpc_fields(facts: ModelFacts, hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Every GenerateRequest field; a key left out stays unset (hostile: `stopping` too,
    which asks for the whole context)."""
    required = {"prompt": prompt(facts, hostile)}
    optional = {
        "request_id": request_id(hostile),
        "sampling": grpc_sampling(hostile),
        "logprobs": ints(UINT32, (0, 5), hostile),
        "model": st.text(max_size=12) if hostile else st.sampled_from([facts.name, ""]),
        "apply_chat_template": st.booleans(),
        "n": ints(UINT32, (1, 4), hostile),
        "priority": ints(INT32, (-2, 2), hostile),
        "resume_from": ints(UINT32, (1, 40), hostile) if hostile else st.just(0),
    }
    (optional if hostile else required)["stopping"] = grpc_stopping(facts, hostile)
    return st.fixed_dictionaries(required, optional=optional)


def grpc_generate(facts: ModelFacts) -> st.SearchStrategy[GrpcGenerate]:
    return st.builds(GrpcGenerate, benign_or_hostile(lambda hostile: grpc_fields(facts, hostile)))


# ------------------------------------------------------------------ OpenAI JSON bodies


def any_json() -> st.SearchStrategy[Any]:
    """Any value `json.dumps` writes (NaN and Infinity too), a few levels deep."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=12)
        | st.sampled_from([-1, -5, 2**31, 2**32, 2**63, 2**64, 2**70, -(2**70), 1e308, -0.0])
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=6,
    )


def field_value(
    benign: st.SearchStrategy, hostile: bool, edges: st.SearchStrategy | None = None
) -> st.SearchStrategy:
    """A body field: `benign` values; hostile: sometimes `edges` or any JSON value at all."""
    if not hostile:
        return benign
    return mix((2, benign), (1, any_json()), *([(1, edges)] if edges is not None else []))


def common_fields(facts: ModelFacts, hostile: bool) -> dict[str, st.SearchStrategy]:
    """Fields both endpoints take (and, hostile, a few OpenAI has that the router refuses)."""
    valid_id = st.integers(1, facts.vocab_size - 1)
    big = st.sampled_from([-1, -5, 2**32, 2**64, 2**70])

    def number(low: float, high: float) -> st.SearchStrategy:
        return field_value(st.floats(low, high), hostile, st.floats())

    fields = {
        "model": field_value(st.just(facts.name), hostile, st.text(max_size=10)),
        "temperature": number(0.0, 2.0),
        "top_p": number(0.0625, 1.0),
        "top_k": field_value(st.integers(-1, 50), hostile, big),
        "min_p": number(0.0, 1.0),
        "repetition_penalty": number(0.5, 2.0),
        "presence_penalty": number(-2.0, 2.0),
        "frequency_penalty": number(-2.0, 2.0),
        "seed": field_value(st.integers(0, 2**32), hostile, st.integers(-10, 2**70)),
        "n": field_value(st.integers(1, 3), hostile, st.integers(-1, 17) | big),
        "stream": field_value(st.booleans(), hostile),
        "stop": field_value(
            st.text(min_size=1, max_size=4) | stop_strings(False), hostile, stop_strings(True)
        ),
        "stop_token_ids": field_value(st.lists(valid_id, max_size=3), hostile, st.lists(big)),
        "ignore_eos": field_value(st.booleans(), hostile),
        "min_tokens": field_value(st.integers(0, 8), hostile, big),
        "priority": field_value(st.integers(-3, 3), hostile, big),
        "user": field_value(st.text(max_size=8), hostile),
    }
    if hostile:
        fields |= {
            "stream_options": field_value(
                st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}), hostile
            ),
            "logit_bias": field_value(
                st.dictionaries(
                    st.text(string.digits, min_size=1, max_size=3),
                    st.integers(-100, 100),
                    max_size=2,
                ),
                hostile,
            ),
            "request_id": field_value(request_id(hostile), hostile),
            "resume_from": field_value(st.integers(0, 40), hostile, big),
            "return_token_ids": field_value(st.booleans(), hostile),
        }
    return fields


def max_tokens(hostile: bool) -> st.SearchStrategy[Any]:
    return field_value(
        st.integers(1, 16), hostile, st.integers(-2, 3000) | st.sampled_from([2**32, 2**70])
    )


def completion_body(facts: ModelFacts, hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
    valid_id = st.integers(1, facts.vocab_size - 1)
    prompt_value = field_value(
        st.text(min_size=1, max_size=40) | st.lists(valid_id, min_size=1, max_size=24),
        hostile,
        st.lists(st.text(max_size=8), max_size=3)
        | st.lists(st.lists(valid_id, max_size=4), max_size=2),
    )
    optional = {
        **common_fields(facts, hostile),
        "logprobs": field_value(st.integers(0, 5), hostile, st.integers(-1, 21)),
    }
    if hostile:
        optional |= {
            "echo": st.booleans(),
            "suffix": st.text(max_size=4),
            "best_of": st.integers(0, 3),
        }
    return st.fixed_dictionaries(
        {"prompt": prompt_value, "max_tokens": max_tokens(hostile)}, optional=optional
    )


def chat_message(hostile: bool) -> st.SearchStrategy[Any]:
    part = st.fixed_dictionaries(
        {
            "type": field_value(st.just("text"), hostile),
            "text": field_value(st.text(max_size=20), hostile),
        }
    )
    content = field_value(
        st.text(max_size=40) | st.lists(part, min_size=1, max_size=3), hostile, st.none()
    )
    role = field_value(
        st.sampled_from(["system", "user", "assistant", "developer"]), hostile, st.text(max_size=8)
    )
    message = st.fixed_dictionaries(
        {"role": role, "content": content}, optional={"name": st.text(max_size=6)}
    )
    return field_value(message, hostile)


def chat_body(facts: ModelFacts, hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
    messages = field_value(
        st.lists(chat_message(hostile), min_size=1, max_size=4),
        hostile,
        st.just("notalist") | st.just([]),
    )
    optional = {
        **common_fields(facts, hostile),
        "max_completion_tokens": field_value(st.integers(1, 16), hostile, st.integers(-1, 3000)),
        "logprobs": field_value(st.booleans(), hostile),
        "top_logprobs": field_value(st.integers(0, 5), hostile, st.integers(-1, 21)),
    }
    if hostile:
        optional |= {
            "tools": st.lists(
                st.dictionaries(st.text(max_size=4), st.text(max_size=4)), max_size=1
            ),
            "tool_choice": st.sampled_from(["none", "auto", "required"]),
            "response_format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object"])}
            ),
        }
    return st.fixed_dictionaries(
        {"messages": messages, "max_tokens": max_tokens(hostile)}, optional=optional
    )


def headers() -> st.SearchStrategy[dict[str, str]]:
    """Headers a client may add; values printable ASCII (the client library refuses others)."""
    value = st.text(PRINTABLE, max_size=24)
    return st.fixed_dictionaries(
        {},
        optional={
            "X-Request-Id": mix((2, value), (1, st.sampled_from(DUPLICATE_IDS))),
            "X-Resume-From": mix((2, st.integers(0, 40).map(str)), (1, value)),
            "Authorization": value,
        },
    )


def http_body(path: str, body: st.SearchStrategy) -> st.SearchStrategy[HttpJson]:
    """Hostile bodies come with extra headers a quarter of the time."""
    return st.builds(HttpJson, st.just(path), body, mix((3, st.just({})), (1, headers())))


def http_completion(facts: ModelFacts) -> st.SearchStrategy[HttpJson]:
    return st.one_of(
        http_body(COMPLETIONS, completion_body(facts, False)).map(_without_headers),
        http_body(COMPLETIONS, completion_body(facts, True)),
    )


def http_chat(facts: ModelFacts) -> st.SearchStrategy[HttpJson]:
    return st.one_of(
        http_body(CHAT, chat_body(facts, False)).map(_without_headers),
        http_body(CHAT, chat_body(facts, True)),
    )


def _without_headers(spec: HttpJson) -> HttpJson:
    return HttpJson(spec.path, spec.body)
