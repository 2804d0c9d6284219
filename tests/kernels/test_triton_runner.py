"""The worker with `attention_backend="triton"` (Triton's interpreter on CPU) produces the
torch backend's greedy tokens through continuous batching and chunked prefill."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.tiny_models import write_tiny_model  # noqa: E402
from tests.worker.test_runner_vs_hf import (  # noqa: E402
    BLOCK_SIZE,
    ScriptedRequest,
    drive,
    random_prompt,
)
from worker_svc.attention import (  # noqa: E402
    TorchAttentionBackend,
    TritonAttentionBackend,
    get_attention_backend,
)
from worker_svc.runner import ModelRunner, RunnerConfig  # noqa: E402

NUM_NEW_TOKENS = 5


def test_backend_choice():
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("triton", "cpu"), TritonAttentionBackend)
    assert os.environ["TRITON_INTERPRET"] == "1"
    # Constructing touches no GPU: the kernels compile on their first launch.
    assert get_attention_backend("auto", "cuda").name == "triton"
    assert get_attention_backend("torch", "cuda").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")


def test_missing_triton_is_a_clear_error(monkeypatch):
    import kernels

    monkeypatch.delattr(kernels, "attention", raising=False)
    monkeypatch.setitem(sys.modules, "kernels.attention", None)  # import now raises
    with pytest.raises(RuntimeError, match="needs the triton package"):
        get_attention_backend("triton", "cpu")


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> Path:
    # Mistral with a sliding window shorter than the prompts: the kernels' window is used.
    return write_tiny_model(tmp_path_factory.mktemp("mistral"), arch="mistral",
                            sliding_window=6, num_hidden_layers=2)


def run_requests(model: Path, backend: str) -> dict[str, list[int]]:
    runner = ModelRunner.from_config(RunnerConfig(
        model_path=str(model), block_size=BLOCK_SIZE, num_blocks=32, attention_backend=backend,
    ))
    assert runner.backend.name == backend
    vocab_size = runner.info().vocab_size
    requests = [
        ScriptedRequest("a", random_prompt(11, vocab_size, 1), join_step=0, prefill_chunk=4),
        ScriptedRequest("b", random_prompt(5, vocab_size, 2), join_step=0),
        ScriptedRequest("c", random_prompt(9, vocab_size, 3), join_step=2, prefill_chunk=6),
    ]
    drive(runner, requests, NUM_NEW_TOKENS)
    return {r.request_id: r.outputs for r in requests}


def test_triton_runner_matches_torch_runner(tiny_mistral: Path):
    torch.manual_seed(0)
    assert run_requests(tiny_mistral, "triton") == run_requests(tiny_mistral, "torch")
