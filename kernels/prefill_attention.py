"""Triton kernel: paged prefill / extend attention over a ragged batch.

Same signature and semantics as `kernels.reference.paged_attention`: sequence `s` owns
query rows `query_start_loc[s]:query_start_loc[s + 1]` (its `q_len` new tokens), which are
the LAST `q_len` positions of its `seq_lens[s]` tokens of context, and attends causally to
its cached prefix and to itself. Every key and value, the new tokens' included, is read from
the paged cache (`store_kv` ran first). Layouts: query `[num_tokens, num_heads, head_dim]`;
k_cache/v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`; block_tables
`[num_seqs, max_blocks]`.

One program owns one (sequence, tile of `BLOCK_Q` query tokens, kv head). Its `BLOCK_M`
rows are the tile's tokens times the kv head's query group (row = token * GROUP_PAD +
head in group), so each K/V tile is loaded once for the whole group, as vLLM's unified
attention kernel does. Key tiles run from the sliding window's first key to the tile's last
query position; the online softmax is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention import (
    LOG2_E,
    NO_WINDOW,
    check_attention_args,
    check_block_tables_cover,
    dot,
    dot_in_fp32,
    load_kv_tile,
)

# (query rows = tokens x heads of one group, context tokens) per tile. fp16/bf16 at 64 x 64
# compile for sm_90 to wgmma with ~216 registers and no spills; fp32's IEEE dot is done on
# FMA units and spills there above 32 x 32.
TILES = {torch.float16: (64, 64), torch.bfloat16: (64, 64), torch.float32: (32, 32)}


@triton.jit
def _prefill_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    scale_log2,
    sliding_window,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_block_tables_seq,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.load(seq_ids_ptr + tl.program_id(0))
    tile_first_token = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_first_token >= q_len:
        return  # the grid covers the longest q_len; shorter sequences leave programs idle
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query_pos = seq_len - q_len  # absolute position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    tokens = tile_first_token + rows // GROUP_PAD
    in_group = rows % GROUP_PAD
    row_mask = (tokens < q_len) & (in_group < GROUP)
    heads = kv_head * GROUP + in_group
    query_pos = first_query_pos + tokens
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + tokens).to(tl.int64)
    q = tl.load(
        query_ptr
        + q_rows[:, None] * stride_query_token
        + heads[:, None] * stride_query_head
        + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    # Causality bounds the keys by the tile's last query, the window by its first one.
    context_end = first_query_pos + tl.minimum(q_len, tile_first_token + BLOCK_Q)
    context_start = tl.maximum(first_query_pos + tile_first_token - sliding_window + 1, 0)
    running_max = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: no inf - inf = NaN
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    for tile_start in range(context_start, context_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        in_context = positions < context_end
        k, v = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_table,
            positions,
            in_context,
            kv_head,
            dims,
            dim_mask,
            stride_cache_block,
            stride_cache_token,
            stride_cache_head,
            BLOCK_SIZE,
        )
        scores = dot(q, tl.trans(k), DOT_FP32) * scale_log2
        visible = (
            in_context[None, :]
            & (positions[None, :] <= query_pos[:, None])
            & (positions[None, :] > query_pos[:, None] - sliding_window)
        )
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + dot(probs.to(v.dtype), v, DOT_FP32)
        running_max = new_max

    # Padding rows past q_len may see no key inside a sliding window; keep them finite.
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr
        + q_rows[:, None] * stride_out_token
        + heads[:, None] * stride_out_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def launch_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    seq_ids: torch.Tensor,
    max_query_len: int,
) -> None:
    """Attend the query rows of sequences `seq_ids` (int32 on the device) into `out`.
    Arguments are checked by the caller; `max_query_len` is their longest q_len (tokens)."""
    num_heads, head_dim = query.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m, block_n = TILES[query.dtype]
    block_m = max(block_m, group_pad)
    block_q = block_m // group_pad
    grid = (seq_ids.shape[0], triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        seq_ids,
        scale * LOG2_E,
        NO_WINDOW if sliding_window is None else sliding_window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=dot_in_fp32(_prefill_kernel, query.dtype),
    )


def check_query_lens(starts: list[int], lens: list[int], num_tokens: int) -> list[int]:
    """Host-side checks of the ragged batch; returns each sequence's q_len (tokens)."""
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    if starts[0] != 0 or starts[-1] != num_tokens or min(q_lens, default=0) < 0:
        raise ValueError(f"query_start_loc {starts} must rise from 0 to num_tokens {num_tokens}")
    for i, (q_len, seq_len) in enumerate(zip(q_lens, lens)):
        if q_len > seq_len:
            raise ValueError(
                f"sequence {i}: {q_len} query tokens cannot exceed a context of {seq_len}"
            )
    return q_lens


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch over paged K/V (see the module docstring); any
    q_len from 1 to seq_len. Returns [num_tokens, num_heads, head_dim] in the query's dtype.
    Reads seq_lens/query_start_loc on the host (one sync)."""
    check_attention_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        sliding_window,
        _prefill_kernel,
    )
    lens = seq_lens.tolist()
    q_lens = check_query_lens(query_start_loc.tolist(), lens, query.shape[0])
    check_block_tables_cover(block_tables, k_cache.shape[1], max(lens, default=0))
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] > 0:
        seq_ids = torch.arange(len(lens), dtype=torch.int32, device=query.device)
        launch_prefill(
            out,
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            sliding_window,
            seq_ids,
            max(q_lens),
        )
    return out
