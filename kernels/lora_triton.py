"""Triton kernels: batched LoRA for CUDA (SGMV-style shrink and expand over row blocks of one
adapter), `out[i] += (x[i] @ lora_a[s].T) @ lora_bt[s]` for each row i with slot s in
0..S-1. Layouts and the reference are `kernels/lora.py`'s.

Rows are grouped by slot with `align_pairs` (`kernels/fused_moe_triton.py`: adapters are
experts, top_k 1): one stable sort, each slot's run padded to BLOCK_M rows, `block_slots[b]`
the slot of row block b, S for the rows without an adapter; torch ops only, no host sync, so
a step can be captured in a CUDA graph. Programs of a block past the used length, or of the
no-adapter run, return at once: those rows are never read or written.

Two kernels, one launch each, because fusing them would repeat the shrink once per output
tile (out_f / BLOCK_N times: 32x at out_f 4096) while it is the larger reduction (over in_f):
- `_shrink_kernel`, one program per row block: t[rows] = x[rows] @ lora_a[s].T, a `tl.dot`
  over BLOCK_K chunks of in_f (tensor cores for bf16/fp16, fp32 accumulation; products of
  half-precision values are exact in fp32), into a fp32 buffer t [n, R]. Not split over
  in_f: a decode step has few blocks, but each streams only its slot's A (R x in_f) once,
  and a split would need atomics (a sum order that varies from run to run).
- `_expand_kernel`, one program per (row block, BLOCK_N columns): out[rows, cols] =
  round(out + t @ lora_bt[s][:, cols]) as R outer products in fp32 (CUDA cores). t stays
  fp32, as the reference's, so the result is rounded once; tensor cores would need t
  rounded to bf16/fp16 first, and an IEEE fp32 `tl.dot` spilled registers at these tiles.
  At R <= 64 the expand's cost is reading BT and reading and writing out, not the
  multiply-adds. Every (row, column) belongs to one program: no atomics, deterministic.
A row block holds one slot's rows, so a slot's A and BT tiles are loaded once per block
(prefill: up to 64 rows) instead of once per row as a per-row BGMV kernel would; a decode
step (one row per adapter) pays for its blocks' padding with masked loads and a 16-row
tensor-core tile it barely fills, which costs nothing where the step is bound by memory.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests); the interpreter's bf16
`tl.dot` is wrong, so there every dot is fp32 (`dot_in_fp32`), and it rounds fp32 -> bf16
toward zero (a GPU rounds to nearest): one ulp of bf16 at most.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fused_moe_triton import align_pairs
from kernels.lora import check_lora_args
from kernels.paged_attention import check_on_kernel_device, dot, dot_in_fp32

MIN_DOT = 16  # tl.dot needs each dimension >= 16
# Register budgets, from ptxas for sm_90 at 4 warps (no spills at any tile chosen here): the
# shrink's [BLOCK_M, BLOCK_R] sums with its operand tiles, the expand's [BLOCK_M, BLOCK_N]
# sums with as many 64-bit output pointers.
SHRINK_TILE = 2048
EXPAND_TILE = 4096


class LoraTiles(NamedTuple):
    """Rows per block (one slot's), padded rank, in_f chunk (shrink), out_f tile (expand)."""

    block_m: int
    block_r: int
    block_k: int
    block_n: int


def choose_tiles(dtype: torch.dtype, num_rows: int, num_slots: int, rank: int) -> LoraTiles:
    """BLOCK_M follows the mean rows per slot (16 at decode, up to 64 for prefill; past rank
    64 up to 32, 16 in fp32), as the MoE kernel's tiles do; BLOCK_K and BLOCK_N shrink as
    BLOCK_M x BLOCK_R and BLOCK_M grow, within the register budgets above."""
    block_r = max(MIN_DOT, triton.next_power_of_2(rank))
    max_m = 64 if block_r <= 64 else 16 if dtype == torch.float32 else 32
    block_m = min(max_m, max(MIN_DOT, triton.next_power_of_2(triton.cdiv(num_rows, num_slots))))
    block_k = 32 if dtype == torch.float32 else 64
    block_k = max(MIN_DOT, block_k * SHRINK_TILE // max(SHRINK_TILE, block_m * block_r))
    return LoraTiles(block_m, block_r, block_k, min(128, EXPAND_TILE // block_m))


@triton.jit
def _shrink_kernel(
    t_ptr,
    x_ptr,
    a_ptr,
    sorted_rows_ptr,
    block_slots_ptr,
    num_padded_ptr,
    n,
    in_f,
    rank,
    num_slots,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return  # the grid covers the worst-case padding
    slot = tl.load(block_slots_ptr + block).to(tl.int64)
    if slot >= num_slots:
        return  # the rows without an adapter
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < n  # false on the padding
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    a_slot = a_ptr + slot * rank * in_f
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, in_f, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < in_f
        x = tl.load(
            x_ptr + rows[:, None] * in_f + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            a_slot + ranks[None, :] * in_f + ks[:, None],
            mask=k_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )  # A's transpose
        acc += dot(x, a, DOT_FP32)
    tl.store(
        t_ptr + rows[:, None] * rank + ranks[None, :],
        acc,
        mask=row_mask[:, None] & rank_mask[None, :],
    )


@triton.jit
def _expand_kernel(
    out_ptr,
    t_ptr,
    bt_ptr,
    sorted_rows_ptr,
    block_slots_ptr,
    num_padded_ptr,
    n,
    out_f,
    rank,
    num_slots,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slots_ptr + block).to(tl.int64)
    if slot >= num_slots:
        return
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < n
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_f
    bt_cols = bt_ptr + slot * rank * out_f + cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r in range(0, rank):  # outer products: fp32 multiply-adds, the rank unpadded
        t = tl.load(t_ptr + rows * rank + r, mask=row_mask, other=0.0)
        bt = tl.load(bt_cols + r * out_f, mask=col_mask, other=0.0).to(tl.float32)
        acc += t[:, None] * bt[None, :]
    out_ptrs = out_ptr + rows[:, None] * out_f + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    base = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def lora_triton_(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """out += each row's LoRA product, in place (module docstring), after checking the
    arguments; no host sync. Slots outside 0..S-1 count as no adapter."""
    check_lora_args(out, x, lora_a, lora_bt, slots)
    check_on_kernel_device(x.device, _shrink_kernel)
    launch_lora_(out, x, lora_a, lora_bt, slots)


def launch_lora_(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """`lora_triton_` on arguments already checked (`kernels.lora.lora_apply_`)."""
    n, in_f = x.shape
    num_slots, rank, out_f = lora_bt.shape
    if n == 0 or rank == 0 or num_slots == 0:
        return
    tiles = choose_tiles(x.dtype, n, num_slots, rank)
    sorted_rows, block_slots, num_padded = align_pairs(slots[:, None], num_slots, tiles.block_m)
    routing = (sorted_rows, block_slots, num_padded)
    t = torch.empty((n, rank), dtype=torch.float32, device=x.device)
    num_blocks = block_slots.shape[0]
    _shrink_kernel[(num_blocks,)](
        t,
        x,
        lora_a,
        *routing,
        n,
        in_f,
        rank,
        num_slots,
        DOT_FP32=dot_in_fp32(_shrink_kernel, x.dtype),
        BLOCK_M=tiles.block_m,
        BLOCK_R=tiles.block_r,
        BLOCK_K=tiles.block_k,
    )
    _expand_kernel[(num_blocks, triton.cdiv(out_f, tiles.block_n))](
        out,
        t,
        lora_bt,
        *routing,
        n,
        out_f,
        rank,
        num_slots,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
    )
