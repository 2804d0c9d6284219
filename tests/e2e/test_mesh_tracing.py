"""One OpenTelemetry trace per request through a real mesh (`pagemesh up`), exported over
OTLP/gRPC to a real receiver in this test: router, scheduler and worker spans share the trace
id, with the right parents, links and GenAI attributes; an incoming `traceparent` (gRPC
metadata or the HTTP header) becomes the router span's parent."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.otlp_receiver import (
    SPAN_KIND_SERVER,
    STATUS_CODE_ERROR,
    OtlpReceiver,
    ReceivedSpan,
)
from tests.support.mesh_harness import Mesh, greedy_request
from tests.support.mesh_ids import mesh_request_id

PROMPT_IDS = list(range(5, 25))  # 20 tokens: one full KV block of 16, shared by equal prompts
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def http_port() -> int:
    return reserve_port()


@pytest.fixture(scope="module")
def traced_mesh(
    tiny_llama_dir: Path,
    redis_url: str,
    receiver: OtlpReceiver,
    http_port: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("logs") / "traced-mesh.log"
    with pytest.MonkeyPatch.context() as env:  # the services inherit it at start
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: spans reach the receiver quickly
        mesh = Mesh(
            str(tiny_llama_dir),
            log,
            redis_url=redis_url,
            cluster="e2e-traced",
            extra_args=[
                "--num-kv-blocks",
                "64",
                "--http-port",
                str(http_port),
                "--otlp-traces-endpoint",
                receiver.endpoint,
            ],
        )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _complete(num_tokens: int) -> Callable[[list[ReceivedSpan]], bool]:
    """Whether every span of one `num_tokens`-token request is in: each service exports on
    its own schedule, and the worker's last steps may arrive after the scheduler's spans (on
    a loaded machine, seconds later), so its steps (one per token) are counted, not seen."""

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = {(s.service, s.name) for s in spans}
        steps = sum(1 for s in spans if (s.service, s.name) == ("pagemesh-worker", "execute_step"))
        return {
            ("pagemesh-router", "Generate"),
            ("pagemesh-scheduler", "Submit"),
            ("pagemesh-scheduler", "decode"),
        } <= names and steps >= num_tokens

    return complete


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, [(s.service, s.name) for s in spans]
    return found[0]


def test_grpc_request_is_one_trace_across_router_scheduler_and_worker(
    traced_mesh: Mesh, receiver: OtlpReceiver, redis_url: str
) -> None:
    header, trace_id, caller_span_id = _traceparent()
    request = greedy_request(PROMPT_IDS, MAX_TOKENS, request_id="traced-grpc-1")
    request.sampling.seed = 7
    chunks = list(
        traced_mesh.stub.Generate(request, timeout=120, metadata=[("traceparent", header)])
    )
    assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS

    spans = receiver.wait_for(_complete(MAX_TOKENS), trace_id)
    generate = _one(spans, "pagemesh-router", "Generate")
    assert generate.parent_span_id == caller_span_id and generate.kind == SPAN_KIND_SERVER
    attributes = generate.attributes
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == "tiny-llama"
    assert attributes["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.request.seed"] == 7
    assert attributes["gen_ai.usage.input_tokens"] == len(PROMPT_IDS)
    assert attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    # The span carries the mesh's id of the request, a keyed hash: never the client's id.
    mesh_id = mesh_request_id(redis_url, "e2e-traced", "traced-grpc-1")
    assert attributes["gen_ai.response.id"] == attributes["pagemesh.request_id"] == mesh_id
    assert not any(
        "traced-grpc-1" in str(v) for s in receiver.spans() for v in s.attributes.values()
    )
    assert not any(key.startswith("gen_ai.usage.prompt") for key in attributes)

    submit = _one(spans, "pagemesh-scheduler", "Submit")
    assert submit.parent_span_id == generate.span_id and submit.kind == SPAN_KIND_SERVER
    assert submit.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    phases = {
        name: _one(spans, "pagemesh-scheduler", name) for name in ("queue", "prefill", "decode")
    }
    assert all(p.parent_span_id == submit.span_id for p in phases.values())

    steps = [s for s in spans if s.service == "pagemesh-worker" and s.name == "execute_step"]
    assert len(steps) >= MAX_TOKENS  # one prefill step, then a decode step per further token
    for step in steps:
        assert step.parent_span_id == submit.span_id
        assert (trace_id, submit.span_id) in step.links
        assert step.attributes["pagemesh.step.num_tokens"] >= 1
        assert step.attributes["pagemesh.step.forward_time_ms"] > 0
    # Nothing of this request went to another trace: look at every span received, not only
    # this trace's (`spans` is already filtered by its id).
    ours = [
        s
        for s in receiver.spans()
        if s.attributes.get("pagemesh.request_id") == mesh_id
        or any(span_id == submit.span_id for _, span_id in s.links)
    ]
    assert {(s.service, s.name) for s in ours} >= {
        ("pagemesh-router", "Generate"),
        ("pagemesh-scheduler", "Submit"),
        ("pagemesh-worker", "execute_step"),
    }
    assert {s.trace_id for s in ours} == {trace_id}


def test_without_traceparent_the_router_span_starts_the_trace(
    traced_mesh: Mesh, receiver: OtlpReceiver, redis_url: str
) -> None:
    prompt = [3, *PROMPT_IDS]  # not the other tests' prompt: the first request misses the cache
    for request_id in ("traced-root-a", "traced-root-b"):
        list(
            traced_mesh.stub.Generate(greedy_request(prompt, 2, request_id=request_id), timeout=120)
        )
    root_b = mesh_request_id(redis_url, "e2e-traced", "traced-root-b")

    def generate_span(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
        return next(
            (
                s
                for s in spans
                if s.name == "Generate" and s.attributes.get("pagemesh.request_id") == root_b
            ),
            None,
        )

    root = generate_span(receiver.wait_for(lambda spans: generate_span(spans) is not None))
    assert root is not None and root.parent_span_id == ""
    spans = receiver.wait_for(_complete(2), root.trace_id)
    assert _one(spans, "pagemesh-scheduler", "Submit").parent_span_id == root.span_id
    # The second request's first block comes from the prefix cache.
    prefill = _one(spans, "pagemesh-scheduler", "prefill")
    assert ("prefix_cache_hit", {"pagemesh.cached_tokens": 16}) in prefill.events


def test_http_traceparent_header_parents_the_chat_span(
    traced_mesh: Mesh, receiver: OtlpReceiver, http_port: int
) -> None:
    header, trace_id, caller_span_id = _traceparent()
    reply = httpx.post(
        f"http://127.0.0.1:{http_port}/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
        headers={"traceparent": header},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    spans = receiver.wait_for(_complete(4), trace_id)
    generate = _one(spans, "pagemesh-router", "Generate")
    assert generate.parent_span_id == caller_span_id
    assert generate.attributes["gen_ai.operation.name"] == "chat"
    # The mesh's id of the request (hashed), not the id the client was given.
    assert generate.attributes["gen_ai.response.id"] == generate.attributes["pagemesh.request_id"]
    assert reply.json()["id"].removeprefix("chatcmpl-") not in str(generate.attributes)
    assert generate.attributes["gen_ai.usage.output_tokens"] == 4
    assert _one(spans, "pagemesh-scheduler", "Submit").parent_span_id == generate.span_id


def test_a_refused_request_is_an_error_span(traced_mesh: Mesh, receiver: OtlpReceiver) -> None:
    header, trace_id, caller_span_id = _traceparent()
    request = greedy_request(PROMPT_IDS, 10**6, request_id="traced-refused")  # past the context
    with pytest.raises(grpc.RpcError) as refused:
        list(traced_mesh.stub.Generate(request, timeout=60, metadata=[("traceparent", header)]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (generate,) = receiver.wait_for(
        lambda spans: any(s.name == "Generate" for s in spans), trace_id
    )
    assert generate.parent_span_id == caller_span_id
    assert generate.status_code == STATUS_CODE_ERROR
    assert generate.attributes["error.type"] == "INVALID_ARGUMENT"
