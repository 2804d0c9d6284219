"""The router's Admin service through real meshes: a prefix cache reset seen in the hit
counters, memory that adds up per rank, step statistics that grow, profiler traces written
per worker, the API key, two ranks of a tp=2 group; and `pagemesh top`, `health`, `admin`
and `profile` finding a local `pagemesh up` (embedded Valkey, default cluster) with no flags.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from pagemesh.tools.admin import AdminClient, profile
from pagemesh.tools.discovery import STATE_DIR_ENV, find_local_mesh
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import admin_pb2, generate_pb2
from tests.support.eventually import eventually
from tests.support.mesh_harness import REPO_ROOT, Mesh, greedy_request, scheduler_stats_at

KEY = "admin-test-key"
NUM_BLOCKS = 64
BLOCK_SIZE = 16
PROMPT = [(7 * i) % 200 + 3 for i in range(40)]  # 2 full blocks and a partial one


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mesh-state")


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles").resolve()


MAX_PROFILE_S = 4.0


@pytest.fixture(scope="module")
def meshes(
    tiny_llama_dir: Path,
    redis_url: str,
    state_dir: Path,
    profile_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Mesh, Mesh]]:
    """A one-worker mesh started as a new user would (no --redis-url: the embedded Valkey;
    the default cluster), announcing itself in its own state folder, its traces under
    `profile_root`; and a tp=2 mesh with an admin API key (in the environment, as a secret
    goes). Both start at once."""
    logs = tmp_path_factory.mktemp("logs")
    previous = os.environ.get(STATE_DIR_ENV)
    os.environ[STATE_DIR_ENV] = str(state_dir)  # what the `pagemesh up` process inherits
    try:
        local = Mesh(
            str(tiny_llama_dir),
            logs / "local.log",
            extra_args=[
                "--num-kv-blocks",
                str(NUM_BLOCKS),
                "--profile-dir",
                str(profile_root),
                "--max-profile-s",
                str(MAX_PROFILE_S),
            ],
        )
    finally:
        if previous is None:
            del os.environ[STATE_DIR_ENV]
        else:
            os.environ[STATE_DIR_ENV] = previous
    tp2 = Mesh(
        str(tiny_llama_dir),
        logs / "tp2.log",
        redis_url=redis_url,
        cluster="e2e-admin-tp2",
        extra_args=["--tp", "2", "--num-kv-blocks", "32"],
        env={"PAGEMESH_ADMIN_API_KEY": KEY},
    )
    try:
        yield local.wait_ready(), tp2.wait_ready()
    finally:
        local.stop()
        tp2.stop()


@pytest.fixture(scope="module")
def local(meshes: tuple[Mesh, Mesh]) -> Mesh:
    return meshes[0]


@pytest.fixture(scope="module")
def admin(local: Mesh) -> AdminClient:
    return AdminClient(local.channel)


def stats(state_dir: Path) -> scheduler_pb2.GetStatsResponse:
    """GetStats of the local mesh's scheduler, found in its registry."""
    mesh = find_local_mesh(folder=state_dir)
    assert mesh is not None
    client = redis.Redis.from_url(mesh.redis_url)
    try:
        raw = client.get(f"{mesh.cluster}:scheduler:g0")
    finally:
        client.close()
    assert raw is not None
    return scheduler_stats_at(json.loads(raw)["address"])


def run_cli(
    state_dir: Path, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEMESH_")}
    env[STATE_DIR_ENV] = str(state_dir)
    return subprocess.run(
        [sys.executable, "-m", "pagemesh.tools.cli", *args],
        cwd=cwd or REPO_ROOT,
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- the one-worker mesh -----------------------------------------------------------------


def test_commands_find_the_local_mesh_with_no_flags(
    local: Mesh, state_dir: Path, profile_root: Path, tmp_path: Path
) -> None:
    mesh = find_local_mesh(folder=state_dir)
    assert mesh is not None and mesh.cluster == "pagemesh"
    assert mesh.router_address == local.address and "6379" not in mesh.redis_url
    top = run_cli(state_dir, "top", "--once", "--interval", "0", "--format", "json")
    assert top.returncode == 0, top.stderr
    snapshot = json.loads(top.stdout)["snapshot"]
    assert [g["status"] for g in snapshot["groups"]] == ["ready"]
    (worker,) = snapshot["workers"]
    assert worker["weight_bytes"] > 0 and worker["kv_cache_bytes"] > 0 and worker["rss_bytes"] > 0
    health = run_cli(state_dir, "health")
    assert health.returncode == 0, health.stderr
    assert local.address in health.stderr and "SERVING" in health.stderr
    memory = run_cli(state_dir, "admin", "memory", "--format", "json")
    assert memory.returncode == 0, memory.stderr
    assert len(json.loads(memory.stdout)["groups"][0]["ranks"]) == 1
    table = run_cli(state_dir, "admin", "step-stats")
    assert table.returncode == 0 and "utilisation" in table.stdout, table.stderr
    traced = run_cli(
        state_dir,
        "profile",
        "--seconds",
        "0.5",
        "--out",
        "traces",
        "--format",
        "json",
        cwd=tmp_path,
    )
    assert traced.returncode == 0, traced.stderr
    (trace,) = json.loads(traced.stdout)["groups"][0]["traces"]
    assert Path(trace["path"]).parent == profile_root / "traces" and Path(trace["path"]).is_file()


def test_without_a_mesh_the_commands_say_what_they_tried(tmp_path: Path) -> None:
    top = run_cli(tmp_path, "top", "--once", "--interval", "0")
    assert top.returncode == 1
    assert "redis://127.0.0.1:6379/0 (the default; no local `pagemesh up`" in top.stderr
    assert str(tmp_path) in top.stderr


def test_reset_prefix_cache_makes_a_repeated_prompt_miss(
    local: Mesh, admin: AdminClient, state_dir: Path
) -> None:
    def hits_of_one_request() -> int:
        before = stats(state_dir).prefix_cache_hits
        local.generate(greedy_request(PROMPT, max_tokens=2))
        return stats(state_dir).prefix_cache_hits - before

    hits_of_one_request()
    assert hits_of_one_request() == 2 * BLOCK_SIZE  # the repeat finds both full blocks
    reply = admin.reset_prefix_cache()
    (group,) = reply.groups
    assert group.group == "g0" and not group.error
    assert group.num_blocks_dropped >= 2 and group.num_blocks_kept_in_use == 0
    assert stats(state_dir).num_cached_blocks == 0
    assert hits_of_one_request() == 0  # right after the reset: a miss
    assert hits_of_one_request() == 2 * BLOCK_SIZE  # and cached again


def test_memory_adds_up_while_a_request_runs(local: Mesh, admin: AdminClient) -> None:
    idle = admin.memory().groups[0]
    (rank,) = idle.ranks
    assert rank.num_kv_blocks == rank.num_allocated_kv_blocks == NUM_BLOCKS
    assert rank.num_used_kv_blocks == 0 and rank.num_free_kv_blocks == NUM_BLOCKS
    assert rank.kv_cache_bytes == NUM_BLOCKS * rank.kv_bytes_per_block > 0
    assert rank.weight_bytes > 0 and rank.rss_bytes > rank.weight_bytes
    assert rank.device == "cpu" and rank.worker_id
    # A long request holds blocks meanwhile: used + free is still the total.
    stream = local.stub.Generate(greedy_request(PROMPT, max_tokens=400), timeout=120)
    first = threading.Event()

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled below
            for _ in stream:
                first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(60)
    busy = admin.memory().groups[0]
    stream.cancel()
    reader.join(30)
    (rank,) = busy.ranks
    assert busy.num_running == 1
    assert rank.num_used_kv_blocks >= 3
    assert rank.num_used_kv_blocks + rank.num_free_kv_blocks == rank.num_kv_blocks
    assert rank.kv_cache_used_bytes == rank.num_used_kv_blocks * rank.kv_bytes_per_block


def test_step_stats_grow_with_requests(local: Mesh, admin: AdminClient) -> None:
    before = admin.step_stats(window_s=600).groups[0]
    local.generate(greedy_request(PROMPT[:10], max_tokens=8))
    after = admin.step_stats(window_s=600).groups[0]
    (was,), (now,) = before.ranks, after.ranks
    assert after.num_steps >= before.num_steps + 8
    assert now.num_steps >= was.num_steps + 8 and now.busy_s > was.busy_s
    assert now.window_num_steps >= 8 and now.window_busy_s > 0
    assert 0 < now.utilization <= 1 and now.collective_s == 0.0  # one rank: no collectives
    with pytest.raises(grpc.RpcError) as refused:
        admin.step_stats(window_s=7200)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_profile_writes_a_trace_per_worker(
    local: Mesh, admin: AdminClient, profile_root: Path
) -> None:
    def generate_while_tracing(seconds: float) -> None:
        local.generate(greedy_request(PROMPT[:8], max_tokens=4))

    reply = profile(admin, 0, "per-worker", sleep=generate_while_tracing)
    (group,) = reply.groups
    assert not group.error
    (trace,) = group.traces
    assert trace.num_steps >= 4 and trace.duration_s > 0
    assert Path(trace.path).parent == profile_root / "per-worker"
    events = json.loads(Path(trace.path).read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    stopped_twice = admin.stop_profile().groups[0]
    assert "no profiler trace is running" in stopped_twice.error


def test_traces_are_written_only_under_the_profile_dir(
    admin: AdminClient, profile_root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    for out_dir in (str(outside), "../escape", "a/../../escape"):
        (group,) = admin.start_profile(out_dir).groups
        assert "INVALID_ARGUMENT" in group.error and "--profile-dir" in group.error, group.error
    assert not outside.exists() and not (profile_root.parent / "escape").exists()
    (group,) = admin.stop_profile().groups
    assert "no profiler trace is running" in group.error  # none was started


def test_a_trace_nobody_stops_stops_itself(admin: AdminClient, profile_root: Path) -> None:
    (group,) = admin.start_profile("forgotten").groups
    assert not group.error
    eventually(
        lambda: any((profile_root / "forgotten").glob("*.json")),
        4 * MAX_PROFILE_S,
        "the trace never stopped itself",
    )
    (group,) = admin.stop_profile().groups
    assert "no profiler trace is running" in group.error


def test_an_unknown_group_is_not_found(admin: AdminClient) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        admin.memory(group="g9")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "g0" in refused.value.details()


# --- the tp=2 mesh with an API key -------------------------------------------------------


def test_tp2_reports_two_ranks_behind_the_api_key(meshes: tuple[Mesh, Mesh]) -> None:
    tp2 = meshes[1]
    with pytest.raises(grpc.RpcError) as refused:
        AdminClient(tp2.channel).memory()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError):
        AdminClient(tp2.channel, api_key="wrong").reset_prefix_cache()
    admin = AdminClient(tp2.channel, api_key=KEY)
    request = greedy_request(PROMPT[:12], max_tokens=4)
    list(tp2.stub.Generate(request, metadata=[("authorization", f"Bearer {KEY}")], timeout=120))
    memory = admin.memory().groups[0]
    assert [(r.pp_rank, r.tp_rank) for r in memory.ranks] == [(0, 0), (0, 1)]
    for rank in memory.ranks:
        assert rank.weight_bytes > 0 and rank.rss_bytes > 0
        assert rank.num_used_kv_blocks + rank.num_free_kv_blocks == rank.num_kv_blocks == 32
    assert len({r.worker_id for r in memory.ranks}) == 2
    steps = admin.step_stats().groups[0]
    assert [r.tp_rank for r in steps.ranks] == [0, 1]
    for rank in steps.ranks:
        assert rank.num_steps >= 4 and rank.collective_s > 0  # every layer all-reduces
        assert rank.window_communication_s > 0
    assert admin.reset_prefix_cache().groups[0].num_blocks_dropped >= 0


def test_admin_service_is_listed_by_reflection(local: Mesh) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(local.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert {"pagemesh.v1.Admin", "pagemesh.v1.Generation"} <= names
    assert admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name in names
    assert generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name in names
