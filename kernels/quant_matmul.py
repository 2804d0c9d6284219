"""Triton kernels: x @ W^T with W dequantized on the fly, from FP8 or from AWQ 4-bit.

Two kernels of one shape (dequantize a weight tile in registers, multiply, accumulate in
fp32), kept together because they share the tiling and the wrapper checks. Each has a
plain-torch reference with the same signature (`*_reference`) that tests compare against.

- `fp8_matmul(x, weight, scale, bias)`: weight float8_e4m3fn [N, K], scale fp32 [N]
  (per output channel; applied once to the accumulated row, which is exact).
- `awq_matmul(x, qweight, qzeros, scales, group_size, bias)`: AutoAWQ's gemm layout,
  qweight int32 [K, N / 8], qzeros int32 [K / group_size, N / 8], scales [K / group, N];
  column j of each 8 lives in nibble (0, 4, 1, 5, 2, 6, 3, 7)[j]; w = (q - z) * s.

x is [M, K] in fp32 / bf16 / fp16; the result is [M, N] in x's dtype. On CUDA a bf16/fp16
x multiplies in its own dtype (tensor cores, fp32 accumulation); fp32 x, and everything in
Triton's interpreter (whose bf16 `tl.dot` is wrong), multiply in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention import FLOAT_DTYPES, check_on_kernel_device

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@triton.jit
def _fp8_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :],
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + rk[:, None],
            mask=(rn[None, :] < N) & (rk[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    acc = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def _awq_matmul_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qw,
    stride_qz,
    stride_s,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # AutoAWQ's interleaving: column j of each 8 sits in nibble (j // 2) + 4 * (j % 2).
    shifts = (((rn % 8) // 2) + (rn % 2) * 4) * 4
    packed_cols = rn // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :],
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        )
        w_mask = (rk[:, None] < K) & (rn[None, :] < N)
        packed = tl.load(
            qweight_ptr + rk[:, None] * stride_qw + packed_cols[None, :], mask=w_mask, other=0
        )
        groups = rk // GROUP_SIZE
        packed_zeros = tl.load(
            qzeros_ptr + groups[:, None] * stride_qz + packed_cols[None, :], mask=w_mask, other=0
        )
        scales = tl.load(
            scales_ptr + groups[:, None] * stride_s + rn[None, :], mask=w_mask, other=0.0
        )
        q = (packed >> shifts[None, :]) & 0xF
        z = (packed_zeros >> shifts[None, :]) & 0xF
        w = (q - z).to(tl.float32) * scales.to(tl.float32)  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def _check_common(
    x: torch.Tensor,
    n: int,
    k: int,
    bias: torch.Tensor | None,
    tensors: dict[str, torch.Tensor],
    kernel,
) -> None:
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(
            f"x must be [M, {k}] in {FLOAT_DTYPES}, contiguous in K; got "
            f"{x.dtype} {tuple(x.shape)} strides {x.stride()}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dim, strides {tensor.stride()}"
            )
    devices = {t.device for t in (x, *tensors.values(), *([bias] if bias is not None else []))}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    check_on_kernel_device(x.device, kernel)


def _grid(m: int, n: int, block_m: int, block_n: int) -> tuple[int, int]:
    return triton.cdiv(m, block_m), triton.cdiv(n, block_n)


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 64


def _dot_fp32(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 or x.device.type == "cpu"


def fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] fp8 * scale [N, 1])^T + bias -> [M, N] in x's dtype."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"weight must be float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 [{n}], got {scale.dtype} {tuple(scale.shape)}")
    _check_common(x, n, k, bias, {"weight": weight, "scale": scale}, _fp8_matmul_kernel)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _block_m(m), 64, 64
    _fp8_matmul_kernel[_grid(m, n, block_m, block_n)](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        DOT_FP32=_dot_fp32(x),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def fp8_matmul_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    w = (weight.to(torch.float32) * scale[:, None]).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


def awq_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W + bias, W [K, N] dequantized from AutoAWQ's layout -> [M, N]."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(
            f"qweight must be int32 [K, N / 8], got {qweight.dtype} {tuple(qweight.shape)}"
        )
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must divide K = {k}")
    groups = k // group_size
    if qzeros.shape != (groups, n // 8) or qzeros.dtype != torch.int32:
        raise ValueError(
            f"qzeros must be int32 [{groups}, {n // 8}], got {qzeros.dtype} {tuple(qzeros.shape)}"
        )
    if scales.shape != (groups, n) or scales.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"scales must be [{groups}, {n}] floats, got {scales.dtype} {tuple(scales.shape)}"
        )
    _check_common(
        x, n, k, bias, {"qweight": qweight, "qzeros": qzeros, "scales": scales}, _awq_matmul_kernel
    )
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _block_m(m), 64, 32
    _awq_matmul_kernel[_grid(m, n, block_m, block_n)](
        x,
        qweight,
        qzeros,
        scales,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        qzeros.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        HAS_BIAS=bias is not None,
        DOT_FP32=_dot_fp32(x),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def awq_matmul_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    shifts = torch.tensor(AWQ_REVERSE_ORDER, dtype=torch.int32, device=qweight.device) * 4

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        return ((packed[:, :, None] >> shifts) & 0xF).reshape(packed.shape[0], -1)

    z = unpack(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    w = ((unpack(qweight) - z).to(torch.float32) * s).to(x.dtype)  # [K, N]
    return torch.nn.functional.linear(x, w.t(), bias)
