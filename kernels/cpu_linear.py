"""The ctypes wrappers of `kernels/cpu_linear.c` (built by `cpu_native.py`): the fp32 linear
layer on packed weight panels (`pack_linear_f32` once per weight, then `linear_f32`), and a
MoE layer's experts in one call (`moe_f32`)."""

from __future__ import annotations

import ctypes

import torch

from kernels import cpu_native


def pack_linear_f32(weight: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """W [n, k] fp32 -> cpu_linear.c's panels (a flat fp32 tensor of ceil(n / P) * k * P,
    P the build's panel width: 16 floats on AVX-512, else 8), for `linear_f32`. Raises when
    the kernel cannot be built here (`cpu_native.library("cpu_linear")`)."""
    lib = lib or cpu_native.library("cpu_linear")
    if lib is None or weight.dtype != torch.float32 or weight.dim() != 2:
        raise RuntimeError("the native linear kernel is not available for this weight")
    n, k = weight.shape
    weight = weight.contiguous()
    panel = lib.linear_panel()
    packed = torch.empty(-(-n // panel) * panel * k, dtype=torch.float32)
    lib.pack_f32(max(1, torch.get_num_threads()), weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def moe_f32(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    num_experts: int,
    intermediate: int,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """`kernels.moe.fused_experts` in one C call (cpu_linear.c's `moe_f32`), fp32: hidden
    [tokens, h]; the experts' gate|up and down weights each packed by `pack_linear_f32` and
    concatenated in expert order (`w13_packed`, `w2_packed`)."""
    lib = lib or cpu_native.library("cpu_linear")
    if lib is None:
        raise RuntimeError("the native linear kernel is not available")
    tokens, h = hidden.shape
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    x = hidden.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty((tokens, h), dtype=torch.float32)
    rows, down = torch.empty((pairs, h)), torch.empty((pairs, h))
    gate_up, act = torch.empty((pairs, 2 * intermediate)), torch.empty((pairs, intermediate))
    scratch = torch.empty(2 * pairs + 2 * (num_experts + 1), dtype=torch.int64)
    lib.moe_f32(
        torch.get_num_threads(),
        x.data_ptr(),
        tokens,
        h,
        ids.data_ptr(),
        weights.data_ptr(),
        top_k,
        num_experts,
        w13_packed.data_ptr(),
        w2_packed.data_ptr(),
        intermediate,
        out.data_ptr(),
        rows.data_ptr(),
        gate_up.data_ptr(),
        act.data_ptr(),
        down.data_ptr(),
        scratch.data_ptr(),
    )
    return out


def linear_f32(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [..., k] W^T + bias for W packed by `pack_linear_f32` ([n, k]): [..., n], fp32."""
    lib = lib or cpu_native.library("cpu_linear")
    if lib is None:
        raise RuntimeError("the native linear kernel is not available")
    k = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.to(torch.float32).contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.to(torch.float32).contiguous()
    lib.linear_f32(
        torch.get_num_threads(),
        rows.data_ptr(),
        rows.shape[0],
        k,
        packed.data_ptr(),
        n,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
    )
    if x.dim() == 2:
        return out
    return out.reshape(*x.shape[:-1], n)
