"""The router's OpenAI-compatible HTTP API: a thin Starlette adapter over the router's data
plane, `router.generation.Generation`.

The gRPC servicer adapts the same object, so HTTP and gRPC give the same tokens, reject the
same requests and trace the same span. `router.openai_protocol` turns JSON into
`GenerationRequest`s and `TokenChunk`s into OpenAI's objects.

A client that closes its connection before its answer is complete cancels the request down
the mesh, streaming or not. A client that sets `X-Request-Id` can get the rest of its answer
from any router after this one died (`X-Resume-From`, docs/fault-tolerance.md): the data
plane replays it from the request's checkpoint, as for gRPC's `resume_from`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pagemesh.runtime.auth import ADMIN, HTTP_HOW_TO, ApiKeys, missing_key_message
from pagemesh.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagemesh.runtime.service_flags import option
from pagemesh.runtime.serving import ServiceError
from pagemesh.runtime.telemetry import tracing_enabled
from router import lora_admin
from router import openai_protocol as oai
from router.generation import Generation
from router.openai_embeddings import embeddings_object, parse_embeddings
from router.tool_calls import HERMES, CallFormat, ToolCallStream, parse
from router.tracing import TraceContextMiddleware
from router.types import TokenChunk

logger = logging.getLogger(__name__)

MAX_BODY_BYTES: int = option("--max-message-bytes").default  # as for a gRPC message
_PARSE_OFF_LOOP_BYTES = 1024 * 1024  # larger bodies are parsed on a worker thread

# ServiceError carries a gRPC status code (pagemesh/runtime/serving.py): OpenAI's status for each.
_STATUS_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict"),  # the id's own stream is running
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def build_http_app(
    generation: Generation,
    is_serving: Callable[[], bool],
    api_keys: ApiKeys | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    tool_format: CallFormat = HERMES,
) -> Starlette:
    """The ASGI app; `is_serving()` is the router's gRPC health (True with >= 1 ready engine group).
    With `api_keys` enabled, `/v1/*` needs `Authorization: Bearer <key>`; `/health` and
    `/metrics` stay open. `tool_format`: how the model writes tool calls (--tool-call-parser)."""
    api = _OpenAIApi(generation, is_serving, max_body_bytes, tool_format, api_keys)
    middleware = (
        [Middleware(_ApiKeyMiddleware, keys=api_keys)] if api_keys and api_keys.enabled else []
    )
    if tracing_enabled():  # a `traceparent` header parents the request's Generate span
        middleware.insert(0, Middleware(TraceContextMiddleware))
    return Starlette(
        middleware=middleware,
        routes=[
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
            Route("/v1/embeddings", api.embeddings, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/load_lora_adapter", api.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", api.unload_lora_adapter, methods=["POST"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
        ],
        exception_handlers={
            oai.ProtocolError: _protocol_error,
            ServiceError: _service_error,
            HTTPException: _http_error,  # an unknown path or method, in OpenAI's shape too
        },
    )


class _ApiKeyMiddleware:
    """Answers 401 `invalid_api_key`, as OpenAI does, to `/v1/*` requests without a valid key."""

    def __init__(self, app: Any, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            value = next(
                (v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None
            )
            if not self.keys.check_authorization(value):
                error = oai.ProtocolError(
                    missing_key_message(value, HTTP_HOW_TO),
                    None,
                    401,
                    "invalid_request_error",
                    "invalid_api_key",
                )
                response = JSONResponse(
                    error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def protocol_error_for(exc: ServiceError) -> oai.ProtocolError:
    """OpenAI's status and error type for a data plane error."""
    if exc.reason == "model_not_found" or (
        exc.code == grpc.StatusCode.INVALID_ARGUMENT and "is not served here" in exc.message
    ):
        return oai.ProtocolError(
            exc.message, "model", 404, "invalid_request_error", "model_not_found"
        )
    if exc.reason == "id_conflict":  # the id is taken by another request of the caller's
        return oai.ProtocolError(exc.message, None, 409, "conflict", "request_id_conflict")
    status, type = _STATUS_FOR_CODE.get(exc.code, (500, "internal_error"))
    return oai.ProtocolError(exc.message, None, status, type)


async def _protocol_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, oai.ProtocolError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    error = protocol_error_for(exc)
    # A client (OpenAI's SDK among them) waits this long, seconds, before it tries again.
    headers = {"Retry-After": RETRY_AFTER_S} if error.status == 429 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


RETRY_AFTER_S = "1"


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = oai.ProtocolError(
        f"{request.method} {request.url.path}: {exc.detail}", None, exc.status_code
    )
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0  # characters of token text sent so far (completions logprobs)
    started: bool = False  # chat streams: the role chunk was sent
    tool_calls: ToolCallStream | None = None  # chat streams parsing tool calls


class _OpenAIApi:
    def __init__(
        self,
        generation: Generation,
        is_serving: Callable[[], bool],
        max_body_bytes: int,
        tool_format: CallFormat,
        api_keys: ApiKeys | None = None,
    ) -> None:
        self.generation = generation
        self.api_keys = api_keys
        self.is_serving = is_serving
        self.max_body_bytes = max_body_bytes
        self.tool_format = tool_format
        self.created = int(time.time())

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.is_serving() else 503)

    async def metrics(self, request: Request) -> Response:
        """Prometheus text format, as on the router's --metrics-port (open, like /health)."""
        return Response(self.generation.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            oai.models_object(
                await self.generation.model_info(), self.created, self.generation.directory.adapters
            )
        )

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime LoRA loading: {"lora_name", "lora_path"} on every engine group
        that serves LoRA; an admin key's call when keys are on."""
        self._require_admin(request)
        body = await _json_body(request, self.max_body_bytes)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise oai.ProtocolError("give lora_name and lora_path (strings)", "lora_name")
        await lora_admin.load_adapter(self.generation.directory, name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        self._require_admin(request)
        body = await _json_body(request, self.max_body_bytes)
        name = body.get("lora_name")
        if not isinstance(name, str):
            raise oai.ProtocolError("give lora_name (a string)", "lora_name")
        await lora_admin.unload_adapter(self.generation.directory, name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    def _require_admin(self, request: Request) -> None:
        keys = self.api_keys
        if (
            keys is not None
            and keys.enabled
            and not keys.check_authorization(request.headers.get("authorization"), ADMIN)
        ):
            raise oai.ProtocolError(
                "loading and unloading LoRA adapters needs an admin key (--admin-api-key)",
                None,
                403,
                "permission_denied",
            )

    async def embeddings(self, request: Request) -> Response:
        owner = self.generation.tenancy.owner(request.headers.get("authorization"))
        parsed, encoding = parse_embeddings(await _json_body(request, self.max_body_bytes), owner)
        result = await self.generation.embed(parsed)
        model = (await self.generation.model_info()).model
        return JSONResponse(embeddings_object(result, model, encoding))

    async def completions(self, request: Request) -> Response:
        parsed = oai.parse_completion(
            await _json_body(request, self.max_body_bytes), request.headers
        )
        return await _unless_client_leaves(request, self._generate(request, parsed, chat=False))

    async def chat_completions(self, request: Request) -> Response:
        parsed = oai.parse_chat(
            await _json_body(request, self.max_body_bytes), request.headers, self.tool_format
        )
        tools = parsed.tools.tools if parsed.tools is not None else None
        owner = self.generation.tenancy.owner(request.headers.get("authorization"))
        try:
            prompt_ids = await self.generation.tokenize_chat(parsed.messages, tools, owner)
        except ServiceError as exc:
            if exc.code != grpc.StatusCode.INVALID_ARGUMENT:  # the admission limits'
                raise
            raise oai.ProtocolError(exc.message, "messages") from exc
        parsed.generate = dataclasses.replace(parsed.generate, prompt=prompt_ids)
        return await _unless_client_leaves(request, self._generate(request, parsed, chat=True))

    async def _generate(
        self, http_request: Request, parsed: oai.ParsedRequest, chat: bool
    ) -> Response:
        model = (await self.generation.model_info()).model
        # The client's id, whose checkpoint the data plane resumes when asked to; or a fresh
        # one, with no checkpoint to look up.
        client_id = parsed.client_request_id or uuid.uuid4().hex
        request = dataclasses.replace(
            parsed.generate,
            request_id=parsed.id_prefix + client_id,
            new_request=parsed.generate.new_request or not parsed.client_request_id,
            owner=self.generation.tenancy.owner(http_request.headers.get("authorization")),
        )
        batches = self.generation.generate(request)
        try:
            # Validation happens on the first step: pull it here so that errors are 4xx replies.
            first = await anext(batches)
        except BaseException:
            await batches.aclose()
            raise
        stream = _Stream(self.generation, parsed, chat, request.request_id, model, int(time.time()))
        headers = {oai.REQUEST_ID_HEADER: client_id}
        if parsed.stream:
            return _EventStream(
                stream.events(first, batches), media_type="text/event-stream", headers=headers
            )
        return JSONResponse(await stream.collect(first, batches), headers=headers)


Batches = AsyncIterator[list[TokenChunk]]


class _Stream:
    """Turns one request's `TokenChunk`s, a list per step, into OpenAI objects."""

    def __init__(
        self,
        generation: Generation,
        parsed: oai.ParsedRequest,
        chat: bool,
        response_id: str,
        model: str,
        created: int,
    ) -> None:
        self.tokenizer = generation.tokenizer
        self.parsed = parsed
        self.chat = chat
        self.build = oai.chat_object if chat else oai.completion_object
        self.head = (response_id, created, model)
        # By index, as chunks come: a resume has the checkpoint's samples, whatever its n says.
        self.choices: dict[int, _Choice] = {}
        self.resume_from = parsed.generate.resume_from
        self.token_text: dict[int, str] = {}
        self.usage: dict[str, int] | None = None

    async def collect(self, first: list[TokenChunk], batches: Batches) -> dict[str, Any]:
        async with contextlib.aclosing(batches):
            async for batch in _prepend(first, batches):
                for chunk in batch:
                    self._absorb(chunk)
        choices = []
        for index, choice in sorted(self.choices.items()):
            logprobs = self._logprobs(choice.logprobs, 0)
            if self.chat:
                out = self._chat_choice(index, choice, logprobs)
            else:
                out = oai.completion_choice(index, choice.text, logprobs, choice.finish_reason)
            choices.append(self._with_token_ids(out, choice.token_ids))
        return self.build(*self.head, choices, self.usage)

    def _chat_choice(
        self, index: int, choice: _Choice, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        """A whole chat reply; with tools, its calls parsed out of the text (a reply whose
        markup does not parse stays content)."""
        tool_format = self.parsed.tool_format
        if tool_format is None:
            return oai.chat_choice(index, choice.text, logprobs, choice.finish_reason)
        content, calls = parse(tool_format, choice.text)
        if not calls:
            return oai.chat_choice(index, choice.text, logprobs, choice.finish_reason)
        return oai.chat_choice(
            index,
            content,
            logprobs,
            _with_calls(choice.finish_reason),
            [call.to_openai() for call in calls],
        )

    async def events(self, first: list[TokenChunk], batches: Batches) -> AsyncIterator[str]:
        # Closing `batches` (also when the client goes away) cancels the request down the mesh.
        async with contextlib.aclosing(batches):
            try:
                async for batch in _prepend(first, batches):
                    for chunk in batch:
                        for event in self._chunk_events(chunk):
                            yield _sse(event)
            except ServiceError as exc:
                yield _sse(protocol_error_for(exc).body())
                return
        if self.parsed.include_usage:
            yield _sse(self.build(*self.head, [], self.usage, chunk=True))
        yield "data: [DONE]\n\n"

    def _absorb(self, chunk: TokenChunk) -> oai.ChoiceDelta:
        delta = oai.choice_delta(chunk, self.parsed.num_top_logprobs)
        if delta.logprobs:
            self.token_text.update(self._token_texts(chunk))
        choice = self._choice(delta.index)
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        choice.logprobs.extend(delta.logprobs)
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        if chunk.usage is not None:
            self.usage = oai.usage(chunk.usage)
        return delta

    def _chunk_events(self, chunk: TokenChunk) -> list[dict[str, Any]]:
        delta = self._absorb(chunk)
        choice = self._choice(delta.index)
        events = []
        if self.chat and not choice.started:
            choice.started = True
            role = oai.chat_chunk_choice(
                delta.index, {"role": "assistant", "content": ""}, None, None
            )
            events.append(self.build(*self.head, [role], None, chunk=True))
        # A token whose text is not whole yet goes out with a later one, unless the client
        # counts tokens (to resume): then every token goes out in the chunk that brought it.
        counted = self.parsed.return_token_ids and delta.token_ids
        if not (delta.text or counted or delta.logprobs or delta.finish_reason):
            return events
        logprobs = self._logprobs(delta.logprobs, choice.text_offset)
        choice.text_offset += sum(
            len(self.token_text.get(e["token_id"], "")) for e in delta.logprobs
        )
        if self.chat:
            content, finish_reason = self._chat_delta(choice, delta)
            if not (content or counted or logprobs or finish_reason):
                return events  # all held back as possible tool call markup
            out = oai.chat_chunk_choice(delta.index, content, logprobs, finish_reason)
        else:
            out = oai.completion_choice(delta.index, delta.text, logprobs, delta.finish_reason)
        events.append(
            self.build(*self.head, [self._with_token_ids(out, delta.token_ids)], None, chunk=True)
        )
        return events

    def _chat_delta(
        self, choice: _Choice, delta: oai.ChoiceDelta
    ) -> tuple[dict[str, Any], str | None]:
        """A chat chunk's `delta` and finish reason; with tools, the text goes through the
        choice's tool call parser, which holds back what may be markup."""
        tool_format = self.parsed.tool_format
        if tool_format is None:
            return ({"content": delta.text} if delta.text else {}), delta.finish_reason
        if choice.tool_calls is None:
            choice.tool_calls = ToolCallStream(tool_format)
        parsed = choice.tool_calls.feed(delta.text)
        if delta.finish_reason is None:
            return parsed.to_openai(), None
        rest = choice.tool_calls.finish()
        parsed.content += rest.content
        finish_reason = delta.finish_reason
        if choice.tool_calls.num_calls:
            finish_reason = _with_calls(finish_reason)
        return parsed.to_openai(), finish_reason

    def _with_token_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        """vLLM's `return_token_ids`: the choice's (new) output token ids."""
        if self.parsed.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _choice(self, index: int) -> _Choice:
        choice = self.choices.get(index)
        if choice is None:
            offset = self.resume_from
            if isinstance(offset, list):
                offset = offset[index] if index < len(offset) else 0
            # A choice the client has tokens of had its role chunk with the first of them.
            choice = self.choices[index] = _Choice(started=offset > 0)
        return choice

    def _logprobs(self, entries: list[dict[str, Any]], text_offset: int) -> dict[str, Any] | None:
        if self.parsed.num_top_logprobs is None:
            return None
        if self.chat:
            return oai.chat_logprobs(entries, self.token_text)
        return oai.completion_logprobs(entries, self.token_text, text_offset)

    def _token_texts(self, chunk: TokenChunk) -> dict[int, str]:
        texts = {t.token_id: t.token for lp in chunk.logprobs for t in lp.top}
        for token_id in chunk.token_ids:
            if token_id not in texts:
                texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return texts


def _with_calls(finish_reason: str | None) -> str | None:
    """OpenAI's finish reason for a reply that ended in tool calls (one cut off by
    max_tokens stays "length")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


class _EventStream(StreamingResponse):
    """A server-sent-event stream that stops generating as soon as the client goes away.

    Starlette only notices a disconnect on its next write under ASGI 2.4; listening for
    `http.disconnect` too cancels the body at once, and closing the body closes
    `Generation.generate`, which cancels the scheduler call.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as task_group:

            async def stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                task_group.cancel_scope.cancel()

            task_group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            task_group.cancel_scope.cancel()
        await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _unless_client_leaves(request: Request, answer: Awaitable[Response]) -> Response:
    """`answer`, unless the client closes its connection first: then `answer` is cancelled,
    which cancels the generation down the mesh (its blocks are freed), and the reply goes
    nowhere. A stream's own body then listens for the same (`_EventStream`)."""
    task = asyncio.ensure_future(answer)
    client_gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, client_gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        client_gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()


async def _disconnected(receive: Receive) -> None:
    """Returns when the client closed the connection (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _json_body(request: Request, max_bytes: int) -> Any:
    """The body as JSON: 413 past `max_bytes` (said up front by Content-Length, or found
    while reading), 400 when it does not parse. A large body is parsed off the event loop."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > max_bytes:
                raise _too_large(len(body), max_bytes)
    except ClientDisconnect:  # nobody reads the answer; no traceback in the log either
        raise oai.ProtocolError(
            "the client closed the connection while sending its body", status=400
        ) from None
    try:
        if len(body) > _PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(json.loads, body)
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise oai.ProtocolError(f"the request body is not valid JSON: {_brief(exc)}") from exc


def _too_large(num_bytes: int, max_bytes: int) -> oai.ProtocolError:
    return oai.ProtocolError(
        f"the request body is {num_bytes:,} bytes or more, past this router's limit of "
        f"{max_bytes:,} (--max-message-bytes); send a shorter prompt",
        status=413,
    )


def _brief(exc: BaseException) -> str:
    return str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
