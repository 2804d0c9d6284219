"""LoRA adapters in the offline engine, as vLLM's: `LLM(enable_lora=True, max_loras=...,
max_lora_rank=..., max_cpu_loras=...)` and `generate(..., lora_request=LoRARequest(name,
int_id, path))`, one request for every prompt or one per prompt (None: the base model).

An adapter is checked when a call first names it: every rank reads its folder and fits it to
its shard of the model, between steps, so a bad folder, a rank above `max_lora_rank` or
another base model's adapter is a ValueError before anything runs, at any tp and pp.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from protos.step import LoraRef


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest`: the adapter's name, an id unique per adapter, its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRARequest needs a lora_name")
        if not self.lora_path:
            raise ValueError(
                f"LoRARequest {self.lora_name!r} needs lora_path, the adapter's PEFT folder"
            )

    @property
    def ref(self) -> LoraRef:
        return LoraRef(self.lora_name, str(self.lora_path))


def per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoraRef | None]:
    """One adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        ref = lora_request.ref if lora_request is not None else None
        return [ref] * num_prompts
    requests = list(lora_request)
    if len(requests) != num_prompts:
        raise ValueError(f"lora_request has {len(requests)} entries for {num_prompts} prompts")
    return [r.ref if r is not None else None for r in requests]


class AdapterChecks:
    """Checks each adapter once per (name, folder), with `check` (raises ValueError)."""

    def __init__(self, check: Callable[[LoraRef], object] | None) -> None:
        self._check = check
        self._checked: set[LoraRef] = set()

    def __call__(self, refs: list[LoraRef | None]) -> None:
        for ref in dict.fromkeys(r for r in refs if r is not None):
            if ref in self._checked:
                continue
            if self._check is None:
                raise ValueError(
                    f"the prompt names LoRA adapter {ref.name!r}, but LoRA is "
                    "off: create the LLM with enable_lora=True"
                )
            self._check(ref)
            self._checked.add(ref)
