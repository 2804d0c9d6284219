"""Where adapters live in a mesh of two engine groups that hold one adapter each
(`--replicas 2 --max-cpu-loras 1`): a run-time load goes where there is room, a request
goes to the group holding its adapter, and an adapter no live group holds (its holder's
scheduler was killed and came back empty) is loaded on demand from the cluster's table by
a group with room, with PEFT's tokens every time."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.tiny_lora import write_lora
from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.pagemesh.v1 import generate_pb2
from tests.e2e.test_lora_mesh import MAX_TOKENS, PROMPT, reference
from tests.support.eventually import eventually
from tests.support.mesh_harness import Mesh, scheduler_stats_at

CLUSTER = "e2e-lora-placement"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-placement")
    base = write_tiny_model(root / "base", "llama", seed=4)
    return {
        "base": base,
        "sql": write_lora(base, root / "sql", rank=8, seed=11),
        "chat": write_lora(
            base, root / "chat", rank=4, seed=12, target_modules=("q_proj", "v_proj", "down_proj")
        ),
    }


@pytest.fixture(scope="module")
def mesh(
    folders: dict[str, Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    http_port = reserve_port()
    mesh = Mesh(
        str(folders["base"]),
        tmp_path_factory.mktemp("logs") / "placement.log",
        redis_url=redis_url,
        cluster=CLUSTER,
        extra_args=[
            "--http-port",
            str(http_port),
            "--dtype",
            "float32",
            "--replicas",
            "2",
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-cpu-loras",
            "1",
        ],
    )
    mesh.http_url = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    try:
        mesh.wait_ready()
        eventually(lambda: len(schedulers(redis_url)) == 2, 120, mesh.log, interval_s=0.2)
        yield mesh
    finally:
        mesh.stop()


def schedulers(redis_url: str) -> dict[str, dict]:
    client = redis.Redis.from_url(redis_url)
    try:
        return {
            key.decode().rsplit(":", 1)[1]: json.loads(client.get(key))
            for key in client.scan_iter(f"{CLUSTER}:scheduler:*")
        }
    finally:
        client.close()


def holdings(redis_url: str) -> dict[str, list[str]]:
    return {group: entry["loras"] for group, entry in schedulers(redis_url).items()}


def completion(mesh: Mesh, model: str) -> list[int]:
    client = openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return reply.choices[0].token_ids  # type: ignore[attr-defined]


def load(mesh: Mesh, name: str, path: Path) -> None:
    reply = httpx.post(
        f"{mesh.http_url}/v1/load_lora_adapter",
        timeout=120,
        json={"lora_name": name, "lora_path": str(path)},
    )
    assert reply.status_code == 200, reply.text


def steps(redis_url: str) -> dict[str, int]:
    return {
        group: scheduler_stats_at(entry["address"]).num_steps
        for group, entry in schedulers(redis_url).items()
    }


def test_adapters_are_placed_routed_to_and_loaded_on_demand(
    mesh: Mesh, folders: dict[str, Path], redis_url: str
) -> None:
    # Both groups have room: both load the first adapter.
    load(mesh, "sql", folders["sql"])
    assert holdings(redis_url) == {"g0": ["sql"], "g1": ["sql"]}
    # Neither has room for the second: one group loads it, letting its first go.
    load(mesh, "chat", folders["chat"])
    held = holdings(redis_url)
    assert sorted(held.values()) == [["chat"], ["sql"]], held
    holder = {names[0]: group for group, names in held.items()}

    # Each request runs on the group holding its adapter, as PEFT answers it.
    for name in ("chat", "sql", "chat"):
        before = steps(redis_url)
        assert completion(mesh, name) == reference(folders["base"], folders[name]), name
        after = steps(redis_url)
        ran = {group for group in after if after[group] > before[group]}
        assert ran == {holder[name]}, (name, before, after)

    # The holder of sql dies; its scheduler comes back holding nothing. The table still
    # serves sql: the router sends it to the group with room, which loads it.
    victim = holder["sql"]
    old = schedulers(redis_url)[victim]
    os.kill(old["pid"], signal.SIGKILL)
    eventually(
        lambda: (
            (entry := schedulers(redis_url).get(victim)) is not None
            and entry["instance"] != old["instance"]
            and entry["status"] == "ready"
        ),
        60,
        mesh.log,
        interval_s=0.3,
    )
    assert holdings(redis_url)[victim] == []
    eventually(
        lambda: mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).layout.num_replicas == 2,
        60,
        mesh.log,
        interval_s=0.2,
    )
    assert "sql" in [
        m.id
        for m in openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused").models.list().data
    ]
    assert completion(mesh, "sql") == reference(folders["base"], folders["sql"])
    assert holdings(redis_url)[victim] == ["sql"], (holdings(redis_url), mesh.log())
    assert completion(mesh, "chat") == reference(folders["base"], folders["chat"])
