"""Tiny random PEFT LoRA adapters for tests and benchmarks: `peft.get_peft_model` on the
base folder with `init_lora_weights=False` (A and B both random, so the adapter changes the
output), saved as PEFT saves (adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def write_lora(
    base: str | Path,
    path: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    seed: int = 0,
    gain: float = 1.0,
    **config: Any,
) -> Path:
    """An adapter of `base` at `path`; `gain` scales B (how far it moves the output);
    `config`: more LoraConfig fields (use_rslora, alpha_pattern, ...)."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        init_lora_weights=False,
        **config,
    )
    adapted = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.mul_(gain)
    adapted.save_pretrained(str(path))
    return Path(path)
