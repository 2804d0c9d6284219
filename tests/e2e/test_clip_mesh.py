"""A CLIP model through the mesh: `pagemesh up` on a CLIPModel folder serves text and image
embeddings in one space over `/v1/embeddings` (texts as `input`; an image as vLLM's
`messages` with an image_url data URL) and gRPC `Embed`, equal to transformers'
`get_text_features` / `get_image_features` (normalised) with its own image processor; an
image that is not one, a decompression bomb, text and image in one input, or a text past
CLIP's 77 tokens is a 400 naming what to fix."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.tiny_clip import write_tiny_clip
from protos.pagemesh.v1 import generate_pb2
from tests.support.mesh_harness import Mesh

TEXTS = ["a photo of a cat", "two dogs playing in the snow"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip", seed=2)


@pytest.fixture(scope="module")
def mesh(
    clip_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    http_port = reserve_port()
    mesh = Mesh(
        str(clip_dir),
        tmp_path_factory.mktemp("logs") / "clip.log",
        redis_url=redis_url,
        cluster="e2e-clip",
        extra_args=["--http-port", str(http_port), "--dtype", "float32"],
    )
    mesh.http_url = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def images() -> list[Image.Image]:
    rng = np.random.default_rng(4)
    return [
        Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 255, (32, 32, 4), dtype=np.uint8), "RGBA"),
    ]


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def reference(clip_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    from transformers import AutoTokenizer, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = CLIPModel.from_pretrained(clip_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(clip_dir)
    processor = CLIPImageProcessorPil.from_pretrained(clip_dir)
    with torch.no_grad():
        text = model.get_text_features(**tokenizer(TEXTS, return_tensors="pt", padding=True))
        image = model.get_image_features(**processor(images(), return_tensors="pt"))
    text = getattr(text, "pooler_output", text)
    image = getattr(image, "pooler_output", image)
    normalize = torch.nn.functional.normalize
    return normalize(text, dim=-1).numpy(), normalize(image, dim=-1).numpy()


def post(mesh: Mesh, body: dict) -> httpx.Response:
    return httpx.post(f"{mesh.http_url}/v1/embeddings", json=body, timeout=60)


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_message(data: bytes, media_type: str = "image/png") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(data, media_type)}}],
        }
    ]


def test_text_and_image_embeddings_equal_transformers(mesh: Mesh, reference) -> None:
    text_ref, image_ref = reference
    reply = post(mesh, {"input": TEXTS, "encoding_format": "float"}).json()
    ours = np.array([d["embedding"] for d in reply["data"]], dtype=np.float32)
    np.testing.assert_allclose(ours, text_ref, atol=1e-5)
    for image, expected, fmt, media in zip(
        images(), image_ref, ("PNG", "WEBP"), ("image/png", "image/webp")
    ):
        # WebP lossless keeps the pixels (RGBA composited onto white by both sides).
        data = encoded(image, fmt) if fmt == "PNG" else _lossless_webp(image)
        reply = post(mesh, {"messages": image_message(data, media), "encoding_format": "float"})
        assert reply.status_code == 200, reply.text
        np.testing.assert_allclose(reply.json()["data"][0]["embedding"], expected, atol=1e-5)
    grpc_reply = mesh.stub.Embed(
        generate_pb2.EmbedRequest(
            inputs=[
                generate_pb2.EmbedInput(text=TEXTS[0]),
                generate_pb2.EmbedInput(image=encoded(images()[0])),
            ]
        ),
        timeout=60,
    )
    np.testing.assert_allclose(grpc_reply.embeddings[0].values, text_ref[0], atol=1e-5)
    np.testing.assert_allclose(grpc_reply.embeddings[1].values, image_ref[0], atol=1e-5)
    model = httpx.get(f"{mesh.http_url}/v1/models", timeout=10).json()["data"][0]
    assert model["task"] == "embed" and model["pooling"]["type"] == "clip"


def _lossless_webp(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="WEBP", lossless=True, exact=True)
    return buffer.getvalue()


def bomb_png(width: int = 30_000, height: int = 30_000) -> bytes:
    """A PNG whose header claims `width` x `height` (900 megapixels) in a few bytes."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload))
            + kind
            + payload
            + struct.pack(">I", zlib.crc32(kind + payload))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * (1 + 3 * width)))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"messages": image_message(b"not an image at all")}, "input 0"),
        ({"messages": image_message(bomb_png())}, "pixels"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a cat"},
                            {"type": "image_url", "image_url": {"url": data_url(b"x")}},
                        ],
                    }
                ]
            },
            "not both",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "https://example.com/cat.png"},
                            }
                        ],
                    }
                ]
            },
            "remote image URLs are off",
        ),  # no --allowed-media-domains
        ({"input": "cat " * 100}, "at most 77"),
        ({"input": "cat", "dimensions": 8}, "not supported"),
    ],
)
def test_bad_image_input_is_a_400(mesh: Mesh, body: dict, needle: str) -> None:
    reply = post(mesh, body)
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]
