"""A stream asking for top-5 logprobs, its router SIGKILLed after 8 tokens, resumed by
request id on the restarted router: the resumed tokens (replayed from the checkpoint, then
computed on) carry the logprobs the undisturbed run gave."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from grpc_health.v1 import health_pb2

from pagemesh.runtime.checkpoints import Checkpoint
from protos.pagemesh.v1 import generate_pb2
from tests.support.eventually import eventually
from tests.support.mesh_harness import (
    Mesh,
    alive,
    entries,
    greedy_request,
    health_status,
)
from tests.support.mesh_ids import mesh_request_id

CLUSTER = "e2e-resume-logprobs"
# Long enough that the request is still running when the checkpoint is read: a router hands
# a finished request's tokens to gRPC's buffers and deletes its checkpoint, and 64 tokens of
# the tiny model were all computed and buffered before the first read on a fast Xeon.
MAX_TOKENS = 256
NUM_LOGPROBS = 5
# Logprobs of tokens computed after the resume, against the undisturbed run's: the bound the
# suite holds the mesh to against transformers (docs/contributing.md, parity with transformers).
RECOMPUTED_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def mesh(
    tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("logs") / "resume-logprobs.log"
    mesh = Mesh(
        str(tiny_llama_dir),
        log,
        redis_url=redis_url,
        cluster=CLUSTER,
        extra_args=["--num-kv-blocks", "128"],
    )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def request(request_id: str) -> generate_pb2.GenerateRequest:
    return greedy_request(
        [3, 14, 15, 92, 65], MAX_TOKENS, logprobs=NUM_LOGPROBS, request_id=request_id
    )


def as_tuples(
    logprobs: list[generate_pb2.TokenLogprob],
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in logprobs]


def checkpoint(redis_url: str, request_id: str) -> Checkpoint | None:
    mesh_id = mesh_request_id(redis_url, CLUSTER, request_id)  # checkpoints are by the mesh's id
    raw = redis.Redis.from_url(redis_url).get(f"{CLUSTER}:ckpt:{mesh_id}")
    return Checkpoint.from_json(raw) if raw is not None else None


def router_pid(redis_url: str) -> int:
    pids = [e["pid"] for e in entries(redis_url, CLUSTER, "router").values() if alive(e["pid"])]
    assert pids, "no live router registered"
    return pids[0]


def test_resumed_tokens_carry_the_undisturbed_runs_logprobs(mesh: Mesh, redis_url: str) -> None:
    calm = mesh.generate(request("calm"))
    assert len(calm.token_ids) == MAX_TOKENS and len(calm.logprobs) == MAX_TOKENS

    received: list[generate_pb2.TokenLogprob] = []
    stream = mesh.stub.Generate(request("killed"), timeout=300)
    for chunk in stream:
        assert len(chunk.logprobs) == len(chunk.token_ids)
        received.extend(chunk.logprobs)
        if len(received) >= 8:
            break
    # The scheduler goes on while the client holds back: its checkpoint gets ahead of the client.
    eventually(
        lambda: (
            (c := checkpoint(redis_url, "killed")) and len(c.samples[0].token_ids) > len(received)
        ),
        60,
        "the checkpoint never got past what the client has",
    )
    os.kill(router_pid(redis_url), signal.SIGKILL)
    stream.cancel()
    eventually(
        lambda: health_status(mesh) == health_pb2.HealthCheckResponse.SERVING,
        60,
        "the restarted router serving",
    )
    num_received = len(received)
    stored = checkpoint(redis_url, "killed")
    num_checkpointed = len(stored.samples[0].token_ids)
    assert (
        stored.samples[0].logprobs is not None
        and len(stored.samples[0].logprobs) == num_checkpointed
    )

    resume = generate_pb2.GenerateRequest(request_id="killed", resume_from=num_received)
    for chunk in mesh.stub.Generate(resume, timeout=300):
        assert len(chunk.logprobs) == len(chunk.token_ids), "a resumed chunk without its logprobs"
        received.extend(chunk.logprobs)

    got, want = as_tuples(received), as_tuples(calm.logprobs)
    assert [t for t, _, _ in got] == calm.token_ids
    assert [[i for i, _ in top] for _, _, top in got] == [[i for i, _ in top] for _, _, top in want]
    # Up to the checkpoint (what the client had, then the replay) the very numbers of the
    # undisturbed run: the same decode steps computed them, the checkpoint kept them exactly.
    assert got[:num_checkpointed] == want[:num_checkpointed]
    replayed = got[num_received:num_checkpointed]
    assert [(lp, top) for _, lp, top in replayed] == [
        (lp, list(top)) for lp, top in stored.samples[0].logprobs[num_received:]
    ]
    # After it, tokens computed on a recomputed KV (one prefill over prompt + outputs, where
    # the undisturbed run decoded token by token): equal up to float32 summation order.
    worst = max(
        (
            abs(a - b)
            for (_, lp, top), (_, calm_lp, calm_top) in zip(
                got[num_checkpointed:], want[num_checkpointed:]
            )
            for a, b in zip([lp, *(x for _, x in top)], [calm_lp, *(x for _, x in calm_top)])
        ),
        default=0.0,
    )
    assert worst <= RECOMPUTED_TOLERANCE
    print(
        f"{num_received} tokens received, {num_checkpointed - num_received} replayed from the "
        f"checkpoint (equal), {MAX_TOKENS - num_checkpointed} computed after the resume "
        f"(worst logprob difference {worst:.1e})"
    )
