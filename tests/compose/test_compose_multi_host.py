"""compose/multi-host, run: head.yml's services in one network namespace (the head host) and
gpu-host.yml's in two more (two GPU hosts, one GPU each: the tp=2 ranks on different hosts,
plus a standby on the second), each with its own .env made from .env.example — HEAD_HOST,
HOST_IP, the ranks, the interface NCCL and gloo use. The same commands and environment as
the containers (host networking on the GPU hosts), then a request through the head's router.
Tracing is off: Jaeger's address on the head has nothing standing in for it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis

from pagemesh.tools.testing.netns import Host, HostNetwork, namespaces_unavailable
from protos.pagemesh.v1 import generate_pb2_grpc
from tests.support.compose_files import (
    MULTI_HOST_DIR,
    compose_command,
    compose_config,
    write_env_file,
)
from tests.support.compose_runner import Localizer, LocalRun, LocalService, Site, run_healthcheck
from tests.support.eventually import eventually
from tests.support.mesh_harness import greedy_request

REASON = namespaces_unavailable() or (compose_command() is None and "no Compose CLI") or None
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"multi-host compose test: {REASON}")

CLUSTER = "compose-mh"


@dataclass
class MultiHost:
    head: Host
    gpu_hosts: list[Host]
    services: dict[str, LocalService]  # "<site address>/<service>"
    run: LocalRun
    run_dir: Path
    redis_password: str  # of the user `pagemesh`, from the secrets every host was given


def _project(file: str, env_file: Path, site: Site, run_dir: Path) -> dict[str, LocalService]:
    return Localizer(compose_config([MULTI_HOST_DIR / file], env_file), site, run_dir).localize()


@pytest.fixture(scope="module")
def multi_host(
    model_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MultiHost]:
    tmp = tmp_path_factory.mktemp("compose-multi-host")
    network = HostNetwork(prefix="10.213.79").open()
    run = LocalRun(
        tmp / "logs", extra_env={"OTEL_TRACES_EXPORTER": "none", "PAGEMESH_TORCH_THREADS": "1"}
    )
    try:
        head = network.add_host("head")
        gpu_hosts = [network.add_host(f"gpu{i}") for i in range(2)]
        common = dict(
            **model_env,
            HEAD_HOST=head.address,
            CLUSTER=CLUSTER,
            TP="2",
            PP="1",
            KV_CACHE_MEMORY_GIB="0.0625",
        )
        example = MULTI_HOST_DIR / ".env.example"
        projects = [
            _project(
                "head.yml",
                write_env_file(tmp / "head.env", example, **common),
                Site(head.address, head),
                tmp / "head",
            )
        ]
        for rank, host in enumerate(gpu_hosts):
            env = write_env_file(
                tmp / f"{host.name}.env",
                example,
                **common,
                HOST_IP=host.address,
                NCCL_SOCKET_IFNAME=host.interface,
                WORKER0_TP_RANK=str(rank),
                COMPOSE_PROFILES="standby" if rank == 1 else "",
            )
            projects.append(
                _project("gpu-host.yml", env, Site(host.address, host), tmp / host.name)
            )
        run.start(projects, timeout_s=180)
        run.wait_serving(f"{head.address}:50051", timeout_s=180)
        services = {
            f"{s.site.address}/{name}": s for project in projects for name, s in project.items()
        }
        password = (Path(model_env["SECRETS_DIR"]) / "redis-password").read_text().strip()
        multi_host = MultiHost(head, gpu_hosts, services, run, tmp, password)
        _wait_for_worker(multi_host, f"{gpu_hosts[1].address}-standby")  # it starts last
        yield multi_host
    finally:
        run.stop()
        network.close()


def test_the_services_each_host_starts(multi_host: MultiHost) -> None:
    head, (gpu0, gpu1) = multi_host.head.address, [h.address for h in multi_host.gpu_hosts]
    assert set(multi_host.services) == {
        f"{head}/redis",
        f"{head}/router",
        f"{head}/scheduler",
        f"{head}/prometheus-targets",
        f"{gpu0}/worker-0",
        f"{gpu1}/worker-0",
        f"{gpu1}/worker-standby",
    }


def test_generate_through_the_head(multi_host: MultiHost) -> None:
    with grpc.insecure_channel(f"{multi_host.head.address}:50051") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for prompt in ([5, 9, 33, 2, 70], list(range(1, 40))):
            token_ids = []
            for chunk in stub.Generate(greedy_request(prompt, 8), timeout=120):
                token_ids += chunk.token_ids
            assert len(token_ids) == 8


def _workers(multi_host: MultiHost) -> dict[str, dict]:
    client = redis.Redis(
        host=multi_host.head.address,
        port=6379,
        username="pagemesh",
        password=multi_host.redis_password,
        decode_responses=True,
    )
    try:
        return {
            key.rsplit(":", 1)[1]: json.loads(client.get(key))
            for key in client.scan_iter(f"{CLUSTER}:worker:*")
        }
    finally:
        client.close()


def _wait_for_worker(multi_host: MultiHost, worker_id: str, timeout_s: float = 60.0) -> None:
    def registered() -> bool:
        multi_host.run.check_alive()
        return worker_id in _workers(multi_host)

    eventually(
        registered,
        timeout_s,
        lambda: f"{worker_id} never registered\n{multi_host.run.log_tails()}",
        interval_s=0.3,
    )


def test_workers_advertise_host_ip_and_the_standby_waits(multi_host: MultiHost) -> None:
    gpu0, gpu1 = [h.address for h in multi_host.gpu_hosts]
    workers = _workers(multi_host)
    assert workers[f"{gpu0}-worker-0"]["address"] == f"{gpu0}:50070"
    assert workers[f"{gpu1}-worker-0"]["tp_rank"] == 1
    standby = workers[f"{gpu1}-standby"]
    assert standby["status"] == "standby" and standby["address"] == f"{gpu1}:50079"


def test_prometheus_targets_follow_the_registry(multi_host: MultiHost) -> None:
    """head.yml's prometheus-targets service writes every service's metrics address into
    the volume Prometheus reads, the GPU hosts' workers at HOST_IP:9102."""
    gpu0, gpu1 = [h.address for h in multi_host.gpu_hosts]
    path = multi_host.run_dir / "head" / "volumes" / "prometheus-targets" / "pagemesh.json"
    expected = {f"{gpu0}:9102", f"{gpu1}:9102", f"{gpu1}:9111", f"{multi_host.head.address}:9101"}

    def targets() -> set[str]:
        if not path.exists():
            return set()
        return {t for group in json.loads(path.read_text()) for t in group["targets"]}

    eventually(
        lambda: expected <= targets(),
        20,
        lambda: f"targets {sorted(targets())} lack {sorted(expected - targets())}",
        interval_s=0.5,
    )


def test_healthchecks_pass(multi_host: MultiHost) -> None:
    for label, service in multi_host.services.items():
        if service.healthcheck is not None:
            done = run_healthcheck(service)
            assert done.returncode == 0, f"{label}: {done.stdout} {done.stderr}"
