"""Speculative decoding through the mesh: `pagemesh up --pp 2 --speculative-config ...`,
with n-grams (the scheduler drafts) and with a draft model (the last stage's driver drafts
at the end of each step, and the drafts come back with its tokens). The last pipeline
stage verifies, every stage learns the kept tokens from the next step: greedy answers equal
transformers' (tokens and logprobs), a seeded sample equals the offline engine's without
speculation, and the group's counters show the drafts. One-token n-grams on a random model:
most drafts are rejected, so the rollback is under test; the draft model is the served
model itself, so nearly all are kept (the draft's KV follows the target's across stages)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagemesh import LLM, SamplingParams
from protos.pagemesh.v1 import generate_pb2
from tests.support.mesh_harness import Mesh, greedy_request, scheduler_stats

CLUSTER = "e2e-spec"
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
PROMPTS = [[5, 17, 33, 101, 7, 250, 3] * 3, [9, 8, 7, 6, 5, 4, 3, 2] * 2, [40, 41, 40, 41, 40]]


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def mesh(
    request: pytest.FixtureRequest,
    tiny_llama_dir: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Mesh]:
    config = (
        NGRAM
        if request.param == "ngram"
        else {"model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    )
    mesh = Mesh(
        str(tiny_llama_dir),
        tmp_path_factory.mktemp("logs") / "spec.log",
        redis_url=redis_url,
        cluster=CLUSTER,
        extra_args=["--pp", "2", "--dtype", "float32", "--speculative-config", json.dumps(config)],
    )
    mesh.method = request.param  # type: ignore[attr-defined]
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def test_greedy_answers_equal_transformers(
    mesh: Mesh, tiny_llama_dir: Path, redis_url: str
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        got = mesh.generate(greedy_request(prompt, 24, logprobs=1))
        ids, expected, logprobs = torch.tensor([prompt]), [], []
        with torch.no_grad():
            for _ in range(24):
                scores = model(input_ids=ids).logits[0, -1].log_softmax(-1)
                expected.append(int(scores.argmax()))
                logprobs.append(float(scores.max()))
                ids = torch.cat([ids, torch.tensor([[expected[-1]]])], dim=1)
        assert got.token_ids == expected, mesh.log()
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(logprobs, abs=1e-4)
    stats = scheduler_stats(redis_url, CLUSTER)
    assert 0 < stats.num_drafts <= stats.num_draft_tokens, stats
    if mesh.method == "draft_model":  # type: ignore[attr-defined]
        assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, stats
    # The request's own counts, in its usage (the last chunk's).
    chunks = list(mesh.stub.Generate(greedy_request(PROMPTS[2], 24), timeout=120))
    usage = chunks[-1].usage
    assert usage.completion_tokens == 24 and usage.num_draft_tokens > 0
    assert 0 <= usage.num_accepted_tokens <= usage.num_draft_tokens


def test_a_seeded_sample_equals_the_engine_without_speculation(
    mesh: Mesh, tiny_llama_dir: Path
) -> None:
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=PROMPTS[0]))
    request.sampling.temperature, request.sampling.top_p, request.sampling.seed = 0.9, 0.95, 21
    request.stopping.max_tokens, request.stopping.ignore_eos = 24, True
    got = mesh.generate(request)
    with LLM(str(tiny_llama_dir), dtype="float32") as plain:
        expected = (
            plain.generate(
                [{"prompt_token_ids": PROMPTS[0]}],
                SamplingParams(
                    temperature=0.9, top_p=0.95, seed=21, max_tokens=24, ignore_eos=True
                ),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .token_ids
        )
    assert got.token_ids == list(expected)
