"""What an image costs a vision-language request, through the mesh, in one run.

    .venv/bin/python -m bench.images [--repeats 6] [--text-tokens 64] [--max-tokens 16]
        [--same-image 8] [--dtype float32|bfloat16] [--name images]

The model: a LLaVA at a small real VLM's size, random weights (timing needs no training):
SmolLM2-135M's decoder shape (30 layers, hidden 576, 9 heads, 3 KV heads, a 49,152-token
head) behind a CLIP ViT-B/16 tower at 224 px (12 layers, hidden 768: 196 image tokens) and
LLaVA's two-layer projector; written once to `.cache/bench-llava`
(pagemesh.tools.testing.tiny_llava).

One mesh (`pagemesh up`), one request at a time, greedy, `--max-tokens` out:

1. The issue's target: a request with one image (`--text-tokens` random ids, then the image
   token: 196 placeholders) against a text request of the same prompt length, alternated
   `--repeats` times, each with its own image and its own ids (no encoder-cache or prefix
   hit). The tower's own time is the worker's `pagemesh:worker_image_encode_seconds` over
   those requests (decode, preprocessing, tower and projector, per image). Ratio:
   median image request / (median text request + tower per image); target <= 1.1.
2. The encoder cache: `--same-image` requests showing one image after different texts (so
   the prefix cache cannot cover the image): the worker's counters must show one encode
   and the rest cache hits.

Writes bench/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis
from PIL import Image

from bench.common import REPO_ROOT, write_results
from pagemesh.tools.mesh_process import Mesh
from protos.pagemesh.v1 import generate_pb2

CLUSTER = "bench-images"
IMAGE_TOKENS = 196  # (224 / 16) ** 2


def write_bench_llava(folder: Path) -> Path:
    from pagemesh.tools.testing.tiny_llava import write_tiny_llava

    if not (folder / "config.json").exists():
        write_tiny_llava(
            folder,
            seed=0,
            naming="llava-hf",
            image_size=224,
            patch_size=16,
            vision_layers=12,
            vision_hidden=768,
            text_hidden=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            max_position_embeddings=2048,
        )
    return folder


def photo(seed: int) -> bytes:
    """A 320x240 JPEG of smooth random colour (a photo's size and entropy, roughly)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((320, 240), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def request(
    prompt: list[int], max_tokens: int, images: list[bytes] = ()
) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        images=list(images),
        sampling=generate_pb2.SamplingParams(temperature=0),
        stopping=generate_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def timed(mesh: Mesh, req: generate_pb2.GenerateRequest) -> tuple[float, float]:
    """(seconds to the first token, seconds to the last) of one streamed request."""
    start = time.perf_counter()
    first = None
    for chunk in mesh.stub.Generate(req, timeout=600):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


def worker_counters(mesh: Mesh) -> dict[str, float]:
    client = redis.Redis.from_url(mesh.redis_url)
    try:
        entry = next(json.loads(client.get(key)) for key in client.scan_iter(f"{CLUSTER}:worker:*"))
    finally:
        client.close()
    text = httpx.get(f"http://{entry['metrics_address']}/metrics", timeout=10).text
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagemesh:worker_image")
    }


def cost_of_an_image(
    mesh: Mesh, args: argparse.Namespace, image_token: int, rng: random.Random
) -> dict[str, float]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(600, 49000) for _ in range(n)]

    before = worker_counters(mesh)
    text, image = [], []
    for r in range(args.repeats):
        with_image = request(
            ids(args.text_tokens) + [image_token], args.max_tokens, [photo(1000 + r)]
        )
        plain = request(ids(args.text_tokens + IMAGE_TOKENS), args.max_tokens)
        pair = [(image, with_image), (text, plain)]
        for into, req in pair if r % 2 else pair[::-1]:  # alternated: drift hits both
            into.append(timed(mesh, req))
    after = worker_counters(mesh)
    encoded = (
        after["pagemesh:worker_images_encoded_total"]
        - before["pagemesh:worker_images_encoded_total"]
    )
    tower_s = (
        after["pagemesh:worker_image_encode_seconds_total"]
        - before["pagemesh:worker_image_encode_seconds_total"]
    ) / max(encoded, 1)
    text_s = statistics.median(t for _, t in text)
    image_s = statistics.median(t for _, t in image)
    return {
        "text_request_s": text_s,
        "image_request_s": image_s,
        "tower_s": tower_s,
        "images_encoded": encoded,
        "ratio": image_s / (text_s + tower_s),
        "text_ttft_s": statistics.median(f for f, _ in text),
        "image_ttft_s": statistics.median(f for f, _ in image),
    }


def encoder_cache(
    mesh: Mesh, args: argparse.Namespace, image_token: int, rng: random.Random
) -> dict[str, float]:
    shared = photo(7)
    before = worker_counters(mesh)
    times = [
        timed(
            mesh,
            request(
                [rng.randrange(600, 49000) for _ in range(args.text_tokens)] + [image_token],
                args.max_tokens,
                [shared],
            ),
        )[1]
        for _ in range(args.same_image)
    ]
    after = worker_counters(mesh)

    def delta(name: str) -> float:
        return after[name] - before[name]

    return {
        "requests": args.same_image,
        "encoded": delta("pagemesh:worker_images_encoded_total"),
        "cache_hits": delta("pagemesh:worker_image_cache_hits_total"),
        "first_s": times[0],
        "rest_median_s": statistics.median(times[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--same-image", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--name", default="images")
    args = parser.parse_args()
    folder = write_bench_llava(REPO_ROOT / ".cache" / "bench-llava")
    image_token = json.loads((folder / "config.json").read_text())["image_token_index"]
    rng = random.Random(0)
    mesh = Mesh(
        str(folder),
        Path(tempfile.mkdtemp()) / "mesh.log",
        cluster=CLUSTER,
        extra_args=["--dtype", args.dtype],
    ).wait_ready()
    try:
        timed(mesh, request([5] * 32 + [image_token], 4, [photo(1)]))  # warm-up
        timed(mesh, request([6] * 300, 4))
        cost = cost_of_an_image(mesh, args, image_token, rng)
        cache = encoder_cache(mesh, args, image_token, rng)
    finally:
        mesh.stop()
    prompt_len = args.text_tokens + IMAGE_TOKENS
    rows = [
        [
            "text request",
            f"{prompt_len}",
            f"{cost['text_ttft_s']:.3f}",
            f"{cost['text_request_s']:.3f}",
            "",
        ],
        [
            "image request (one image)",
            f"{prompt_len}",
            f"{cost['image_ttft_s']:.3f}",
            f"{cost['image_request_s']:.3f}",
            f"{cost['ratio']:.3f}x (text + tower {cost['tower_s']:.3f} s per image)",
        ],
        [
            f"{cache['requests']} requests, one image",
            f"{prompt_len}",
            "",
            f"first {cache['first_s']:.3f}, then {cache['rest_median_s']:.3f}",
            f"encoded {cache['encoded']:.0f}, cache hits {cache['cache_hits']:.0f}",
        ],
    ]
    write_results(
        args.name,
        f"The cost of an image: a LLaVA of SmolLM2-135M's decoder shape behind a CLIP "
        f"ViT-B/16 tower (random weights), {args.dtype}, through the mesh, one request at a "
        f"time, {args.max_tokens} tokens out, medians of {args.repeats} alternated pairs "
        "(bench/images.py)",
        ["request", "prompt tokens", "TTFT, s", "latency, s", "ratio / counters"],
        rows,
        {"cost": cost, "encoder_cache": cache, "args": vars(args)},
    )


if __name__ == "__main__":
    main()
