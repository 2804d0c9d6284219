"""Data parallelism: two engine groups behind one router. Requests sharing a long prefix land
on one group (its prefix-cache hit rate shows it), unrelated ones spread out, and when a
group dies new requests go to the other while health stays truthful."""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2
from tests.support.mesh_harness import Mesh, greedy_request
from tests.support.eventually import eventually

CLUSTER = "e2e-replicas"


@pytest.fixture(scope="module")
def two_groups(tiny_llama_dir: Path, redis_url: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = Mesh(str(tiny_llama_dir), tmp_path_factory.mktemp("logs") / "replicas.log",
                redis_url=redis_url, cluster=CLUSTER, extra_args=["--replicas", "2"])
    try:
        mesh.wait_ready()
        # The router serves as soon as one group is up.
        eventually(lambda: len(schedulers(redis_url)) >= 2, 60, mesh.log, interval_s=0.2)
        eventually(lambda: mesh.stub.GetModelInfo(
            generate_pb2.GetModelInfoRequest()).layout.num_replicas >= 2, 60, mesh.log, interval_s=0.2)
        yield mesh
    finally:
        mesh.stop()


def schedulers(redis_url: str) -> dict[str, dict]:
    client = redis.Redis.from_url(redis_url)
    return {key.decode().rsplit(":", 1)[1]: json.loads(client.get(key))
            for key in client.scan_iter(f"{CLUSTER}:scheduler:*")}


def stats(address: str) -> scheduler_pb2.GetStatsResponse:
    with grpc.insecure_channel(address) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest())


def test_shared_prefix_sticks_and_unrelated_requests_spread(two_groups: Mesh, redis_url: str) -> None:
    groups = schedulers(redis_url)
    rng = random.Random(9)
    prefix = [rng.randrange(1, 500) for _ in range(96)]  # six full blocks
    for i in range(6):
        two_groups.generate(greedy_request(prefix + [100 + i, 7, 8], 3))
    rates = {g: stats(info["address"]).prefix_cache_hit_rate for g, info in groups.items()}
    assert sorted(rates.values())[0] == 0 and sorted(rates.values())[1] > 0.5, rates

    before = {g: stats(info["address"]).num_steps for g, info in groups.items()}
    unrelated = [[rng.randrange(1, 500) for _ in range(40)] for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: two_groups.generate(greedy_request(p, 24)), unrelated))
    after = {g: stats(info["address"]).num_steps for g, info in groups.items()}
    assert all(after[g] > before[g] for g in groups), (before, after)


def test_a_dead_group_is_routed_around(two_groups: Mesh, redis_url: str) -> None:
    groups = schedulers(redis_url)
    victim = sorted(groups)[1]
    os.kill(groups[victim]["pid"], signal.SIGKILL)
    for i in range(6):  # before and after its heartbeat expires: retried, never lost
        result = two_groups.generate(greedy_request([30 + i, 31, 32], 4))
        assert len(result.token_ids) == 4
    eventually(lambda: two_groups.stub.GetModelInfo(
        generate_pb2.GetModelInfoRequest()).layout.num_replicas == 1, 10,
        "the router still counts the dead group", interval_s=0.3)
    health = health_pb2_grpc.HealthStub(two_groups.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
