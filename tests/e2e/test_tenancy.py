"""Tenants that cannot see each other (docs/security.md), on a real mesh with two API keys:
a request id is scoped to the key that sent it, so another key naming it reaches nothing,
over gRPC and over HTTP; and a client reusing its own id for another request is refused
instead of being replayed the old answer.

The mesh keeps its registry in a Redis as a shared mesh would: an ACL user with a password
(given in a file, as a compose or Kubernetes secret is), over TLS (`rediss://`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from pagemesh.runtime.checkpoints import ORPHANED
from pagemesh.runtime.config import with_password
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.admin import AdminClient
from pagemesh.tools.embedded_valkey import EmbeddedValkey
from protos.pagemesh.v1 import generate_pb2
from tests.support.eventually import eventually
from tests.support.mesh_harness import Mesh, greedy_request
from tests.support.mesh_ids import mesh_request_id, redis_checkpoint
from tests.support.tls_certs import make_certs
from tests.support.tls_proxy import TlsProxy

CLUSTER = "e2e-tenancy"
KEY_A, KEY_B = "sk-team-a", "sk-team-b"
KEY_C = "sk-team-c-from-the-environment"
KEY_OPS = "sk-operators"  # an admin key
PROMPT_A = [5, 6, 7, 8, 9]
PROMPT_B = [11, 12, 13]
LONG = 48  # tokens: a stream that is still running while the other tenant calls
# An orphaned stream's length: still running when its client goes away. (A router deletes a
# finished request's checkpoint once its tokens are in gRPC's buffers: 48 tokens of the tiny
# model were all computed before a client that read 3 could cancel, on a fast Xeon.)
ORPHANED_LEN = 8 * LONG
PER_KEY = 3  # --max-requests-per-key


def auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A Valkey that needs its user's password, behind TLS: (its URL without the password,
    the password). The mesh trusts the test CA through the URL's `ssl_ca_certs`."""
    certs = make_certs(tmp_path_factory.mktemp("redis-certs"))
    valkey = EmbeddedValkey(reserve_port()).start()
    try:
        with TlsProxy(("127.0.0.1", valkey.port), certs.server_cert, certs.server_key) as proxy:
            yield (
                f"rediss://pagemesh@127.0.0.1:{proxy.port}/0?ssl_ca_certs={certs.ca}",
                valkey.password,
            )
    finally:
        valkey.stop()


@pytest.fixture(scope="module")
def redis_url(locked_redis: tuple[str, str]) -> str:
    """This module's Redis (not the session's plain one), password included."""
    return with_password(*locked_redis)


@pytest.fixture(scope="module")
def mesh(
    tiny_llama_dir: Path, locked_redis: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Mesh, str]]:
    folder = tmp_path_factory.mktemp("tenancy")
    url, password = locked_redis
    password_file = folder / "redis_password"
    password_file.write_text(password + "\n")
    keys_file = folder / "keys"
    keys_file.write_text(
        f"# two teams and their operators\n{KEY_A}\n{KEY_B} inference\n{KEY_OPS} admin\n"
    )
    http_port = reserve_port()
    mesh = Mesh(
        str(tiny_llama_dir),
        folder / "mesh.log",
        cluster=CLUSTER,
        extra_args=[
            "--num-kv-blocks",
            "96",
            "--http-port",
            str(http_port),
            "--api-keys-file",
            str(keys_file),
            "--log-level",
            "INFO",
            "--max-requests-per-key",
            str(PER_KEY),
        ],
        env={
            "PAGEMESH_API_KEY": KEY_C,
            "PAGEMESH_REDIS_URL": url,
            "PAGEMESH_REDIS_PASSWORD_FILE": str(password_file),
        },
    )
    try:
        yield mesh.wait_ready(), f"http://127.0.0.1:{http_port}"
    finally:
        mesh.stop()


def tokens(mesh: Mesh, request: generate_pb2.GenerateRequest, key: str) -> list[int]:
    return [
        t
        for chunk in mesh.stub.Generate(request, metadata=auth(key), timeout=120)
        for t in chunk.token_ids
    ]


def orphan(mesh: Mesh, redis_url: str, request_id: str, key: str, num_tokens: int) -> list[int]:
    """Starts `request_id` as `key`, reads `num_tokens` and goes away: its checkpoint stays
    for the resume window. Returns the tokens received."""
    stream = mesh.stub.Generate(
        greedy_request(PROMPT_A, ORPHANED_LEN, request_id=request_id),
        metadata=auth(key),
        timeout=120,
    )
    received: list[int] = []
    for chunk in stream:
        received.extend(chunk.token_ids)
        if len(received) >= num_tokens:
            break
    stream.cancel()
    mesh_id = mesh_request_id(redis_url, CLUSTER, request_id, key)
    eventually(
        lambda: (
            (c := redis_checkpoint(redis_url, CLUSTER, mesh_id)) is not None and c.state == ORPHANED
        ),
        30,
        f"{request_id}'s checkpoint was never orphaned",
    )
    return received


def orphan_http(http: str, redis_url: str, request_id: str, key: str) -> None:
    """As `orphan`, over HTTP: a streamed completion left after its first event."""
    # Long enough to be running still when the router notices the client left (an HTTP
    # client's leaving is seen only at the next write, or the next read of the socket).
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT_A,
        "max_tokens": ORPHANED_LEN,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{http}/v1/completions",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {key}", "X-Request-Id": request_id},
    ) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        next(lines)
    mesh_id = mesh_request_id(redis_url, CLUSTER, "cmpl-" + request_id, key)  # HTTP ids: prefixed
    eventually(
        lambda: (
            (c := redis_checkpoint(redis_url, CLUSTER, mesh_id)) is not None and c.state == ORPHANED
        ),
        30,
        f"{request_id}'s checkpoint was never orphaned",
    )


def test_another_key_cannot_resume_or_replay_an_orphaned_request(
    mesh: tuple[Mesh, str], redis_url: str
) -> None:
    grpc_mesh, http = mesh
    whole_a = tokens(grpc_mesh, greedy_request(PROMPT_A, ORPHANED_LEN), KEY_A)
    whole_b = tokens(grpc_mesh, greedy_request(PROMPT_B, 6), KEY_B)
    received = orphan(grpc_mesh, redis_url, "job-a", KEY_A, 4)

    # B resuming A's id: exactly as for an id nobody used (NOT_FOUND, 404).
    with pytest.raises(grpc.RpcError) as info:
        tokens(grpc_mesh, generate_pb2.GenerateRequest(request_id="job-a", resume_from=2), KEY_B)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    orphan_http(http, redis_url, "job-a-http", KEY_A)
    headers = {"Authorization": f"Bearer {KEY_B}", "X-Request-Id": "job-a-http"}
    reply = httpx.post(
        f"{http}/v1/completions",
        timeout=60,
        headers={**headers, "X-Resume-From": "1"},
        json={"model": "tiny-llama", "prompt": PROMPT_A, "max_tokens": LONG},
    )
    assert reply.status_code == 404, reply.text
    # X-Resume-From 0 with no checkpoint of the caller's starts the request: B's own.
    reply = httpx.post(
        f"{http}/v1/completions",
        timeout=60,
        headers={**headers, "X-Resume-From": "0"},
        json={
            "model": "tiny-llama",
            "prompt": PROMPT_B,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == whole_b
    # B sending A's id as a new request (resume_from 0) gets its own answer, not A's.
    assert tokens(grpc_mesh, greedy_request(PROMPT_B, 6, request_id="job-a"), KEY_B) == whole_b

    # A's checkpoint is untouched: A resumes and gets the undisturbed run's rest.
    rest = tokens(
        grpc_mesh,
        generate_pb2.GenerateRequest(request_id="job-a", resume_from=len(received)),
        KEY_A,
    )
    assert received + rest == whole_a


def test_another_key_naming_a_running_stream_gets_its_own_request(mesh: tuple[Mesh, str]) -> None:
    grpc_mesh, http = mesh
    whole_b = tokens(grpc_mesh, greedy_request(PROMPT_B, 6), KEY_B)
    stream = grpc_mesh.stub.Generate(
        greedy_request(PROMPT_A, LONG, request_id="live-a"), metadata=auth(KEY_A), timeout=120
    )
    first = next(stream)  # A's stream is running now
    assert first.token_ids
    # Not ALREADY_EXISTS (which says the id exists), not a 500: B's own new request.
    assert tokens(grpc_mesh, greedy_request(PROMPT_B, 6, request_id="live-a"), KEY_B) == whole_b
    reply = httpx.post(
        f"{http}/v1/completions",
        timeout=60,
        json={
            "model": "tiny-llama",
            "prompt": PROMPT_B,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        headers={"Authorization": f"Bearer {KEY_B}", "X-Request-Id": "live-a"},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == whole_b
    stream.cancel()


def test_reusing_ones_own_id_for_another_request_is_refused(
    mesh: tuple[Mesh, str], redis_url: str
) -> None:
    grpc_mesh, http = mesh
    received = orphan(grpc_mesh, redis_url, "job-reused", KEY_A, 3)
    with pytest.raises(grpc.RpcError) as info:
        tokens(grpc_mesh, greedy_request(PROMPT_B, 6, request_id="job-reused"), KEY_A)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already taken by a different request" in info.value.details()
    orphan_http(http, redis_url, "job-reused-http", KEY_A)
    reply = httpx.post(
        f"{http}/v1/completions",
        timeout=60,
        json={"model": "tiny-llama", "prompt": PROMPT_B, "max_tokens": 6},
        headers={
            "Authorization": f"Bearer {KEY_A}",
            "X-Request-Id": "job-reused-http",
            "X-Resume-From": "0",
        },
    )
    assert reply.status_code == 409, reply.text
    assert reply.json()["error"]["code"] == "request_id_conflict"
    # The same request under the same id is a resume from nothing: the whole answer.
    again = tokens(
        grpc_mesh, greedy_request(PROMPT_A, ORPHANED_LEN, request_id="job-reused"), KEY_A
    )
    assert again[: len(received)] == received and len(again) == ORPHANED_LEN


def test_ones_own_running_stream_named_again_is_a_409_over_http(mesh: tuple[Mesh, str]) -> None:
    _, http = mesh
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Request-Id": "twice"}
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT_A,
        "max_tokens": 8 * LONG,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{http}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=60
    ) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the response
        assert next(lines).startswith("data:")  # its stream is running now
        reply = httpx.post(f"{http}/v1/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 409, reply.text  # was a 500
        assert "twice" in reply.json()["error"]["message"]


def _environment_value(pids: list[int], name: str) -> str:
    """The variable `name` of the first of `pids` that has it (children get secrets there)."""
    for pid in pids:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(name.encode() + b"="):
                return item.split(b"=", 1)[1].decode()
    raise AssertionError(f"no process has {name}")


def _tree(pid: int) -> list[int]:
    """`pid` and every process under it."""
    found, todo = [], [pid]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            pass
    return found


def test_no_secret_is_in_any_command_line_or_log_line(
    mesh: tuple[Mesh, str], locked_redis: tuple[str, str]
) -> None:
    grpc_mesh, _ = mesh
    assert (
        len(tokens(grpc_mesh, greedy_request(PROMPT_B, 2), KEY_C)) == 2
    )  # the environment's key works
    pids = _tree(grpc_mesh.process.pid)
    assert len(pids) >= 4  # up, its worker, scheduler and router
    internal_token = _environment_value(pids, "PAGEMESH_INTERNAL_TOKEN")  # `up` made it
    _, redis_password = locked_redis
    keys = (KEY_A, KEY_B, KEY_C, KEY_OPS, redis_password, internal_token)
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert not any(key in cmdline for key in keys), cmdline
    log = grpc_mesh.log_path.read_text(errors="replace")  # all of it
    assert "router config" in log  # the INFO line that used to print every key
    assert not any(key in log for key in keys)


def test_only_admin_keys_reach_the_admin_service(mesh: tuple[Mesh, str]) -> None:
    grpc_mesh, _ = mesh
    for key, code in (
        (KEY_A, grpc.StatusCode.PERMISSION_DENIED),
        (KEY_C, grpc.StatusCode.PERMISSION_DENIED),
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("sk-nobody", grpc.StatusCode.UNAUTHENTICATED),
    ):
        for call in (
            lambda c: c.memory(),
            lambda c: c.reset_prefix_cache(),
            lambda c: c.start_profile("x"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(AdminClient(grpc_mesh.channel, api_key=key))
            assert info.value.code() == code, (key, info.value.details())
    assert "admin" in info.value.details() or code == grpc.StatusCode.UNAUTHENTICATED
    admin = AdminClient(grpc_mesh.channel, api_key=KEY_OPS)
    assert admin.memory().groups[0].ranks
    assert len(tokens(grpc_mesh, greedy_request(PROMPT_B, 2), KEY_OPS)) == 2  # and inference


def test_input_gaps_are_clear_400s(mesh: tuple[Mesh, str]) -> None:
    grpc_mesh, http = mesh
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    base = '{"model": "tiny-llama", "prompt": "hello", "max_tokens": 2'
    for extra, expected in (
        (', "stop": ["' + "x" * 600 + '"]', "stop string 0 is 600 characters"),
        (', "stop": ["ok\\ud800"]', "stop string 0 is not valid Unicode"),  # a lone surrogate
        (', "priority": 10000000', "priority must be in"),
        (
            ', "structured_outputs": {"choice": ["' + "y" * 1_000_001 + '", "n"]}',
            "characters together",
        ),
        (', "structured_outputs": {"choice": ["yes", "no\\udc00"]}', "not valid Unicode"),
    ):
        reply = httpx.post(
            f"{http}/v1/completions", content=base + extra + "}", headers=headers, timeout=60
        )
        assert reply.status_code == 400, (extra[:40], reply.text[:300])
        assert expected in reply.json()["error"]["message"], reply.text[:300]
    request = greedy_request(PROMPT_B, 2, priority=-10_000_000)
    with pytest.raises(grpc.RpcError) as info:
        tokens(grpc_mesh, request, KEY_A)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(tokens(grpc_mesh, greedy_request(PROMPT_B, 2), KEY_A)) == 2  # still serving


def test_one_key_cannot_take_every_slot(mesh: tuple[Mesh, str]) -> None:
    grpc_mesh, http = mesh
    streams = [
        grpc_mesh.stub.Generate(
            greedy_request(PROMPT_A, 8 * LONG), metadata=auth(KEY_A), timeout=120
        )
        for _ in range(PER_KEY)
    ]
    try:
        for stream in streams:
            assert next(stream).token_ids  # all PER_KEY running
        with pytest.raises(grpc.RpcError) as info:
            tokens(grpc_mesh, greedy_request(PROMPT_B, 2), KEY_A)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-requests-per-key 3" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # tokenizing takes a slot too
            grpc_mesh.stub.Tokenize(
                generate_pb2.TokenizeRequest(text="hi"), metadata=auth(KEY_A), timeout=30
            )
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reply = httpx.post(
            f"{http}/v1/chat/completions",
            timeout=60,
            headers={"Authorization": f"Bearer {KEY_A}"},
            json={
                "model": "tiny-llama",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert reply.status_code == 429 and reply.headers["Retry-After"] == "1", reply.text
        # Another tenant is served meanwhile.
        assert len(tokens(grpc_mesh, greedy_request(PROMPT_B, 2), KEY_B)) == 2
    finally:
        for stream in streams:
            stream.cancel()
    eventually(lambda: _served(grpc_mesh, KEY_A), 30, "key A's slots were never given back")


def _served(mesh: Mesh, key: str) -> bool:
    try:
        return len(tokens(mesh, greedy_request(PROMPT_B, 2), key)) == 2
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
        return False


def test_tools_are_refused_by_size_before_rendering(mesh: tuple[Mesh, str]) -> None:
    _, http = mesh
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"f{i}",
                "description": "d" * 1000,
                "parameters": {"type": "object"},
            },
        }
        for i in range(1100)
    ]
    reply = httpx.post(
        f"{http}/v1/chat/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={
            "model": "tiny-llama",
            "max_tokens": 2,
            "tools": tools,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert reply.status_code == 400, reply.text[:300]
    assert "tools and tool calls are" in reply.json()["error"]["message"]


def test_schedulers_and_workers_answer_only_their_mesh(
    mesh: tuple[Mesh, str], redis_url: str
) -> None:
    from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
    from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc
    from tests.support.mesh_harness import entries, scheduler_stats_at

    (scheduler,) = entries(redis_url, CLUSTER, "scheduler").values()
    (worker,) = entries(redis_url, CLUSTER, "worker").values()
    wrong = [("x-pagemesh-internal-token", "guessed")]
    for metadata in (None, wrong):
        with grpc.insecure_channel(scheduler["address"]) as channel:
            with pytest.raises(grpc.RpcError) as info:
                scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                    scheduler_pb2.GetStatsRequest(), metadata=metadata, timeout=10
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(worker["address"]) as channel:
            with pytest.raises(grpc.RpcError) as info:
                worker_pb2_grpc.WorkerStub(channel).GetMemory(
                    worker_pb2.GetMemoryRequest(), metadata=metadata, timeout=10
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert scheduler_stats_at(scheduler["address"]).num_steps >= 0  # with the mesh's token
