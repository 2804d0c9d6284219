"""API keys, TLS with client certificates (mTLS) on every service, and the router's admission
limits, against a real mesh: `pagemesh up` with `--tls-*` and `--api-key`."""

from __future__ import annotations

import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.tls import TlsConfig
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from tests.support.eventually import eventually
from tests.support.mesh_harness import REPO_ROOT, Mesh, greedy_request, router_process
from tests.support.tls_certs import CertFiles, make_certs

CLUSTER = "e2e-security"
KEY = "sk-test-key"
AUTH = [("authorization", f"Bearer {KEY}")]
PROMPT_IDS = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secure_mesh(
    certs: CertFiles, tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Mesh, int]]:
    http_port = reserve_port()
    mesh = Mesh(
        str(tiny_llama_dir),
        tmp_path_factory.mktemp("logs") / "secure-mesh.log",
        redis_url=redis_url,
        cluster=CLUSTER,
        client_tls=certs.client_tls(),
        extra_args=[
            "--num-kv-blocks",
            "64",
            "--http-port",
            str(http_port),
            "--api-key",
            KEY,
            *certs.server_tls().flags(),
        ],
    )
    try:
        yield mesh.wait_ready(), http_port
    finally:
        mesh.stop()


def _generate(
    stub: generate_pb2_grpc.GenerationStub, metadata: list[tuple[str, str]] | None
) -> list[int]:
    token_ids: list[int] = []
    for chunk in stub.Generate(greedy_request(PROMPT_IDS, 4), metadata=metadata, timeout=60):
        token_ids.extend(chunk.token_ids)
    return token_ids


def test_grpc_needs_the_right_key(secure_mesh: tuple[Mesh, int]) -> None:
    mesh, _ = secure_mesh
    for metadata, expected in (
        (None, "requires an API key"),
        ([("authorization", "Bearer wrong")], "not valid"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            _generate(mesh.stub, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert expected in info.value.details() and "authorization: Bearer" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(_generate(mesh.stub, AUTH)) == 4  # over mTLS, through mTLS scheduler and worker
    health = health_pb2_grpc.HealthStub(mesh.channel)  # health stays open
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        == health_pb2.HealthCheckResponse.SERVING
    )


def test_pagemesh_generate_sends_key_over_mtls(
    secure_mesh: tuple[Mesh, int], certs: CertFiles
) -> None:
    mesh, _ = secure_mesh
    argv = [
        sys.executable,
        "-m",
        "pagemesh.tools.cli",
        "generate",
        "hello",
        "--address",
        mesh.address,
        "--max-tokens",
        "3",
        *certs.client_tls().flags(),
    ]
    ok = subprocess.run(
        [*argv, "--api-key", KEY], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    denied = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert denied.returncode == 2 and "UNAUTHENTICATED" in denied.stderr


def test_plaintext_and_certless_clients_fail(
    secure_mesh: tuple[Mesh, int], certs: CertFiles
) -> None:
    mesh, _ = secure_mesh
    without_client_cert = TlsConfig(ca_path=str(certs.ca))
    for tls in (TlsConfig(), without_client_cert):
        with tls.channel(mesh.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=AUTH, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, tls


def test_public_tls_without_client_certs_beside_internal_mtls(
    secure_mesh: tuple[Mesh, int],
    certs: CertFiles,
    tiny_llama_dir: Path,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """A router that serves TLS to clients without certificates (`--tls-client-ca none`)
    while it dials the mesh's schedulers, which require client certificates, with its own."""
    with router_process(
        tiny_llama_dir,
        redis_url,
        CLUSTER,
        tmp_path / "public-router.log",
        *certs.server_tls().flags(),
        "--tls-client-ca",
        "none",
        "--api-keys-file",
        str(_keys_file(tmp_path)),
    ) as router:
        public = TlsConfig(ca_path=str(certs.ca))  # TLS, but no client certificate
        with public.channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            eventually(lambda: _serves(stub), 60, "the public router never served")
            assert len(_generate(stub, AUTH)) == 4
        with TlsConfig().channel(router.address) as plaintext:  # TLS it is, still
            with pytest.raises(grpc.RpcError) as info:
                generate_pb2_grpc.GenerationStub(plaintext).GetModelInfo(
                    generate_pb2.GetModelInfoRequest(), metadata=AUTH, timeout=5
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def _keys_file(folder: Path) -> Path:
    path = folder / "keys"
    path.write_text(KEY + "\n")
    return path


def _serves(stub: generate_pb2_grpc.GenerationStub) -> bool:
    try:
        return len(_generate(stub, AUTH)) == 4
    except grpc.RpcError:
        return False


def test_http_needs_key_and_client_cert(secure_mesh: tuple[Mesh, int], certs: CertFiles) -> None:
    # The HTTP port follows the gRPC port's rule: with --tls-ca, client certificates are required.
    _, http_port = secure_mesh
    url = f"https://127.0.0.1:{http_port}"
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    with httpx.Client(verify=context, timeout=60) as http:
        # The HTTP server starts just after gRPC health; /health is open without a key.
        assert (
            eventually(
                lambda: http.get(f"{url}/health"),
                30,
                "the HTTP server never answered",
                interval_s=0.3,
                ignoring=(httpx.TransportError,),
            ).status_code
            == 200
        )
        response = http.get(f"{url}/v1/models")
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, http_client=http)
        result = client.completions.create(
            model="tiny-llama",
            prompt=PROMPT_IDS,
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert result.usage.completion_tokens == 4
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, http_client=http)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    certless = ssl.create_default_context(cafile=str(certs.ca))
    with httpx.Client(verify=certless, timeout=10) as http, pytest.raises(httpx.TransportError):
        http.get(f"{url}/health")


@pytest.fixture(scope="module")
def limited_router(
    secure_mesh: tuple[Mesh, int],
    certs: CertFiles,
    tiny_llama_dir: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[grpc.Channel]:
    """A second router on the secure mesh: one request in flight, prompts up to 8 tokens."""
    port = reserve_port()
    log_path = tmp_path_factory.mktemp("logs") / "limited-router.log"
    log = open(log_path, "wb")
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.main",
            "--model",
            str(tiny_llama_dir),
            "--port",
            str(port),
            "--http-port",
            "0",
            "--redis-url",
            redis_url,
            "--cluster",
            CLUSTER,
            "--log-level",
            "WARNING",
            "--max-queued-requests",
            "1",
            "--max-prompt-tokens",
            "8",
            *certs.server_tls().flags(),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
    )
    channel = certs.client_tls().channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            assert router.poll() is None, log_path.read_text()
            return (
                health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                == health_pb2.HealthCheckResponse.SERVING
            )

        eventually(serving, 60, log_path.read_text, interval_s=0.3, ignoring=(grpc.RpcError,))
        yield channel
    finally:
        channel.close()
        router.terminate()
        assert router.wait(timeout=30) == 0, log_path.read_text()
        log.close()


def test_queue_limit_and_prompt_limit(limited_router: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerationStub(limited_router)
    held = stub.Generate(greedy_request(PROMPT_IDS, 480), timeout=120)
    try:
        next(held)  # the first token: this request is in flight until cancelled
        with pytest.raises(grpc.RpcError) as info:
            _generate(stub, None)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-requests 1" in info.value.details()
    finally:
        held.cancel()

    def admitted() -> list | None:  # the slot frees as soon as the router sees the cancellation
        try:
            return _generate(stub, None)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            return None

    assert len(eventually(admitted, 10, "the cancelled request's slot never freed")) == 4
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(greedy_request(list(range(5, 14)), 2), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-prompt-tokens" in info.value.details()
