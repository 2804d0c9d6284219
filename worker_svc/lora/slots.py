"""LoRA in the model's linear layers: each adapted layer holds `max_loras` slots of stacked,
sharded, zero-padded adapter weights, and adds every row's adapter product to its output
in one batched call per step (kernels/lora.py `lora_apply_`: rows of different adapters,
and of none, in one batch).

Layouts per layer (`LayerLora`): A [slots, parts * R, in] and B^T [slots, parts * R, out],
R = --max-lora-rank, scaling folded into B^T. A merged projection (q|k|v, gate|up) stacks
its parts' ranks: part p's A rows are p*R..p*R+r, and its B^T rows write only part p's
output columns, so one product pair computes every part's LoRA. Under tensor parallelism an
adapter is sharded as its base layer: a column-parallel layer (the merged projections)
keeps A whole and the B rows of its own output features; a row-parallel layer (o_proj,
down_proj) keeps the A columns of its own input features and B whole, and its product is
added to the rank's partial sum before the all-reduce (sum over ranks of
(x_r A_r^T) B^T = (x A^T) B^T).

`LoraState.slots` is the step's slot per batch row (int32, -1: the base model), set by the
runner before the forward and cleared after; None when no row has an adapter, and then the
layers do nothing at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from worker_svc.lora.adapter import AdapterError, LoraAdapter

# PEFT module -> (the model's layer attribute path, the merged part or None).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None),
}


@dataclass
class LoraState:
    """What every adapted layer of one model reads during a forward."""

    slots: torch.Tensor | None = None  # [num_tokens] int32, -1 = base; None = no adapter


@dataclass
class LayerLora:
    """One linear layer's adapter slots."""

    state: LoraState
    a: torch.Tensor  # [max_loras, parts * R, in_local]
    bt: torch.Tensor  # [max_loras, parts * R, out_local]
    parts: dict[str, tuple[int, int, int]] = field(
        default_factory=dict
    )  # name -> (index, out offset, out size)
    row_parallel: bool = False
    in_start: int = 0  # row-parallel: this rank's first input feature
    part_row_starts: dict[str, int] = field(default_factory=dict)  # column-parallel: B rows

    def apply_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out` plus each row's adapter product (in place); `out` unchanged without one."""
        slots = self.state.slots
        if slots is not None:
            from kernels.lora import lora_apply_

            lora_apply_(out, x, self.a, self.bt, slots)
        return out

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()

    def shard(
        self, part: str | None, a: torch.Tensor, b: torch.Tensor, where: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of part `part`'s full A [r, in] and B [out, r]; AdapterError
        when they do not fit the layer (an adapter of another base model)."""
        _, _, out_size = self.parts[part or ""]
        in_local = self.a.shape[2]
        if self.row_parallel:
            a = a[:, self.in_start : self.in_start + in_local]
        else:
            start = self.part_row_starts.get(part or "", 0)
            b = b[start : start + out_size]
        if a.shape[1] != in_local or b.shape[0] != out_size:
            raise AdapterError(
                f"{where}: the adapter's matrices (A {tuple(a.shape)}, B {tuple(b.shape)} on "
                f"this rank) do not fit the model's layer ({in_local} inputs, {out_size} "
                "outputs on this rank): it was trained for another base model"
            )
        return a, b

    def write(
        self,
        slot: int,
        part: str | None,
        a: torch.Tensor,
        b: torch.Tensor,
        scaling: float,
        rank_limit: int,
    ) -> None:
        """A part's shard (from `shard`) into `slot`, scaling folded into B^T."""
        index, out_offset, out_size = self.parts[part or ""]
        rows = slice(index * rank_limit, index * rank_limit + a.shape[0])
        dtype = self.a.dtype
        self.a[slot, rows].copy_(a.to(dtype))
        self.bt[slot, rows, out_offset : out_offset + out_size].copy_((b * scaling).T.to(dtype))


def attach(model: nn.Module, max_loras: int, max_rank: int) -> dict[tuple[int, str], LayerLora]:
    """Gives every adapted layer of this rank's decoder layers its slots (zeros); returns
    them by (layer index, attribute path). The layers' forwards add their products."""
    state = LoraState()
    model.lora_state = state  # type: ignore[attr-defined]
    layers: dict[tuple[int, str], LayerLora] = {}
    for index, block in enumerate(model.model.layers):  # every layer; another stage's empty
        if not hasattr(block, "self_attn"):
            continue  # another stage's layer
        for path in dict.fromkeys(p for p, _ in TARGETS.values()):
            module = _resolve(block, path)
            if module is None:
                continue  # e.g. a mixture-of-experts MLP: no LoRA on experts
            module.lora = layers[(index, path)] = _layer_lora(module, state, max_loras, max_rank)
    return layers


def _layer_lora(module: nn.Module, state: LoraState, max_loras: int, max_rank: int) -> LayerLora:
    weight = module.weight
    out_features, in_features = weight.shape
    part_sizes = getattr(module, "part_sizes", None)
    if part_sizes:
        offsets = module.part_offsets
        parts = {
            name: (i, offsets[name], size) for i, (name, size) in enumerate(part_sizes.items())
        }
        row_starts = dict(module.part_row_starts)
    else:
        parts, row_starts = {"": (0, 0, out_features)}, {}
    row_parallel = hasattr(module, "in_start")

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=weight.dtype, device=weight.device)

    return LayerLora(
        state,
        zeros(max_loras, len(parts) * max_rank, in_features),
        zeros(max_loras, len(parts) * max_rank, out_features),
        parts,
        row_parallel,
        getattr(module, "in_start", 0),
        row_starts,
    )


def _resolve(block: nn.Module, path: str) -> nn.Module | None:
    module: nn.Module | None = block
    for name in path.split("."):
        module = getattr(module, name, None)
    return (
        module
        if module is not None
        and hasattr(module, "weight")
        and isinstance(getattr(module, "weight"), torch.Tensor)
        and module.weight.dim() == 2
        else None
    )


def write_adapter(
    layers: dict[tuple[int, str], LayerLora],
    slot: int,
    adapter: LoraAdapter,
    max_rank: int,
    stage_layers: range,
    num_layers: int,
    dry_run: bool = False,
) -> None:
    """`adapter` into `slot` of every layer this rank holds (`stage_layers`; the other
    stages' are theirs). AdapterError for a module the model has no layer for, or matrices
    that do not fit it, before any slot is changed; `dry_run`: only those checks."""
    writes = []
    for (index, module), weights in adapter.modules.items():
        if not 0 <= index < num_layers:
            raise AdapterError(
                f"adapter {adapter.name!r} has layers.{index}.{module}, but the "
                f"model has {num_layers} layers: it was trained for another "
                "base model"
            )
        if index not in stage_layers:
            continue
        path, part = TARGETS[module]
        layer = layers.get((index, path))
        if layer is None:
            raise AdapterError(
                f"adapter {adapter.name!r}: layers.{index}.{module} is not a "
                "dense projection of this model (LoRA on experts is not served)"
            )
        a, b = layer.shard(
            part, weights.a, weights.b, f"adapter {adapter.name!r}, layers.{index}.{module}"
        )
        writes.append((layer, part, a, b, weights.scaling))
    if dry_run:
        return
    for layer in layers.values():
        layer.clear(slot)
    for layer, part, a, b, scaling in writes:
        layer.write(slot, part, a, b, scaling, max_rank)
