"""Prometheus metrics (pagemesh/runtime/metrics.py and metrics_{router,scheduler,worker}.py): the
names the dashboards rely on, per-request timing, the scheduler's and worker's scrape-time reads,
and the `/metrics` endpoint."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagemesh.runtime.metrics import MetricsConfig, ServiceMetrics, serve_metrics
from pagemesh.runtime.metrics_router import ABORT, ERROR, RouterMetrics
from pagemesh.runtime.metrics_scheduler import SchedulerMetrics
from pagemesh.runtime.metrics_worker import WorkerMetrics, WorkerSnapshot
from pagemesh.runtime.registry import Registry, RegistryConfig
from pagemesh.runtime.registry_entries import GroupStatus
from scheduler_svc.checkpoint import Checkpointer
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine_loop import EngineLoop, QueueSink
from scheduler_svc.engine_metrics import observe_engine
from tests.support.core_harness import fake_step, make_request
from tests.support.eventually import eventually_async

ROUTER_NAMES = {
    "pagemesh:request_success": "counter",
    "pagemesh:prompt_tokens": "counter",
    "pagemesh:generation_tokens": "counter",
    "pagemesh:time_to_first_token_seconds": "histogram",
    "pagemesh:inter_token_latency_seconds": "histogram",
    "pagemesh:e2e_request_latency_seconds": "histogram",
    "pagemesh:num_requests_in_flight": "gauge",
    "pagemesh:request_resumes": "counter",
    "pagemesh:engine_groups_ready": "gauge",
    # Embedding requests (router/embedding.py).
    "pagemesh:router_embedding_inputs": "counter",
    "pagemesh:router_embedding_prompt_tokens": "counter",
    "pagemesh:router_embedding_request_latency_seconds": "histogram",
}
SCHEDULER_NAMES = {
    "pagemesh:num_requests_running": "gauge",
    "pagemesh:num_requests_waiting": "gauge",
    "pagemesh:num_requests_swapped": "gauge",
    "pagemesh:kv_cache_usage_perc": "gauge",
    "pagemesh:prefix_cache_queries": "counter",
    "pagemesh:prefix_cache_hits": "counter",
    "pagemesh:num_preemptions": "counter",
    "pagemesh:request_queue_time_seconds": "histogram",
    "pagemesh:num_swap_outs": "counter",
    "pagemesh:num_swap_ins": "counter",
    "pagemesh:spec_decode_num_drafts": "counter",
    "pagemesh:spec_decode_num_draft_tokens": "counter",
    "pagemesh:spec_decode_num_accepted_tokens": "counter",
    "pagemesh:step_time_seconds": "histogram",
    "pagemesh:scheduled_tokens_per_step": "histogram",
    "pagemesh:engine_recoveries": "counter",
    "pagemesh:engine_group_ready": "gauge",
    "pagemesh:checkpoint_writes": "counter",
}
WORKER_NAMES = {
    "pagemesh:worker_forward_time_seconds": "histogram",
    "pagemesh:worker_steps": "counter",
    "pagemesh:worker_tp_collective_seconds": "counter",
    "pagemesh:worker_pp_send_seconds": "counter",
    "pagemesh:worker_pp_recv_seconds": "counter",
    "pagemesh:worker_weight_bytes": "gauge",
    "pagemesh:model_quantization_info": "gauge",
    "pagemesh:worker_busy_seconds": "counter",
    "pagemesh:worker_kv_cache_bytes": "gauge",
    "pagemesh:worker_resident_memory_bytes": "gauge",
}
EVERY_SERVICE = {"pagemesh:heartbeat_age_seconds": "gauge", "pagemesh:build_info": "gauge"}


def families(metrics: ServiceMetrics) -> dict[str, str]:
    """Family name (counters without `_total`, as the parser gives them) -> type."""
    return {f.name: f.type for f in text_string_to_metric_families(metrics.exposition().decode())}


def samples(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value of one scrape."""
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape[(name, frozenset(labels.items()))]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beating() -> SimpleNamespace:
    """A stand-in registry whose key was refreshed 2 s ago."""
    return SimpleNamespace(last_heartbeat_s=time.monotonic() - 2.0)


# --- the names are a contract -------------------------------------------------------------


def test_every_service_exports_the_agreed_names_and_types() -> None:
    router = RouterMetrics()
    router.follow_router(lambda: "m", lambda: 0, lambda: 1, lambda: 0)
    router.request(lambda: "m", 1).observe(0, 1, "length", 3)  # histograms appear once used
    router.follow_heartbeat(lambda: time.monotonic())
    assert families(router) == {**ROUTER_NAMES, **EVERY_SERVICE}

    loop = EngineLoop(Scheduler(SchedulerConfig(num_blocks=8, block_size=4)), workers=None)
    scheduler = SchedulerMetrics("g0")
    observe_engine(scheduler, loop, Checkpointer(None, "g0", 0, 0.0), beating())
    assert families(scheduler) == {**SCHEDULER_NAMES, **EVERY_SERVICE}

    worker = WorkerMetrics("g0", {"tp_rank": 1, "pp_rank": 0})
    worker.follow_worker(
        lambda: WorkerSnapshot(0, 0.0, 0.0, 0.0, 0.0, kv_cache_bytes=1 << 20, rss_bytes=1 << 30)
    )
    worker.observe_forward(0.01)
    worker.set_weights("awq", 1000)
    worker.follow_heartbeat(lambda: time.monotonic())
    assert families(worker) == {**WORKER_NAMES, **EVERY_SERVICE}


def test_the_names_top_reads_are_exported() -> None:
    from pagemesh.tools import top_snapshot

    router = RouterMetrics()
    router.follow_router(lambda: "m", lambda: 0, lambda: 1, lambda: 0)
    router.request(lambda: "m", 1).observe(0, 1, "length", 3)
    router.follow_heartbeat(lambda: time.monotonic())
    loop = EngineLoop(Scheduler(SchedulerConfig(num_blocks=8, block_size=4)), workers=None)
    scheduler = SchedulerMetrics("g0")
    observe_engine(scheduler, loop, Checkpointer(None, "g0", 0, 0.0), beating())
    exported = {
        name for metrics in (router, scheduler) for name, _ in samples(metrics.exposition())
    }
    read = [
        value
        for name, value in vars(top_snapshot).items()
        if name.isupper() and isinstance(value, str) and value.startswith("pagemesh:")
    ]
    assert len(read) >= 9
    for name in read:  # a histogram shows as its `_bucket` samples
        assert name in exported or name + "_bucket" in exported, name


def test_build_info_and_heartbeat_age_carry_the_service() -> None:
    metrics = ServiceMetrics("router")
    assert "pagemesh:heartbeat_age_seconds" not in families(metrics)  # no heartbeat yet
    metrics.follow_heartbeat(lambda: time.monotonic() - 3.0)
    scrape = samples(metrics.exposition())
    assert value(scrape, "pagemesh:build_info", service="router", version="0.1.0") == 1
    assert 3.0 <= value(scrape, "pagemesh:heartbeat_age_seconds", service="router") < 10


def test_each_service_has_its_own_registry() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.request(lambda: "m", 1).observe(0, 2, "stop", 5)
    assert ("pagemesh:generation_tokens_total", frozenset({("model", "m")})) not in samples(
        b.exposition()
    )


# --- router: requests as the client sees them ---------------------------------------------


def test_a_request_is_timed_per_token_and_counted_by_finish_reason() -> None:
    clock, metrics = FakeClock(), RouterMetrics()
    timer = metrics.request(lambda: "tiny", 1, clock)
    clock.now += 0.5
    timer.observe(0, 1, None)
    for _ in range(3):
        clock.now += 0.1
        timer.observe(0, 1, None)
    clock.now += 0.1
    timer.observe(0, 1, "length", num_prompt_tokens=7)
    scrape = samples(metrics.exposition())
    assert value(scrape, "pagemesh:time_to_first_token_seconds_count", model="tiny") == 1
    assert value(scrape, "pagemesh:time_to_first_token_seconds_sum", model="tiny") == pytest.approx(
        0.5
    )
    assert value(scrape, "pagemesh:inter_token_latency_seconds_count", model="tiny") == 4
    assert value(scrape, "pagemesh:inter_token_latency_seconds_sum", model="tiny") == pytest.approx(
        0.4
    )
    assert value(scrape, "pagemesh:e2e_request_latency_seconds_sum", model="tiny") == pytest.approx(
        0.9
    )
    assert value(scrape, "pagemesh:generation_tokens_total", model="tiny") == 5
    assert value(scrape, "pagemesh:prompt_tokens_total", model="tiny") == 7
    assert (
        value(scrape, "pagemesh:request_success_total", model="tiny", finished_reason="length") == 1
    )
    # The 0.5 s TTFT lands in vLLM's 0.5 bucket, not below.
    assert (
        value(scrape, "pagemesh:time_to_first_token_seconds_bucket", model="tiny", le="0.25") == 0
    )
    assert value(scrape, "pagemesh:time_to_first_token_seconds_bucket", model="tiny", le="0.5") == 1


def test_each_sample_of_n_counts_as_a_request() -> None:
    clock, metrics = FakeClock(), RouterMetrics()
    timer = metrics.request(lambda: "m", 2, clock)
    clock.now += 1
    timer.observe(0, 1, None)
    timer.observe(1, 1, "stop")
    clock.now += 1
    timer.observe(0, 1, "length", num_prompt_tokens=4)
    timer.end(ABORT)  # everything finished already: nothing more
    scrape = samples(metrics.exposition())
    assert value(scrape, "pagemesh:time_to_first_token_seconds_count", model="m") == 2
    assert value(scrape, "pagemesh:inter_token_latency_seconds_count", model="m") == 1
    assert value(scrape, "pagemesh:request_success_total", model="m", finished_reason="stop") == 1
    assert value(scrape, "pagemesh:request_success_total", model="m", finished_reason="length") == 1
    assert value(scrape, "pagemesh:e2e_request_latency_seconds_count", model="m") == 2
    assert value(scrape, "pagemesh:prompt_tokens_total", model="m") == 4


def test_a_client_going_away_is_an_abort_and_a_refused_request_counts_nothing() -> None:
    metrics = RouterMetrics()
    timer = metrics.request(lambda: "m", 1)
    timer.observe(0, 2, None)
    timer.end(ABORT)
    metrics.request(lambda: "m", 1).end(ERROR)  # invalid: failed before its first message
    scrape = samples(metrics.exposition())
    assert value(scrape, "pagemesh:request_success_total", model="m", finished_reason=ABORT) == 1
    assert (
        "pagemesh:request_success_total",
        frozenset({("model", "m"), ("finished_reason", ERROR)}),
    ) not in scrape
    assert value(scrape, "pagemesh:generation_tokens_total", model="m") == 2


def test_the_model_label_is_read_at_the_first_message() -> None:
    metrics, model = RouterMetrics(), [""]
    timer = metrics.request(lambda: model[0], 1)
    model[0] = "served"  # the router learned it while validating the request
    timer.observe(0, 1, "stop", 3)
    assert value(samples(metrics.exposition()), "pagemesh:prompt_tokens_total", model="served") == 3


# --- scheduler: read from the engine loop ---------------------------------------------------


def step(loop: EngineLoop, step_time_ms: float) -> None:
    """One step as EngineLoop.run does it, with made-up sampled tokens."""
    output = loop.scheduler.schedule()
    for hook in loop.on_schedule:
        hook(output)
    loop.scheduler.update(output, fake_step(loop.scheduler, output))
    loop.last_step_time_ms = step_time_ms
    for hook in loop.on_step:
        hook()


def test_scheduler_metrics_follow_the_core_and_survive_its_replacement() -> None:
    config = SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    loop = EngineLoop(Scheduler(config), workers=None)
    metrics = SchedulerMetrics("g0")
    observe_engine(metrics, loop, Checkpointer(None, "g0", 0, 0.0), beating())
    arrival_s = time.time() - 0.5
    loop.submit([make_request("a", 8, max_tokens=4, arrival_time_s=arrival_s)], QueueSink())
    loop.submit([make_request("b", 6, max_tokens=4, arrival_time_s=arrival_s)], QueueSink())
    step(loop, 20.0)
    scrape = samples(metrics.exposition())
    assert value(scrape, "pagemesh:num_requests_running", group="g0") == 2
    assert value(scrape, "pagemesh:num_requests_waiting", group="g0") == 0
    assert value(scrape, "pagemesh:kv_cache_usage_perc", group="g0") == pytest.approx(4 / 8)
    assert value(scrape, "pagemesh:request_queue_time_seconds_count", group="g0") == 2
    assert 0.5 <= value(scrape, "pagemesh:request_queue_time_seconds_sum", group="g0") < 10
    assert value(scrape, "pagemesh:scheduled_tokens_per_step_sum", group="g0") == 14
    assert value(scrape, "pagemesh:step_time_seconds_sum", group="g0") == pytest.approx(0.02)
    assert value(scrape, "pagemesh:prefix_cache_queries_total", group="g0") == 14
    assert value(scrape, "pagemesh:engine_group_ready", group="g0") == 1
    step(loop, 10.0)  # decodes: no request is scheduled for the first time again
    scrape = samples(metrics.exposition())
    assert value(scrape, "pagemesh:request_queue_time_seconds_count", group="g0") == 2
    assert value(scrape, "pagemesh:scheduled_tokens_per_step_count", group="g0") == 2

    # A recovery replaces the core: its counters start over, the exported ones go on.
    asyncio.run(loop.set_status(GroupStatus.DEGRADED))
    loop.scheduler, loop.num_recoveries = Scheduler(config), 1
    asyncio.run(loop.set_status(GroupStatus.READY))
    loop.submit([make_request("c", 4, max_tokens=2)], QueueSink())
    step(loop, 10.0)
    scrape = samples(metrics.exposition())
    assert value(scrape, "pagemesh:prefix_cache_queries_total", group="g0") == 14 + 4
    assert value(scrape, "pagemesh:engine_recoveries_total", group="g0") == 1
    assert value(scrape, "pagemesh:num_requests_running", group="g0") == 1


def test_preemptions_and_swapped_requests_are_counted() -> None:
    # 4 blocks of 2 tokens: two requests growing past their prompts cannot both stay.
    config = SchedulerConfig(num_blocks=4, block_size=2, max_model_len=16)
    loop = EngineLoop(Scheduler(config), workers=None)
    metrics = SchedulerMetrics("g1")
    observe_engine(metrics, loop, Checkpointer(None, "g1", 0, 0.0), beating())
    loop.submit([make_request("a", 3, max_tokens=5)], QueueSink())
    loop.submit([make_request("b", 3, max_tokens=5)], QueueSink())
    for _ in range(4):
        step(loop, 1.0)
    scrape = samples(metrics.exposition())
    assert value(scrape, "pagemesh:num_preemptions_total", group="g1") >= 1
    assert (
        value(scrape, "pagemesh:num_preemptions_total", group="g1")
        == loop.scheduler.num_preemptions
    )
    # No swap space (recompute): no preemption swapped.
    assert value(scrape, "pagemesh:num_swap_outs_total", group="g1") == 0
    assert value(scrape, "pagemesh:num_swap_ins_total", group="g1") == 0
    stats = loop.scheduler.stats()
    assert (
        value(scrape, "pagemesh:num_requests_waiting", group="g1")
        == stats.num_waiting - stats.num_swapped
    )


# --- worker ------------------------------------------------------------------------------


def test_worker_counters_are_read_not_accumulated_and_ranks_follow_the_layout() -> None:
    layout = {"tp_rank": -1, "pp_rank": -1}  # a standby, until it takes a place
    metrics = WorkerMetrics("g0", layout)
    counts = WorkerSnapshot(3, 0.25, 0.5, 0.75, busy_s=2.5)
    metrics.follow_worker(lambda: counts)
    layout.update(tp_rank=1, pp_rank=0)
    metrics.observe_forward(0.02)
    labels = {"group": "g0", "tp_rank": "1", "pp_rank": "0"}
    for _ in range(2):  # scraping twice counts nothing twice
        scrape = samples(metrics.exposition())
        assert value(scrape, "pagemesh:worker_steps_total", **labels) == 3
        assert value(scrape, "pagemesh:worker_tp_collective_seconds_total", **labels) == 0.25
        assert value(scrape, "pagemesh:worker_pp_send_seconds_total", **labels) == 0.5
        assert value(scrape, "pagemesh:worker_pp_recv_seconds_total", **labels) == 0.75
        assert value(scrape, "pagemesh:worker_busy_seconds_total", **labels) == 2.5
        assert value(scrape, "pagemesh:worker_forward_time_seconds_count", **labels) == 1


def test_weight_memory_and_quantization_appear_once_the_model_is_loaded() -> None:
    layout = {"tp_rank": -1, "pp_rank": -1}
    metrics = WorkerMetrics("g0", layout)
    names = {name for name, _ in samples(metrics.exposition())}
    assert not names & {"pagemesh:worker_weight_bytes", "pagemesh:model_quantization_info"}
    layout.update(tp_rank=1, pp_rank=0)  # a standby took a place, then loaded
    metrics.set_weights("fp8", 123_456_789)
    scrape = samples(metrics.exposition())
    assert (
        value(scrape, "pagemesh:worker_weight_bytes", group="g0", tp_rank="1", pp_rank="0")
        == 123_456_789
    )
    assert value(scrape, "pagemesh:model_quantization_info", group="g0", quantization="fp8") == 1


# --- the endpoint ------------------------------------------------------------------------


def http(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def test_the_endpoint_serves_the_text_format_on_an_ephemeral_port() -> None:
    async def scenario() -> None:
        metrics = RouterMetrics()
        server = await serve_metrics(metrics, MetricsConfig("127.0.0.1", 0))
        try:
            assert server.port and server.registry_info() == {
                "metrics_address": f"127.0.0.1:{server.port}"
            }
            base = f"http://{server.address}"
            status, content_type, body = await asyncio.to_thread(http, base + "/metrics")
            assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
            assert (
                samples(body)[
                    (
                        "pagemesh:build_info",
                        frozenset({("service", "router"), ("version", "0.1.0")}),
                    )
                ]
                == 1
            )
            status, _, body = await asyncio.to_thread(http, base + "/metrics", "HEAD")
            assert status == 200 and body == b""
            assert (await asyncio.to_thread(http, base + "/other"))[0] == 404
        finally:
            await server.close()
        assert server.registry_info() == {}

    asyncio.run(scenario())


def test_port_minus_one_turns_the_endpoint_off() -> None:
    async def scenario() -> None:
        server = await serve_metrics(ServiceMetrics("worker"), MetricsConfig(port=-1))
        assert server.address is None and server.registry_info() == {}
        await server.close()

    asyncio.run(scenario())
    with pytest.raises(ValueError):
        MetricsConfig(port=-2)


def test_advertise_host_is_what_the_registry_gets() -> None:
    async def scenario() -> None:
        config = MetricsConfig("127.0.0.1", 0, advertise_host="worker-3.example")
        server = await serve_metrics(ServiceMetrics("worker"), config)
        try:
            assert server.address == f"worker-3.example:{server.port}"
        finally:
            await server.close()

    asyncio.run(scenario())


def test_the_registry_records_its_last_successful_heartbeat(redis_url: str) -> None:
    async def scenario() -> None:
        registry = Registry(
            RegistryConfig(
                redis_url, cluster="t-metrics-heartbeat", heartbeat_interval_s=0.05, ttl_s=0.5
            )
        )
        try:
            assert registry.last_heartbeat_s is None
            await registry.start_heartbeat("router", "r1", lambda: {"address": "x"})
            first = registry.last_heartbeat_s
            assert first is not None
            await eventually_async(
                lambda: registry.last_heartbeat_s > first, 5, "no heartbeat after the first"
            )
            assert time.monotonic() - registry.last_heartbeat_s < 0.2
        finally:
            await registry.close(deregister=[("router", "r1")])

    asyncio.run(scenario())


# --- router: through a real router with scripted schedulers (tests/router/test_resume.py) ---


def test_a_stream_resumed_after_a_group_failed_is_counted_and_timed_as_one(
    redis_url: str, tmp_path
) -> None:
    from pagemesh.runtime.tokenizer import load_tokenizer
    from tests.support.bpe_folder import write_bpe_folder
    from tests.support.scripted_router import Router, request, run

    tokenizer = load_tokenizer(str(write_bpe_folder(tmp_path / "bpe")))

    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            directory, metrics = router.directory, router.generation.metrics
            metrics.follow_router(
                lambda: directory.model_name,
                lambda: router.generation.num_in_flight,
                lambda: directory.num_groups,
                lambda: router.dispatcher.num_resumes,
            )
            a = await router.add_scheduler("a")
            b = await router.add_scheduler("b")
            a.fail_after_tokens = b.fail_after_tokens = 3  # whichever is picked fails once
            a.failure_budget = b.failure_budget = [1]
            responses = await router.generate(request(tokenizer, 6))
            scrape = samples(metrics.exposition())
            model = {"model": "scripted"}
            assert value(scrape, "pagemesh:request_resumes_total", **model) == 1
            assert (
                value(scrape, "pagemesh:request_success_total", finished_reason="length", **model)
                == 1
            )
            assert value(scrape, "pagemesh:generation_tokens_total", **model) == 6
            assert (
                value(scrape, "pagemesh:prompt_tokens_total", **model)
                == responses[-1].usage.prompt_tokens
            )
            assert value(scrape, "pagemesh:time_to_first_token_seconds_count", **model) == 1
            assert value(scrape, "pagemesh:inter_token_latency_seconds_count", **model) == 5
            assert value(scrape, "pagemesh:engine_groups_ready", **model) >= 1
            assert value(scrape, "pagemesh:num_requests_in_flight", **model) == 0

    run(scenario())
