"""An embedding model through the whole mesh: `pagemesh up` on a sentence-transformers folder
(a Qwen3 trunk, last-token pooling, Normalize, Matryoshka dimensions, a tokenizer that
appends <|endoftext|>) with two replicas and a small step budget (long inputs are chunked).
The official `openai` client's embeddings (float and base64), gRPC `Embed` and token-id
inputs equal sentence-transformers' `encode` on the same folder; bad input gets a 400 /
INVALID_ARGUMENT naming what to fix; and a worker killed with -9 in the middle of a batch
loses no input (its requests are recomputed)."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import redis

from pagemesh import Client
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.tiny_embedding import write_embedding_model
from protos.pagemesh.v1 import generate_pb2
from tests.support.eventually import eventually
from tests.support.mesh_harness import Mesh, scheduler_stats_at

CLUSTER = "e2e-embed"
MATRYOSHKA = [16, 32]
TEXTS = [
    "The capital of France is Paris.",
    "a",
    "naïve café ☕ " * 3,
    "the quick brown fox jumps over the lazy dog " * 12,
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_embedding_model(
        tmp_path_factory.mktemp("embed") / "tiny-qwen3-embedding",
        "qwen3",
        seed=3,
        matryoshka_dimensions=MATRYOSHKA,
    )


@pytest.fixture(scope="module")
def mesh(
    model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    http_port = reserve_port()
    mesh = Mesh(
        str(model_dir),
        tmp_path_factory.mktemp("logs") / "embed.log",
        redis_url=redis_url,
        cluster=CLUSTER,
        extra_args=[
            "--replicas",
            "2",
            "--http-port",
            str(http_port),
            "--max-num-batched-tokens",
            "64",
            "--num-kv-blocks",
            "96",
            "--dtype",
            "float32",
        ],
    )
    mesh.http_url = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    try:
        mesh.wait_ready()
        eventually(lambda: len(entries(redis_url, "scheduler")) >= 2, 60, mesh.log, interval_s=0.2)
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


def entries(redis_url: str, kind: str) -> dict[str, dict]:
    client = redis.Redis.from_url(redis_url)
    return {
        key.decode().rsplit(":", 1)[1]: json.loads(client.get(key))
        for key in client.scan_iter(f"{CLUSTER}:{kind}:*")
    }


def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0)


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    ours, theirs = np.asarray(ours, dtype=np.float32), np.asarray(theirs, dtype=np.float32)
    assert ours.shape == theirs.shape
    cosine = float(ours @ theirs / np.linalg.norm(ours) / np.linalg.norm(theirs))
    assert cosine >= 0.99999, cosine
    assert np.abs(ours - theirs).max() <= 1e-5


def test_openai_client_embeddings_equal_sentence_transformers(mesh: Mesh, reference) -> None:
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    # The SDK asks for base64 and decodes it when not told a format; told one, it passes
    # the answer through.
    for encoding in (openai.NOT_GIVEN, "float", "base64"):
        response = client(mesh).embeddings.create(
            input=TEXTS, model="tiny-qwen3-embedding", encoding_format=encoding
        )
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        for data, vector in zip(response.data, expected):
            ours = (
                np.frombuffer(base64.b64decode(data.embedding), dtype="<f4")
                if encoding == "base64"
                else np.array(data.embedding)
            )
            assert_close(ours, vector)
    tokens = [len(reference.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(tokens)
    models = client(mesh).models.list().data[0].model_dump()
    assert models["task"] == "embed" and models["embedding_dimensions"] == 64
    assert models["pooling"]["type"] == "last" and models["pooling"]["normalize"]


def test_token_ids_matryoshka_grpc_and_the_sdk(mesh: Mesh, reference) -> None:
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    full = reference.encode(TEXTS[:2], convert_to_numpy=True)
    response = client(mesh).embeddings.create(
        input=ids, model="tiny-qwen3-embedding", dimensions=16, encoding_format="float"
    )
    for data, vector in zip(response.data, full):
        assert len(data.embedding) == 16
        assert_close(np.array(data.embedding), vector[:16] / np.linalg.norm(vector[:16]))
    single = client(mesh).embeddings.create(
        input=ids[0], model="tiny-qwen3-embedding", encoding_format="float"
    )
    assert len(single.data) == 1
    assert_close(np.array(single.data[0].embedding), full[0])
    reply = mesh.stub.Embed(
        generate_pb2.EmbedRequest(
            inputs=[
                generate_pb2.EmbedInput(text=TEXTS[0]),
                generate_pb2.EmbedInput(token_ids=generate_pb2.TokenIds(ids=ids[1])),
            ]
        ),
        timeout=60,
    )
    assert [e.index for e in reply.embeddings] == [0, 1]
    for embedding, vector in zip(reply.embeddings, full):
        assert_close(np.array(embedding.values), vector)
    assert reply.usage.prompt_tokens == sum(map(len, ids))
    with Client(mesh.address) as sdk:
        assert sdk.model_info().task == "embed"
        answer = sdk.embed([TEXTS[0], ids[1]], dimensions=32)
        short = sdk.embed(TEXTS[0])
    assert len(answer.embeddings) == 2 and answer.num_prompt_tokens == sum(map(len, ids))
    for vector, reference_vector in zip(answer.embeddings, full):
        assert_close(
            np.array(vector), reference_vector[:32] / np.linalg.norm(reference_vector[:32])
        )
    assert_close(np.array(short.embeddings[0]), full[0])


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input": []}, "input is empty"),
        ({"input": ""}, "input 0 is empty"),
        ({"input": ["ok", ""]}, "input 1 is empty"),
        ({"input": ["x"] * 2049}, "at most 2048"),
        ({"input": "word " * 600}, "at most 512"),
        ({"input": [[1, 2], [10**6]]}, "outside the vocabulary"),
        ({"input": "hi", "dimensions": 7}, "dimensions 7 is not supported"),
        ({"input": "hi", "dimensions": 0}, "dimensions must be an integer >= 1"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format must be one of"),
        ({"input": [1.5]}, "input[0] must be a string"),
        ({"input": "hi", "model": "other"}, "is not served here"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                            }
                        ],
                    }
                ]
            },
            "embeds text only",
        ),
    ],
)
def test_bad_input_is_a_400_naming_what_to_fix(mesh: Mesh, body: dict, needle: str) -> None:
    response = httpx.post(f"{mesh.http_url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    assert needle in response.json()["error"]["message"]


def test_generation_on_an_embedding_model_is_refused(mesh: Mesh) -> None:
    response = httpx.post(
        f"{mesh.http_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert response.status_code == 400
    assert "embedding model" in response.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as error:
        list(mesh.stub.Generate(generate_pb2.GenerateRequest(text="hi"), timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_embeddings_on_a_generative_model_are_refused(tiny_llama_mesh: Mesh) -> None:
    with pytest.raises(grpc.RpcError) as error:
        tiny_llama_mesh.stub.Embed(
            generate_pb2.EmbedRequest(inputs=[generate_pb2.EmbedInput(text="hi")]), timeout=60
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--task embed" in error.value.details()


def test_a_worker_killed_mid_batch_loses_no_input(mesh: Mesh, reference, redis_url: str) -> None:
    """Last in this module: one group loses its worker while 96 inputs are in flight over
    both; the inputs it held are recomputed (on its re-formed group or the other one)."""
    texts = [f"{i} " + TEXTS[i % len(TEXTS)] for i in range(96)]
    expected = reference.encode(texts, convert_to_numpy=True)
    result: dict[str, object] = {}

    def embed() -> None:
        result["response"] = (
            client(mesh)
            .with_options(timeout=240)
            .embeddings.create(input=texts, model="tiny-qwen3-embedding", encoding_format="float")
        )

    thread = threading.Thread(target=embed)
    thread.start()
    victim = max(entries(redis_url, "worker").values(), key=lambda e: e["group"])
    scheduler = entries(redis_url, "scheduler")[victim["group"]]
    # Queued or running there: a prefill-only input may start and end within one step, so
    # `num_running` alone is seldom caught above 0 on a loaded machine.
    eventually(
        lambda: (s := scheduler_stats_at(scheduler["address"])).num_running + s.num_waiting > 0,
        60,
        mesh.log,
        interval_s=0.02,
    )
    os.kill(victim["pid"], signal.SIGKILL)
    thread.join(300)
    assert not thread.is_alive(), mesh.log()
    response = result["response"]
    assert len(response.data) == len(texts)
    for data, vector in zip(response.data, expected):
        assert_close(np.array(data.embedding), vector)

    metrics = httpx.get(f"{mesh.http_url}/metrics", timeout=10).text
    assert (
        'pagemesh:router_embedding_inputs_total{model="tiny-qwen3-embedding",outcome="ok"}'
        in metrics
    )

    def recomputed() -> bool:  # resumed on the other group, or re-prefilled on a re-formed one
        resumes = [
            line
            for line in httpx.get(f"{mesh.http_url}/metrics", timeout=10).text.splitlines()
            if line.startswith("pagemesh:request_resumes")
        ]
        group = entries(redis_url, "scheduler").get(victim["group"], {})
        return (bool(resumes) and float(resumes[0].rsplit(" ", 1)[1]) > 0) or group.get(
            "num_recoveries", 0
        ) > 0

    eventually(recomputed, 60, mesh.log, interval_s=0.2)
