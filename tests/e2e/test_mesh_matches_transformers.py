"""Through the full mesh, greedy tokens and their logprobs equal `transformers` on the same
weights, for every architecture: alone, and as 16 concurrent streams of different lengths.

The models are realistic random ones (`write_realistic_model`: weights of std 0.02 and
attention as peaked as a trained model's, not the peaky std 0.4 of the plumbing tests), so
top-2 logits lie close and a small numerical error (a norm epsilon, a rotary detail, a
softmax scale) would move tokens and logprobs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagemesh.tools.testing.tiny_models import write_realistic_model
from protos.pagemesh.v1 import generate_pb2
from tests.support.hf_reference import (
    LOGPROB_BOUND_FP32,
    assert_logprobs_close,
    hf_greedy_with_logits,
)
from tests.support.mesh_harness import Mesh, greedy_request

NUM_CONCURRENT = 16
NUM_TOP_LOGPROBS = 5


def prompts_for(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def arch_mesh(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, Mesh]]:
    arch = request.param
    folder = write_realistic_model(tmp_path_factory.mktemp(arch) / f"tiny-{arch}", arch, seed=7)
    mesh = Mesh(
        str(folder),
        tmp_path_factory.mktemp("logs") / f"{arch}.log",
        redis_url=redis_url,
        cluster=f"e2e-match-{arch}",
    )
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

    solo = [
        mesh.generate(greedy_request(p, n, logprobs=NUM_TOP_LOGPROBS))
        for p, n in zip(prompts, max_tokens)
    ]
    worst = 0.0
    for prompt, n, result in zip(prompts, max_tokens, solo):
        assert result.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert result.completion_tokens == n and result.prompt_tokens == len(prompt)
        assert all(len(lp.top) == NUM_TOP_LOGPROBS for lp in result.logprobs)
        worst = max(
            worst,
            assert_logprobs_close(
                result.token_ids, list(result.logprobs), *hf_greedy_with_logits(model, prompt, n)
            ),
        )
    print(f"{arch}: worst logprob difference from transformers {worst:.2e} (fp32)")

    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        together = list(
            pool.map(
                lambda pn: mesh.generate(greedy_request(*pn, logprobs=NUM_TOP_LOGPROBS)),
                zip(prompts, max_tokens),
            )
        )
    for i, (alone, concurrent) in enumerate(zip(solo, together)):
        assert concurrent.token_ids == alone.token_ids, f"stream {i} differs when batched"
        gaps = [abs(a.logprob - b.logprob) for a, b in zip(alone.logprobs, concurrent.logprobs)]
        assert max(gaps) <= LOGPROB_BOUND_FP32, (
            f"stream {i}: logprobs move by {max(gaps):.3g} batched"
        )


# Per architecture, one setting of every filter the sampler has (the first output token, so
# presence and frequency penalties, which count output tokens only, cannot act; the
# repetition penalty acts on the prompt's tokens).
SAMPLING_SETTINGS = {
    "llama": dict(temperature=0.05, top_k=40, top_p=0.9),
    "mistral": dict(temperature=0.1, top_k=16),
    "qwen2": dict(temperature=0.08, min_p=0.05, repetition_penalty=1.5),
    "qwen3": dict(temperature=0.08, top_k=30, top_p=0.95, min_p=0.05),
}
NUM_DRAW_REQUESTS, DRAWS_PER_REQUEST = 200, 16  # 3,200 seeded draws per setting
FALSE_FAILURE_RATE = 1e-4  # per setting: the chance a correct sampler fails for random seeds


@torch.inference_mode()
def _expected_first_token(model: torch.nn.Module, prompt: list[int], setting: dict) -> torch.Tensor:
    """The first token's distribution under `setting`, computed by transformers' own logits
    processors in its warper order (repetition penalty, temperature, top-k, top-p, min-p)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([prompt])
    scores = model(ids).logits[:, -1].double()
    processors = [
        RepetitionPenaltyLogitsProcessor(setting.get("repetition_penalty", 1.0)),
        TemperatureLogitsWarper(setting["temperature"]),
    ]
    if "top_k" in setting:
        processors.append(TopKLogitsWarper(setting["top_k"]))
    if "top_p" in setting:
        processors.append(TopPLogitsWarper(setting["top_p"]))
    if "min_p" in setting:
        processors.append(MinPLogitsWarper(setting["min_p"]))
    for processor in processors:
        scores = processor(ids, scores)
    return torch.softmax(scores, dim=-1)[0]


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of draw counts against `probs`; tokens expected fewer than 5 times
    share one bin."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed_bins = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    expected_bins = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if expected_bins[-1] < 5:  # too little left over for a bin of its own: fold it in
        observed_bins[-2] += observed_bins[-1]
        expected_bins[-2] += expected_bins[-1]
        observed_bins, expected_bins = observed_bins[:-1], expected_bins[:-1]
    statistic = float(((observed_bins - expected_bins) ** 2 / expected_bins).sum())
    dof = len(expected_bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


def test_seeded_draws_follow_transformers_distribution(arch_mesh: tuple[str, Path, Mesh]) -> None:
    """3,200 seeded draws of the first token through the mesh (n = 16 samples a request)
    against the distribution transformers' processors give. With the seeds fixed the test is
    deterministic; for seeds drawn at random a correct sampler would fail it with probability
    FALSE_FAILURE_RATE per setting (its p-value threshold)."""
    arch, folder, mesh = arch_mesh
    setting = SAMPLING_SETTINGS[arch]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = prompts_for(model.config.vocab_size, [12], seed=5)[0]
    probs = _expected_first_token(model, prompt, setting)

    def draws(k: int) -> list[int]:
        request = greedy_request(prompt, 1, n=DRAWS_PER_REQUEST)
        for name, value in setting.items():
            setattr(request.sampling, name, value)
        request.sampling.seed = 10_000 + DRAWS_PER_REQUEST * k  # samples draw with seed + i
        return mesh.generate(request).token_ids

    with ThreadPoolExecutor(8) as pool:
        tokens = [t for batch in pool.map(draws, range(NUM_DRAW_REQUESTS)) for t in batch]
    assert len(tokens) == NUM_DRAW_REQUESTS * DRAWS_PER_REQUEST
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    outside = sorted(set(tokens) - set(torch.nonzero(probs).flatten().tolist()))
    assert not outside, f"tokens the filters exclude were drawn: {outside}"
    p_value = _chi_square_p_value(counts, probs)
    print(f"{arch} {setting}: chi-square p = {p_value:.3f} over {len(tokens)} draws")
    assert p_value > FALSE_FAILURE_RATE, (arch, setting, p_value)
