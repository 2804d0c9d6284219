"""A router with no engine group behind it tells the truth: NOT_SERVING and UNAVAILABLE."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.eventually import eventually
from tests.support.mesh_harness import greedy_request, router_process


def test_router_without_groups_is_not_serving_and_unavailable(
    tiny_llama_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    with router_process(tiny_llama_dir, redis_url, "e2e-empty", tmp_path / "router.log") as router:
        health = health_pb2_grpc.HealthStub(router.channel)
        response = eventually(
            lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=1),
            60,
            router.log,
            interval_s=0.3,
            ignoring=(grpc.RpcError,),
        )
        assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            list(router.stub.Generate(greedy_request([1, 2], 2), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine group" in info.value.details()
