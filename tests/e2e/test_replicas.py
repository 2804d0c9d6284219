"""Data parallelism: two engine groups behind one router. Requests sharing a long prefix land
on one group (its prefix-cache hit rate shows it), unrelated ones spread out, every routing
policy gives transformers' tokens, and when a group dies new requests go to the other while
health stays truthful."""

from __future__ import annotations

import contextlib
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
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from protos.pagemesh.v1 import generate_pb2
from router.routing import POLICIES as ROUTING_POLICIES
from tests.support.eventually import eventually
from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import Mesh, greedy_request, router_process, scheduler_stats_at

CLUSTER = "e2e-replicas"


@pytest.fixture(scope="module")
def two_groups(
    tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    mesh = Mesh(
        str(tiny_llama_dir),
        tmp_path_factory.mktemp("logs") / "replicas.log",
        redis_url=redis_url,
        cluster=CLUSTER,
        extra_args=["--replicas", "2"],
    )
    try:
        mesh.wait_ready()
        # The router serves as soon as one group is up.
        eventually(lambda: len(schedulers(redis_url)) >= 2, 60, mesh.log, interval_s=0.2)
        eventually(
            lambda: (
                mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).layout.num_replicas >= 2
            ),
            60,
            mesh.log,
            interval_s=0.2,
        )
        yield mesh
    finally:
        mesh.stop()


def schedulers(redis_url: str) -> dict[str, dict]:
    client = redis.Redis.from_url(redis_url)
    return {
        key.decode().rsplit(":", 1)[1]: json.loads(client.get(key))
        for key in client.scan_iter(f"{CLUSTER}:scheduler:*")
    }


def test_shared_prefix_sticks_and_unrelated_requests_spread(
    two_groups: Mesh, redis_url: str
) -> None:
    groups = schedulers(redis_url)
    rng = random.Random(9)
    prefix = [rng.randrange(1, 500) for _ in range(96)]  # six full blocks
    for i in range(6):
        two_groups.generate(greedy_request(prefix + [100 + i, 7, 8], 3))
    rates = {
        g: scheduler_stats_at(info["address"]).prefix_cache_hit_rate for g, info in groups.items()
    }
    assert sorted(rates.values())[0] == 0 and sorted(rates.values())[1] > 0.5, rates

    before = {g: scheduler_stats_at(info["address"]).num_steps for g, info in groups.items()}
    unrelated = [[rng.randrange(1, 500) for _ in range(40)] for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: two_groups.generate(greedy_request(p, 24)), unrelated))
    after = {g: scheduler_stats_at(info["address"]).num_steps for g, info in groups.items()}
    assert all(after[g] > before[g] for g in groups), (before, after)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def num_steps(groups: dict[str, dict]) -> dict[str, int]:
    return {g: scheduler_stats_at(info["address"]).num_steps for g, info in groups.items()}


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_each_routing_policy_gives_transformers_tokens(
    policy: str,
    two_groups: Mesh,
    tiny_llama_dir: Path,
    redis_url: str,
    hf_model: torch.nn.Module,
    tmp_path: Path,
) -> None:
    """Through a router of each policy (the mesh's own is prefix_aware; the others run beside
    it over the same two groups): sequential requests sharing a prefix and concurrent
    unrelated ones all get transformers' greedy tokens, and the groups' step counts show the
    policy's choice: prefix_aware keeps the prefix on one group, round_robin alternates,
    least_load spreads what arrives at once."""
    rng = random.Random(ROUTING_POLICIES.index(policy))
    prefix = [rng.randrange(1, 500) for _ in range(48)]  # three full blocks, new to every group
    shared = [prefix + [rng.randrange(1, 500), i + 1] for i in range(4)]
    unrelated = [[rng.randrange(1, 500) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    groups = schedulers(redis_url)
    with contextlib.ExitStack() as stack:
        router = two_groups
        if policy != "prefix_aware":
            router = stack.enter_context(
                router_process(
                    tiny_llama_dir, redis_url, CLUSTER, tmp_path / "router.log", "--routing", policy
                )
            )
            eventually(
                lambda: (
                    router.stub.GetModelInfo(
                        generate_pb2.GetModelInfoRequest(), timeout=1
                    ).layout.num_replicas
                    == 2
                ),
                60,
                router.log,
                interval_s=0.2,
                ignoring=(grpc.RpcError,),
            )
        at_start = num_steps(groups)
        sequential = [router.generate(greedy_request(p, 8)).token_ids for p in shared]
        after_shared = num_steps(groups)
        with ThreadPoolExecutor(len(unrelated)) as pool:
            concurrent = list(
                pool.map(lambda p: router.generate(greedy_request(p, 16)).token_ids, unrelated)
            )
        after_unrelated = num_steps(groups)

    for prompt, ours in zip(shared + unrelated, sequential + concurrent):
        assert_greedy_match(hf_model, prompt, ours, hf_greedy(hf_model, prompt, len(ours)))
    took_shared = {g for g in groups if after_shared[g] > at_start[g]}
    took_unrelated = {g for g in groups if after_unrelated[g] > after_shared[g]}
    expected = {"prefix_aware": (1, 2), "round_robin": (2, 2), "least_load": (None, 2)}[policy]
    if expected[0] is not None:
        assert len(took_shared) == expected[0], (policy, at_start, after_shared)
    assert len(took_unrelated) == expected[1], (policy, after_shared, after_unrelated)


def test_a_dead_group_is_routed_around(two_groups: Mesh, redis_url: str) -> None:
    groups = schedulers(redis_url)
    victim = sorted(groups)[1]
    os.kill(groups[victim]["pid"], signal.SIGKILL)
    for i in range(6):  # before and after its heartbeat expires: retried, never lost
        result = two_groups.generate(greedy_request([30 + i, 31, 32], 4))
        assert len(result.token_ids) == 4
    eventually(
        lambda: (
            two_groups.stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).layout.num_replicas
            == 1
        ),
        10,
        "the router still counts the dead group",
        interval_s=0.3,
    )
    health = health_pb2_grpc.HealthStub(two_groups.channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest()).status
        == health_pb2.HealthCheckResponse.SERVING
    )
