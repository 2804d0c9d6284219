"""The worker with `attention_backend="triton"` (Triton's interpreter on CPU) produces the
torch backend's greedy tokens through continuous batching and chunked prefill."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pagemesh.tools.testing.tiny_models import write_tiny_model  # noqa: E402
from tests.support.runner_script import (  # noqa: E402
    BLOCK_SIZE,
    ScriptedRequest,
    drive,
    random_prompt,
)
from worker_svc.attention import (  # noqa: E402
    TorchAttentionBackend,
    TritonAttentionBackend,
    get_attention_backend,
    needs_triton_interpreter,
)
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.runner_config import RunnerConfig  # noqa: E402

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


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    # The backend only checks: setting TRITON_INTERPRET is the process's startup's job.
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1 set before"):
        get_attention_backend("triton", "cpu")
    assert "TRITON_INTERPRET" not in os.environ


def test_the_worker_startup_sets_the_interpreter_for_triton_on_cpu(monkeypatch, caplog):
    from kernels import cpu_native
    from worker_svc.main import configure_kernels

    assert needs_triton_interpreter("triton", "cpu")
    assert not needs_triton_interpreter("triton", "cuda")
    assert not needs_triton_interpreter("auto", "cpu")
    previous = cpu_native.current_config()
    monkeypatch.delenv("TRITON_INTERPRET")
    try:
        configure_kernels(argparse.Namespace(attention_backend="torch", device="cpu"))
        assert "TRITON_INTERPRET" not in os.environ
        with caplog.at_level("INFO", logger="worker_svc.main"):
            configure_kernels(argparse.Namespace(attention_backend="triton", device="cpu"))
    finally:
        cpu_native.configure(previous)
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert "TRITON_INTERPRET=1" in caplog.text
    assert isinstance(get_attention_backend("triton", "cpu"), TritonAttentionBackend)


def test_missing_triton_is_a_clear_error(monkeypatch):
    import kernels

    monkeypatch.delattr(kernels, "attention", raising=False)
    monkeypatch.setitem(sys.modules, "kernels.attention", None)  # import now raises
    with pytest.raises(RuntimeError, match="needs the triton package"):
        get_attention_backend("triton", "cpu")


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> Path:
    # Mistral with a sliding window shorter than the prompts: the kernels' window is used.
    return write_tiny_model(
        tmp_path_factory.mktemp("mistral"), arch="mistral", sliding_window=6, num_hidden_layers=2
    )


def run_requests(model: Path, backend: str) -> dict[str, list[int]]:
    runner = ModelRunner.from_config(
        RunnerConfig(
            model_path=str(model),
            block_size=BLOCK_SIZE,
            num_blocks=32,
            attention_backend=backend,
        )
    )
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


def test_the_graph_plan_attends_like_an_eager_step(tmp_path: Path):
    """What a CUDA graph captures (worker_svc/cuda_graphs.py): decodes padded into static
    buffers, attended with the plan fixed at max_model_len (split-K over its three
    partitions, those past a context's end returning at once; a sliding window too), agree
    with the eager step."""
    from tests.support.runner_script import padded_decode_matches

    model = write_tiny_model(
        tmp_path,
        arch="mistral",
        sliding_window=6,
        num_hidden_layers=2,
        max_position_embeddings=1536,
    )
    runner = ModelRunner.from_config(
        RunnerConfig(
            model_path=str(model), block_size=BLOCK_SIZE, num_blocks=48, attention_backend="triton"
        )
    )
    assert runner.metadata.max_model_len == 1536
    vocab_size = runner.info().vocab_size
    requests = [
        ScriptedRequest(name, random_prompt(length, vocab_size, seed), join_step=0)
        for name, length, seed in (("a", 11, 1), ("b", 3, 2), ("c", 9, 3))
    ]
    drive(runner, requests, 2)
    max_len = runner.metadata.max_model_len
    padded_decode_matches(
        runner,
        requests,
        size=4,
        fix_plan=lambda metadata, size: runner.backend.fix_decode_plan(metadata, size, max_len),
    )
