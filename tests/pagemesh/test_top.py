"""`pagemesh top`: the snapshot / rates / quantile functions on hand-written input, the
command against a real Valkey and real /metrics endpoints, and the TUI in textual's pilot."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from rich.console import Console

from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.registry import Registry, RegistryConfig
from pagemesh.runtime.registry_entries import RouterEntry, SchedulerEntry, WorkerEntry
from pagemesh.tools import top_snapshot
from pagemesh.tools.top_render import render
from pagemesh.tools.top_snapshot import (
    ServiceRecord,
    build_snapshot,
    compute_rates,
    heartbeat_age,
    histogram_buckets,
    histogram_quantile,
    metric_sum,
    parse_metrics,
    prometheus_targets,
)
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT

ROUTER_TEXT_1 = """\
# HELP pagemesh:generation_tokens_total Generated tokens.
# TYPE pagemesh:generation_tokens_total counter
pagemesh:generation_tokens_total 1000.0
# TYPE pagemesh:prompt_tokens_total counter
pagemesh:prompt_tokens_total 400.0
# TYPE pagemesh:request_success_total counter
pagemesh:request_success_total{finished_reason="stop"} 8.0
pagemesh:request_success_total{finished_reason="length"} 2.0
# TYPE pagemesh:num_requests_in_flight gauge
pagemesh:num_requests_in_flight 3.0
# TYPE pagemesh:time_to_first_token_seconds histogram
pagemesh:time_to_first_token_seconds_bucket{le="0.1"} 10.0
pagemesh:time_to_first_token_seconds_bucket{le="0.5"} 10.0
pagemesh:time_to_first_token_seconds_bucket{le="1.0"} 10.0
pagemesh:time_to_first_token_seconds_bucket{le="+Inf"} 10.0
pagemesh:time_to_first_token_seconds_sum 0.5
pagemesh:time_to_first_token_seconds_count 10.0
# TYPE pagemesh:inter_token_latency_seconds histogram
pagemesh:inter_token_latency_seconds_bucket{le="0.01"} 0.0
pagemesh:inter_token_latency_seconds_bucket{le="0.05"} 0.0
pagemesh:inter_token_latency_seconds_bucket{le="+Inf"} 0.0
pagemesh:inter_token_latency_seconds_sum 0.0
pagemesh:inter_token_latency_seconds_count 0.0
"""

# Two seconds later: +100 generated tokens, +4 finished requests, 4 first tokens in
# (0.1, 0.5] and 100 inter-token gaps, half of them under 10 ms.
ROUTER_TEXT_2 = (
    ROUTER_TEXT_1.replace("generation_tokens_total 1000.0", "generation_tokens_total 1100.0")
    .replace('"stop"} 8.0', '"stop"} 12.0')
    .replace('le="0.5"} 10.0', 'le="0.5"} 14.0')
    .replace('le="1.0"} 10.0', 'le="1.0"} 14.0')
    .replace(
        'first_token_seconds_bucket{le="+Inf"} 10.0', 'first_token_seconds_bucket{le="+Inf"} 14.0'
    )
    .replace('le="0.01"} 0.0', 'le="0.01"} 50.0')
    .replace('le="0.05"} 0.0', 'le="0.05"} 100.0')
    .replace('latency_seconds_bucket{le="+Inf"} 0.0', 'latency_seconds_bucket{le="+Inf"} 100.0')
)

SCHEDULER_TEXT = """\
# TYPE pagemesh:heartbeat_age_seconds gauge
pagemesh:heartbeat_age_seconds{service="scheduler"} 1.25
# TYPE pagemesh:kv_cache_usage_perc gauge
pagemesh:kv_cache_usage_perc{group="g0"} 0.75
# TYPE pagemesh:num_requests_swapped gauge
pagemesh:num_requests_swapped{group="g0"} 1.0
"""


def scheduler_entry(**changes: object) -> dict:
    entry = {
        "address": "127.0.0.1:6001",
        "group": "g0",
        "status": "ready",
        "instance": "s1",
        "num_running": 3,
        "num_waiting": 2,
        "num_free_blocks": 25,
        "num_blocks": 100,
        "num_preemptions": 4,
        "num_swapped": 1,
        "prefix_cache_hit_rate": 0.5,
        "num_recoveries": 1,
        "members": ["w0", "w1"],
        "num_steps": 500,
        "metrics_address": "127.0.0.1:9101",
        "num_draft_tokens": 400,
        "num_drafts": 100,
        "num_accepted_tokens": 300,
    }
    return entry | changes


def worker_entry(tp_rank: int, **changes: object) -> dict:
    entry = {
        "address": f"127.0.0.1:700{tp_rank}",
        "group": "g0",
        "status": "ready",
        "instance": f"w{tp_rank}",
        "tp_rank": tp_rank,
        "tp_size": 2,
        "pp_rank": 0,
        "pp_size": 1,
        "epoch": "abcdef0123456789",
        "num_steps": 500,
        "busy_time_s": 10.0,
    }
    return entry | changes


def records(
    router_text: str, *, w0_busy: float = 10.0, w1_instance: str = "w1", scheduler_steps: int = 500
) -> list[ServiceRecord]:
    router = RouterEntry(
        address="127.0.0.1:50051", serving=True, num_groups=1, metrics_address="127.0.0.1:9100"
    )
    return [
        ServiceRecord("router", "r0", router, 0.4, router_text),
        ServiceRecord(
            "scheduler",
            "s0",
            SchedulerEntry.from_json(scheduler_entry(num_steps=scheduler_steps)),
            0.2,
            SCHEDULER_TEXT,
        ),
        ServiceRecord(
            "worker", "w0", WorkerEntry.from_json(worker_entry(0, busy_time_s=w0_busy)), 0.1
        ),
        ServiceRecord(
            "worker",
            "w1",
            WorkerEntry.from_json(worker_entry(1, instance=w1_instance)),
            0.3,
            None,
            "down: refused",
        ),
        ServiceRecord(
            "worker",
            "w2",
            WorkerEntry.from_json(
                worker_entry(-1, group="g1", status="standby", tp_size=1, pp_size=1)
            ),
            2.5,
        ),
    ]


# --- metrics text and quantiles --------------------------------------------------------


def test_parse_metrics_keys_by_sample_name_with_total_and_bucket_suffixes() -> None:
    samples = parse_metrics(ROUTER_TEXT_1)
    assert metric_sum(samples, "pagemesh:generation_tokens_total") == 1000.0
    assert metric_sum(samples, "pagemesh:request_success_total") == 10.0
    assert metric_sum(samples, "pagemesh:request_success_total", finished_reason="length") == 2.0
    assert metric_sum(samples, "pagemesh:request_success_total", finished_reason="abort") is None
    assert metric_sum(samples, "pagemesh:not_there") is None
    buckets = histogram_buckets(samples, "pagemesh:time_to_first_token_seconds")
    assert buckets == {0.1: 10.0, 0.5: 10.0, 1.0: 10.0, math.inf: 10.0}


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, math.inf: 40.0}
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: top of bucket 1
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.1 * 4 / 10)
    assert histogram_quantile(1.0, buckets) == pytest.approx(1.0)
    # A rank in the +Inf bucket: the highest finite bound, as Prometheus answers.
    assert histogram_quantile(0.99, {0.1: 1.0, math.inf: 10.0}) == pytest.approx(0.1)
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.5, {}) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def test_heartbeat_age_from_timestamp_or_remaining_ttl() -> None:
    assert heartbeat_age(RouterEntry(heartbeat_at=100.0), 2500, 3.0, now=101.5) == pytest.approx(
        1.5
    )
    assert heartbeat_age(RouterEntry(), 2500, 3.0, now=0.0) == pytest.approx(0.5)
    assert heartbeat_age(RouterEntry(heartbeat_ttl_s=10.0), 2500, 3.0, now=0.0) == pytest.approx(
        7.5
    )
    assert heartbeat_age(RouterEntry(), -1, 3.0, now=0.0) is None  # a key without TTL
    assert heartbeat_age(RouterEntry(), None, 3.0, now=0.0) is None


# --- snapshot and rates ----------------------------------------------------------------


def test_snapshot_rows_from_entries_and_metrics() -> None:
    snapshot = build_snapshot(records(ROUTER_TEXT_1), taken_at=10.0)
    g0, g1 = snapshot.groups
    assert (g0.group, g0.scheduler_id, g0.status) == ("g0", "s0", "ready")
    assert (g0.workers_alive, g0.workers_expected) == (2, 2)
    assert (g0.num_waiting, g0.num_running, g0.num_swapped) == (2, 3, 1)
    assert g0.kv_usage == pytest.approx(0.75) and g0.prefix_hit_rate == pytest.approx(0.5)
    assert (g0.num_recoveries, g0.heartbeat_age_s, g0.metrics) == (1, 0.2, "ok")
    assert g0.spec_acceptance == pytest.approx(0.75)  # drafts kept / verified
    assert g0.spec_mean_length == pytest.approx(4.0)  # 1 + 300 kept / 100 drafts
    # Workers alive with no scheduler: the group still shows, flagged.
    assert (g1.group, g1.status, g1.workers_alive, g1.workers_expected) == (
        "g1",
        "no scheduler",
        0,
        1,
    )
    assert [w.worker_id for w in snapshot.workers] == ["w0", "w1", "w2"]
    w0, w1, w2 = snapshot.workers
    assert (w0.tp_rank, w0.pp_rank, w0.metrics) == (0, 0, "-")
    assert w1.metrics == "down: refused"
    assert (w2.tp_rank, w2.status) == (-1, "standby")
    (router,) = snapshot.routers
    assert (router.num_in_flight, router.serving, router.metrics) == (3, True, "ok")


def test_kv_usage_falls_back_to_the_metric_and_bad_text_is_reported() -> None:
    entry = scheduler_entry()
    del entry["num_free_blocks"]
    snapshot = build_snapshot(
        [
            ServiceRecord("scheduler", "s0", SchedulerEntry.from_json(entry), None, SCHEDULER_TEXT),
            ServiceRecord("router", "r0", RouterEntry(), None, "this is { not prometheus"),
        ],
        taken_at=0.0,
    )
    assert snapshot.groups[0].kv_usage == pytest.approx(0.75)
    # No age from Redis (heartbeat_age_s None): the one the service reports, if any.
    assert snapshot.groups[0].heartbeat_age_s == pytest.approx(1.25)
    assert snapshot.routers[0].metrics.startswith("bad metrics")
    assert snapshot.routers[0].num_in_flight is None


def test_rates_between_two_snapshots() -> None:
    prev = build_snapshot(records(ROUTER_TEXT_1), taken_at=10.0)
    cur = build_snapshot(
        records(ROUTER_TEXT_2, w0_busy=11.0, w1_instance="w1-restarted", scheduler_steps=600),
        taken_at=12.0,
    )
    rates = compute_rates(prev, cur)
    assert rates.window_s == pytest.approx(2.0)
    assert rates.output_tokens_per_s == pytest.approx(50.0)
    assert rates.prompt_tokens_per_s == pytest.approx(0.0)
    assert rates.requests_per_s == pytest.approx(2.0)
    # From the bucket deltas: 4 first tokens in (0.1, 0.5] -> median 0.3 s, whereas over all
    # time (14 observations, 10 under 0.1 s) it would be 0.07 s.
    assert rates.ttft_p50_s == pytest.approx(0.3)
    assert rates.itl_p50_s == pytest.approx(0.01)
    assert rates.e2e_p50_s is None
    assert rates.busy_fraction == {"worker:w0": pytest.approx(0.5), "worker:w2": 0.0}
    assert rates.steps_per_s["scheduler:s0"] == pytest.approx(50.0)
    assert "worker:w1" not in rates.steps_per_s  # another instance: no rate across restarts
    assert rates.preemptions_per_s["scheduler:s0"] == 0.0


def test_rates_without_a_previous_snapshot_use_all_observations() -> None:
    rates = compute_rates(None, build_snapshot(records(ROUTER_TEXT_2), taken_at=0.0))
    assert rates.window_s is None and rates.output_tokens_per_s is None
    assert rates.ttft_p50_s == pytest.approx(0.1 * 7 / 10)


def test_counter_reset_counts_the_new_value_and_new_services_count_nothing() -> None:
    prev = build_snapshot(records(ROUTER_TEXT_1), taken_at=0.0)
    restarted = ROUTER_TEXT_1.replace(
        "generation_tokens_total 1000.0", "generation_tokens_total 30.0"
    )
    newcomer = ServiceRecord("router", "r1", RouterEntry(), None, ROUTER_TEXT_2)
    cur = build_snapshot(records(restarted) + [newcomer], taken_at=1.0)
    assert compute_rates(prev, cur).output_tokens_per_s == pytest.approx(30.0)


def test_prometheus_targets_from_entries() -> None:
    targets = prometheus_targets(records(ROUTER_TEXT_1))
    assert targets == [
        {"targets": ["127.0.0.1:9100"], "labels": {"pagemesh_kind": "router", "pagemesh_id": "r0"}},
        {
            "targets": ["127.0.0.1:9101"],
            "labels": {"pagemesh_kind": "scheduler", "pagemesh_id": "s0"},
        },
    ]


def test_render_shows_every_table() -> None:
    prev = build_snapshot(records(ROUTER_TEXT_1), taken_at=10.0)
    cur = build_snapshot(records(ROUTER_TEXT_2, w0_busy=11.0), taken_at=12.0)
    text = render_text(render(cur, compute_rates(prev, cur), "demo"))
    for expected in (
        "pagemesh cluster 'demo' (rates and latencies over the last 2.0s)",
        "engine groups",
        "no scheduler",
        "75.0%",
        "50.0%",
        "300.0 ms",
        "10.0 ms",
        "workers",
        "standby",
        "routers",
        "127.0.0.1:50051",
        "down: refused",
    ):
        assert expected in text, expected


def test_metric_names_read_are_in_the_contract() -> None:
    from tests.deploy.test_dashboards import CONTRACT

    names = [
        value
        for name, value in vars(top_snapshot).items()
        if name.isupper() and isinstance(value, str) and value.startswith("pagemesh:")
    ]
    assert len(names) >= 9 and set(names) <= CONTRACT


def render_text(renderable: object) -> str:
    console = Console(width=220, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(renderable)
    return console.export_text()


# --- the TUI ---------------------------------------------------------------------------


def test_tui_mounts_and_draws_a_refresh() -> None:
    from textual.widgets import Static

    from pagemesh.tools.top_app import TopApp

    snapshots = iter(
        [
            build_snapshot(records(ROUTER_TEXT_1), taken_at=10.0),
            build_snapshot(records(ROUTER_TEXT_2, w0_busy=11.0), taken_at=12.0),
        ]
    )

    async def scenario() -> None:
        app = TopApp(lambda: next(snapshots), interval_s=60.0, cluster="demo")
        async with app.run_test(size=(200, 60)) as pilot:
            await pilot.pause()
            assert app.num_refreshes == 1
            await pilot.press("r")  # a refresh now: the second snapshot, rates over 2 s
            await pilot.pause()
            assert app.num_refreshes == 2
            summary = render_text(app.query_one("#summary", Static).content)
            assert "50.0" in summary and "300.0 ms" in summary
            groups = render_text(app.query_one("#groups", Static).content)
            assert "g0" in groups and "75.0%" in groups
            assert "w2" in render_text(app.query_one("#workers", Static).content)
            await pilot.press("p")
            assert app.paused
            await app.refresh_data()  # a timer tick while paused changes nothing
            assert app.num_refreshes == 2
            await pilot.press("q")

    asyncio.run(scenario())


# --- the command, against a real Valkey and real /metrics endpoints ---------------------


@pytest.fixture
def router_metrics() -> Iterator[tuple[str, CollectorRegistry, Counter]]:
    """A real router-like /metrics endpoint, served by prometheus_client on 127.0.0.1."""
    registry = CollectorRegistry()
    tokens = Counter("pagemesh:generation_tokens", "generated tokens", registry=registry)
    tokens.inc(500)
    Counter(
        "pagemesh:request_success", "finished requests", ["finished_reason"], registry=registry
    ).labels("stop").inc(5)
    Gauge("pagemesh:num_requests_in_flight", "in flight", registry=registry).set(7)
    ttft = Histogram(
        "pagemesh:time_to_first_token_seconds", "TTFT", registry=registry, buckets=[0.05, 0.25, 1.0]
    )
    for _ in range(4):
        ttft.observe(0.1)  # all four in (0.05, 0.25]: median 0.05 + 0.2 * 2/4 = 150 ms
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{server.server_port}", registry, tokens
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def register(redis_url: str, cluster: str, metrics_address: str) -> None:
    async def scenario() -> None:
        registry = Registry(
            RegistryConfig(redis_url, cluster=cluster, heartbeat_interval_s=1.0, ttl_s=60.0)
        )
        await registry.put(
            "router",
            "router-a",
            {
                "address": "127.0.0.1:50051",
                "serving": True,
                "num_groups": 1,
                "metrics_address": metrics_address,
            },
        )
        await registry.put(
            "scheduler",
            "sched-a",
            scheduler_entry(group="grp-a", members=["wk-a0", "wk-a1"], metrics_address=None),
        )
        await registry.put("worker", "wk-a0", worker_entry(0, group="grp-a"))
        await registry.put(
            "worker",
            "wk-a1",
            worker_entry(1, group="grp-a", metrics_address=f"127.0.0.1:{reserve_port()}"),
        )
        await registry.close()

    asyncio.run(scenario())


def run_top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagemesh.tools.cli", "top", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_top_once_prints_the_cluster(redis_url: str, router_metrics) -> None:
    address, _, _ = router_metrics
    cluster = f"t-top-{uuid.uuid4().hex[:8]}"
    register(redis_url, cluster, address)
    done = run_top(
        "--redis-url",
        redis_url,
        "--cluster",
        cluster,
        "--once",
        "--interval",
        "0",
        "--heartbeat-ttl-s",
        "60",
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for expected in (
        f"pagemesh cluster '{cluster}'",
        "grp-a",
        "sched-a",
        "ready",
        "2/2",
        "75.0%",
        "50.0%",
        "wk-a0",
        "wk-a1",
        "down: connection refused",
        "router-a",
        "127.0.0.1:50051",
        "150.0 ms",
    ):
        assert expected in out, f"{expected!r} not in:\n{out}"
    router_line = next(line for line in out.splitlines() if "router-a" in line)
    assert " 7 " in router_line and "ok" in router_line  # in flight, scraped


def test_top_once_json_measures_rates_over_the_interval(redis_url: str, router_metrics) -> None:
    address, _, tokens = router_metrics
    cluster = f"t-top-{uuid.uuid4().hex[:8]}"
    register(redis_url, cluster, address)
    stop = threading.Event()

    def generate() -> None:  # a steady 10 tokens every 20 ms while top measures
        while not stop.wait(0.02):
            tokens.inc(10)

    producer = threading.Thread(target=generate, daemon=True)
    producer.start()
    try:
        done = run_top(
            "--redis-url",
            redis_url,
            "--cluster",
            cluster,
            "--once",
            "--interval",
            "0.5",
            "--format",
            "json",
        )
    finally:
        stop.set()
        producer.join()
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert 0.4 < body["rates"]["window_s"] < 5.0
    assert body["rates"]["output_tokens_per_s"] > 50.0
    assert body["rates"]["requests_per_s"] == 0.0
    assert [g["group"] for g in body["snapshot"]["groups"]] == ["grp-a"]
    assert {w["worker_id"] for w in body["snapshot"]["workers"]} == {"wk-a0", "wk-a1"}


def test_top_writes_prometheus_targets(redis_url: str, router_metrics, tmp_path: Path) -> None:
    address, _, _ = router_metrics
    cluster = f"t-top-{uuid.uuid4().hex[:8]}"
    register(redis_url, cluster, address)
    path = tmp_path / "targets.json"
    done = run_top(
        "--redis-url", redis_url, "--cluster", cluster, "--once", "--prometheus-targets", str(path)
    )
    assert done.returncode == 0, done.stderr
    targets = json.loads(path.read_text())
    assert {t["labels"]["pagemesh_id"]: t["targets"] for t in targets} == {
        "router-a": [address],
        "wk-a1": [targets[-1]["targets"][0]],
    }


def test_top_says_when_redis_is_unreachable() -> None:
    done = run_top("--redis-url", f"redis://127.0.0.1:{reserve_port()}/0", "--once")
    assert done.returncode == 1
    assert "cannot read the registry" in done.stderr


def test_workers_show_memory_and_the_share_of_busy_time_communicating() -> None:
    def worker(busy_s: float, collective_s: float, **memory: int) -> list[ServiceRecord]:
        entry = WorkerEntry.from_json(
            worker_entry(0, busy_time_s=busy_s, tp_collective_time_s=collective_s, **memory)
        )
        return [ServiceRecord("worker", "w0", entry, 0.1)]

    memory = {"weight_bytes": 812 << 20, "kv_cache_bytes": 3 << 30, "rss_bytes": 5 << 30}
    prev = build_snapshot(worker(10.0, 2.0, **memory), taken_at=10.0)
    cur = build_snapshot(worker(11.0, 2.25, **memory), taken_at=12.0)
    (row,) = cur.workers
    assert (row.weight_bytes, row.kv_cache_bytes, row.rss_bytes) == (812 << 20, 3 << 30, 5 << 30)
    assert row.communication_time_s == 2.25
    rates = compute_rates(prev, cur)
    assert rates.communication_fraction == {"worker:w0": pytest.approx(0.25)}
    text = render_text(render(cur, rates, "demo"))
    for expected in ("comm", "RSS", "812M", "3G", "5G", "25.0%"):
        assert expected in text, expected
    (old,) = build_snapshot(worker(1.0, 0.0), taken_at=1.0).workers  # an older worker
    assert old.weight_bytes is None and old.rss_bytes is None
