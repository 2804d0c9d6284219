"""Multi-LoRA through the mesh: `pagemesh up --enable-lora --lora-modules name=path ...`
serves two PEFT adapters beside the base model; the official `openai` client names one as
its `model` and gets PEFT's greedy tokens, gRPC names one too, `/v1/models` lists them with
the base as parent, and an unknown name is a 404 naming what is served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
import torch

from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.tiny_lora import write_lora
from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.pagemesh.v1 import generate_pb2
from tests.support.mesh_harness import Mesh

PROMPT = [5, 17, 33, 101, 7, 250, 3]
MAX_TOKENS = 8
MODEL = "sql"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-mesh")
    # Peaky (tiny_models' default scale): greedy tokens never part at a near-tie, so a stream
    # recomputed after a worker's death must equal its undisturbed run exactly (the realistic
    # models' parity with PEFT is tests/worker_svc/test_lora_generate.py's).
    base = write_tiny_model(root / "base", "llama", seed=3)
    return {
        "base": base,
        "sql": write_lora(base, root / "sql", rank=8, seed=1),
        "chat": write_lora(
            base,
            root / "chat",
            rank=4,
            alpha=8,
            use_rslora=True,
            seed=2,
            target_modules=("q_proj", "v_proj", "down_proj"),
        ),
    }


@pytest.fixture(scope="module")
def mesh(
    folders: dict[str, Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    http_port = reserve_port()
    mesh = Mesh(
        str(folders["base"]),
        tmp_path_factory.mktemp("logs") / "lora.log",
        redis_url=redis_url,
        cluster="e2e-lora",
        extra_args=[
            "--http-port",
            str(http_port),
            "--dtype",
            "float32",
            "--enable-lora",
            "--max-loras",
            "2",
            "--lora-modules",
            f"sql={folders['sql']}",
            "--lora-modules",
            f"chat={folders['chat']}",
        ],
    )
    mesh.http_url = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def reference(base: Path, adapter: Path | None) -> list[int]:
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    ids, tokens = torch.tensor([PROMPT]), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            tokens.append(int(model.eval()(input_ids=ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens


def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0)


def completion(mesh: Mesh, model: str) -> list[int]:
    reply = client(mesh).completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return reply.choices[0].token_ids  # type: ignore[attr-defined]


def test_each_adapter_and_the_base_equal_peft(mesh: Mesh, folders: dict[str, Path]) -> None:
    for name in ("sql", "chat", "base"):
        expected = reference(folders["base"], folders.get(name) if name != "base" else None)
        assert completion(mesh, name) == expected, name
    # gRPC names an adapter as the model too.
    answer = list(
        mesh.stub.Generate(
            generate_pb2.GenerateRequest(
                model="chat",
                token_ids=generate_pb2.TokenIds(ids=PROMPT),
                sampling=generate_pb2.SamplingParams(temperature=0),
                stopping=generate_pb2.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True),
            ),
            timeout=120,
        )
    )
    assert [t for c in answer for t in c.token_ids] == reference(folders["base"], folders["chat"])


def test_models_lists_the_adapters_and_an_unknown_one_is_a_404(mesh: Mesh) -> None:
    models = client(mesh).models.list().data
    assert [m.id for m in models] == ["base", "chat", "sql"]
    assert all(getattr(m, "parent") == "base" for m in models[1:])
    with pytest.raises(openai.NotFoundError) as error:
        completion(mesh, "nope")
    assert "chat, sql" in str(error.value)
    with pytest.raises(grpc.RpcError) as info:
        list(
            mesh.stub.Generate(
                generate_pb2.GenerateRequest(
                    model="nope", token_ids=generate_pb2.TokenIds(ids=PROMPT)
                ),
                timeout=30,
            )
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def lora_request(request_id: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=request_id,
        model=MODEL,
        token_ids=generate_pb2.TokenIds(ids=PROMPT),
        sampling=generate_pb2.SamplingParams(temperature=0),
        stopping=generate_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def test_a_resumed_request_keeps_its_adapter(mesh: Mesh) -> None:
    """The checkpoint keeps the adapter's name: a client that went away resumes with it."""
    from pagemesh.runtime.checkpoints import FINISHED, ORPHANED
    from protos.pagemesh.scheduler.v1 import scheduler_pb2
    from tests.support.eventually import eventually
    from tests.support.mesh_ids import mesh_request_id, redis_checkpoint

    whole = [t for c in mesh.stub.Generate(lora_request("", 120), timeout=120) for t in c.token_ids]
    stream = mesh.stub.Generate(lora_request("lora-resume", 120), timeout=120)
    received: list[int] = []
    for chunk in stream:
        received += chunk.token_ids
        if len(received) >= 3:
            break
    stream.cancel()
    mesh_id = mesh_request_id(mesh.redis_url, "e2e-lora", "lora-resume")
    record = eventually(
        lambda: (
            (c := redis_checkpoint(mesh.redis_url, "e2e-lora", mesh_id)) is not None
            and c.state in (ORPHANED, FINISHED)
            and c
        ),
        30,
        "the request's checkpoint was never left for a resume",
    )
    assert scheduler_pb2.SubmitRequest.FromString(record.submit).lora_name == "sql"
    rest = [
        t
        for c in mesh.stub.Generate(
            generate_pb2.GenerateRequest(request_id="lora-resume", resume_from=len(received)),
            timeout=120,
        )
        for t in c.token_ids
    ]
    assert received + rest == whole


def test_a_worker_killed_mid_answer_changes_nothing(mesh: Mesh) -> None:
    """The restarted worker reads its --lora-modules again; the request, re-sent with its
    adapter, ends as the undisturbed run."""
    import json
    import os
    import signal

    import redis

    whole = [t for c in mesh.stub.Generate(lora_request("", 200), timeout=120) for t in c.token_ids]
    client = redis.Redis.from_url(mesh.redis_url)
    worker = next(json.loads(client.get(k)) for k in client.scan_iter("e2e-lora:worker:*"))
    client.close()
    received: list[int] = []
    for chunk in mesh.stub.Generate(lora_request("", 200), timeout=300):
        received += chunk.token_ids
        if len(received) >= 10 and worker is not None:
            os.kill(worker["pid"], signal.SIGKILL)
            worker = None
    assert received == whole, mesh.log()


def test_adapters_load_and_unload_at_run_time(
    mesh: Mesh, folders: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM's endpoints: loaded, an adapter answers as PEFT does and is listed; unloaded, it
    is a 404; bad adapters are 400s naming why, and the mesh serves everyone meanwhile."""
    import httpx

    late = write_lora(
        folders["base"],
        tmp_path / "late",
        rank=16,
        seed=5,
        target_modules=("k_proj", "o_proj", "up_proj"),
    )
    reply = httpx.post(
        f"{mesh.http_url}/v1/load_lora_adapter",
        timeout=120,
        json={"lora_name": "late", "lora_path": str(late)},
    )
    assert reply.status_code == 200, reply.text
    assert completion(mesh, "late") == reference(folders["base"], late)
    assert "late" in [m.id for m in client(mesh).models.list().data]

    too_wide = write_lora(folders["base"], tmp_path / "wide", rank=32, seed=6)
    other_base = write_tiny_model(
        tmp_path / "other", "llama", seed=9, hidden_size=32, intermediate_size=64
    )
    for path, needle in (
        (too_wide, "rank 32, above the maximum 16"),
        (tmp_path, "no adapter_config.json"),
        (write_lora(other_base, tmp_path / "other-lora", rank=4), "another base model"),
    ):
        reply = httpx.post(
            f"{mesh.http_url}/v1/load_lora_adapter",
            timeout=120,
            json={"lora_name": "bad", "lora_path": str(path)},
        )
        assert reply.status_code == 400 and needle in reply.json()["error"]["message"], reply.text
    assert completion(mesh, "sql") == reference(folders["base"], folders["sql"])

    reply = httpx.post(
        f"{mesh.http_url}/v1/unload_lora_adapter", timeout=60, json={"lora_name": "late"}
    )
    assert reply.status_code == 200, reply.text
    with pytest.raises(openai.NotFoundError):
        completion(mesh, "late")
    reply = httpx.post(
        f"{mesh.http_url}/v1/unload_lora_adapter", timeout=60, json={"lora_name": "late"}
    )
    assert reply.status_code == 404, reply.text


def test_unloading_an_adapter_in_use_lets_its_requests_finish(
    mesh: Mesh, folders: dict[str, Path], tmp_path: Path
) -> None:
    """Unloaded mid-answer: the request running with it ends as its undisturbed run (the
    workers read the adapter again from its folder when they need it), and new requests
    naming it are 404s."""
    import httpx

    path = write_lora(folders["base"], tmp_path / "brief", rank=8, seed=7)
    load = httpx.post(
        f"{mesh.http_url}/v1/load_lora_adapter",
        timeout=120,
        json={"lora_name": "brief", "lora_path": str(path)},
    )
    assert load.status_code == 200, load.text
    request = generate_pb2.GenerateRequest(
        model="brief",
        token_ids=generate_pb2.TokenIds(ids=PROMPT),
        sampling=generate_pb2.SamplingParams(temperature=0),
        stopping=generate_pb2.StoppingCriteria(max_tokens=150, ignore_eos=True),
    )
    whole = [t for c in mesh.stub.Generate(request, timeout=120) for t in c.token_ids]
    received: list[int] = []
    for chunk in mesh.stub.Generate(request, timeout=120):
        received += chunk.token_ids
        if len(received) >= 5 and len(received) - len(chunk.token_ids) < 5:
            unload = httpx.post(
                f"{mesh.http_url}/v1/unload_lora_adapter", timeout=60, json={"lora_name": "brief"}
            )
            assert unload.status_code == 200, unload.text
    assert received == whole
    with pytest.raises(openai.NotFoundError):
        completion(mesh, "brief")
