"""Through the full mesh, greedy tokens and their logprobs equal `transformers` on the same
weights, for every architecture: alone, and as 16 concurrent streams of different lengths.

The models are realistic random ones (weights of std 0.02, as trained checkpoints have, not
the peaky 0.4 of the other tests), so top-2 logits lie close and a small numerical error
(a norm epsilon, a rotary detail, a softmax scale) would move tokens and logprobs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.pagemesh.v1 import generate_pb2
from pagemesh.testing.tiny_models import write_tiny_model
from tests.support.hf_reference import (
    LOGPROB_BOUND_FP32,
    assert_logprobs_close,
    hf_greedy_with_logits,
)
from tests.support.mesh_harness import Mesh, greedy_request

NUM_CONCURRENT = 16
NUM_TOP_LOGPROBS = 5
REALISTIC_STD = 0.02


def prompts_for(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def arch_mesh(request: pytest.FixtureRequest, redis_url: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Mesh]]:
    arch = request.param
    folder = write_tiny_model(tmp_path_factory.mktemp(arch) / f"tiny-{arch}", arch, seed=7,
                              std=REALISTIC_STD)
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

    solo = [mesh.generate(greedy_request(p, n, logprobs=NUM_TOP_LOGPROBS))
            for p, n in zip(prompts, max_tokens)]
    worst = 0.0
    for prompt, n, result in zip(prompts, max_tokens, solo):
        assert result.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert result.completion_tokens == n and result.prompt_tokens == len(prompt)
        assert all(len(lp.top) == NUM_TOP_LOGPROBS for lp in result.logprobs)
        worst = max(worst, assert_logprobs_close(result.token_ids, list(result.logprobs),
                                                 *hf_greedy_with_logits(model, prompt, n)))
    print(f"{arch}: worst logprob difference from transformers {worst:.2e} (fp32)")

    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        together = list(pool.map(
            lambda pn: mesh.generate(greedy_request(*pn, logprobs=NUM_TOP_LOGPROBS)),
            zip(prompts, max_tokens)))
    for i, (alone, concurrent) in enumerate(zip(solo, together)):
        assert concurrent.token_ids == alone.token_ids, f"stream {i} differs when batched"
        gaps = [abs(a.logprob - b.logprob) for a, b in zip(alone.logprobs, concurrent.logprobs)]
        assert max(gaps) <= LOGPROB_BOUND_FP32, f"stream {i}: logprobs move by {max(gaps):.3g} batched"
