"""FP8 weights (`float8_e4m3fn`) with one fp32 scale per output channel: W = q * scale[:, None].

A per-tensor scale (vLLM's own FP8 checkpoints) is stored expanded to one value per row:
the product is the same, and the parts of a fused layer (q|k|v, gate|up), each with its
own per-tensor scale, then fit in one weight. Activations are not quantized: the matmul
runs in the activation dtype on the dequantized weight (W8A16), so a checkpoint's
`input_scale` is not used.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from worker_svc.model.matmul import PreparedWeight

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (fp8 [out, in], fp32 scale [out]) with scale = absmax(row) / 448,
    as vLLM and llm-compressor quantize per channel. An all-zero row gets scale 1."""
    w32 = weight.to(torch.float32)
    absmax = w32.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """fp8 [out, in], fp32 scale [out] -> [out, in] in `dtype` (the product taken in fp32)."""
    return (weight.to(torch.float32) * scale[:, None]).to(dtype)


class Fp8Weight(PreparedWeight):
    """A linear layer's weight in FP8."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(
                f"FP8 weight must be 2-d {FP8_DTYPE}, got {weight.dtype} {tuple(weight.shape)}"
            )
        if scale.shape != (weight.shape[0],) or scale.dtype != torch.float32:
            raise ValueError(
                f"FP8 scale must be fp32 [{weight.shape[0]}], got {scale.dtype} "
                f"{tuple(scale.shape)}"
            )
        self.weight = weight  # [out, in]
        self.scale = scale  # [out]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * 4

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from kernels.quant_matmul import fp8_matmul

            return fp8_matmul(x, self.weight, self.scale, bias)
        # One layer's dequantized copy lives only for this call.
        return F.linear(x, dequantize_fp8(self.weight, self.scale, x.dtype), bias)
