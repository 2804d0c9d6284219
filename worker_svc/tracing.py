"""The worker's `execute_step` span: one per step that computes a traced request.

A step serves many requests, each with its own trace. The scheduler sends the `traceparent`
of every traced request's span in the step (`ExecuteStepRequest.traceparents`); the step span
is a child of the first one (cached requests first, so usually the longest-running request)
and links to all of them, so each request's trace reaches the steps that computed it. A step
without trace context (tracing off at the scheduler, or a step that only frees requests) gets
no span; with tracing off here nothing is parsed.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from pagemesh.runtime.telemetry import (
    parent_context,
    span_context_from_traceparent,
    tracing_enabled,
)
from worker_svc import convert

_tracer = trace.get_tracer("pagemesh.worker")


def traced_step(execute_step: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Wraps `WorkerServicer.ExecuteStep` in its step span (see the module docstring); the
    span is current while the step runs, so the step's log lines carry its trace id."""

    @functools.wraps(execute_step)
    async def traced(self: Any, request: Any, context: Any) -> Any:
        if not request.traceparents or not tracing_enabled():
            return await execute_step(self, request, context)
        span = start_step_span(_tracer, request, self.worker_id, self.layout)
        if span is None:
            return await execute_step(self, request, context)
        with trace.use_span(span, end_on_exit=True):
            response = await execute_step(self, request, context)
            span.set_attribute("pagemesh.step.forward_time_ms", response.forward_time_ms)
            return response

    return traced


def start_step_span(
    tracer: trace.Tracer, request: Any, worker_id: str, layout: dict[str, int]
) -> trace.Span | None:
    """The span of one step, or None when no request in it carries a valid trace context."""
    traceparents, num_requests, num_tokens = convert.step_trace_from_pb(request)
    contexts = [c for c in map(span_context_from_traceparent, traceparents) if c is not None]
    if not contexts:
        return None
    return tracer.start_span(
        "execute_step",
        context=parent_context(contexts[0]),
        kind=SpanKind.SERVER,
        links=[Link(c) for c in contexts],
        attributes={
            "pagemesh.step.id": request.step_id,
            "pagemesh.step.num_requests": num_requests,
            "pagemesh.step.num_tokens": num_tokens,
            "pagemesh.step.num_traced_requests": len(contexts),
            "pagemesh.worker.id": worker_id,
            "pagemesh.worker.tp_rank": layout.get("tp_rank", 0),
            "pagemesh.worker.pp_rank": layout.get("pp_rank", 0),
        },
    )
