"""A PEFT LoRA adapter folder, read and checked: `adapter_config.json` and
`adapter_model.safetensors` (or `adapter_model.bin`, refused: pickles are not loaded).

What is served: LoRA (`peft_type` "LORA") on the decoder's attention and MLP projections,
`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`, any of them in
any layer, each module with its own rank (the tensors' shapes say it; `rank_pattern` only
documents it) and alpha (`lora_alpha`, or the first `alpha_pattern` key that names the
module, matched as PEFT matches it: the key as a regex ending the module's name). The
scaling is alpha / r, or alpha / sqrt(r) with rsLoRA (`use_rslora`), as PEFT's.

What is refused, with the reason named: DoRA, LoRA biases, `modules_to_save` (a trained
head or embedding), `fan_in_fan_out` (GPT-2's Conv1D), tensors on other modules (embeddings,
the LM head, a MoE's experts), a rank above `max_rank`.

Tensor names are PEFT's: `base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>
[.<adapter name>].weight`; A is [r, in_features], B is [out_features, r] (full, unsharded:
the workers shard them as their base layer, worker_svc/lora/slots.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why and what to do."""


@dataclass(frozen=True)
class LoraModule:
    """One module's adapter: A [r, in], B [out, r] (float32), and its scaling."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    modules: dict[tuple[int, str], LoraModule] = field(default_factory=dict)  # (layer, module)
    base_model: str = ""  # adapter_config's base_model_name_or_path, for messages

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoraAdapter:
    """The adapter at `path`, checked (AdapterError naming what is wrong)."""
    folder = Path(path)
    config = _read_config(folder)
    alpha = float(config.get("lora_alpha", 8))
    alpha_pattern = dict(config.get("alpha_pattern") or {})
    rslora = bool(config.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in _read_tensors(folder).items():
        match = _NAME.match(tensor_name)
        if match is None or match.group(2) not in MODULES:
            raise AdapterError(
                f"{folder}: tensor {tensor_name!r} is not on a module LoRA is served for "
                f"here ({', '.join(MODULES)} of the decoder's layers)"
            )
        key = (int(match.group(1)), match.group(2))
        pairs.setdefault(key, {})[match.group(3)] = tensor.to(torch.float32)
    if not pairs:
        raise AdapterError(f"{folder}: the adapter holds no LoRA tensors")
    modules = {}
    for (layer, module), parts in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"{folder}: {where} has lora_{''.join(parts)} but not both A and B")
        a, b = parts["A"], parts["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"{folder}: {where}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not make a rank-r pair"
            )
        rank = a.shape[0]
        if rank > max_rank:
            raise AdapterError(
                f"{folder}: {where} has rank {rank}, above the maximum {max_rank} (--max-lora-rank)"
            )
        module_alpha = _alpha_for(f"model.{where}", alpha_pattern, alpha)
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        modules[(layer, module)] = LoraModule(a.contiguous(), b.contiguous(), scaling)
    return LoraAdapter(name, str(folder), modules, str(config.get("base_model_name_or_path") or ""))


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise AdapterError(f"{folder} is not a PEFT adapter folder: it has no adapter_config.json")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{file} cannot be read as JSON: {exc}") from None
    kind = config.get("peft_type", "LORA")
    refusals = {
        f"peft_type is {kind!r}; only LORA adapters are served": kind != "LORA",
        "it is a DoRA adapter (use_dora); only plain LoRA is served": config.get("use_dora"),
        "it trains biases (bias / lora_bias); only LoRA matrices are served": config.get(
            "bias", "none"
        )
        != "none"
        or config.get("lora_bias"),
        f"it saves whole modules ({config.get('modules_to_save')}, modules_to_save), "
        "which are not served": config.get("modules_to_save"),
        "its layers are Conv1D-style (fan_in_fan_out), which are not served": config.get(
            "fan_in_fan_out"
        ),
    }
    for reason, refused in refusals.items():
        if refused:
            raise AdapterError(f"{folder}: {reason}")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        found = (
            "adapter_model.bin (a pickle, not loaded)"
            if (folder / "adapter_model.bin").is_file()
            else "no weights"
        )
        raise AdapterError(
            f"{folder}: no adapter_model.safetensors ({found}); save the "
            "adapter with safe_serialization=True"
        )
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(f"{file} cannot be read as safetensors: {exc}") from None


def _alpha_for(module_name: str, pattern: dict[str, float], default: float) -> float:
    """PEFT's `get_pattern_key`: the first key that, as a regex, ends the module's name."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return float(value)
    return default
