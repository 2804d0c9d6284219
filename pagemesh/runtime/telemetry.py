"""OpenTelemetry tracing: set-up once per service, and W3C trace context across the mesh.

Tracing is on when an OTLP endpoint is configured: `--otlp-traces-endpoint`, or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` variables (unless
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`). Then `setup_tracing` installs an SDK
`TracerProvider` whose `BatchSpanProcessor` exports over OTLP gRPC; every other `OTEL_*`
variable (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`,
`OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_*_HEADERS`, ...) works as the SDK documents it. Off, nothing
is installed: the API's no-op tracer answers, no interceptor is added, and the services skip
their per-request and per-step trace work (`tracing_enabled()`, `span.is_recording()`).

Context crosses gRPC as the W3C `traceparent` (and `tracestate`) metadata entries of the global
propagator (W3C TraceContext + Baggage unless `OTEL_PROPAGATORS` says otherwise): servers
extract it in `TraceContextInterceptor`; clients inject a span explicitly (`grpc_metadata`), not
from the ambient context, because the router's streams resume inside async generators whose
ambient context is not reliably the request's. The scheduler hands each request's context to
its workers in the step message (`ExecuteStepRequest.traceparents`, one per request).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

logger = logging.getLogger(__name__)

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def traces_endpoint(flag: str | None) -> str | None:
    """Where spans go: the flag, else the standard variables; None = tracing off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    if flag:
        # A bare host:port means plaintext, as a local collector serves it; the OTLP exporter
        # would read it as a scheme and dial TLS.
        return flag if "://" in flag else f"http://{flag}"
    return next((os.environ[v] for v in _ENDPOINT_VARIABLES if os.environ.get(v)), None)


def setup_tracing(service_name: str, endpoint: str | None = None) -> Any | None:
    """Installs the global tracer provider when an endpoint is configured (see the module
    docstring); returns it, for `shutdown_tracing`, or None when tracing stays off.

    `service_name` (e.g. "pagemesh-router") is `service.name` unless `OTEL_SERVICE_NAME` or
    `OTEL_RESOURCE_ATTRIBUTES` name the service."""
    endpoint = traces_endpoint(endpoint)
    if endpoint is None:
        return None
    # Imported here: a service with tracing off never loads the SDK or the exporter.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=tracing_resource(service_name))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    logger.info(
        "tracing: OTLP gRPC export to %s as %s",
        endpoint,
        provider.resource.attributes.get("service.name"),
    )
    return provider


def tracing_resource(service_name: str) -> Any:
    """The SDK resource: `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_SERVICE_NAME` as the SDK reads
    them, with `service_name` as service.name unless they name one."""
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource

    attributes = {}
    if SERVICE_NAME not in OTELResourceDetector().detect().attributes:
        attributes[SERVICE_NAME] = service_name
    return Resource.create(attributes)


def shutdown_tracing(provider: Any | None) -> None:
    """Exports the spans still queued (bounded by the processor's export timeout)."""
    if provider is not None:
        provider.shutdown()


def tracing_enabled() -> bool:
    """Whether an SDK tracer provider is installed (by `setup_tracing`)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def make_current(context: otel_context.Context) -> None:
    """Makes `context` (e.g. a request's span) the current one for the rest of this task,
    the way `request_id_var.set()` does for the request id. There is no detach on purpose:
    each gRPC call and each HTTP request runs in its own task, whose context ends with it, and
    a detach from inside an async generator may run in another context (and fail)."""
    otel_context.attach(context)


class TraceContextInterceptor(grpc.aio.ServerInterceptor):
    """Makes the caller's W3C trace context (gRPC metadata) current for the call's task, so a
    span a servicer starts is the caller's child. Starts no span itself: health checks and
    worker steps must not each make one."""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        metadata = details.invocation_metadata
        if metadata and any(key == "traceparent" for key, _ in metadata):
            make_current(propagate.extract(dict(metadata)))
        return await continuation(details)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """What every gRPC server installs: trace-context extraction when tracing is on."""
    return [TraceContextInterceptor()] if tracing_enabled() else []


def grpc_metadata(span: trace.Span | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata carrying `span`'s context to a callee; None without a valid context. A
    span the caller's sampling decision left unrecorded goes too, so the callee drops its
    spans as well instead of starting a trace of its own."""
    if span is None or not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def extract_headers(headers: Mapping[str, str]) -> otel_context.Context:
    """The trace context of HTTP headers (`traceparent`, `tracestate`)."""
    return propagate.extract(headers)


def traceparent(span: trace.Span) -> str:
    """The W3C `traceparent` of `span` (version 00)."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def span_context_from_traceparent(text: str) -> SpanContext | None:
    """A remote span context from a version-00 `traceparent`; None when malformed. Faster than
    the propagator's regular expression, which matters for a step span linked to every
    request in the batch."""
    if len(text) != 55 or text[:3] != "00-" or text[35] != "-" or text[52] != "-":
        return None
    try:
        trace_id, span_id, flags = int(text[3:35], 16), int(text[36:52], 16), int(text[53:], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))


def parent_context(span_context: SpanContext) -> otel_context.Context:
    """A context whose current span is the remote `span_context`: a parent for a new span."""
    return trace.set_span_in_context(NonRecordingSpan(span_context))


def current_trace_id() -> str:
    """The current span's trace id in hex, or '-' (for log lines)."""
    ctx = trace.get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else "-"
