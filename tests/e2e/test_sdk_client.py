"""`pagemesh.api.sdk.Client` / `AsyncClient` against a real mesh with an API key and mutual TLS,
and a second router on the same engine group: the client's answers equal the raw gRPC
stub's, its errors are typed, and a stream whose router is SIGKILLed mid-answer continues on
the other router (or the same one, restarted) with exactly the undisturbed run's tokens."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.api.sampling_params import SamplingParams
from pagemesh.api.sdk import (
    AsyncClient,
    Client,
    Completion,
    InvalidArgument,
    NotFound,
    Unauthenticated,
    Unavailable,
)
from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.tls import TlsConfig
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from tests.support.eventually import eventually
from tests.support.mesh_harness import (
    Mesh,
    alive,
    entries,
    greedy_request,
    router_process,
)
from tests.support.tls_certs import CertFiles, make_certs

CLUSTER = "e2e-sdk"
KEY = "sk-sdk-test"
AUTH = [("authorization", f"Bearer {KEY}")]
PROMPT_IDS = [5, 6, 7, 8, 9, 10]
MAX_TOKENS = 160
# Seeded sampling with the filters on, two samples, logprobs: the hardest stream to splice.
SAMPLED = SamplingParams(
    n=2, seed=11, temperature=1.0, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2
)


@dataclass
class SdkMesh:
    mesh: Mesh  # `pagemesh up`: restarts its router when it is killed
    second: str  # another router's address, on the same engine group
    redis_url: str
    tls: TlsConfig  # the client's: certificate, key and the CA

    def client(self, *addresses: str, **kwargs: object) -> Client:
        return Client(
            list(addresses) or [self.mesh.address],
            api_key=KEY,
            tls=self.tls,
            timeout_s=120,
            **kwargs,
        )

    def async_client(self, *addresses: str) -> AsyncClient:
        return AsyncClient(
            list(addresses) or [self.mesh.address], api_key=KEY, tls=self.tls, timeout_s=120
        )

    def stub(self, channel: grpc.Channel) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(channel)

    def kill_first_router(self) -> None:
        """SIGKILL to `pagemesh up`'s router; returns at once (it restarts it meanwhile)."""
        argv_tail = f"--port\0{self.mesh.port}\0".encode()
        routers = []
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes()
            except OSError:  # not a process, or it just ended
                continue
            if b"router.main\0" in argv and argv_tail in argv and alive(int(proc.name)):
                routers.append(int(proc.name))
        assert len(routers) == 1, (routers, self.mesh.log())
        os.kill(routers[0], signal.SIGKILL)

    def wait_first_router(self) -> None:
        with self.tls.channel(self.mesh.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            eventually(
                lambda: (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ),
                120,
                self.mesh.log,
                interval_s=0.2,
                ignoring=(grpc.RpcError,),
            )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def sdk_mesh(
    certs: CertFiles, tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SdkMesh]:
    logs = tmp_path_factory.mktemp("logs")
    flags = ["--api-key", KEY, *certs.server_tls().flags()]
    mesh = Mesh(
        str(tiny_llama_dir),
        logs / "sdk-mesh.log",
        redis_url=redis_url,
        cluster=CLUSTER,
        client_tls=certs.client_tls(),
        extra_args=["--num-kv-blocks", "256", *flags],
    )
    try:
        mesh.wait_ready()
        with router_process(
            tiny_llama_dir, redis_url, CLUSTER, logs / "second-router.log", *flags
        ) as second:

            def registered() -> str | None:
                found = [
                    e["address"]
                    for e in entries(redis_url, CLUSTER, "router").values()
                    if e.get("pid") == second.process.pid
                ]
                return found[0] if found else None

            port = eventually(registered, 60, second.log, interval_s=0.3).rsplit(":", 1)[1]
            address = f"127.0.0.1:{port}"
            sdk = SdkMesh(mesh, address, redis_url, certs.client_tls())
            with sdk.client(address) as client:  # the second router serves too
                eventually(
                    lambda: client.generate(PROMPT_IDS, max_tokens=1).token_ids,
                    60,
                    second.log,
                    interval_s=0.3,
                    ignoring=(Unavailable,),
                )
            yield sdk
    finally:
        mesh.stop()


def raw(sdk: SdkMesh, request: generate_pb2.GenerateRequest) -> list[generate_pb2.GenerateResponse]:
    with sdk.tls.channel(sdk.mesh.address) as channel:
        return list(sdk.stub(channel).Generate(request, metadata=AUTH, timeout=120))


def test_answers_equal_the_raw_stubs(sdk_mesh: SdkMesh) -> None:
    request = greedy_request(PROMPT_IDS, 12, logprobs=2)
    expected = raw(sdk_mesh, request)
    with sdk_mesh.client() as client:
        completion = client.generate(
            PROMPT_IDS, temperature=0, max_tokens=12, ignore_eos=True, logprobs=2
        )
        chunks = list(
            client.stream(
                PROMPT_IDS,
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
            )
        )
        assert completion.token_ids == [t for pb in expected for t in pb.token_ids]
        assert completion.text == "".join(pb.text for pb in expected)
        assert [
            (lp.token_id, lp.logprob, [t.token_id for t in lp.top]) for lp in completion.logprobs
        ] == [
            (lp.token_id, lp.logprob, [t.token_id for t in lp.top])
            for pb in expected
            for lp in pb.logprobs
        ]
        assert completion.finish_reason == "length" and completion.num_resumes == 0
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
            expected[-1].usage.prompt_tokens,
            expected[-1].usage.completion_tokens,
        )
        assert [c.token_ids for c in chunks] == [list(pb.token_ids) for pb in expected]
        assert chunks[-1].usage == completion.usage and chunks[0].request_id.startswith("pm-")

        with sdk_mesh.tls.channel(sdk_mesh.mesh.address) as channel:
            stub = sdk_mesh.stub(channel)
            for chat in (False, True):
                want = stub.Tokenize(
                    generate_pb2.TokenizeRequest(text="Hello there", apply_chat_template=chat),
                    metadata=AUTH,
                    timeout=30,
                )
                got = client.tokenize("Hello there", chat=chat)
                assert (got.token_ids, got.tokens) == (list(want.token_ids), list(want.tokens))
            info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=AUTH, timeout=30)
        got_info = client.model_info()
        tls = sdk_mesh.tls
        with Client(
            sdk_mesh.mesh.address,
            api_key=KEY,
            ca_path=tls.ca_path,
            cert_path=tls.cert_path,
            key_path=tls.key_path,
        ) as by_paths:
            assert by_paths.model_info() == got_info
        assert (
            got_info.model,
            got_info.vocab_size,
            got_info.max_model_len,
            got_info.num_replicas,
        ) == (info.model, info.vocab_size, info.max_model_len, info.layout.num_replicas)

        chat_request = greedy_request([1], 6)
        chat_request.ClearField("token_ids")
        chat_request.text, chat_request.apply_chat_template = "Say hi", True
        want_chat = [t for pb in raw(sdk_mesh, chat_request) for t in pb.token_ids]
        assert (
            client.chat(
                [{"role": "user", "content": "Say hi"}],
                temperature=0,
                max_tokens=6,
                ignore_eos=True,
            ).token_ids
            == want_chat
        )


def test_n_samples_equal_the_raw_stubs(sdk_mesh: SdkMesh) -> None:
    request = greedy_request(PROMPT_IDS, 10, n=2)
    request.sampling.temperature, request.sampling.seed = 1.0, 3
    expected = raw(sdk_mesh, request)
    with sdk_mesh.client() as client:
        completion = client.generate(
            PROMPT_IDS, n=2, seed=3, temperature=1.0, max_tokens=10, ignore_eos=True
        )
    for index in (0, 1):
        assert completion.outputs[index].token_ids == [
            t for pb in expected if pb.index == index for t in pb.token_ids
        ]
        assert len(completion.outputs[index].token_ids) == 10
    assert completion.outputs[0].token_ids != completion.outputs[1].token_ids
    assert completion.usage.completion_tokens == 20


def test_errors_are_typed(sdk_mesh: SdkMesh) -> None:
    with Client(sdk_mesh.mesh.address, tls=sdk_mesh.tls) as keyless:
        with pytest.raises(Unauthenticated, match="requires an API key"):
            keyless.generate(PROMPT_IDS, max_tokens=2)
        with pytest.raises(Unauthenticated):
            keyless.model_info()
    with sdk_mesh.client() as client:
        with pytest.raises(InvalidArgument) as caught:  # the router's check: needs the model
            client.generate(PROMPT_IDS, max_tokens=2, stop_token_ids=[10**6])
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "stop token id 1000000" in caught.value.details
        with pytest.raises(InvalidArgument, match="temperature"):  # SamplingParams' check
            client.generate(PROMPT_IDS, temperature=-1)
        with pytest.raises(InvalidArgument, match="one user message"):
            client.chat(
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
            )
        with pytest.raises(NotFound, match="no checkpoint"):
            list(client.resume("pm-never-sent", 3))
    no_cert = Client(sdk_mesh.mesh.address, api_key=KEY, ca_path=sdk_mesh.tls.ca_path)
    with no_cert, pytest.raises(Unavailable):  # mutual TLS: the router wants a certificate
        no_cert.model_info()
    with Client(f"127.0.0.1:{reserve_port()}", timeout_s=10) as nobody:
        with pytest.raises(Unavailable):
            nobody.generate(PROMPT_IDS, max_tokens=2)
        with pytest.raises(Unavailable):
            nobody.tokenize("hi")


def test_a_stream_left_by_its_client_is_resumed_by_another(sdk_mesh: SdkMesh) -> None:
    """A client process that dies mid-stream (here: closes it) loses nothing: another one
    resumes the request by its id and the count of tokens the first one had."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    with sdk_mesh.client() as client:
        want = client.generate(PROMPT_IDS, params)
        stream = client.stream(PROMPT_IDS, params)
        first = [next(stream) for _ in range(5)]
        stream.close()  # cancels the call; the checkpoint stays for the resume window
    with sdk_mesh.client(sdk_mesh.second) as other:
        rest = other.resume(stream.request_id, 5).collect()
    assert [t for c in first for t in c.token_ids] + rest.token_ids == want.token_ids
    assert "".join(c.text for c in first) + rest.text == want.text
    assert rest.finish_reason == "length" and rest.usage == want.usage


def test_the_async_client_answers_as_the_sync_one(sdk_mesh: SdkMesh) -> None:
    with sdk_mesh.client() as client:
        want = client.generate(PROMPT_IDS, temperature=0, max_tokens=12, ignore_eos=True, n=2)
        want_tokens = client.tokenize("Hello there", chat=True)
        want_info = client.model_info()

    async def run() -> None:
        async with sdk_mesh.async_client() as client:
            got = await client.generate(
                PROMPT_IDS, temperature=0, max_tokens=12, ignore_eos=True, n=2
            )
            assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
            assert [o.text for o in got.outputs] == [o.text for o in want.outputs]
            assert got.usage == want.usage
            assert await client.tokenize("Hello there", chat=True) == want_tokens
            assert await client.model_info() == want_info
            chat = await client.chat("Say hi", temperature=0, max_tokens=4, ignore_eos=True)
            assert len(chat.token_ids) == 4
            with pytest.raises(InvalidArgument, match="stop token id"):
                await client.generate(PROMPT_IDS, stop_token_ids=[10**6])
            with pytest.raises(NotFound):
                async for _ in client.resume("pm-never-sent", 2):
                    pass
        async with AsyncClient(sdk_mesh.mesh.address, tls=sdk_mesh.tls) as keyless:
            with pytest.raises(Unauthenticated):
                await keyless.model_info()
            with pytest.raises(Unauthenticated):
                await keyless.generate(PROMPT_IDS, max_tokens=2)

    asyncio.run(run())


def undisturbed(sdk: SdkMesh) -> Completion:
    with sdk.client() as client:
        return client.generate(PROMPT_IDS, SAMPLED)


def assert_same(got: Completion, want: Completion) -> None:
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert len(g.token_ids) == MAX_TOKENS
        for a, b in zip(g.logprobs, w.logprobs, strict=True):  # recomputed after the resume
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    assert got.usage == want.usage


def test_a_stream_whose_router_dies_continues_on_the_other_router(sdk_mesh: SdkMesh) -> None:
    want = undisturbed(sdk_mesh)
    got, killed_at = Completion.empty("", 2), None
    with sdk_mesh.client(sdk_mesh.mesh.address, sdk_mesh.second) as client:
        stream = client.stream(PROMPT_IDS, SAMPLED)  # a new client's first stream: address 0
        for chunk in stream:
            got.add(chunk)
            if killed_at is None and len(got.outputs[0].token_ids) == 8:
                sdk_mesh.kill_first_router()  # the client reads on: what was sent is its
                killed_at = [len(o.token_ids) for o in got.outputs]
    sdk_mesh.wait_first_router()
    print(
        f"killed the router with {killed_at} tokens per sample received, "
        f"{stream.num_resumes} resume(s)"
    )
    assert stream.num_resumes >= 1, "the router died mid-stream and the stream was resumed"
    assert_same(got, want)


def test_an_async_stream_waits_for_its_only_router_to_restart(sdk_mesh: SdkMesh) -> None:
    want = undisturbed(sdk_mesh)

    async def run() -> tuple[Completion, int]:
        got, killed = Completion.empty("", 2), False
        async with sdk_mesh.async_client() as client:
            stream = client.stream(PROMPT_IDS, SAMPLED)
            async for chunk in stream:
                got.add(chunk)
                if not killed and len(got.outputs[1].token_ids) == 8:
                    sdk_mesh.kill_first_router()
                    killed = True
            return got, stream.num_resumes

    got, num_resumes = asyncio.run(run())
    assert num_resumes >= 1
    assert_same(got, want)
