"""Building blocks of the Llama-family decoder, numerically matched to transformers.

The elementwise ops (RMSNorm with its residual add, rotary, SiLU·mul) are
`kernels/cpu_fused.py`'s: one C pass each on CPU in fp32/bf16, their torch references
(transformers' formulas, the same rounding) anywhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kernels import cpu_fused
from worker_svc.model.config import RopeConfig
from worker_svc.model.matmul import PreparableLinear, PreparedWeight, linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in fp32 and cast back before the weight multiply, like LlamaRMSNorm,
        so bf16 results round the same way as the HF reference. x [..., hidden] (the C
        kernel takes 2-D rows; per-head norms of [tokens, heads, dim] take the reference)."""
        return cpu_fused.add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum in the model's dtype as transformers
        adds it; `residual` None means x itself. The sum may be written into `residual`."""
        return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, as transformers' ROPE_INIT_FUNCTIONS."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_divisors is not None:
        return inv_freq / torch.tensor(rope.freq_divisors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are stretched by `factor`, short ones kept, the band between
    # interpolated: the Llama 3.1 recipe, written as transformers writes it.
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, computed in fp32."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.build_tables(self.cos_cache.device)

    def build_tables(self, device: torch.device | str) -> None:
        """(Re)compute the fp32 tables on `device`; loaders call it after materialising a
        model built on the meta device, and after any dtype cast of the whole module."""
        if torch.device(device).type == "meta":
            self.cos_cache = torch.empty(self.max_positions, self.head_dim, device="meta")
            self.sin_cache = torch.empty(self.max_positions, self.head_dim, device="meta")
            return
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.int64)
        # The same fp32 product transformers computes per forward, so values match bitwise.
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = emb.cos()
        self.sin_cache = emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotary:
        """positions [num_tokens] -> what every layer of the step rotates q and k with."""
        return StepRotary(positions, self.cos_cache, self.sin_cache, dtype)


@dataclass
class StepRotary:
    """One step's rotary: positions and the fp32 tables, shared by every layer. The C
    kernel reads the tables by position; the torch path gets their rows cast to the
    model's dtype (as transformers casts them), gathered once per step, not per layer."""

    positions: torch.Tensor  # [num_tokens] int64
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    dtype: torch.dtype
    _tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply_(self, x: torch.Tensor) -> None:
        """x [num_tokens, heads, head_dim] <- x * cos + rotate_half(x) * sin, in place."""
        if self._tables is None and not cpu_fused.has_rotary_kernel(x):
            self._tables = cpu_fused.rotary_tables(
                self.cos_cache, self.sin_cache, self.positions, self.dtype
            )
        cpu_fused.rotary_(x, self.positions, self.cos_cache, self.sin_cache, self._tables)


class MergedLinear(nn.Linear, PreparableLinear):
    """Several projections of the same input stacked on the output dim (q|k|v, gate|up).

    Weights are still loaded per named part; under tensor parallelism each part holds
    only some rows of its checkpoint tensor (column-parallel), starting at
    `part_row_starts[part]`, and `checkpoint_slice` names them for the loader.
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: dict[str, int],
        bias: bool,
        part_row_starts: dict[str, int] | None = None,
    ) -> None:
        super().__init__(in_features, sum(part_sizes.values()), bias=bias)
        self.packed_weight: PreparedWeight | None = None  # quantized or packed: see matmul.py
        self.part_sizes = dict(part_sizes)
        self.part_row_starts = {name: 0 for name in part_sizes} | dict(part_row_starts or {})
        self.part_offsets: dict[str, int] = {}
        offset = 0
        for name, size in part_sizes.items():
            self.part_offsets[name] = offset
            offset += size

    lora = None  # its LoRA slots (worker_svc/lora/slots.py LayerLora) when LoRA is on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, self.packed_weight)
        return out if self.lora is None else self.lora.apply_(out, x)

    def checkpoint_slice(self, part: str) -> tuple[slice, ...]:
        """The rows of the checkpoint's `part` tensor (weight or bias) this module holds."""
        start = self.part_row_starts[part]
        return (slice(start, start + self.part_sizes[part]),)

    def load_part(self, part: str, param_name: str, tensor: torch.Tensor) -> None:
        target = self.weight if param_name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {part} bias but the model expects none")
        start, size = self.part_offsets[part], self.part_sizes[part]
        rows = target.data[start : start + size]
        if rows.shape != tensor.shape:
            raise ValueError(
                f"{part}.{param_name}: expected {tuple(rows.shape)}, got {tuple(tensor.shape)}"
            )
        rows.copy_(tensor)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split(list(self.part_sizes.values()), dim=-1))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate|up [num_tokens, 2 * intermediate] -> silu(gate) * up."""
    return cpu_fused.silu_mul(gate_up)
