"""A real OTLP/gRPC trace receiver for tests and benchmarks: the trace service of
`opentelemetry-proto`, served with grpc on 127.0.0.1, keeping what it is sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
STATUS_CODE_ERROR = 2  # opentelemetry.proto.trace.v1.Status.StatusCode.STATUS_CODE_ERROR


@dataclass
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    attributes: dict[str, Any]
    status_code: int = 0  # 0 unset, 1 ok, 2 error
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace_id, span_id)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Serves `opentelemetry.proto.collector.trace.v1.TraceService/Export`. With `keep=False`
    it only counts spans (a benchmark's receiver should cost little)."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.num_spans = 0
        self.num_exports = 0
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = []
        count = 0
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                count += len(scope_spans.spans)
                if self.keep:
                    spans += [self._convert(service, s) for s in scope_spans.spans]
        with self._lock:
            self.num_spans += count
            self.num_exports += 1
            self._spans += spans
        return trace_service_pb2.ExportTraceServiceResponse()

    @staticmethod
    def _convert(service: str, span: Any) -> ReceivedSpan:
        return ReceivedSpan(
            service=service,
            name=span.name,
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex(),
            kind=span.kind,
            attributes=_attributes(span.attributes),
            status_code=span.status.code,
            events=[(e.name, _attributes(e.attributes)) for e in span.events],
            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
        )

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(
        self,
        done: Callable[[list[ReceivedSpan]], bool],
        trace_id: str | None = None,
        timeout_s: float = 30.0,
    ) -> list[ReceivedSpan]:
        """The spans (of `trace_id`) once `done(spans)` holds; raises after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans(trace_id)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                summary = sorted((s.service, s.name) for s in spans)
                raise TimeoutError(f"spans of trace {trace_id} after {timeout_s} s: {summary}")
            time.sleep(0.05)
