"""The router's span of each `Generate` call: OpenTelemetry GenAI attributes, resume events.

One SERVER span per generation (`traced_generate`, on `Generation.generate`, which the gRPC
`Generate` call and the HTTP API both run), the child of the caller's W3C trace context:
gRPC metadata (pagemesh.runtime.telemetry.TraceContextInterceptor) or the HTTP `traceparent` header
(`TraceContextMiddleware`). Its context travels to the scheduler in `Submit`'s metadata, again
on every resume. Attribute names follow the current GenAI semantic conventions
(`gen_ai.usage.input_tokens`, not the deprecated `prompt_tokens`):

- at the start: pagemesh.request_id and gen_ai.response.id, the mesh's id of the request (a
  keyed hash of the caller's key and id, router/tenancy.py; never the client's id itself),
  gen_ai.operation.name ("chat" for the chat template or /v1/chat/completions,
  else "text_completion"), gen_ai.request.model, gen_ai.request.seed when the client set it;
- once the request is planned (`describe_request`): gen_ai.request.max_tokens, .temperature,
  .top_p, .top_k, .choice.count (n > 1), gen_ai.response.model, gen_ai.usage.input_tokens;
- from the responses: gen_ai.response.finish_reasons (one per sample),
  gen_ai.usage.output_tokens.

With tracing off the span is the API's non-recording one and none of this runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Receive, Scope, Send

from pagemesh.runtime.serving import ServiceError
from pagemesh.runtime.telemetry import extract_headers, make_current
from router.types import GenerationRequest, Submission, TokenChunk

# Set by the HTTP API: which GenAI operation the request is ("chat", "text_completion").
OPERATION_KEY = otel_context.create_key("pagemesh.gen_ai.operation")

_tracer = trace.get_tracer("pagemesh.router")


Batches = AsyncIterator[list[TokenChunk]]


def traced_generate(
    generate: Callable[[Any, GenerationRequest], Batches],
) -> Callable[[Any, GenerationRequest], Batches]:
    """Wraps `Generation.generate` in its span: started before anything else runs (an
    admission refusal is traced too), current for the call's task (its logs carry the trace
    id), ended with the stream. The span's parent is the current context: the caller's."""

    @functools.wraps(generate)
    async def traced(self: Any, request: GenerationRequest) -> Batches:
        span = _tracer.start_span(
            "Generate", kind=SpanKind.SERVER, attributes=_start_attributes(request)
        )
        batches = generate(self, request)
        if not span.is_recording():
            async with contextlib.aclosing(batches):
                async for batch in batches:
                    yield batch
            return
        make_current(trace.set_span_in_context(span))
        outcome = _Outcome(span)
        try:
            async with contextlib.aclosing(batches):
                async for batch in batches:
                    for chunk in batch:
                        outcome.observe(chunk)
                    yield batch
        except (GeneratorExit, asyncio.CancelledError):
            span.add_event("cancelled")  # the client went away, or stopped reading
            raise
        except BaseException as exc:
            _record_error(span, exc)
            raise
        finally:
            outcome.finish()
            span.end()

    return traced


def describe_request(
    span: trace.Span, submission: Submission, resumed: bool, requested_model: str, served_model: str
) -> None:
    """Attributes of the request as the scheduler gets it (the router's defaults filled in,
    or a checkpoint's parameters on a resume)."""
    if not span.is_recording():
        return
    sampling = submission.sampling
    attributes: dict[str, Any] = {
        "gen_ai.request.model": requested_model or served_model,
        "gen_ai.request.max_tokens": submission.max_tokens,
        "gen_ai.response.model": served_model,
        "gen_ai.usage.input_tokens": len(submission.prompt_token_ids),
    }
    if sampling.temperature is not None:
        attributes["gen_ai.request.temperature"] = sampling.temperature
    if sampling.top_p is not None:
        attributes["gen_ai.request.top_p"] = sampling.top_p
    if sampling.top_k:
        attributes["gen_ai.request.top_k"] = sampling.top_k
    if submission.n > 1:
        attributes["gen_ai.request.choice.count"] = submission.n
    span.set_attributes(attributes)
    if resumed:
        span.add_event("resumed_from_checkpoint")


def identify_request(mesh_id: str) -> None:
    """The current (Generate) span's request id: the mesh's, as logs and the scheduler's spans
    carry it."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({"pagemesh.request_id": mesh_id, "gen_ai.response.id": mesh_id})


def resume_event(span: trace.Span | None, scheduler_id: str, num_tokens: list[int]) -> None:
    """A failed request continues on another engine group (router/resume.py)."""
    if span is not None and span.is_recording():
        span.add_event(
            "resume",
            {"pagemesh.engine_group": scheduler_id, "pagemesh.output_tokens_received": num_tokens},
        )


def group_failed_event(span: trace.Span | None, scheduler_id: str, code: Any, details: str) -> None:
    """The engine group serving the request failed its stream."""
    if span is not None and span.is_recording():
        span.add_event(
            "engine_group_failed",
            {
                "pagemesh.engine_group": scheduler_id,
                "rpc.grpc.status_code": code.value[0] if code is not None else -1,
                "pagemesh.details": details,
            },
        )


class TraceContextMiddleware:
    """HTTP: the request's `traceparent` header becomes the parent of its Generate span, and
    the endpoint names the GenAI operation. Installed only when tracing is on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        operation = "chat" if scope["path"].endswith("/chat/completions") else "text_completion"
        context = otel_context.set_value(OPERATION_KEY, operation, extract_headers(headers))
        token = otel_context.attach(context)
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)


def _start_attributes(request: GenerationRequest) -> dict[str, Any]:
    operation = otel_context.get_value(OPERATION_KEY) or (
        "chat" if request.apply_chat_template else "text_completion"
    )
    attributes: dict[str, Any] = {"gen_ai.operation.name": operation}
    if request.model:
        attributes["gen_ai.request.model"] = request.model
    if request.sampling.seed is not None:
        attributes["gen_ai.request.seed"] = request.sampling.seed
    return attributes


def _record_error(span: trace.Span, exc: BaseException) -> None:
    if isinstance(exc, ServiceError):
        span.set_attribute("error.type", exc.code.name)
        span.set_status(Status(StatusCode.ERROR, exc.message))
    else:
        span.set_attribute("error.type", type(exc).__qualname__)
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


class _Outcome:
    """What the responses of one call say: each sample's finish reason, usage."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.finish_reasons: dict[int, str] = {}
        self.num_output_tokens: int | None = None

    def observe(self, chunk: TokenChunk) -> None:
        if chunk.finish_reason is not None:
            self.finish_reasons[chunk.index] = chunk.finish_reason.value
        if chunk.usage is not None:
            self.num_output_tokens = chunk.usage.num_completion_tokens

    def finish(self) -> None:
        attributes: dict[str, Any] = {}
        if self.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = [
                self.finish_reasons[i] for i in sorted(self.finish_reasons)
            ]
        if self.num_output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = self.num_output_tokens
        self.span.set_attributes(attributes)
