"""Prometheus metrics of a real mesh: every service publishes where it serves `/metrics` in its
registry entry, and after a known workload the scraped counts are exact and the histograms
plausible."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagemesh.runtime.ports import reserve_port
from tests.support.eventually import eventually
from tests.support.mesh_harness import Mesh, greedy_request

CLUSTER = "e2e-metrics"
PROMPT_LENGTHS = (5, 9, 17)  # 17: one full block of 16, found in the prefix cache next time
MAX_TOKENS = 5
GROUP = {"group": "g0"}
WORKER = {"group": "g0", "tp_rank": "0", "pp_rank": "0"}


@pytest.fixture(scope="module")
def mesh(
    tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    # Its own mesh and cluster: the counts below start from zero.
    log = tmp_path_factory.mktemp("logs") / "metrics-mesh.log"
    mesh = Mesh(
        str(tiny_llama_dir),
        log,
        redis_url=redis_url,
        cluster=CLUSTER,
        extra_args=["--num-kv-blocks", "64", "--http-port", str(reserve_port())],
    )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def registry_entries(redis_url: str, kind: str) -> list[dict]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = list(client.scan_iter(match=f"{CLUSTER}:{kind}:*"))
        return [json.loads(value) for value in client.mget(keys) if value is not None]
    finally:
        client.close()


def scrape(address: str, path: str = "/metrics") -> dict[tuple[str, frozenset], float]:
    response = httpx.get(f"http://{address}{path}", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(response.text)
        for s in f.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def prompt(length: int, offset: int) -> list[int]:
    """Distinct prompts: no prefix shared between them."""
    return [(offset * 37 + i * 7) % 200 + 3 for i in range(length)]


def run_workload(mesh: Mesh, prompts: list[list[int]]) -> float:
    """Sends the prompts at once; returns the wall time, seconds."""
    start = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(
            pool.map(lambda ids: mesh.generate(greedy_request(ids, MAX_TOKENS)), prompts)
        )
    for result in results:
        assert len(result.token_ids) == MAX_TOKENS
    return time.monotonic() - start


def metrics_addresses(redis_url: str) -> dict[str, str]:
    addresses = {}
    for kind in ("router", "scheduler", "worker"):
        entries = registry_entries(redis_url, kind)
        assert len(entries) == 1, entries
        assert entries[0]["metrics_address"].startswith("127.0.0.1:"), entries[0]
        addresses[kind] = entries[0]["metrics_address"]
    return addresses


def check_router(samples: dict, wall_s: float, num_requests: int, num_prompt_tokens: int) -> None:
    model = {"model": "tiny-llama"}
    assert value(samples, "pagemesh:prompt_tokens_total", **model) == num_prompt_tokens
    assert value(samples, "pagemesh:generation_tokens_total", **model) == num_requests * MAX_TOKENS
    assert (
        value(samples, "pagemesh:request_success_total", finished_reason="length", **model)
        == num_requests
    )
    assert value(samples, "pagemesh:time_to_first_token_seconds_count", **model) == num_requests
    assert value(samples, "pagemesh:inter_token_latency_seconds_count", **model) == num_requests * (
        MAX_TOKENS - 1
    )
    assert value(samples, "pagemesh:e2e_request_latency_seconds_count", **model) == num_requests
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        total_s = value(samples, f"pagemesh:{name}_seconds_sum", **model)
        assert 0 < total_s < num_requests * wall_s, name
    # Each request's first token came before its last one.
    assert value(samples, "pagemesh:time_to_first_token_seconds_sum", **model) < value(
        samples, "pagemesh:e2e_request_latency_seconds_sum", **model
    )
    assert value(samples, "pagemesh:num_requests_in_flight", **model) == 0
    assert value(samples, "pagemesh:engine_groups_ready", **model) == 1
    assert value(samples, "pagemesh:request_resumes_total", **model) == 0
    assert value(samples, "pagemesh:build_info", service="router", version="0.1.0") == 1
    assert 0 <= value(samples, "pagemesh:heartbeat_age_seconds", service="router") < 3.0


def check_scheduler(samples: dict, wall_s: float) -> None:
    num_prompt_tokens = sum(PROMPT_LENGTHS)
    # Every prompt token once, then one token per later step of each request.
    assert value(
        samples, "pagemesh:scheduled_tokens_per_step_sum", **GROUP
    ) == num_prompt_tokens + len(PROMPT_LENGTHS) * (MAX_TOKENS - 1)
    assert value(samples, "pagemesh:prefix_cache_queries_total", **GROUP) == num_prompt_tokens
    assert value(samples, "pagemesh:prefix_cache_hits_total", **GROUP) == 0
    assert value(samples, "pagemesh:request_queue_time_seconds_count", **GROUP) == len(
        PROMPT_LENGTHS
    )
    assert (
        0
        <= value(samples, "pagemesh:request_queue_time_seconds_sum", **GROUP)
        < len(PROMPT_LENGTHS) * wall_s
    )
    num_steps = value(samples, "pagemesh:step_time_seconds_count", **GROUP)
    assert (
        MAX_TOKENS
        <= num_steps
        <= value(samples, "pagemesh:scheduled_tokens_per_step_count", **GROUP)
    )
    # Under async scheduling one more step may still run after the client has its last
    # token (a loaded machine made it 8% of the wall time), hence not just `< wall_s`.
    assert 0 < value(samples, "pagemesh:step_time_seconds_sum", **GROUP) < 2 * wall_s
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_swapped",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "engine_recoveries_total",
    ):
        assert value(samples, f"pagemesh:{name}", **GROUP) == 0, name
    assert value(samples, "pagemesh:engine_group_ready", **GROUP) == 1
    assert value(samples, "pagemesh:checkpoint_writes_total", **GROUP) >= len(PROMPT_LENGTHS)
    assert 0 <= value(samples, "pagemesh:heartbeat_age_seconds", service="scheduler") < 3.0


def check_worker(samples: dict, wall_s: float, num_scheduler_steps: float) -> None:
    assert value(samples, "pagemesh:worker_steps_total", **WORKER) == num_scheduler_steps > 0
    assert (
        value(samples, "pagemesh:worker_forward_time_seconds_count", **WORKER)
        == num_scheduler_steps
    )
    assert 0 < value(samples, "pagemesh:worker_forward_time_seconds_sum", **WORKER) < 2 * wall_s
    for name in ("tp_collective", "pp_send", "pp_recv"):  # one worker: no collectives
        assert value(samples, f"pagemesh:worker_{name}_seconds_total", **WORKER) == 0
    assert value(samples, "pagemesh:build_info", service="worker", version="0.1.0") == 1
    assert 0 <= value(samples, "pagemesh:heartbeat_age_seconds", service="worker") < 3.0


def wait_for_checkpoint_writes(address: str, minimum: int) -> None:
    """Checkpoints are written in the background: the last ones may trail the responses."""
    eventually(
        lambda: value(scrape(address), "pagemesh:checkpoint_writes_total", **GROUP) >= minimum,
        10,
        f"fewer than {minimum} checkpoint writes",
    )


def test_a_known_workload_gives_exact_counts_on_every_service(mesh: Mesh, redis_url: str) -> None:
    addresses = metrics_addresses(redis_url)
    prompts = [prompt(length, offset) for offset, length in enumerate(PROMPT_LENGTHS)]
    wall_s = run_workload(mesh, prompts)
    wait_for_checkpoint_writes(addresses["scheduler"], len(PROMPT_LENGTHS))

    check_router(scrape(addresses["router"]), wall_s, len(prompts), sum(PROMPT_LENGTHS))
    scheduler = scrape(addresses["scheduler"])
    check_scheduler(scheduler, wall_s)
    check_worker(
        scrape(addresses["worker"]),
        wall_s,
        value(scheduler, "pagemesh:step_time_seconds_count", **GROUP),
    )

    # The 17-token prompt again: its first full block (16 tokens) comes from the prefix cache.
    run_workload(mesh, [prompts[2]])
    scheduler = scrape(addresses["scheduler"])
    assert (
        value(scheduler, "pagemesh:prefix_cache_queries_total", **GROUP) == sum(PROMPT_LENGTHS) + 17
    )
    assert value(scheduler, "pagemesh:prefix_cache_hits_total", **GROUP) == 16
    router = scrape(addresses["router"])
    assert (
        value(
            router, "pagemesh:request_success_total", model="tiny-llama", finished_reason="length"
        )
        == len(prompts) + 1
    )


def test_the_router_serves_the_same_metrics_on_its_http_port(mesh: Mesh, redis_url: str) -> None:
    mesh.generate(greedy_request(prompt(3, 9), MAX_TOKENS))
    http_port = int(mesh.process.args[mesh.process.args.index("--http-port") + 1])
    from_http = scrape(f"127.0.0.1:{http_port}")
    from_metrics_port = scrape(metrics_addresses(redis_url)["router"])
    assert {name for name, _ in from_http} == {name for name, _ in from_metrics_port}
    tokens = ("pagemesh:generation_tokens_total", frozenset({("model", "tiny-llama")}))
    assert from_http[tokens] == from_metrics_port[tokens] >= MAX_TOKENS
    assert value(from_http, "pagemesh:build_info", service="router", version="0.1.0") == 1


def test_pagemesh_top_sees_the_live_mesh(mesh: Mesh, redis_url: str) -> None:
    """`pagemesh top --once` against the running mesh: every service found in Redis, every
    /metrics endpoint scraped, and tokens/s measured while a request streams."""
    import subprocess
    import sys
    import threading

    done = threading.Event()

    def keep_generating() -> None:
        while not done.is_set():
            mesh.generate(greedy_request(list(range(1, 30)), 100))

    streaming = threading.Thread(target=keep_generating)
    streaming.start()
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagemesh.tools.cli",
                "top",
                "--once",
                "--format",
                "json",
                "--interval",
                "1",
                "--redis-url",
                redis_url,
                "--cluster",
                CLUSTER,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    finally:
        done.set()
        streaming.join()
    view = json.loads(out)
    [group] = view["snapshot"]["groups"]
    assert (group["status"], group["workers_alive"], group["metrics"]) == ("ready", 1, "ok")
    [worker] = view["snapshot"]["workers"]
    assert worker["status"] == "ready" and worker["metrics"] == "ok"
    [router] = view["snapshot"]["routers"]
    assert router["serving"] and router["metrics"] == "ok"
    assert view["rates"]["output_tokens_per_s"] > 0
