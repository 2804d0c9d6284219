"""Tracing pieces in-process, each with its own SDK tracer (never the global provider, which
a process can set only once): trace context parsing, the scheduler's request spans driven by
the real core, the worker's step span, log lines carrying the trace id."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagemesh.runtime import telemetry
from pagemesh.runtime.logs import RequestIdFilter, request_id_var
from pagemesh.runtime.tokenizer import load_tokenizer
from protos.pagemesh.worker.v1 import worker_pb2
from protos.step import SchedulerOutput
from router import tracing as router_tracing
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.tracing import RequestTracing
from tests.support.bpe_folder import write_bpe_folder
from tests.support.core_harness import fake_step, make_request
from tests.support.scripted_router import Router, ScriptedScheduler, run
from tests.support.scripted_router import request as resume_request
from worker_svc.tracing import start_step_span


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Iterator[trace.Tracer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test")
    provider.shutdown()


def test_traces_endpoint_from_flag_or_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
    ):
        monkeypatch.delenv(name, raising=False)
    assert telemetry.traces_endpoint(None) is None
    assert telemetry.traces_endpoint("127.0.0.1:4317") == "http://127.0.0.1:4317"
    assert telemetry.traces_endpoint("https://collector:4317") == "https://collector:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://general:4317")
    assert telemetry.traces_endpoint(None) == "http://general:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert telemetry.traces_endpoint(None) == "http://traces:4317"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert telemetry.traces_endpoint("127.0.0.1:4317") is None


def test_service_name_defaults_to_ours_unless_the_variables_name_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    resource = telemetry.tracing_resource("pagemesh-router").attributes
    assert resource["service.name"] == "pagemesh-router"
    assert resource["deployment.environment"] == "test"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes")
    assert (
        telemetry.tracing_resource("pagemesh-router").attributes["service.name"]
        == "from-attributes"
    )
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-router")
    assert telemetry.tracing_resource("pagemesh-router").attributes["service.name"] == "edge-router"


def test_tracing_is_off_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert telemetry.setup_tracing("pagemesh-test") is None
    assert not telemetry.tracing_enabled()
    assert telemetry.server_interceptors() == []
    assert telemetry.grpc_metadata(trace.get_tracer("x").start_span("off")) is None


def test_traceparent_round_trip_and_malformed_input(tracer: trace.Tracer) -> None:
    span = tracer.start_span("a")
    text = telemetry.traceparent(span)
    parsed = telemetry.span_context_from_traceparent(text)
    assert parsed is not None and parsed.is_remote
    assert (parsed.trace_id, parsed.span_id) == (
        span.get_span_context().trace_id,
        span.get_span_context().span_id,
    )
    assert parsed.trace_flags.sampled
    assert telemetry.grpc_metadata(span) == (("traceparent", text),)
    # An unsampled caller's context goes on unsampled: the callee must not start a trace.
    unsampled = trace.NonRecordingSpan(trace.SpanContext(parsed.trace_id, parsed.span_id, True))
    assert telemetry.grpc_metadata(unsampled) == (("traceparent", text[:-2] + "00"),)
    zero_trace = "00-" + "0" * 32 + "-" + "1" * 16 + "-01"
    for bad in ("", text[:-1], text.replace("-", "_"), zero_trace, "00-" + "x" * 32 + text[35:]):
        assert telemetry.span_context_from_traceparent(bad) is None


def _spans(exporter: InMemorySpanExporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def _drive(scheduler: Scheduler, tracing: RequestTracing) -> list[SchedulerOutput]:
    """Steps until nothing is left, feeding the tracing hooks as the engine loop does."""
    outputs = []
    while scheduler.has_work():
        output = scheduler.schedule()
        traceparents = tracing.on_scheduled(output, scheduler.requests)
        assert set(traceparents) <= set(output.num_scheduled_tokens)
        outputs.append(output)
        tracing.on_events(scheduler.update(output, fake_step(scheduler, output)))
    return outputs


def test_scheduler_spans_follow_queue_prefill_decode(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    tracing = RequestTracing(tracer)
    traces = []
    for request_id in ("a", "b"):  # the same prompt: b's first block is a cache hit
        request = make_request(request_id, prompt_len=6, max_tokens=3)
        scheduler.add_request(request)
        traces.append(
            contextvars.copy_context().run(tracing.start, request_id, [request], 6, False)
        )
        first = scheduler.schedule()
        assert tracing.on_scheduled(first, scheduler.requests) == {
            request_id: traces[-1].traceparent
        }
        tracing.on_events(scheduler.update(first, fake_step(scheduler, first)))
        _drive(scheduler, tracing)
        tracing.end(traces[-1])
    assert tracing.on_scheduled(scheduler.schedule(), scheduler.requests) == {}

    submits = {s.attributes["pagemesh.request_id"]: s for s in _spans(exporter, "Submit")}
    assert set(submits) == {"a", "b"}
    for request_id, submit in submits.items():
        assert submit.kind == trace.SpanKind.SERVER
        assert submit.attributes["gen_ai.usage.output_tokens"] == 3
        assert submit.attributes["gen_ai.response.finish_reasons"] == ("length",)
        children = [
            s
            for s in exporter.get_finished_spans()
            if s.parent is not None and s.parent.span_id == submit.context.span_id
        ]
        assert [s.name for s in sorted(children, key=lambda s: s.start_time)] == [
            "queue",
            "prefill",
            "decode",
        ]
    hits = [
        (s.parent.span_id, e.attributes["pagemesh.cached_tokens"])
        for s in _spans(exporter, "prefill")
        for e in s.events
        if e.name == "prefix_cache_hit"
    ]
    assert hits == [(submits["b"].context.span_id, 4)]


def test_preemption_rescheduling_and_recovery_are_events(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    # 4 blocks of 4 tokens: two 7-token prompts fit, but not both growing past 8 tokens.
    scheduler = Scheduler(SchedulerConfig(num_blocks=4, block_size=4, enable_prefix_caching=False))
    tracing = RequestTracing(tracer)
    states = {}
    for request_id in ("first", "second"):
        request = make_request(request_id, prompt_len=7, max_tokens=4)
        scheduler.add_request(request)
        states[request_id] = contextvars.copy_context().run(
            tracing.start, request_id, [request], 7, False
        )
    tracing.on_recovery("a worker died", 1.5)
    _drive(scheduler, tracing)
    for state in states.values():
        tracing.end(state)
    events = {
        s.attributes["pagemesh.request_id"]: [e.name for e in s.events]
        for s in _spans(exporter, "Submit")
    }
    assert events["first"] == ["recovery"]
    assert events["second"] == ["recovery", "preempted", "rescheduled"]
    assert scheduler.num_preemptions == 1


def test_untraced_requests_cost_no_hooks() -> None:
    tracing = RequestTracing(trace.NoOpTracer())
    request = make_request("quiet", prompt_len=4)
    assert tracing.start("quiet", [request], 4, False) is None
    scheduler = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    scheduler.add_request(request)
    assert tracing.on_scheduled(scheduler.schedule(), scheduler.requests) == {}


def test_worker_step_span_is_a_child_of_the_first_traced_request_linked_to_all(
    tracer: trace.Tracer, exporter: InMemorySpanExporter
) -> None:
    running, new = tracer.start_span("running"), tracer.start_span("new")
    step = worker_pb2.ExecuteStepRequest(
        step_id=42,
        new_requests=[worker_pb2.NewRequest(request_id="new")],
        cached_requests=[
            worker_pb2.CachedRequest(request_id="running"),
            worker_pb2.CachedRequest(request_id="untraced"),
        ],
        num_scheduled_tokens={"new": 30, "running": 1, "untraced": 1},
        traceparents={"new": telemetry.traceparent(new), "running": telemetry.traceparent(running)},
    )
    span = start_step_span(tracer, step, "w0", {"tp_rank": 1, "pp_rank": 0})
    assert span is not None
    span.end()
    (finished,) = _spans(exporter, "execute_step")
    assert finished.parent.span_id == running.get_span_context().span_id
    assert [link.context.span_id for link in finished.links] == [
        running.get_span_context().span_id,
        new.get_span_context().span_id,
    ]
    assert finished.attributes["pagemesh.step.id"] == 42
    assert finished.attributes["pagemesh.step.num_requests"] == 3
    assert finished.attributes["pagemesh.step.num_tokens"] == 32
    assert finished.attributes["pagemesh.worker.tp_rank"] == 1
    untraced = worker_pb2.ExecuteStepRequest(
        num_scheduled_tokens={"x": 1}, traceparents={"x": "not a traceparent"}
    )
    assert start_step_span(tracer, untraced, "w0", {}) is None


def test_log_lines_carry_the_trace_id_and_request_id(tracer: trace.Tracer) -> None:
    def record() -> logging.LogRecord:
        entry = logging.LogRecord("t", logging.INFO, __file__, 1, "m", None, None)
        RequestIdFilter().filter(entry)
        return entry

    def inside_a_request() -> logging.LogRecord:
        request_id_var.set("r-1")
        span = tracer.start_span("request")
        telemetry.make_current(trace.set_span_in_context(span))
        return record()

    traced = contextvars.copy_context().run(inside_a_request)
    assert traced.request_id == "r-1" and len(traced.trace_id) == 32 and traced.trace_id != "0" * 32
    plain = record()
    assert (plain.request_id, plain.trace_id) == ("-", "-")


def test_router_span_records_a_failed_group_and_the_resume(
    tracer: trace.Tracer,
    exporter: InMemorySpanExporter,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizer = load_tokenizer(str(write_bpe_folder(tmp_path / "bpe")))
    monkeypatch.setattr(router_tracing, "_tracer", tracer)
    seen: list[dict[str, str]] = []
    scripted_submit = ScriptedScheduler.Submit

    async def submit(self: ScriptedScheduler, request: Any, context: Any) -> Any:
        seen.append(dict(context.invocation_metadata()))
        async for response in scripted_submit(self, request, context):
            yield response

    monkeypatch.setattr(ScriptedScheduler, "Submit", submit)

    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            for name in ("a", "b"):
                scheduler = await router.add_scheduler(name)
                scheduler.fail_after_tokens = 3
                scheduler.failure_budget = [1]
            responses = await router.generate(resume_request(tokenizer, 6, request_id="resumed-1"))
            assert responses[-1].usage.completion_tokens == 6

    run(scenario())
    (generate,) = _spans(exporter, "Generate")
    assert [e.name for e in generate.events] == ["engine_group_failed", "resume"]
    assert generate.events[1].attributes["pagemesh.output_tokens_received"] == (3,)
    assert generate.attributes["gen_ai.response.finish_reasons"] == ("length",)
    # Both attempts are children of the router's span.
    assert [m["traceparent"] for m in seen] == [telemetry.traceparent(generate)] * 2
