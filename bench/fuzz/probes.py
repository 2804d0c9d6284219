"""Sends one drawn spec (bench/fuzz/specs.py) and classes what came back
(bench/fuzz/outcomes.py): gRPC calls on grpc.aio channels, HTTP on an aiohttp session, and
plain sockets for what no client library would send."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc

from bench.fuzz import outcomes as oc
from bench.fuzz.specs import (
    Cancel,
    GrpcGenerate,
    GrpcRaw,
    HttpJson,
    HttpRaw,
    Oversized,
    RawSocket,
    Spec,
    Storm,
)
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc

Result = tuple[str, str]  # (class, detail)
ANSWER_WAIT_S = 30.0  # how long a raw socket waits for the answer to a whole request
NO_ANSWER_WAIT_S = 1.0  # ... and for anything at all after an incomplete one
SECONDS_PER_CHUNK = 0.2  # a cancel "after k chunks" of an HTTP answer that is not streamed


@dataclass
class Targets:
    """Where probes go: the router's gRPC channels (calls spread over a few, so one torn
    connection cannot fail many), its HTTP base URL and an aiohttp session."""

    grpc_address: str
    http_url: str
    channels: list[grpc.aio.Channel]
    session: aiohttp.ClientSession
    _next: int = 0

    def channel(self) -> grpc.aio.Channel:
        self._next += 1
        return self.channels[self._next % len(self.channels)]

    def host_port(self, port: str) -> tuple[str, int]:
        address = (
            self.grpc_address if port == "grpc" else self.http_url.split("://", 1)[1].rstrip("/")
        )
        host, _, number = address.rpartition(":")
        return host, int(number)


async def send(spec: Spec, targets: Targets) -> list[Result]:
    """One result per client the spec makes (a storm makes several)."""
    if isinstance(spec, Storm):
        return list(await asyncio.gather(*(_one(client, targets) for client in spec.clients)))
    return [await _one(spec, targets)]


async def _one(spec: Spec, targets: Targets) -> Result:
    if isinstance(spec, GrpcGenerate):
        return await grpc_generate(
            targets.channel(), generate_request(spec.fields), spec.cancel, spec.fields
        )
    if isinstance(spec, GrpcRaw):
        return await grpc_raw(targets.channel(), spec)
    if isinstance(spec, HttpJson):
        return await http_json(targets, spec)
    if isinstance(spec, HttpRaw):
        return await http_raw(targets, spec)
    if isinstance(spec, RawSocket):
        return await raw_socket(targets, spec)
    if isinstance(spec, Oversized):
        return await oversized(targets, spec)
    raise TypeError(f"no sender for {spec!r}")


# ------------------------------------------------------------------ gRPC


def generate_request(fields: dict[str, Any]) -> generate_pb2.GenerateRequest:
    """The GenerateRequest of `strategies.grpc_fields`' dict."""
    request = generate_pb2.GenerateRequest()
    prompt = fields.get("prompt")
    if prompt is not None:
        if prompt[0] == "text":
            request.text = prompt[1]
        elif prompt[0] == "ids":
            request.token_ids.ids.extend(prompt[1])
        else:  # ("ids_repeat", id, count)
            request.token_ids.ids.extend([prompt[1]] * prompt[2])
    for name in (
        "request_id",
        "logprobs",
        "model",
        "apply_chat_template",
        "n",
        "priority",
        "resume_from",
    ):
        if name in fields:
            setattr(request, name, fields[name])
    for message, values in (
        (request.sampling, fields.get("sampling")),
        (request.stopping, fields.get("stopping")),
    ):
        for name, value in (values or {}).items():
            if isinstance(value, list):
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
    return request


async def grpc_generate(
    channel: grpc.aio.Channel,
    request: generate_pb2.GenerateRequest,
    cancel: Cancel | None,
    fields: dict[str, Any] | None = None,
) -> Result:
    call = generate_pb2_grpc.GenerationStub(channel).Generate(request)
    # A request with an id may be a resume (even with resume_from 0): the checkpoint's
    # parameters apply then, logprobs or not, so only a request without one must have them.
    check = _StreamCheck(with_logprobs=request.logprobs > 0 and not request.request_id)
    if cancel and cancel.after_chunks == 0:
        await asyncio.sleep(0.05)  # time for the request to leave
        call.cancel()
        return oc.CANCELLED, "cancelled before the first chunk"
    try:
        async with _give_up_after(cancel):
            async for chunk in call:
                problem = check.add(chunk)
                if problem:
                    call.cancel()
                    return oc.MALFORMED, problem
                if (
                    cancel
                    and cancel.after_chunks is not None
                    and check.num_chunks >= cancel.after_chunks
                ):
                    call.cancel()
                    return oc.CANCELLED, f"cancelled after {check.num_chunks} chunks"
    except _GaveUp:
        call.cancel()
        return oc.CANCELLED, f"cancelled after {cancel.after_s:.2f} s"
    except grpc.aio.AioRpcError as exc:
        return oc.grpc_status(exc.code(), exc.details())
    return check.end()


class _StreamCheck:
    """What a finished Generate stream must have been: every sample seen ended exactly once,
    nothing after its end, one logprob per token when asked, usage on the last chunk."""

    def __init__(self, with_logprobs: bool) -> None:
        self.with_logprobs = with_logprobs
        self.num_chunks = 0
        self.seen: set[int] = set()
        self.finished: set[int] = set()
        self.last_has_usage = False

    def add(self, chunk: generate_pb2.GenerateResponse) -> str | None:
        self.num_chunks += 1
        if chunk.index in self.finished:
            return f"sample {chunk.index} got a chunk after its last"
        if self.with_logprobs and len(chunk.logprobs) != len(chunk.token_ids):
            return f"{len(chunk.token_ids)} tokens with {len(chunk.logprobs)} logprobs"
        self.seen.add(chunk.index)
        if chunk.finish_reason:
            self.finished.add(chunk.index)
        self.last_has_usage = chunk.HasField("usage")
        return None

    def end(self) -> Result:
        if not self.num_chunks:
            return oc.MALFORMED, "the stream ended without a chunk"
        if self.seen - self.finished:
            return (
                oc.MALFORMED,
                f"the stream ended before samples {sorted(self.seen - self.finished)} did",
            )
        if not self.last_has_usage:
            return oc.MALFORMED, "the last chunk carries no usage"
        return oc.OK, f"{self.num_chunks} chunks"


async def grpc_raw(channel: grpc.aio.Channel, spec: GrpcRaw) -> Result:
    """The bytes as the request message: no serializer on either side."""
    call = channel.unary_stream(spec.method)(spec.payload)
    try:
        num = sum([1 async for _ in call])
    except grpc.aio.AioRpcError as exc:
        result, detail = oc.grpc_status(exc.code(), exc.details())
        return result, f"{spec.what}: {detail}"
    return oc.OK, f"{spec.what}: {num} messages"


# ------------------------------------------------------------------ HTTP


async def http_json(targets: Targets, spec: HttpJson) -> Result:
    data = json.dumps(spec.body).encode()
    headers = {"Content-Type": "application/json", **spec.headers}
    return await _http(
        targets,
        "POST",
        spec.path,
        data,
        headers,
        spec.cancel,
        streamed=isinstance(spec.body, dict) and spec.body.get("stream") is True,
    )


async def http_raw(targets: Targets, spec: HttpRaw) -> Result:
    headers = {"Content-Type": spec.content_type} if spec.content_type else {}
    result, detail = await _http(
        targets, spec.method, spec.path, spec.body, headers, None, streamed=False, any_success=True
    )
    return result, f"{spec.what}: {detail}"


async def _http(
    targets: Targets,
    method: str,
    path: str,
    data: bytes,
    headers: dict[str, str],
    cancel: Cancel | None,
    streamed: bool,
    any_success: bool = False,
) -> Result:
    after_s = None if cancel is None else cancel.after_s
    if cancel is not None and after_s is None and not streamed:
        after_s = SECONDS_PER_CHUNK * (cancel.after_chunks or 0)
    try:
        async with _give_up_after(Cancel(None, after_s) if after_s is not None else None):
            async with targets.session.request(
                method, targets.http_url + path, data=data, headers=headers
            ) as response:
                if response.status != 200:
                    return oc.http_error_body(response.status, await response.read())
                if any_success:
                    await response.read()
                    return oc.OK, f"HTTP {response.status}"
                if streamed:
                    return await _event_stream(response, cancel)
                return _completion_object(await response.read())
    except _GaveUp:
        return oc.CANCELLED, f"closed after {after_s:.2f} s"
    except aiohttp.ClientConnectorError as exc:
        return oc.UNAVAILABLE, oc.short(f"no connection: {exc}")
    except (aiohttp.ClientError, ConnectionError) as exc:
        return oc.MALFORMED, oc.short(f"the connection broke: {exc!r}")


async def _event_stream(response: aiohttp.ClientResponse, cancel: Cancel | None) -> Result:
    if not response.content_type.startswith("text/event-stream"):
        return oc.MALFORMED, f"stream asked for, {response.content_type} answered"
    if cancel and cancel.after_chunks == 0:
        return oc.CANCELLED, "closed before the first event"
    finished: dict[int, bool] = {}
    num_events = 0
    async for line in _lines(response):
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            unfinished = sorted(i for i, done in finished.items() if not done)
            if unfinished:
                return oc.MALFORMED, f"[DONE] before choices {unfinished} finished"
            return oc.OK, f"{num_events} events"
        try:
            event = json.loads(line[len("data: ") :])
        except ValueError:
            return oc.MALFORMED, oc.short(f"an event that is not JSON: {line}")
        if isinstance(event, dict) and "error" in event:
            return oc.in_stream_error(event)
        num_events += 1
        for choice in event.get("choices", []):
            finished[choice["index"]] = finished.get(choice["index"], False) or bool(
                choice.get("finish_reason")
            )
        if cancel and cancel.after_chunks is not None and num_events >= cancel.after_chunks:
            return oc.CANCELLED, f"closed after {num_events} events"
    return oc.MALFORMED, f"the stream ended without [DONE] after {num_events} events"


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    while line := await response.content.readline():
        yield line.decode("utf-8", "replace").rstrip("\r\n")


def _completion_object(body: bytes) -> Result:
    try:
        answer = json.loads(body)
        choices = answer["choices"]
        unfinished = [c["index"] for c in choices if not c.get("finish_reason")]
        usage = answer["usage"]["completion_tokens"]
    except (ValueError, TypeError, KeyError) as exc:
        return oc.MALFORMED, oc.short(f"not a completion object ({exc!r}): {body[:200]!r}")
    if not choices or unfinished:
        return oc.MALFORMED, f"choices {unfinished or []} without a finish reason"
    return oc.OK, f"{len(choices)} choices, {usage} tokens"


# ------------------------------------------------------------------ raw sockets


async def raw_socket(targets: Targets, spec: RawSocket) -> Result:
    host, port = targets.host_port(spec.port)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        try:
            for chunk in spec.chunks:
                writer.write(chunk)
                await writer.drain()
                if spec.delay_s:
                    await asyncio.sleep(spec.delay_s)
            if spec.hold_s:
                await asyncio.sleep(spec.hold_s)
        except ConnectionError:
            return oc.CLOSED, f"{spec.what}: closed by the server while sending"
        wait_s = ANSWER_WAIT_S if spec.complete else NO_ANSWER_WAIT_S
        answer, closed = await _read_answer(reader, wait_s)
    finally:
        writer.close()
    return _raw_result(spec, answer, closed)


async def _read_answer(reader: asyncio.StreamReader, wait_s: float) -> tuple[bytes, bool]:
    """What the server sent within `wait_s`, and whether it closed the connection."""
    data = b""
    try:
        async with asyncio.timeout(wait_s):
            while chunk := await reader.read(65536):
                data += chunk
        return data, True
    except TimeoutError:
        return data, False
    except ConnectionError:
        return data, True


def _raw_result(spec: RawSocket, answer: bytes, closed: bool) -> Result:
    what = spec.what
    if spec.port == "grpc":  # nothing here is owed an answer; staying up is the test
        return oc.CLOSED if closed else oc.CANCELLED, f"{what}: {len(answer)} bytes back"
    if not answer.startswith(b"HTTP/"):
        if spec.complete:
            return oc.HUNG if not closed else oc.MALFORMED, f"{what}: no answer ({answer[:60]!r})"
        return (oc.CLOSED if closed else oc.CANCELLED), f"{what}: no answer"
    status = int(answer.split(b" ", 2)[1])
    body = answer.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in answer else b""
    if status == 200:
        return oc.OK, f"{what}: HTTP 200"
    if spec.complete or status >= 500:
        result, detail = oc.http_error_body(status, body)
        return result, f"{what}: {detail}"
    # HTTP itself was broken: the server's own plain-text 4xx is the right answer.
    return (oc.REFUSED if body.strip() else oc.UNCLEAR), oc.short(
        f"{what}: HTTP {status}: {body!r}"
    )


# ------------------------------------------------------------------ oversized


async def oversized(targets: Targets, spec: Oversized) -> Result:
    size = spec.num_bytes
    if spec.transport == "grpc":
        request = generate_pb2.GenerateRequest()
        request.stopping.max_tokens = 2
        if spec.shape == "text":
            request.text = "a" * size
        elif spec.shape == "token_ids":
            request.token_ids.ids.extend([5] * size)  # one byte each on the wire
        else:  # stop strings (the prompt: a token)
            request.token_ids.ids.append(5)
            request.stopping.stop.extend(["x" * 62] * (size // 64))
        result, detail = await grpc_generate(targets.channel(), request, None)
    else:
        body = {
            "prompt_text": lambda: json.dumps({"prompt": "a" * size, "max_tokens": 2}).encode(),
            "prompt_ids": lambda: json.dumps(
                {"prompt": [5] * (size // 3), "max_tokens": 2}
            ).encode(),
            "messages": lambda: json.dumps(
                {"messages": [{"role": "user", "content": "hi"}] * (size // 35), "max_tokens": 2}
            ).encode(),
            "garbage": lambda: os.urandom(64) * (size // 64),
        }[spec.shape]()
        result, detail = await _http(
            targets,
            "POST",
            "/v1/chat/completions" if spec.shape == "messages" else "/v1/completions",
            body,
            {"Content-Type": "application/json"},
            None,
            streamed=False,
        )
    return result, f"{spec.transport} {spec.shape} of {size:,} bytes: {detail}"


# ------------------------------------------------------------------ giving up on purpose


class _GaveUp(Exception):
    """The client's own timer ran out (a disconnect on purpose, not a hung answer)."""


class _give_up_after:
    """`async with`: raises _GaveUp once `cancel.after_s` passes (no-op without one)."""

    def __init__(self, cancel: Cancel | None) -> None:
        self.after_s = cancel.after_s if cancel is not None else None
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        if self.after_s is not None:
            self._timeout = asyncio.timeout(self.after_s)
            await self._timeout.__aenter__()

    async def __aexit__(self, *exc: object) -> None:
        if self._timeout is None:
            return
        try:
            await self._timeout.__aexit__(*exc)
        except TimeoutError:
            raise _GaveUp() from None
