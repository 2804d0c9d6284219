"""A LLaVA through the mesh: `pagemesh up` on a tiny LLaVA folder (the Hub's llava-hf
naming) answers an OpenAI chat request whose message carries an image as a data URL, and a
gRPC request with the image's bytes, with transformers' greedy tokens on the same folder
and image; images to bad places are refused by name."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.tiny_llava import write_tiny_llava
from protos.pagemesh.v1 import generate_pb2
from tests.support.mesh_harness import Mesh

MAX_TOKENS = 6
LONG = 200  # an answer still running when its client goes away
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llava(
        tmp_path_factory.mktemp("llava") / "tiny-llava", seed=5, naming="llava-hf"
    )


@pytest.fixture(scope="module")
def mesh(folder: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    http_port = reserve_port()
    mesh = Mesh(
        str(folder),
        tmp_path_factory.mktemp("logs") / "llava.log",
        redis_url=redis_url,
        cluster="e2e-llava",
        extra_args=[
            "--http-port",
            str(http_port),
            "--dtype",
            "float32",
            "--max-num-batched-tokens",
            "20",
            "--allowed-media-domains",
            "127.0.0.1",
            "--max-images-per-request",
            "3",
        ],
    )
    mesh.http_url = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def picture() -> Image.Image:
    pixels = np.random.default_rng(8).integers(0, 255, (44, 40, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def reference(folder: Path) -> tuple[str, list[int]]:
    """The chat prompt transformers' processor renders, and its greedy tokens."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[picture()], return_tensors="pt")
    ids, tokens = inputs["input_ids"], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"]).logits[0, -1]
            tokens.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return text, tokens


def test_chat_and_grpc_with_an_image_equal_transformers(mesh: Mesh, folder: Path) -> None:
    text, expected = reference(folder)
    url = "data:image/png;base64," + base64.b64encode(png(picture())).decode()
    reply = httpx.post(
        f"{mesh.http_url}/v1/chat/completions",
        timeout=120,
        json={
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["token_ids"] == expected
    answer = list(
        mesh.stub.Generate(
            generate_pb2.GenerateRequest(
                text=text,
                images=[png(picture())],
                sampling=generate_pb2.SamplingParams(temperature=0),
                stopping=generate_pb2.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True),
            ),
            timeout=120,
        )
    )
    assert [t for chunk in answer for t in chunk.token_ids] == expected
    # pagemesh.Client, with a PIL image (sent as PNG).
    from pagemesh import Client

    with Client(mesh.address) as client:
        completion = client.generate(
            text, images=[picture()], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
        )
    assert completion.token_ids == expected
    # The same image three times: encoded once (found in the encoder cache, or its
    # placeholders' KV in the prefix cache, after).
    metrics = worker_metrics(mesh)
    assert metrics["pagemesh:worker_images_encoded_total"] == 1
    assert metrics["pagemesh:worker_image_cache_hits_total"] >= 1


def worker_metrics(mesh: Mesh) -> dict[str, float]:
    import json

    import redis

    client = redis.Redis.from_url(mesh.redis_url)
    entry = next(json.loads(client.get(key)) for key in client.scan_iter("e2e-llava:worker:*"))
    text = httpx.get(f"http://{entry['metrics_address']}/metrics", timeout=10).text
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagemesh:worker_image")
    }


@pytest.mark.parametrize(
    "images, text, needle",
    [
        ([b"not an image"], "<image>\\nhi", "not a decodable image"),
        ([], "<image>\\nhi", None),  # no image: the token stays a token (no check to fail)
        ([b"x", b"y"], "<image>\\nhi", "not a decodable image"),
    ],
)
def test_bad_images_over_grpc_are_refused(
    mesh: Mesh, images: list[bytes], text: str, needle: str | None
) -> None:
    request = generate_pb2.GenerateRequest(
        text=text.replace("\\\\n", "\\n"),
        images=images,
        stopping=generate_pb2.StoppingCriteria(max_tokens=2),
    )
    if needle is None:
        assert list(mesh.stub.Generate(request, timeout=60))
        return
    with pytest.raises(grpc.RpcError) as error:
        list(mesh.stub.Generate(request, timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in error.value.details()


def test_image_tokens_and_images_must_pair_up(mesh: Mesh) -> None:
    request = generate_pb2.GenerateRequest(
        text="no image token here",
        images=[png(picture())],
        stopping=generate_pb2.StoppingCriteria(max_tokens=2),
    )
    with pytest.raises(grpc.RpcError) as error:
        list(mesh.stub.Generate(request, timeout=60))
    assert "0 image token(s) for 1 image(s)" in error.value.details()


def test_a_text_only_model_refuses_images(tiny_llama_mesh: Mesh) -> None:
    request = generate_pb2.GenerateRequest(
        text="hello", images=[png(picture())], stopping=generate_pb2.StoppingCriteria(max_tokens=2)
    )
    with pytest.raises(grpc.RpcError) as error:
        list(tiny_llama_mesh.stub.Generate(request, timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text-only model" in error.value.details()


def image_request(request_id: str, image: bytes, max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=request_id,
        text=f"<image>\n{QUESTION}",
        images=[image],
        sampling=generate_pb2.SamplingParams(temperature=0),
        stopping=generate_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def orphan(mesh: Mesh, request_id: str, image: bytes) -> tuple[list[int], str]:
    """Starts an image request, reads a few tokens and goes away: its checkpoint stays for
    the resume window. Returns the tokens received and the mesh's id of the request."""
    from pagemesh.runtime.checkpoints import FINISHED, ORPHANED
    from tests.support.eventually import eventually
    from tests.support.mesh_ids import mesh_request_id, redis_checkpoint

    stream = mesh.stub.Generate(image_request(request_id, image, LONG), timeout=120)
    received: list[int] = []
    for chunk in stream:
        received += chunk.token_ids
        if len(received) >= 3:
            break
    stream.cancel()
    mesh_id = mesh_request_id(mesh.redis_url, "e2e-llava", request_id)
    # Orphaned, or finished before the router saw the client go (a loaded machine): either
    # way the client lacks tokens the record holds, and may resume.
    eventually(
        lambda: (
            (c := redis_checkpoint(mesh.redis_url, "e2e-llava", mesh_id)) is not None
            and c.state in (ORPHANED, FINISHED)
        ),
        30,
        f"{request_id}'s checkpoint was never orphaned",
    )
    return received, mesh_id


def test_a_resume_reads_the_image_from_the_image_store(mesh: Mesh) -> None:
    """The checkpoint names the image by its SHA-256; the bytes are in the store once, for
    two requests; a resume gets the undisturbed tokens; one whose image is gone is
    NOT_FOUND, naming it."""
    import hashlib

    import redis

    from pagemesh.runtime.image_store import ImageStore
    from protos.pagemesh.scheduler.v1 import scheduler_pb2
    from tests.support.mesh_ids import redis_checkpoint

    image = png(picture().rotate(90))
    whole = [
        t
        for c in mesh.stub.Generate(image_request("", image, LONG), timeout=120)
        for t in c.token_ids
    ]
    received, mesh_id = orphan(mesh, "img-resume", image)
    record = redis_checkpoint(mesh.redis_url, "e2e-llava", mesh_id)
    kept = scheduler_pb2.SubmitRequest.FromString(record.submit).images
    digest = hashlib.sha256(image).digest()
    assert [(i.data, i.sha256) for i in kept] == [(b"", digest)]
    client = redis.Redis.from_url(mesh.redis_url)
    store_key = ImageStore(client, "e2e-llava").key(digest)
    assert client.get(store_key) == image

    rest = [
        t
        for c in mesh.stub.Generate(
            generate_pb2.GenerateRequest(request_id="img-resume", resume_from=len(received)),
            timeout=120,
        )
        for t in c.token_ids
    ]
    assert received + rest == whole

    received, _ = orphan(mesh, "img-lost", image)
    client.delete(store_key)
    with pytest.raises(grpc.RpcError) as error:
        list(
            mesh.stub.Generate(
                generate_pb2.GenerateRequest(request_id="img-lost", resume_from=len(received)),
                timeout=60,
            )
        )
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "image(s) [0]" in error.value.details() and "image store" in error.value.details()
    client.close()


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """An HTTP server on 127.0.0.1 serving the test picture at /picture.png (404 elsewhere)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = png(picture())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/picture.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def chat(mesh: Mesh, urls: list[str]) -> httpx.Response:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return httpx.post(
        f"{mesh.http_url}/v1/chat/completions",
        timeout=120,
        json={
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )


def test_an_image_url_from_an_allowed_host_is_fetched(
    mesh: Mesh, folder: Path, image_host: str
) -> None:
    _, expected = reference(folder)
    reply = chat(mesh, [f"http://{image_host}/picture.png"])
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize(
    "path, needle",
    [
        ("http://localhost:{port}/picture.png", "'localhost' is not allowed"),
        ("http://{host}/missing.png", "HTTP status 404"),
        ("ftp://{host}/picture.png", "an image URL must be a data URL"),
    ],
)
def test_image_urls_that_cannot_be_used_are_400(
    mesh: Mesh, image_host: str, path: str, needle: str
) -> None:
    url = path.format(host=image_host, port=image_host.rsplit(":", 1)[1])
    reply = chat(mesh, [url])
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]


def test_more_images_than_allowed_are_400(mesh: Mesh) -> None:
    data_url = "data:image/png;base64," + base64.b64encode(png(picture())).decode()
    reply = chat(mesh, [data_url] * 4)
    assert reply.status_code == 400, reply.text
    assert "at most 3 images" in reply.json()["error"]["message"]


def test_a_llava_next_mesh_tiles_images_of_any_size(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """LLaVA-NeXT through the mesh: the router counts each image's placeholders from its size
    (the model info's tiling), the worker tiles it; a wide image over OpenAI chat gives
    transformers' greedy tokens."""
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    folder = write_tiny_llava(
        tmp_path_factory.mktemp("next") / "tiny-next", seed=6, naming="llava-hf", next=True
    )
    wide = Image.fromarray(np.random.default_rng(3).integers(0, 255, (30, 90, 3), dtype=np.uint8))
    processor = AutoProcessor.from_pretrained(folder)
    model = LlavaNextForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    inputs = processor(
        text=processor.apply_chat_template(messages, add_generation_prompt=True),
        images=[wide],
        return_tensors="pt",
    )
    with torch.no_grad():
        expected = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
        )[0, inputs["input_ids"].shape[1] :]
    http_port = reserve_port()
    mesh = Mesh(
        str(folder),
        tmp_path_factory.mktemp("logs") / "next.log",
        redis_url=redis_url,
        cluster="e2e-llava-next",
        extra_args=["--http-port", str(http_port), "--dtype", "float32"],
    )
    mesh.http_url = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    try:
        mesh.wait_ready()
        info = mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
        assert info.image_tiling.tile_size == 32 and len(info.image_tiling.grid_pinpoints) == 10
        url = "data:image/png;base64," + base64.b64encode(png(wide)).decode()
        reply = chat(mesh, [url])
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected.tolist()
        assert reply.json()["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    finally:
        mesh.stop()
