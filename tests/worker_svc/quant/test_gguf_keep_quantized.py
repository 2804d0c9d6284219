"""`--gguf-keep-quantized`: GGUF linear layers kept as blocks and dequantized per matmul
give exactly what dequantizing at load gives (worker_svc/quant/gguf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch.nn import functional as F

from pagemesh.tools.testing.tiny_models import write_tiny_model
from tests.support.parallel_harness import LocalWorkerGroup
from tests.support.runner_script import ScriptedRequest, drive, random_prompt
from tests.worker_svc.test_loader import (
    add_gguf_header,
    greedy_tokens,
    hf_state_dict,
    hf_to_gguf_name,
    llama_cpp_permute,
)
from worker_svc.loader import load_model
from worker_svc.model.matmul import PreparableLinear
from worker_svc.quant.gguf import GGUF_KEEP_TYPES, GgufWeight, dequantize_gguf, gguf_block_size
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

PROMPT = [1, 7, 42, 99, 3, 250, 17, 5, 300, 11]
NUM_NEW_TOKENS = 12
# Per projection: mixed types inside one fused layer (q|k|v, gate|up) too.
MIXED = {
    "q_proj": "Q4_0",
    "k_proj": "Q4_0",
    "v_proj": "Q8_0",
    "o_proj": "Q5_1",
    "gate_proj": "Q4_1",
    "up_proj": "Q5_0",
    "down_proj": "Q8_0",
}


def write_quantized_gguf(hf_path: Path, out: Path, types: str | dict[str, str]) -> Path:
    """A tiny HF llama as GGUF (llama.cpp's layout) with its linear weights quantized with
    `gguf.quants.quantize`: one type for all, or one per projection (see MIXED)."""
    import gguf

    config = json.loads((hf_path / "config.json").read_text())
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny")
    add_gguf_header(writer, config)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"])
    for name, tensor in hf_state_dict(hf_path).items():
        array = tensor.numpy().astype(np.float32)
        if name.endswith("self_attn.q_proj.weight"):
            array = llama_cpp_permute(array, num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = llama_cpp_permute(array, num_kv_heads)
        leaf = name.rsplit(".", 2)[-2]
        if name.endswith("proj.weight"):
            qtype = gguf.GGMLQuantizationType[types if isinstance(types, str) else types[leaf]]
            writer.add_tensor(
                hf_to_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype
            )
        else:
            writer.add_tensor(hf_to_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    # intermediate 96 = 3 blocks of 32: under tp=2 down_proj's input halves are not whole
    # blocks (dequantized at load), o_proj's are.
    return write_tiny_model(tmp_path_factory.mktemp("gguf_keep"), "llama", intermediate_size=96)


@pytest.mark.parametrize("type_name", GGUF_KEEP_TYPES)
def test_dequantize_equals_gguf_bit_for_bit(type_name: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf_block_size(type_name)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (6, 3 * type_size), dtype=np.uint8)  # every bit pattern
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
    ours = dequantize_gguf(torch.from_numpy(raw.copy()), type_name)
    assert ours.shape == (6, 3 * block_size) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=0, atol=0, equal_nan=True)
    if type_name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # real quantized values too
        weights = rng.standard_normal((5, 4 * block_size)).astype(np.float32)
        blocks = gguf.quants.quantize(weights, qtype)
        torch.testing.assert_close(
            dequantize_gguf(torch.from_numpy(blocks), type_name),
            torch.from_numpy(gguf.quants.dequantize(blocks, qtype)),
            rtol=0,
            atol=0,
        )


def test_gguf_weight_rejects_wrong_shapes() -> None:
    with pytest.raises(ValueError, match="Q4_1 blocks"):
        GgufWeight([("Q4_1", torch.zeros(4, 21, dtype=torch.uint8))], 32)


@pytest.mark.parametrize("types", ["Q8_0", "Q4_0", "Q4_1", "mixed"])
def test_keep_quantized_equals_dequantize_at_load(
    tiny_hf: Path, tmp_path: Path, types: str
) -> None:
    path = write_quantized_gguf(
        tiny_hf, tmp_path / "tiny.gguf", MIXED if types == "mixed" else types
    )
    # fp32 named: a quantized GGUF is bf16 under auto on a CPU with native bf16, and the
    # bit-for-bit claims below are about fp32 activations.
    plain, plain_meta = load_model(path, dtype="float32")
    kept, kept_meta = load_model(path, dtype="float32", gguf_keep_quantized=True)
    assert plain_meta.quantization == "none"
    expected_label = (
        "gguf-q4_0+q4_1+q5_0+q5_1+q8_0" if types == "mixed" else f"gguf-{types.lower()}"
    )
    assert kept_meta.quantization == expected_label
    # 17 rows: dequantized then F.linear, bit for bit the plain path. 5 rows (decoding):
    # the fused C kernel (kernels/cpu_gguf.c) where it builds, with gguf's exact weights
    # but its own summation order.
    x = torch.randn(17, 96, generator=torch.Generator().manual_seed(1))
    for (name, module), (_, kept_module) in zip(plain.named_modules(), kept.named_modules()):
        if not isinstance(module, PreparableLinear) or not name.startswith("model.layers"):
            continue
        assert isinstance(kept_module.packed_weight, GgufWeight), name
        assert torch.equal(kept_module.packed_weight.dequantize(), module.weight), name
        inputs = x[:, : module.weight.shape[1]]
        assert torch.equal(kept_module(inputs), module(inputs)), name
        torch.testing.assert_close(
            kept_module(inputs[:5]), module(inputs[:5]), rtol=1e-5, atol=1e-5, msg=name
        )
    # The tiny models keep their top logits well apart: the same tokens.
    runners = [
        ModelRunner(model, meta, num_blocks=8, block_size=4, cpu_linear="torch")
        for model, meta in ((plain, plain_meta), (kept, kept_meta))
    ]
    tokens = [greedy_tokens(runner, PROMPT, NUM_NEW_TOKENS) for runner in runners]
    assert tokens[0] == tokens[1]
    plain_bytes, kept_bytes = (r.info().weight_bytes for r in runners)
    assert kept_bytes < plain_bytes


def test_tp2_tokens_equal_tp1(tiny_hf: Path, tmp_path: Path) -> None:
    path = write_quantized_gguf(tiny_hf, tmp_path / "tiny.gguf", "Q4_1")
    config = RunnerConfig(
        model_path=str(path),
        block_size=4,
        num_blocks=32,
        dtype="float32",
        cpu_linear="torch",
        gguf_keep_quantized=True,
    )

    def requests() -> list[ScriptedRequest]:
        return [
            ScriptedRequest("a", random_prompt(9, 512, 1), join_step=0),
            ScriptedRequest("b", random_prompt(13, 512, 2), join_step=1, prefill_chunk=5),
        ]

    expected = requests()
    drive(ModelRunner.from_config(config), expected, 8)
    with LocalWorkerGroup(2, 1) as group:
        infos = group.load(config)
        assert {info.quantization for info in infos} == {"gguf-q4_1"}
        grouped = requests()
        drive(group, grouped, 8)
    assert [r.outputs for r in grouped] == [r.outputs for r in expected]


def test_row_parallel_shard_off_block_boundaries_is_dequantized_at_load(
    tiny_hf: Path, tmp_path: Path, caplog
) -> None:
    from worker_svc.loader import open_source
    from worker_svc.model.llama import LlamaForCausalLM
    from worker_svc.parallel import ParallelConfig
    from worker_svc.quant.gguf import GgufKeptLoad

    source = open_source(write_quantized_gguf(tiny_hf, tmp_path / "tiny.gguf", "Q4_1"))
    with torch.device("meta"):
        model = LlamaForCausalLM(source.config, 64, ParallelConfig(tp_size=2, tp_rank=1))
    with caplog.at_level("INFO", logger="worker_svc.quant.gguf"):
        kept = GgufKeptLoad(model, source.gguf_tensor_types)
    # down_proj's input halves [48, 96) are not whole blocks of 32; o_proj's [32, 64) are.
    assert not any(path.endswith("down_proj") for path in kept.layers)
    assert sum(path.endswith("o_proj") for path in kept.layers) == 3
    assert "not whole Q4_1 blocks" in caplog.text


def test_keep_quantized_needs_a_gguf(tiny_hf: Path) -> None:
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(tiny_hf, gguf_keep_quantized=True)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_fused_cpu_kernel_matches_dequantize_then_linear(type_name: str, rows: int) -> None:
    from kernels import cpu_native

    if cpu_native.compiler() is None:
        pytest.skip("no C compiler (cc/gcc/$CC) on PATH")
    assert cpu_native.library("cpu_gguf") is not None, cpu_native.build_error("cpu_gguf")
    rng = np.random.default_rng(rows)
    weights = rng.standard_normal((40, 256)).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(weights, getattr(gguf.GGMLQuantizationType, type_name))
    layer = GgufWeight([(type_name, torch.from_numpy(blocks.view(np.uint8).reshape(40, -1)))], 256)
    x = torch.from_numpy(rng.standard_normal((rows, 256)).astype(np.float32))
    bias = torch.arange(40, dtype=torch.float32)
    fused = layer._fused_matmul(x)
    assert fused is not None
    torch.testing.assert_close(
        layer.apply(x, bias), F.linear(x, layer.dequantize(), bias), rtol=1e-5, atol=1e-5
    )
    assert layer._fused_matmul(torch.zeros(17, 256)) is None  # many rows: dequantized
