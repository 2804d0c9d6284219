"""Quantized checkpoints under tensor parallelism (a spawned tp=2 gloo group): the same
greedy tokens as one rank. Column-parallel layers take their rows (FP8: with their
per-channel scales; AWQ: whole int32 columns), row-parallel ones their input slice (AWQ:
whole groups), scales replicated."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagemesh.tools.testing.quant_checkpoints import write_awq_checkpoint, write_fp8_checkpoint
from pagemesh.tools.testing.tiny_models import write_tiny_model
from tests.support.parallel_harness import LocalWorkerGroup
from tests.support.runner_script import ScriptedRequest, drive, random_prompt
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

BLOCK_SIZE = 4
NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant_tp")
    plain = write_tiny_model(root / "plain", arch="qwen2")
    write_fp8_checkpoint(plain, root / "fp8_tensor", per_channel=False)
    write_fp8_checkpoint(plain, root / "fp8_channel", per_channel=True)
    write_awq_checkpoint(plain, root / "awq", group_size=32)
    return {"plain": plain} | {p.name: p for p in root.iterdir() if p.name != "plain"}


@pytest.fixture(scope="module")
def tp2():
    group = LocalWorkerGroup(2, 1)
    yield group
    group.close()


def runner_config(path: Path, quantization: str) -> RunnerConfig:
    return RunnerConfig(
        model_path=str(path),
        block_size=BLOCK_SIZE,
        num_blocks=32,
        quantization=quantization,
        cpu_linear="torch",
    )


def scripted_requests() -> list[ScriptedRequest]:
    return [
        ScriptedRequest("a", random_prompt(9, 512, 1), join_step=0),
        ScriptedRequest("b", random_prompt(13, 512, 2), join_step=1, prefill_chunk=5),
    ]


@pytest.mark.parametrize(
    ("checkpoint", "quantization"),
    [
        ("fp8_tensor", "auto"),
        ("fp8_channel", "auto"),
        ("awq", "auto"),
        ("plain", "fp8"),  # quantized at load, per rank
    ],
)
def test_tp2_tokens_equal_tp1(tp2, checkpoints, checkpoint, quantization) -> None:
    config = runner_config(checkpoints[checkpoint], quantization)
    single = ModelRunner.from_config(config)
    expected = scripted_requests()
    drive(single, expected, NUM_NEW_TOKENS)
    infos = tp2.load(config)
    assert {info.quantization for info in infos} == {single.info().quantization} - {"none"}
    # Each rank holds half of every linear layer (embedding and LM head rows too).
    for info in infos:
        assert info.weight_bytes < 0.6 * single.info().weight_bytes
    grouped = scripted_requests()
    drive(tp2, grouped, NUM_NEW_TOKENS)
    assert [r.outputs for r in grouped] == [r.outputs for r in expected]
