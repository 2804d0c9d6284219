"""Strategies for input below the level of fields: malformed bytes (HTTP bodies, raw HTTP
requests, protobuf messages and HTTP/2 on the gRPC port), oversized messages, slow clients
(slowloris) and disconnect storms."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from bench.fuzz.specs import (
    Cancel,
    GrpcGenerate,
    GrpcRaw,
    HttpJson,
    HttpRaw,
    ModelFacts,
    Oversized,
    RawSocket,
    Storm,
)
from bench.fuzz.strategies import CHAT, COMPLETIONS, mix

GENERATE = "/pagemesh.v1.Generation/Generate"
GRPC_METHODS = (
    GENERATE,
    "/pagemesh.v1.Generation/Tokenize",
    "/pagemesh.v1.Generation/GetModelInfo",
    "/grpc.health.v1.Health/Check",
    "/pagemesh.v1.Generation/NoSuchMethod",
    "/no.such.Service/Generate",
)
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS_FRAME = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # empty SETTINGS, stream 0


def small_body(facts: ModelFacts, chat: bool) -> dict:
    """A valid body that asks for two tokens."""
    if chat:
        return {
            "model": facts.name,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 2,
        }
    return {"model": facts.name, "prompt": "Hello there", "max_tokens": 2}


def http_request_bytes(path: str, body: bytes, extra_headers: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra_headers}\r\n"
    ).encode() + body


# ------------------------------------------------------------------ malformed HTTP bodies


def bad_json_bodies(facts: ModelFacts) -> st.SearchStrategy[tuple[str, bytes]]:
    """(what, body bytes) of bodies that are not the JSON object an endpoint wants."""
    valid = json.dumps(small_body(facts, False)).encode()
    return st.one_of(
        st.tuples(st.just("random bytes"), st.binary(max_size=300)),
        st.integers(0, len(valid) - 1).map(lambda k: ("truncated JSON", valid[:k])),
        st.sampled_from([1_000, 100_000]).map(
            lambda d: (f"{d} nested arrays", b"[" * d + b"]" * d)
        ),
        st.sampled_from([1_000, 100_000]).map(lambda d: (f"{d} nested objects open", b'{"a":' * d)),
        st.just(("invalid UTF-8 in a string", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}')),
        st.just(("UTF-8 BOM", b"\xef\xbb\xbf" + valid)),
        st.sampled_from([b"1", b"[]", b"null", b'"text"', b"true", b"", b" "]).map(
            lambda b: ("not an object", b)
        ),
        st.just(("5,000-digit integer", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}")),
        st.just(("NaN literal", b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}')),
        st.just(("duplicate keys", b'{"prompt": "a", "prompt": [1, 2], "max_tokens": 2}')),
        st.just(("lone surrogate escape", b'{"prompt": "\\ud800", "max_tokens": 2}')),
        st.just(("form encoding", b"prompt=hi&max_tokens=2")),
    )


def http_raw(facts: ModelFacts) -> st.SearchStrategy[HttpRaw]:
    content_type = st.sampled_from(
        [
            "application/json",
            "application/json",
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/json; charset=latin-1",
            "x/y",
            None,
        ]
    )
    on_endpoint = st.builds(
        lambda path, ct, made: HttpRaw("POST", path, ct, made[1], made[0]),
        st.sampled_from([COMPLETIONS, CHAT]),
        content_type,
        bad_json_bodies(facts),
    )
    elsewhere = st.builds(
        lambda method, path: HttpRaw(
            method,
            path,
            "application/json",
            json.dumps(small_body(facts, False)).encode(),
            "method or path",
        ),
        st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST", "OPTIONS"]),
        st.sampled_from(
            [
                COMPLETIONS,
                CHAT,
                "/v1/models",
                "/v1/nope",
                "/v1/completions/x",
                "/v1//completions",
                "/health",
                "/",
            ]
        ),
    )
    return mix((4, on_endpoint), (1, elsewhere))


# ------------------------------------------------------------------ raw sockets


def raw_http_requests(facts: ModelFacts) -> st.SearchStrategy[RawSocket]:
    """Requests that break HTTP/1.1 itself (or stretch it), written on a socket."""
    body = json.dumps(small_body(facts, False)).encode()

    def sock(what: str, data: bytes, complete: bool = False) -> RawSocket:
        return RawSocket("http", [data], 0.0, 0.0, complete, what)

    return st.one_of(
        st.binary(min_size=1, max_size=200).map(lambda b: sock("random bytes", b)),
        st.just(
            sock("no colon in a header", b"POST /v1/completions HTTP/1.1\r\nHost fuzz\r\n\r\n")
        ),
        st.sampled_from([8_000, 100_000]).map(
            lambda n: sock(
                f"{n}-byte header",
                b"GET /health HTTP/1.1\r\nHost: f\r\nX-Big: " + b"a" * n + b"\r\n\r\n",
            )
        ),
        st.just(
            sock("2,000 headers", b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 2000 + b"\r\n")
        ),
        st.just(
            RawSocket(
                "http",
                [http_request_bytes(COMPLETIONS, body)[:-10]],
                0.0,
                0.5,
                False,
                "body shorter than its Content-Length",
            )
        ),
        st.just(
            sock(
                "body longer than its Content-Length",
                http_request_bytes(COMPLETIONS, body) + b"garbage",
            )
        ),
        st.just(
            sock(
                "non-numeric Content-Length",
                b"POST /v1/completions HTTP/1.1\r\nHost: f\r\nContent-Length: ten\r\n\r\n" + body,
            )
        ),
        st.just(
            sock(
                "bad chunk size",
                b"POST /v1/completions HTTP/1.1\r\nHost: f\r\n"
                b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n",
            )
        ),
        st.just(
            sock(
                "Content-Length and chunked",
                b"POST /v1/completions HTTP/1.1\r\nHost: f\r\n"
                b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            )
        ),
        st.just(sock("HTTP/2 preface on the HTTP port", H2_PREFACE + SETTINGS_FRAME)),
        st.just(sock("NUL in the path", b"GET /v1/\x00models HTTP/1.1\r\nHost: f\r\n\r\n")),
        st.just(
            sock(
                "two pipelined requests",
                http_request_bytes(COMPLETIONS, body, "").replace(b"Connection: close\r\n", b"")
                * 2,
                complete=True,
            )
        ),
        st.just(
            sock(
                "non-ASCII request id header",
                http_request_bytes(COMPLETIONS, body, "X-Request-Id: caf\u00e9\r\n"),
                complete=True,
            )
        ),
    )


def raw_grpc_bytes() -> st.SearchStrategy[RawSocket]:
    """Bytes on the gRPC port that are not a well-formed HTTP/2 conversation."""
    frame = st.binary(min_size=9, max_size=60)
    return st.one_of(
        st.binary(min_size=1, max_size=200).map(
            lambda b: RawSocket("grpc", [b], 0.0, 0.2, False, "random bytes")
        ),
        st.just(
            RawSocket(
                "grpc", [b"GET / HTTP/1.1\r\nHost: f\r\n\r\n"], 0.0, 0.2, False, "HTTP/1.1 request"
            )
        ),
        frame.map(
            lambda f: RawSocket(
                "grpc",
                [H2_PREFACE + SETTINGS_FRAME + f],
                0.0,
                0.2,
                False,
                "preface, then a random frame",
            )
        ),
        st.just(RawSocket("grpc", [H2_PREFACE[:10]], 0.0, 0.5, False, "truncated preface")),
    )


def slowloris(facts: ModelFacts) -> st.SearchStrategy[RawSocket]:
    """Slow clients: a whole request a few bytes at a time (an answer is owed), or part of
    one and then silence with the connection held open."""
    request = st.booleans().map(
        lambda chat: http_request_bytes(
            CHAT if chat else COMPLETIONS, json.dumps(small_body(facts, chat)).encode()
        )
    )

    def split(data: bytes, size: int) -> list[bytes]:
        return [data[i : i + size] for i in range(0, len(data), size)]

    complete = st.builds(
        lambda data, size, delay: RawSocket(
            "http",
            split(data, size),
            delay,
            0.0,
            True,
            f"whole request, {size} bytes every {delay:.3f} s",
        ),
        request,
        st.integers(4, 24),
        st.floats(0.005, 0.03),
    )
    partial = st.builds(
        lambda data, cut, hold: RawSocket(
            "http",
            split(data[:cut], 3),
            0.02,
            hold,
            False,
            f"{cut} bytes, then {hold:.1f} s of silence",
        ),
        request,
        st.integers(1, 120),
        st.floats(0.5, 4.0),
    )
    grpc = st.builds(
        lambda hold: RawSocket(
            "grpc",
            split(H2_PREFACE, 2),
            0.05,
            hold,
            False,
            f"HTTP/2 preface 2 bytes at a time, then {hold:.1f} s",
        ),
        st.floats(0.5, 4.0),
    )
    return mix((3, complete), (2, partial), (1, grpc))


# ------------------------------------------------------------------ protobuf bytes


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def grpc_raw(valid_request: st.SearchStrategy[bytes]) -> st.SearchStrategy[GrpcRaw]:
    """Message bytes no serializer would write: cut, wrongly typed, invalid UTF-8, random."""
    method = mix((4, st.just(GENERATE)), (1, st.sampled_from(GRPC_METHODS)))
    made = st.one_of(
        st.binary(max_size=200).map(lambda b: ("random bytes", b)),
        st.tuples(valid_request, st.integers(0, 60)).map(
            lambda t: ("truncated request", t[0][: max(0, len(t[0]) - 1 - t[1])])
        ),
        st.just(("text field with invalid UTF-8", b"\x12\x03\xff\xfe\xfd")),
        st.just(("text field with a varint wire type", b"\x10\x05")),
        st.just(("length past the end", b"\x12\x7f" + b"a" * 5)),
        st.just(("varint of 11 bytes", b"\x30" + b"\xff" * 10 + b"\x01")),
        st.tuples(valid_request, st.integers(20, 9_999), st.binary(max_size=20)).map(
            lambda t: (
                "unknown field appended",
                t[0] + varint(t[1] << 3 | 2) + varint(len(t[2])) + t[2],
            )
        ),
        st.just(("logprobs = 2**40 (uint32 field)", b"\x12\x02hi\x30" + varint(2**40))),
    )
    return st.builds(lambda m, what_bytes: GrpcRaw(m, what_bytes[1], what_bytes[0]), method, made)


# ------------------------------------------------------------------ oversized, storms


def oversized(limit_bytes: int) -> st.SearchStrategy[Oversized]:
    """Past the router's gRPC message limit, or just under it, or as large over HTTP
    (which has no limit of its own to cross)."""
    past, under = limit_bytes + 1024, limit_bytes - 4096
    return st.one_of(
        st.sampled_from(["text", "token_ids"]).map(lambda shape: Oversized("grpc", shape, past)),
        st.sampled_from(["text", "stop_strings", "token_ids"]).map(
            lambda shape: Oversized("grpc", shape, under)
        ),
        st.sampled_from(["prompt_text", "prompt_ids", "messages", "garbage"]).map(
            lambda shape: Oversized("http", shape, past)
        ),
    )


def storm(facts: ModelFacts) -> st.SearchStrategy[Storm]:
    """5 to 30 clients at once, each asking for a long greedy generation and giving up at
    once, after a few chunks or after a moment."""
    long = st.integers(facts.max_model_len // 2, facts.max_model_len - 16)
    prompt = st.lists(st.integers(1, facts.vocab_size - 1), min_size=1, max_size=8)
    cancel = mix(
        (2, st.builds(Cancel, st.integers(0, 3), st.none())),
        (1, st.builds(Cancel, st.none(), st.floats(0.0, 0.5))),
    )
    grpc_client = st.builds(
        lambda ids, n, c: GrpcGenerate(
            {
                "prompt": ("ids", ids),
                "sampling": {"temperature": 0.0},
                "stopping": {"max_tokens": n, "ignore_eos": True},
            },
            c,
        ),
        prompt,
        long,
        cancel,
    )
    http_client = st.builds(
        lambda ids, n, stream, c: HttpJson(
            COMPLETIONS,
            {
                "model": facts.name,
                "prompt": ids,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
            },
            {},
            c,
        ),
        prompt,
        long,
        st.booleans(),
        cancel,
    )
    return st.builds(
        Storm, st.lists(mix((1, grpc_client), (1, http_client)), min_size=5, max_size=30)
    )
