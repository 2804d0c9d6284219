"""Starts real meshes for tests: `pagemesh up` as a process, real gRPC, real Valkey.

The mesh client is product code (`pagemesh/tools/mesh_process.py`, which the benchmarks use too);
this layer only runs its meshes from this checkout, whatever pytest's working directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime import internal_auth
from pagemesh.tools import mesh_process
from pagemesh.tools.mesh_process import Generation, alive, generate, greedy_request
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from tests.support.paths import REPO_ROOT

__all__ = [
    "REPO_ROOT",
    "Generation",
    "Mesh",
    "RouterProcess",
    "alive",
    "entries",
    "generate",
    "greedy_request",
    "health_status",
    "router_process",
    "scheduler_stats",
    "scheduler_stats_at",
]


class Mesh(mesh_process.Mesh):
    """`pagemesh.tools.mesh_process.Mesh` whose services run from this checkout by default."""

    def __init__(
        self, model: str | None, log_path: Path, *, repo_root: Path = REPO_ROOT, **kwargs: object
    ) -> None:
        super().__init__(model, log_path, repo_root=repo_root, **kwargs)


def scheduler_stats_at(address: str) -> scheduler_pb2.GetStatsResponse:
    """`GetStats` of the scheduler at `address`."""
    token = os.environ.get("PAGEMESH_INTERNAL_TOKEN")  # tests/conftest.py's, every mesh's
    metadata = [(internal_auth.METADATA_KEY, token)] if token else None
    with grpc.insecure_channel(address) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), metadata=metadata
        )


def scheduler_stats(
    redis_url: str, cluster: str, group: str = "g0"
) -> scheduler_pb2.GetStatsResponse:
    """Asks a group's scheduler directly, found where the router finds it: in Redis."""
    raw = redis.Redis.from_url(redis_url).get(f"{cluster}:scheduler:{group}")
    assert raw is not None, f"scheduler {group} of {cluster} is not registered"
    return scheduler_stats_at(json.loads(raw)["address"])


@dataclass
class RouterProcess:
    """A router started on its own (`python -m router.main`), beside a mesh's."""

    process: subprocess.Popen
    channel: grpc.Channel
    stub: generate_pb2_grpc.GenerationStub
    log_path: Path
    address: str = ""  # where it serves (host:port)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def generate(self, request: generate_pb2.GenerateRequest, timeout_s: float = 300) -> Generation:
        return generate(self.stub, request, timeout_s)


@contextlib.contextmanager
def router_process(
    model: Path, redis_url: str, cluster: str, log_path: Path, *args: str
) -> Iterator[RouterProcess]:
    """One more router for `cluster`'s engine groups (found in Redis, as every router finds
    them), with its own flags; stopped with SIGTERM when the block ends, which it must
    survive with exit status 0. It binds port 0 and is dialled where its registry entry
    says it serves."""
    router_id = f"harness-{uuid.uuid4().hex[:8]}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router.main",
                "--model",
                str(model),
                "--port",
                "0",
                "--router-id",
                router_id,
                "--redis-url",
                redis_url,
                "--cluster",
                cluster,
                "--http-port",
                "0",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
        try:
            address = _registered_address(
                process, redis_url, cluster, "router", router_id, log_path
            )
            channel = grpc.insecure_channel(address)
            try:
                yield RouterProcess(
                    process, channel, generate_pb2_grpc.GenerationStub(channel), log_path, address
                )
            finally:
                channel.close()
        finally:
            process.terminate()
            assert process.wait(timeout=30) == 0, log_path.read_text(errors="replace")[-3000:]


def _registered_address(
    process: subprocess.Popen,
    redis_url: str,
    cluster: str,
    kind: str,
    service_id: str,
    log_path: Path,
    timeout_s: float = 120.0,
) -> str:
    """Where the service `kind:service_id` says it serves, once it has registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{kind} {service_id} exited with {process.returncode}:\n"
                + log_path.read_text(errors="replace")[-3000:]
            )
        entry = entries(redis_url, cluster, kind).get(service_id)
        if entry is not None:
            return entry["address"]
        time.sleep(0.1)
    raise TimeoutError(
        f"{kind} {service_id} did not register in {timeout_s} s:\n"
        + log_path.read_text(errors="replace")[-3000:]
    )


def entries(redis_url: str, cluster: str, kind: str) -> dict[str, dict]:
    """Registry entries of `kind` (worker, scheduler, router) as raw JSON, by service id."""
    client = redis.Redis.from_url(redis_url)
    try:
        found = {}
        for key in client.scan_iter(f"{cluster}:{kind}:*"):
            raw = client.get(key)
            if raw is not None:
                found[key.decode().rsplit(":", 1)[1]] = json.loads(raw)
        return found
    finally:
        client.close()


def health_status(mesh: Mesh) -> int:
    """The router's gRPC health (UNKNOWN when it does not answer within a second)."""
    try:
        return (
            health_pb2_grpc.HealthStub(mesh.channel)
            .Check(health_pb2.HealthCheckRequest(), timeout=1)
            .status
        )
    except grpc.RpcError:
        return health_pb2.HealthCheckResponse.UNKNOWN
