"""Spans of the requests a scheduler serves, driven by what the core already returns.

Each `Submit` gets a SERVER span (the router's `Generate` span is its parent, from the call's
metadata) with child spans for its phases and events for what happened to it:

- `queue`: admission until the first step that schedules it;
- `prefill`: that step until its first token (an event `prefix_cache_hit` with the cached
  tokens when the prefix cache spared part of the prompt);
- `decode`: the first token until the stream ends;
- events `preempted` (the core preempted it), `rescheduled` (sent to the workers again after a
  preemption or a recovery, with the tokens whose KV was kept), `recovery` (the engine group
  was re-formed while it was in flight).

The engine loop calls the `on_*` hooks with the core's `SchedulerOutput`s and
`RequestEvent`s; the core itself knows nothing of tracing. With tracing off no request is
ever registered and every hook returns at once. Each step carries the `traceparent` of each
traced request's span to the workers (`traceparents`), whose step spans link to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from pagemesh.runtime.telemetry import make_current as make_current_context
from pagemesh.runtime.telemetry import traceparent
from protos.step import RequestId, SchedulerOutput
from scheduler_svc.core.types import Request, RequestEvent, RequestStatus

QUEUE, PREFILL, DECODE = "queue", "prefill", "decode"
_PREEMPTED = (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)


@dataclass
class RequestTrace:
    """The spans of one Submit (all its samples when n > 1)."""

    span: trace.Span
    traceparent: str
    request_ids: list[RequestId]
    phase: str
    phase_span: trace.Span
    scheduled: set[RequestId] = field(default_factory=set)  # sent to the workers at least once
    num_output_tokens: int = 0
    finish_reasons: dict[RequestId, str] = field(default_factory=dict)


class RequestTracing:
    """The spans of the requests in flight on this scheduler (see the module docstring)."""

    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self._tracer = tracer or trace.get_tracer("pagemesh.scheduler")
        self._traces: dict[RequestId, RequestTrace] = {}  # core request id -> its Submit's trace

    def start(
        self,
        request_id: str,
        requests: list[Request],
        num_prompt_tokens: int,
        resumed: bool,
        context: otel_context.Context | None = None,
        make_current: bool = True,
    ) -> RequestTrace | None:
        """Starts the span of one admitted request (`requests`: its samples), the child of
        `context` (default: the current one), and with `make_current` makes it current for
        the calling task (its logs; not on a stream shared by many requests). Returns what
        `end` takes; None when the request is not traced."""
        attributes: dict[str, Any] = {
            "pagemesh.request_id": request_id,
            "gen_ai.usage.input_tokens": num_prompt_tokens,
        }
        if resumed:
            attributes["pagemesh.resumed"] = True
        span = self._tracer.start_span(
            "Submit", context=context, kind=SpanKind.SERVER, attributes=attributes
        )
        if not span.is_recording():
            return None
        if make_current:
            make_current_context(trace.set_span_in_context(span))
        request_ids = [r.request_id for r in requests]
        state = RequestTrace(span, traceparent(span), request_ids, QUEUE, self._child(span, QUEUE))
        for core_id in request_ids:
            self._traces[core_id] = state
        return state

    def fail(self, state: RequestTrace | None, message: str) -> None:
        """The request cannot go on here (the router resumes it elsewhere)."""
        if state is not None:
            state.span.set_status(Status(StatusCode.ERROR, message))

    def end(self, state: RequestTrace | None) -> None:
        """Ends the spans of a Submit whose stream is over (finished, cancelled or failed)."""
        if state is None:
            return
        for core_id in state.request_ids:
            if self._traces.get(core_id) is state:  # not a resumed stream's that superseded it
                del self._traces[core_id]
        state.phase_span.end()
        span = state.span
        span.set_attribute("gen_ai.usage.output_tokens", state.num_output_tokens)
        if state.finish_reasons:
            span.set_attribute(
                "gen_ai.response.finish_reasons",
                [state.finish_reasons[r] for r in state.request_ids if r in state.finish_reasons],
            )
        span.end()

    def on_scheduled(
        self, output: SchedulerOutput, requests: dict[RequestId, Request]
    ) -> dict[str, str]:
        """Phase changes and events of one scheduled step; returns the `traceparent` of each
        traced request the step computes, for the workers."""
        traces = self._traces
        if not traces:
            return {}
        for new in output.new_requests:
            state = traces.get(new.request_id)
            if state is None:
                continue
            cached = {"pagemesh.cached_tokens": new.num_computed_tokens}
            if new.request_id in state.scheduled:
                state.span.add_event("rescheduled", cached)
            elif state.phase == QUEUE:
                self._next_phase(state, PREFILL)
                if new.num_computed_tokens:
                    state.phase_span.add_event("prefix_cache_hit", cached)
            state.scheduled.add(new.request_id)
        for request_id in output.finished_request_ids:
            state = traces.get(request_id)
            request = requests.get(request_id)
            if state is not None and request is not None and request.status in _PREEMPTED:
                state.span.add_event(
                    "preempted",
                    {
                        "pagemesh.preemption": request.status.value,
                        "pagemesh.num_tokens": request.num_tokens,
                    },
                )
        return {
            request_id: state.traceparent
            for request_id in output.num_scheduled_tokens
            if (state := traces.get(request_id)) is not None
        }

    def on_events(self, events: list[RequestEvent]) -> None:
        """Token counts, the prefill -> decode change, finish reasons."""
        traces = self._traces
        if not traces:
            return
        for event in events:
            state = traces.get(event.request_id)
            if state is None:
                continue
            if event.new_tokens:
                state.num_output_tokens += len(event.new_tokens)
                if state.phase != DECODE:
                    self._next_phase(state, DECODE)
            if event.finish_reason is not None:
                state.finish_reasons[event.request_id] = event.finish_reason.value

    def on_recovery(self, reason: str, duration_s: float) -> None:
        """The engine group was re-formed; every traced request in flight lived through it."""
        attributes: dict[str, Any] = {"pagemesh.reason": reason, "pagemesh.recovery_s": duration_s}
        for state in {id(t): t for t in self._traces.values()}.values():
            state.span.add_event("recovery", attributes)

    def _next_phase(self, state: RequestTrace, phase: str) -> None:
        state.phase_span.end()
        state.phase = phase
        state.phase_span = self._child(state.span, phase)

    def _child(self, span: trace.Span, name: str) -> trace.Span:
        return self._tracer.start_span(name, context=trace.set_span_in_context(span))
