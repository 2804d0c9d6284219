"""Through the full mesh, greedy tokens equal `transformers` on the same weights:
alone, and as 16 concurrent streams of different lengths."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.pagemesh.v1 import generate_pb2
from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import Mesh, greedy_request
from pagemesh.testing.tiny_models import write_tiny_model

NUM_CONCURRENT = 16


def prompts_for(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_mesh(request: pytest.FixtureRequest, redis_url: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Mesh]]:
    arch = request.param
    folder = write_tiny_model(tmp_path_factory.mktemp(arch) / f"tiny-{arch}", arch, seed=7)
    mesh = Mesh(str(folder), tmp_path_factory.mktemp("logs") / f"{arch}.log",
                redis_url=redis_url, cluster=f"e2e-match-{arch}")
    try:
        yield arch, folder, mesh.wait_ready()
    finally:
        mesh.stop()


def test_greedy_alone_and_concurrent_equal_transformers(arch_mesh: tuple[str, Path, Mesh]) -> None:
    arch, folder, mesh = arch_mesh
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vocab_size = model.config.vocab_size
    lengths = [1 + (i * 37) % 90 for i in range(NUM_CONCURRENT)]
    max_tokens = [8 + (i * 5) % 17 for i in range(NUM_CONCURRENT)]
    prompts = prompts_for(vocab_size, lengths, seed=sum(map(ord, arch)))

    solo = [mesh.generate(greedy_request(p, n)) for p, n in zip(prompts, max_tokens)]
    for prompt, n, result in zip(prompts, max_tokens, solo):
        assert result.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert result.completion_tokens == n and result.prompt_tokens == len(prompt)
        assert_greedy_match(model, prompt, result.token_ids, hf_greedy(model, prompt, n))

    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        together = list(pool.map(lambda pn: mesh.generate(greedy_request(*pn)), zip(prompts, max_tokens)))
    for i, (alone, concurrent) in enumerate(zip(solo, together)):
        assert concurrent.token_ids == alone.token_ids, f"stream {i} differs when batched"
