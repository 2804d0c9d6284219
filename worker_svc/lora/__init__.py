"""Multi-LoRA serving on the workers: PEFT adapter folders (adapter.py), their slots in the
model's linear layers (slots.py) and which adapters a worker knows, keeps and has in slots
(manager.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraConfig:
    """vLLM's knobs: adapters in one step (`max_loras`), the highest rank served
    (`max_lora_rank`), adapters kept in memory (`max_cpu_loras`, default `max_loras`)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 0  # 0 = max_loras
    # Adapters read (and checked) at start: (name, PEFT folder) pairs, --lora-modules.
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_cpu_loras == 0:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
