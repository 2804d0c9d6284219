"""Triton kernel: fused mixture-of-experts, a grouped GEMM over expert-sorted token blocks
(vLLM's `fused_moe`).

Same signature and semantics as `kernels.moe.fused_experts` (its module docstring has the
layouts): hidden `[num_tokens, hidden]`; w13 `[num_experts, 2 * intermediate, hidden]`
(gate rows, then up rows); w2 `[num_experts, hidden, intermediate]`; topk_weights and
topk_ids `[num_tokens, top_k]`; an id outside `0..num_experts-1` contributes nothing. The
result `[num_tokens, hidden]` in hidden's dtype is `sum_k w[t, k] * down_e(silu(gate_e(x_t))
* up_e(x_t))`.

A "pair" is one (token, slot): pair `p = t * top_k + k`, `num_pairs = num_tokens * top_k`.
`align_pairs` (torch ops, no host sync, so it can be captured in a CUDA graph) sorts the
pairs by expert, stably, and pads each expert's run to a multiple of `BLOCK_M` with the
sentinel `num_pairs`: `sorted_pair_ids`. Pairs whose id is out of range form one more run
after the last expert's. `expert_ids[b]` is the expert of M-block `b` (`num_experts` for
that last run) and `num_padded` the length of all runs together; the buffer is sized for
the worst case, so programs past `num_padded` return at once.

`_moe_gemm_kernel` is one grouped GEMM: a program takes one M-block (BLOCK_M pairs, all of
one expert) and a BLOCK_N tile of output columns, gathers its pairs' rows of `a` (row
`pair // TOP_K`: hidden's token rows, or a buffer with a row per pair when TOP_K is 1),
multiplies them by that expert's weight tile with `tl.dot`, accumulating in fp32 over
BLOCK_K chunks, optionally scales each row by its routing weight, and stores the rows at
their pair index of a `[num_pairs, N]` buffer. Blocks of the out-of-range run store zeros,
so every pair's row is written exactly once and the buffers need no clearing. The M-blocks
are grid axis 0, so the blocks of one expert run side by side and share its weight tiles
in L2. `fused_experts_triton` runs: gate|up GEMM -> `_silu_mul_kernel` -> down GEMM with
the routing weights -> sum over the top_k slots in fp32, cast to hidden's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.paged_attention import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_on_kernel_device,
    dot,
    dot_in_fp32,
)

WEIGHT_DTYPES = (*FLOAT_DTYPES, torch.float64)  # routing weights; upcast to fp32 in-kernel
MAX_SILU_BLOCK = 1024  # intermediate columns per SiLU-and-mul program


class MoeTiles(NamedTuple):
    """Tile sizes of the grouped GEMM: pairs per M-block, output columns, reduction chunk."""

    block_m: int
    block_n: int
    block_k: int


def choose_tiles(dtype: torch.dtype, num_pairs: int, num_experts: int) -> MoeTiles:
    """Tiles for `num_pairs` (token, slot) pairs spread over `num_experts` experts. BLOCK_M
    follows the mean pairs per expert (16 at decode, where most blocks are mostly padding,
    up to 64), as vLLM's tuned H200 tables for Qwen3-MoE's shapes do; a short M-block gets
    a long BLOCK_K instead. fp32's IEEE dot runs on FMA units and keeps its tiles small."""
    pairs_per_expert = triton.cdiv(num_pairs, max(num_experts, 1))
    block_m = min(64, max(16, triton.next_power_of_2(pairs_per_expert)))
    if dtype == torch.float32:
        return MoeTiles(block_m, 32, 32)
    if block_m <= 32:
        return MoeTiles(block_m, 64, 128)
    return MoeTiles(block_m, 128, 64)


@triton.jit
def _moe_gemm_kernel(
    out_ptr,
    a_ptr,
    w_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return  # the grid covers the worst-case padding
    pairs = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_mask = pairs < num_pairs  # false on the padding sentinel
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    out_ptrs = out_ptr + pairs[:, None] * stride_om + cols[None, :]
    out_mask = pair_mask[:, None] & col_mask[None, :]
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    if expert >= num_experts:  # the run of pairs routed to no local expert
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty), mask=out_mask)
        return

    a_rows = a_ptr + (pairs // TOP_K)[:, None] * stride_am
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_rows + ks[None, :], mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(
            w_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_N]: the weight rows' transpose
        acc += dot(a, w, DOT_FP32)
    if MUL_ROUTED_WEIGHT:
        weights = tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)
        acc *= weights.to(tl.float32)[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _silu_mul_kernel(
    out_ptr, gate_up_ptr, intermediate, stride_out, stride_gate_up, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate_ptrs = gate_up_ptr + row * stride_gate_up + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + intermediate, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def check_moe_args(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments fit `fused_experts_triton`."""
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [num_tokens, hidden], w13 "
            f"{tuple(w13.shape)} [num_experts, 2 * intermediate, hidden] and w2 "
            f"{tuple(w2.shape)} [num_experts, hidden, intermediate]"
        )
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w2.shape[0], w2.shape[2]
    if w13.shape != (num_experts, 2 * intermediate, hidden_size) or (w2.shape[1] != hidden_size):
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden "
            f"size {hidden_size}: need w13 [num_experts, 2 * intermediate, "
            f"{hidden_size}] and w2 [num_experts, {hidden_size}, intermediate]"
        )
    if hidden.dtype not in FLOAT_DTYPES or w13.dtype != hidden.dtype or (w2.dtype != hidden.dtype):
        raise ValueError(
            f"hidden, w13 and w2 must share one of {FLOAT_DTYPES}, got "
            f"{hidden.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if (
        topk_ids.dim() != 2
        or topk_ids.shape[0] != num_tokens
        or (topk_weights.shape != topk_ids.shape)
    ):
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids "
            f"{tuple(topk_ids.shape)} must both be [{num_tokens}, top_k]"
        )
    if topk_ids.dtype not in INDEX_DTYPES or topk_weights.dtype not in WEIGHT_DTYPES:
        raise ValueError(
            f"topk_ids must be one of {INDEX_DTYPES} and topk_weights one of "
            f"{WEIGHT_DTYPES}, got {topk_ids.dtype} and {topk_weights.dtype}"
        )
    for name, tensor in {"hidden": hidden, "w13": w13, "w2": w2}.items():
        if tensor.numel() and tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dim, strides {tensor.stride()}"
            )
    tensors = (hidden, w13, w2, topk_weights, topk_ids)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    check_on_kernel_device(hidden.device, _moe_gemm_kernel)


def align_pairs(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs in expert order, each expert's run padded to a multiple of `block_m`
    (module docstring): (sorted_pair_ids int32 [capacity], padding = num_pairs; expert_ids
    int32 [capacity / block_m], num_experts for the run of out-of-range ids and past the
    end; num_padded int32 [1], the used length of sorted_pair_ids). Torch ops only, no
    host sync: capacity depends on the shapes alone."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1)
    keys = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts).to(torch.int64)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))  # bincount would sync on CUDA
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    sorted_keys, order = torch.sort(keys, stable=True)
    rank_in_run = (
        torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_keys]
    )
    destinations = (padded_ends - padded_counts)[sorted_keys] + rank_in_run
    # Each non-empty run adds at most block_m - 1 padding entries.
    num_runs = min(num_pairs, num_experts + 1)
    capacity = triton.cdiv(num_pairs + num_runs * (block_m - 1), block_m) * block_m
    sorted_pair_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, destinations, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts).to(torch.int32)
    return sorted_pair_ids, expert_ids, padded_ends[-1:].to(torch.int32)


def launch_moe_gemm(
    out: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_pair_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    top_k: int,
    tiles: MoeTiles,
) -> None:
    """out[p] = a[p // top_k] @ w[e]^T (times topk_weights[p], flat, when given) for every
    pair p of sorted_pair_ids, e its block's expert; zeros for pairs of no local expert.
    out [num_pairs, N], w [num_experts, N, K]; arguments are checked by the caller."""
    num_pairs, n = out.shape
    num_experts, _, k = w.shape
    grid = (expert_ids.shape[0], triton.cdiv(n, tiles.block_n))
    _moe_gemm_kernel[grid](
        out,
        a,
        w,
        out if topk_weights is None else topk_weights,
        sorted_pair_ids,
        expert_ids,
        num_padded,
        n,
        k,
        num_pairs,
        num_experts,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        TOP_K=top_k,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_FP32=dot_in_fp32(_moe_gemm_kernel, a.dtype),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
    )


def launch_silu_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """out [rows, intermediate] = silu(gate) * up of gate_up [rows, 2 * intermediate],
    computed in fp32."""
    rows, intermediate = out.shape
    block = min(MAX_SILU_BLOCK, triton.next_power_of_2(intermediate))
    _silu_mul_kernel[(rows, triton.cdiv(intermediate, block))](
        out, gate_up, intermediate, out.stride(0), gate_up.stride(0), BLOCK=block
    )


def fused_experts_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) -> [num_tokens, hidden]
    in hidden's dtype (module docstring; `kernels.moe.fused_experts` is the reference).
    No host sync: the launch sizes follow the shapes alone."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or hidden_size == 0 or intermediate == 0:
        return torch.zeros_like(hidden)
    tiles = choose_tiles(hidden.dtype, num_pairs, num_experts)
    sorted_pair_ids, expert_ids, num_padded = align_pairs(topk_ids, num_experts, tiles.block_m)
    routing = (sorted_pair_ids, expert_ids, num_padded)

    gate_up = hidden.new_empty(num_pairs, 2 * intermediate)
    launch_moe_gemm(gate_up, hidden, w13, None, *routing, top_k, tiles)
    activated = hidden.new_empty(num_pairs, intermediate)
    launch_silu_mul(activated, gate_up)
    down = hidden.new_empty(num_pairs, hidden_size)
    launch_moe_gemm(down, activated, w2, topk_weights.reshape(-1), *routing, 1, tiles)
    summed = down.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32)
    return summed.to(hidden.dtype)
