"""FP8 and AWQ checkpoints (written by the published layouts in checkpoints.py) served by
the runner against transformers running the dequantized weights.

Tolerance for per-layer outputs: everything runs in fp32 and both sides multiply by the
same dequantized weights, so decoder-layer outputs agree to rounding: within
rtol = atol = 1e-4 (observed ~1e-6; the attention kernels sum in different orders).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagemesh.tools.testing.quant_checkpoints import (
    dequantized_hf_model,
    write_awq_checkpoint,
    write_fp8_checkpoint,
)
from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.step import NewRequestData, SamplingParams, SchedulerOutput
from tests.support.hf_reference import assert_greedy_close, hf_greedy_with_logits
from tests.support.runner_script import ScriptedRequest, drive, random_prompt
from worker_svc.convert import worker_info_to_pb
from worker_svc.loader import load_model
from worker_svc.model.matmul import packed_weight_bytes
from worker_svc.parallel import ParallelConfig
from worker_svc.quant import AwqWeight, Fp8Weight
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

BLOCK_SIZE = 4
NUM_NEW_TOKENS = 10
# Layer outputs reach ~250 here: fp32 noise through three quantized layers is a few 1e-4
# in absolute terms (the fused RMSNorm sums squares in another order than torch, which
# alone moves it from 1.1e-4 to 2.6e-4), so atol scales with the output's magnitude.
# A real bug (a wrong scale, eps or rotary) moves outputs by 1e-2 and more.
LAYER_RTOL, LAYER_ATOL_PER_MAGNITUDE = 1e-4, 4e-6

CHECKPOINTS = {
    "fp8_per_tensor": lambda plain, out: write_fp8_checkpoint(plain, out, per_channel=False),
    "fp8_per_channel": lambda plain, out: write_fp8_checkpoint(plain, out, per_channel=True),
    "awq_g32": lambda plain, out: write_awq_checkpoint(plain, out, group_size=32),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    # Qwen2: q/k/v biases, which quantized layers keep in full precision.
    return write_tiny_model(tmp_path_factory.mktemp("plain") / "model", arch="qwen2")


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def quantized(request, plain, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "model"
    dequantized = CHECKPOINTS[request.param](plain, out)
    return out, dequantized_hf_model(plain, dequantized)


def make_runner(path: Path, **overrides) -> ModelRunner:
    return ModelRunner.from_config(
        RunnerConfig(model_path=str(path), block_size=BLOCK_SIZE, num_blocks=48, **overrides)
    )


def scripted_requests() -> list[ScriptedRequest]:
    return [
        ScriptedRequest("a", random_prompt(9, 512, 1), join_step=0),
        ScriptedRequest("b", random_prompt(15, 512, 2), join_step=0, prefill_chunk=6),
        ScriptedRequest("c", random_prompt(4, 512, 3), join_step=3),
    ]


def assert_matches_hf(runner: ModelRunner, hf_model) -> None:
    requests = scripted_requests()
    drive(runner, requests, NUM_NEW_TOKENS)
    for request in requests:
        assert_greedy_close(
            request.outputs, *hf_greedy_with_logits(hf_model, request.prompt, NUM_NEW_TOKENS)
        )


def test_greedy_tokens_match_dequantized_transformers(quantized) -> None:
    path, hf_model = quantized
    runner = make_runner(path)  # quantization "auto": what the checkpoint says
    info = runner.info()
    kind = AwqWeight if info.quantization == "awq" else Fp8Weight
    assert info.quantization == path.parent.name.split("_")[0][:3]
    assert isinstance(runner.model.model.layers[0].mlp.down_proj.packed_weight, kind)
    assert_matches_hf(runner, hf_model)


@torch.inference_mode()
def test_decoder_layer_outputs_within_tolerance(quantized) -> None:
    path, hf_model = quantized
    runner = make_runner(path)
    ours: list[torch.Tensor] = []
    for layer in runner.model.model.layers:
        layer.register_forward_hook(lambda _m, _i, out: ours.append(out[0] + out[1]))
    theirs: list[torch.Tensor] = []
    for layer in hf_model.model.layers:
        layer.register_forward_hook(
            lambda _m, _i, out: theirs.append((out[0] if isinstance(out, tuple) else out)[0])
        )
    prompt = random_prompt(12, 512, 7)
    new = NewRequestData(
        "p", prompt, len(prompt), list(range(3)), 0, SamplingParams(temperature=0.0)
    )
    runner.execute_step(SchedulerOutput(0, [new], num_scheduled_tokens={"p": len(prompt)}))
    hf_model(torch.tensor([prompt]))
    assert len(ours) == len(theirs) == 3
    for index, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(
            a,
            b,
            rtol=LAYER_RTOL,
            atol=LAYER_ATOL_PER_MAGNITUDE * float(b.abs().max()),
            msg=f"layer {index}",
        )


def test_fp8_quantized_at_load_matches_its_dequantization(plain, tmp_path) -> None:
    """--quantization fp8 on a plain checkpoint: per-channel absmax / 448 scales."""
    from safetensors.torch import load_file

    runner = make_runner(plain, quantization="fp8")
    info = runner.info()
    assert info.quantization == "fp8"
    dequantized = {}
    for name, w in load_file(str(plain / "model.safetensors")).items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0
            dequantized[name] = (w / scale).to(torch.float8_e4m3fn).float() * scale
    down = runner.model.model.layers[1].mlp.down_proj.packed_weight
    expected = dequantized["model.layers.1.mlp.down_proj.weight"]
    torch.testing.assert_close(down.weight.float() * down.scale[:, None], expected, rtol=0, atol=0)
    assert_matches_hf(runner, dequantized_hf_model(plain, dequantized))


def test_weight_memory_is_reported(plain) -> None:
    plain_info = make_runner(plain, quantization="none", cpu_linear="torch").info()
    fp8 = make_runner(plain, quantization="fp8", cpu_linear="torch")
    assert plain_info.quantization == "none"
    assert fp8.info().weight_bytes == packed_weight_bytes(fp8.model)
    # Linear weights: 1 byte + 4 / in_features per weight instead of 4 bytes.
    assert fp8.info().weight_bytes < plain_info.weight_bytes * 0.75
    reply = worker_info_to_pb(fp8.info(), "w0", {})  # GetWorkerInfo carries both
    assert (reply.quantization, reply.weight_bytes) == ("fp8", fp8.info().weight_bytes)


def _rewrite_config(path: Path, **quantization: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (path / "config.json").write_text(json.dumps(config))


def test_bad_quantization_configs_are_clear_errors(plain, tmp_path) -> None:
    awq = tmp_path / "awq"
    write_awq_checkpoint(plain, awq, group_size=64)
    # o_proj under tp=2 holds 32 input features: not a whole group of 64.
    with pytest.raises(ValueError, match="group"):
        load_model(awq, parallel=ParallelConfig(tp_size=2, tp_rank=1))
    with pytest.raises(ValueError, match="--quantization awq or auto"):
        load_model(awq, quantization="fp8")
    with pytest.raises(ValueError, match="needs an AWQ checkpoint"):
        load_model(plain, quantization="awq")
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(plain, quantization="int3")
    _rewrite_config(awq, bits=8)
    with pytest.raises(ValueError, match="bits=8"):
        load_model(awq)
    _rewrite_config(awq, bits=4, version="gemv")
    with pytest.raises(ValueError, match="'gemv'"):
        load_model(awq)
    fp8 = tmp_path / "fp8"
    write_fp8_checkpoint(plain, fp8, per_channel=True)
    _rewrite_config(fp8, format="pack-quantized")
    with pytest.raises(ValueError, match="pack-quantized"):
        load_model(fp8)
