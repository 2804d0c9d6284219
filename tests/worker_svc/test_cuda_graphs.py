"""CUDA graphs' plain parts on CPU (worker_svc/cuda_graphs.py): the captured sizes, the
bucket a batch replays, which steps run eagerly, and padding a decode batch into the
graphs' static buffers through the real model (its rows agree with the unpadded batch and
the pads write nothing). Capture and replay run on a GPU in bench/gpu_check.sh; the Triton
backend's fixed graph plan is checked in tests/kernels/test_triton_runner.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemesh.tools.testing.tiny_models import write_tiny_model
from tests.support.runner_script import (
    BLOCK_SIZE,
    ScriptedRequest,
    drive,
    padded_decode_matches,
    random_prompt,
)
from worker_svc.attention import AttentionMetadata
from worker_svc.cuda_graphs import (
    PAD_SLOT,
    StaticDecodeInputs,
    bucket,
    capture_sizes,
    eager_reason,
    parse_capture_sizes,
)
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig, graph_sizes


def test_capture_sizes_are_vllms_buckets_up_to_the_largest_batch():
    assert capture_sizes(128) == (1, 2, 4, *range(8, 129, 8))
    assert capture_sizes(5) == (1, 2, 4, 5)  # the largest batch always has a graph
    assert capture_sizes(1) == (1,)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(4096)[-1] == 512
    with pytest.raises(ValueError, match="at least 1"):
        capture_sizes(0)


def test_parse_capture_sizes():
    assert parse_capture_sizes("8, 1,2,2") == (1, 2, 8)
    for bad in ("", "0,1", "one", "1;2"):
        with pytest.raises(ValueError, match="--cuda-graph-sizes"):
            parse_capture_sizes(bad)


def test_a_batch_replays_the_smallest_graph_that_holds_it():
    sizes = capture_sizes(64)
    assert [bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket(65, sizes) is None


def test_which_steps_run_eagerly():
    sizes = capture_sizes(16)
    assert eager_reason({"a": 1, "b": 1}, sizes) is None
    assert "prefill" in eager_reason({"a": 1, "b": 7}, sizes)
    assert "more than the largest graph (16)" in eager_reason({str(i): 1 for i in range(17)}, sizes)
    assert "pipeline stage" in eager_reason({"a": 1}, sizes, later_stage=True)
    assert eager_reason({}, sizes) == "no tokens to compute"
    assert eager_reason({"a": 1}, ()) == "no graphs were captured"


def test_graphs_only_on_cuda_and_not_when_eager():
    config = RunnerConfig(model_path="m", device="cuda", max_num_seqs=24)
    assert graph_sizes(config) == (1, 2, 4, 8, 16, 24)
    assert graph_sizes(RunnerConfig(model_path="m", device="cuda", enforce_eager=True)) == ()
    assert graph_sizes(RunnerConfig(model_path="m", device="cpu")) == ()
    assert graph_sizes(RunnerConfig(model_path="m", device="cuda", cuda_graph_sizes=(1, 3))) == (
        1,
        3,
    )


def test_static_inputs_pad_the_bucket_and_refuse_what_does_not_fit():
    inputs = StaticDecodeInputs(8, max_blocks_per_seq=4, device="cpu")
    inputs.slot_mapping.fill_(99)  # a previous, larger step's values
    inputs.seq_lens.fill_(99)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([5, 9, 14]),
        block_tables=torch.tensor([[1, 2], [2, 0], [3, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([6, 2, 3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
    )
    inputs.load(torch.tensor([7, 8, 9]), torch.tensor([5, 1, 2]), metadata, size=4)
    view = inputs.metadata(4)
    assert view.slot_mapping.tolist() == [5, 9, 14, PAD_SLOT]
    assert view.seq_lens.tolist() == [6, 2, 3, 1]
    assert view.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert view.block_tables.tolist() == [[1, 2, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0], [0] * 4]
    assert inputs.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert inputs.metadata(4) is view  # the object a graph captured with
    with pytest.raises(ValueError, match="does not fit a graph of 2 rows"):
        inputs.load(torch.tensor([7, 8, 9]), torch.tensor([5, 1, 2]), metadata, size=2)
    wide = AttentionMetadata(
        metadata.slot_mapping,
        torch.zeros(3, 5, dtype=torch.int32),
        metadata.seq_lens,
        metadata.query_start_loc,
    )
    with pytest.raises(ValueError, match="wider than the graphs' 4"):
        inputs.load(torch.tensor([7, 8, 9]), torch.tensor([5, 1, 2]), wide, size=4)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), num_hidden_layers=2)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_padded_decode_batch_matches_the_unpadded_one(tiny_llama: Path, backend: str):
    runner = ModelRunner.from_config(
        RunnerConfig(
            model_path=str(tiny_llama),
            block_size=BLOCK_SIZE,
            num_blocks=48,
            attention_backend=backend,
        )
    )
    vocab_size = runner.info().vocab_size
    requests = [
        ScriptedRequest(name, random_prompt(length, vocab_size, seed), join_step=0)
        for name, length, seed in (("a", 11, 1), ("b", 3, 2), ("c", 17, 3))
    ]
    drive(runner, requests, 3)
    padded_decode_matches(runner, requests, size=8)
