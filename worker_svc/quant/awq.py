"""AWQ 4-bit weights in AutoAWQ's "gemm" layout: W[in, out] = (q - z) * s per group of rows.

- `qweight` int32 [in, out / 8]: eight 4-bit values per int32, the nibble at bits 4i
  holding column `AWQ_ORDER[i]` of its group of 8 (AutoAWQ's interleaving);
- `qzeros` int32 [in / group_size, out / 8], packed the same way;
- `scales` fp16 [in / group_size, out].

Note the transposed layout: rows are input features. Tensor parallelism cuts column-parallel
layers along `out` (whole int32 columns, so multiples of 8) and row-parallel ones along
`in` (whole groups).
"""

from __future__ import annotations

import torch

from worker_svc.model.matmul import PreparedWeight

AWQ_BITS = 4
AWQ_PACK = 32 // AWQ_BITS  # values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j lives in nibble AWQ_REVERSE_ORDER[j]


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] -> int32 values 0..15 [rows, cols] in column order."""
    shifts = torch.tensor(AWQ_REVERSE_ORDER, dtype=torch.int32, device=packed.device) * AWQ_BITS
    values = (packed[:, :, None] >> shifts) & 0xF
    return values.reshape(packed.shape[0], -1)


def dequantize_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """-> W [in, out] in `dtype`, computed in fp32."""
    q = unpack_awq(qweight)
    z = unpack_awq(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return ((q - z).to(torch.float32) * s).to(dtype)


class AwqWeight(PreparedWeight):
    """A linear layer's weight in AWQ form."""

    def __init__(
        self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
    ) -> None:
        in_features, packed_out = qweight.shape
        num_groups = in_features // group_size
        if (
            in_features % group_size
            or qzeros.shape != (num_groups, packed_out)
            or scales.shape != (num_groups, packed_out * AWQ_PACK)
        ):
            raise ValueError(
                f"inconsistent AWQ shapes: qweight {tuple(qweight.shape)}, qzeros "
                f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group_size {group_size}"
            )
        self.qweight = qweight
        self.qzeros = qzeros
        self.scales = scales
        self.group_size = group_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales))

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from kernels.quant_matmul import awq_matmul

            return awq_matmul(x, self.qweight, self.qzeros, self.scales, self.group_size, bias)
        # One layer's dequantized copy lives only for this call.
        w = dequantize_awq(self.qweight, self.qzeros, self.scales, self.group_size, x.dtype)
        return torch.nn.functional.linear(x, w.t(), bias)
