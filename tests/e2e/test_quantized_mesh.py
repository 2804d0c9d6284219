"""Quantized checkpoints through the full mesh: `pagemesh up` on an FP8 (llm-compressor
layout) and an AWQ (AutoAWQ gemm) checkpoint of a tiny Qwen2, written by
pagemesh/tools/testing/quant_checkpoints.py. Greedy tokens equal `transformers` running the
dequantized
weights; GetModelInfo, the worker's registry entry and its gauges report the quantization
and less weight memory than the plain model's; and a tp=2 mesh on the AWQ checkpoint gives
the same tokens as tp=1."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families

from pagemesh.tools.testing.quant_checkpoints import (
    dequantized_hf_model,
    write_awq_checkpoint,
    write_fp8_checkpoint,
)
from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.pagemesh.v1 import generate_pb2
from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import Mesh, greedy_request
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

NUM_NEW_TOKENS = 10
WRITERS = {
    "fp8": lambda plain, out: write_fp8_checkpoint(plain, out, per_channel=True),
    "awq": lambda plain, out: write_awq_checkpoint(plain, out, group_size=32),
}


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in (1, 6, 17, 40)]


def generate_all(mesh: Mesh) -> list[list[int]]:
    requests = [greedy_request(p, NUM_NEW_TOKENS) for p in prompts()]
    with ThreadPoolExecutor(len(requests)) as pool:
        return [r.token_ids for r in pool.map(mesh.generate, requests)]


def worker_entries(redis_url: str, cluster: str) -> list[dict]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = list(client.scan_iter(match=f"{cluster}:worker:*"))
        return [json.loads(value) for value in client.mget(keys) if value is not None]
    finally:
        client.close()


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


@contextlib.contextmanager
def start_mesh(
    model: Path, name: str, redis_url: str, log_dir: Path, tp: int = 1
) -> Iterator[Mesh]:
    """Stopped when the `with` block ends, however it ends."""
    mesh = Mesh(
        str(model),
        log_dir / f"{name}.log",
        redis_url=redis_url,
        cluster=f"e2e-quant-{name}",
        extra_args=["--tp", str(tp), "--dtype", "float32", "--num-kv-blocks", "64"],
    )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Qwen2: q/k/v biases, which quantized layers keep in full precision.
    return write_tiny_model(tmp_path_factory.mktemp("plain") / "tiny-qwen2", "qwen2", seed=3)


@pytest.fixture(scope="module")
def plain_weight_bytes(plain: Path) -> int:
    """What a worker holds of the unquantized model in float32, the dtype the meshes run."""
    config = RunnerConfig(
        model_path=str(plain), dtype="float32", num_blocks=16, quantization="none"
    )
    return ModelRunner.from_config(config).info().weight_bytes


@pytest.fixture(scope="module", params=list(WRITERS))
def quantized(
    request: pytest.FixtureRequest,
    plain: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path, torch.nn.Module, Mesh]]:
    method = request.param
    out = tmp_path_factory.mktemp(method) / f"tiny-qwen2-{method}"
    hf_model = dequantized_hf_model(plain, WRITERS[method](plain, out))
    with start_mesh(out, method, redis_url, tmp_path_factory.mktemp("logs")) as mesh:
        yield method, out, hf_model, mesh


def test_greedy_equals_dequantized_transformers_and_info_reports_the_weights(
    quantized: tuple[str, Path, torch.nn.Module, Mesh], plain_weight_bytes: int, redis_url: str
) -> None:
    method, _, hf_model, mesh = quantized
    for prompt, ours in zip(prompts(), generate_all(mesh)):
        assert_greedy_match(hf_model, prompt, ours, hf_greedy(hf_model, prompt, NUM_NEW_TOKENS))
    info = mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
    assert info.quantization == method
    assert info.dtype == "float32"
    # Only the decoder's linear layers are quantized (8 bits, or ~4.5 with AWQ's scales and
    # zeros, instead of 32); embeddings, LM head and norms stay float32.
    assert 0 < info.weight_bytes < 0.8 * plain_weight_bytes, (info.weight_bytes, plain_weight_bytes)
    # The one worker publishes the same in its registry entry and as gauges.
    [entry] = worker_entries(redis_url, f"e2e-quant-{method}")
    assert (entry["quantization"], entry["weight_bytes"]) == (method, info.weight_bytes)
    samples = scrape(entry["metrics_address"])
    ranks = {"group": "g0", "tp_rank": "0", "pp_rank": "0"}
    assert samples[("pagemesh:worker_weight_bytes", frozenset(ranks.items()))] == info.weight_bytes
    info_labels = frozenset({"group": "g0", "quantization": method}.items())
    assert samples[("pagemesh:model_quantization_info", info_labels)] == 1


def test_awq_on_two_tensor_ranks_gives_the_same_tokens(
    quantized: tuple[str, Path, torch.nn.Module, Mesh], redis_url: str, tmp_path: Path
) -> None:
    method, checkpoint, _, tp1_mesh = quantized
    if method != "awq":
        pytest.skip("one tp=2 mesh, on the AWQ checkpoint")
    expected = generate_all(tp1_mesh)
    tp1_info = tp1_mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
    with start_mesh(checkpoint, "awq-tp2", redis_url, tmp_path, tp=2) as mesh:
        assert generate_all(mesh) == expected
        info = mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
        assert (info.quantization, info.layout.tensor_parallel_size) == ("awq", 2)
        # Summed over both ranks: each holds half of every sharded tensor, so the total is
        # one rank's worth of the model plus what both replicate (norms, biases, scales).
        assert tp1_info.weight_bytes <= info.weight_bytes < 1.2 * tp1_info.weight_bytes, (
            info.weight_bytes,
            tp1_info.weight_bytes,
        )
