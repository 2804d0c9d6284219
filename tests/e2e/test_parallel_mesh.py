"""Tensor and pipeline parallelism through the full mesh: `pagemesh up --tp --pp` on a tiny
model whose shapes hit the edge cases (vocab 509 does not divide by 2, one KV head for two
tensor ranks, three layers over two stages), greedy equal to `transformers`, seeded sampling
equal across layouts."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.pagemesh.v1 import generate_pb2
from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import greedy_request
from tests.support.parallel_layouts import LAYOUTS, run_layout


@pytest.fixture(scope="module")
def edge_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("edge") / "edge-llama",
        "llama",
        seed=11,
        vocab_size=509,
        num_key_value_heads=1,
        num_hidden_layers=3,
    )


@pytest.fixture(scope="module")
def hf_model(edge_model: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(edge_model, dtype=torch.float32).eval()


def seeded_request(prompt: list[int], seed: int) -> generate_pb2.GenerateRequest:
    request = greedy_request(prompt, 10)
    request.sampling.temperature = 0.9
    request.sampling.top_k = 40
    request.sampling.seed = seed
    return request


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, 509) for _ in range(n)] for n in (1, 7, 16, 33, 50)]


@pytest.fixture(scope="module")
def seeded_reference(
    edge_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> list[list[int]]:
    """Seeded samples from the one-worker layout, which every other layout must reproduce."""
    with run_layout(
        "tp1", edge_model, redis_url, tmp_path_factory.mktemp("logs"), cluster="e2e-par-tp1"
    ) as mesh:
        return [mesh.generate(seeded_request(p, seed=i)).token_ids for i, p in enumerate(prompts())]


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "tp1"])
def test_layout_matches_transformers_and_one_worker(
    name: str,
    edge_model: Path,
    hf_model: torch.nn.Module,
    redis_url: str,
    seeded_reference: list[list[int]],
    tmp_path: Path,
) -> None:
    with run_layout(name, edge_model, redis_url, tmp_path, cluster=f"e2e-par-{name}") as mesh:
        requests = [(p, 12) for p in prompts()]
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(
                pool.map(lambda pn: mesh.generate(greedy_request(*pn)).token_ids, requests)
            )
        for (prompt, n), ours in zip(requests, results):
            assert_greedy_match(hf_model, prompt, ours, hf_greedy(hf_model, prompt, n))
        seeded = [
            mesh.generate(seeded_request(p, seed=i)).token_ids for i, p in enumerate(prompts())
        ]
        assert seeded == seeded_reference
        info = mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
        tp, pp, _ = LAYOUTS[name]
        assert (info.layout.tensor_parallel_size, info.layout.pipeline_parallel_size) == (tp, pp)
        # Sized from the host's memory: the fraction shared by the tp x pp workers.
        assert info.kv_cache_sizing.startswith(f"cpu: {0.4 / (tp * pp):g} of ")
        assert info.kv_cache_bytes > 0
