"""Quantized checkpoints written from a tiny model by the published layouts (tests, benchmarks).

The packing here is written from the formats' descriptions, not with the code under test:
- FP8 as vLLM writes it (`quant_method: fp8`, per-tensor `weight_scale`, static
  `input_scale`) and as llm-compressor writes it (`compressed-tensors`,
  `float-quantized`, per-channel `weight_scale` [out, 1]);
- AWQ as AutoAWQ's WQLinear_GEMM writes it: `qweight` [in, out/8] and `qzeros`
  [in/group, out/8] int32 with nibble i holding column (0, 2, 4, 6, 1, 3, 5, 7)[i] of
  each 8, `scales` fp16 [in/group, out]; w = (q - z) * s.

Each writer returns the dequantized weights, which the reference transformers model runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _is_linear_weight(name: str) -> bool:
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in LINEARS


def _copy_folder(plain: Path, out: Path) -> dict[str, torch.Tensor]:
    shutil.copytree(plain, out)
    (out / "model.safetensors").unlink()
    return load_file(str(plain / "model.safetensors"))


def _write(out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> None:
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))


def write_fp8_checkpoint(plain: Path, out: Path, *, per_channel: bool) -> dict[str, torch.Tensor]:
    """per_channel: llm-compressor's layout; else vLLM's per-tensor one."""
    tensors = _copy_folder(plain, out)
    dequantized = {}
    for name in [n for n in tensors if _is_linear_weight(n)]:
        w = tensors[name].float()
        absmax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
        scale = absmax / 448.0
        q = (w / scale).to(torch.float8_e4m3fn)
        tensors[name] = q
        tensors[name + "_scale"] = scale.float().contiguous()  # [out, 1] or []
        tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)
        dequantized[name] = q.float() * scale
    if per_channel:
        config = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "channel",
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
        }
    else:
        config = {"quant_method": "fp8", "activation_scheme": "static"}
    _write(out, tensors, config)
    return dequantized


def _pack_columns(values: torch.Tensor) -> torch.Tensor:
    """int [rows, cols] of 0..15 -> int32 [rows, cols / 8], AutoAWQ's nibble order."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, column in enumerate(PACK_ORDER):
        packed |= grouped[:, :, column] << (4 * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def write_awq_checkpoint(
    plain: Path, out: Path, *, group_size: int, bits: int = 4
) -> dict[str, torch.Tensor]:
    """Asymmetric 4-bit min/max quantization per group of `group_size` input features."""
    tensors = _copy_folder(plain, out)
    dequantized = {}
    for name in [n for n in tensors if _is_linear_weight(n)]:
        wt = tensors.pop(name).float().t()  # [in, out]
        in_features, out_features = wt.shape
        groups = wt.reshape(in_features // group_size, group_size, out_features)
        low = groups.amin(dim=1).clamp(max=0)
        high = groups.amax(dim=1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-5).half()  # [groups, out]
        zeros = (-low / scales.float()).round().clamp(0, 15)
        q = (groups / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15)
        base = name.removesuffix("weight")
        tensors[base + "qweight"] = _pack_columns(q.reshape(in_features, out_features))
        tensors[base + "qzeros"] = _pack_columns(zeros)
        tensors[base + "scales"] = scales
        dequantized[name] = (
            ((q - zeros[:, None]) * scales.float()[:, None])
            .reshape(in_features, out_features)
            .t()
            .contiguous()
        )
    _write(
        out,
        tensors,
        {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        },
    )
    return dequantized


def dequantized_hf_model(plain: Path, dequantized: dict[str, torch.Tensor]):
    """transformers' model of `plain` with each quantized weight replaced by its value."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        plain, attn_implementation="eager", dtype=torch.float32
    )
    state = model.state_dict()
    with torch.no_grad():
        for name, weight in dequantized.items():
            state[name].copy_(weight)
    return model.eval()
