"""A router with no engine group behind it tells the truth: NOT_SERVING and UNAVAILABLE."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from tests.support.mesh_harness import free_port, greedy_request
from tests.support.eventually import eventually


def test_router_without_groups_is_not_serving_and_unavailable(
    tiny_llama_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    log = open(tmp_path / "router.log", "wb")
    router = subprocess.Popen(
        [sys.executable, "-m", "router.main", "--model", str(tiny_llama_dir), "--port", str(port),
         "--redis-url", redis_url, "--cluster", "e2e-empty"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            response = eventually(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=1),
                                  60, (tmp_path / "router.log").read_text, interval_s=0.3,
                                  ignoring=(grpc.RpcError,))
            assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = generate_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(greedy_request([1, 2], 2), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "engine group" in info.value.details()
    finally:
        router.terminate()
        assert router.wait(timeout=30) == 0
        log.close()
