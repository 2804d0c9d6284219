"""Triton kernel: paged decode attention, one query token per sequence, split-K.

Same signature and semantics as `kernels.reference.paged_attention` restricted to a batch
where every sequence has `q_len == 1` (`kernels.attention.paged_attention` dispatches mixed
batches). Layouts: query `[num_tokens, num_heads, head_dim]`; k_cache/v_cache `[num_blocks,
block_size, num_kv_heads, head_dim]`; block_tables `[num_seqs, max_blocks]`; a token at
position `p` lives in block `block_tables[s, p // block_size]` at offset `p % block_size`.

One program owns one (sequence, kv head, context partition): it loads the kv head's whole
query group as a `[GROUP_PAD, HEAD_DIM_PAD]` tile, so each K/V byte is read once for the
group (GQA/MQA), and runs an online softmax in fp32 over `BLOCK_N`-token tiles whose slots
come from the block table token by token (any block size works). A long context is cut into
`partition_size`-token partitions (split-K): each program writes its partial max, sum and
unnormalised output, and `_reduce_partitions_kernel` combines them. A short context (or a
batch with enough programs already) runs in one pass and writes the output directly.

This file also holds the argument checks and interpreter helpers the other kernels share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
NO_WINDOW = 1 << 30  # tokens; stands for sliding_window=None (no real context is this long)
LOG2_E = 1.4426950408889634
# Context tokens per tile. For sm_90 the fp16/bf16 kernel (head_dim 128, group 4) takes
# ~110 registers at 64; fp32's IEEE dot needs ~220 there, 80 at 32.
TILE_TOKENS = {torch.float16: 64, torch.bfloat16: 64, torch.float32: 32}
DEFAULT_PARTITION_SIZE = 512  # tokens per split-K partition, as vLLM's paged attention v2
MAX_NUM_PARTITIONS = 64  # the reduction keeps all partitions of a sequence in registers
# Enough (sequence, kv head) programs to fill an H100/H200 (132 SMs) several times over:
# splitting a context of at most 8k tokens then only adds the reduction's traffic.
ENOUGH_PROGRAMS = 512
MAX_UNSPLIT_CONTEXT = 8192  # tokens


def interpreted(kernel) -> bool:
    """Whether `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def dot_in_fp32(kernel, dtype: torch.dtype) -> bool:
    """The DOT_FP32 flag of `dot`: fp32 caches, and everything in Triton's interpreter, whose
    bf16 `tl.dot` is wrong (results ~1e10 off here). On a GPU fp16/bf16 operands go to the
    tensor cores as they are."""
    return dtype == torch.float32 or interpreted(kernel)


@triton.jit
def dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b accumulated in fp32. With DOT_FP32 the operands are upcast and multiplied in
    IEEE fp32 (not TF32, which would cost fp32 caches ~1e-3 of accuracy). The callers round
    the probabilities to the cache dtype before P @ V either way, so interpreter runs see the
    GPU's precision (though the interpreter rounds fp32 -> bf16 toward zero)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def load_kv_tile(
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
    BLOCK_SIZE: tl.constexpr,
):
    """K and V of one kv head at `positions` of a sequence, read through its block table
    (zeros where `in_context` is false or past the head dim)."""
    block_ids = tl.load(block_table + positions // BLOCK_SIZE, mask=in_context, other=0)
    token_offsets = (
        block_ids.to(tl.int64) * stride_cache_block
        + (positions % BLOCK_SIZE) * stride_cache_token
        + kv_head * stride_cache_head
    )
    kv_offsets = token_offsets[:, None] + dims[None, :]
    kv_mask = in_context[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    return k, v


def check_on_kernel_device(device: torch.device, kernel) -> None:
    if device.type == "cpu" and not interpreted(kernel):
        raise ValueError(
            "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
            "the kernel modules are imported (or use the torch reference ops)"
        )


def check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sliding_window: int | None,
    kernel=None,
) -> None:
    """Raise ValueError unless the arguments fit the paged attention kernels; `kernel` (default
    the decode kernel) tells whether CPU tensors can run."""
    if query.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"query {tuple(query.shape)} must be [num_tokens, num_heads, head_dim] "
            f"and k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0 or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} kv "
            f"heads x {k_cache.shape[3]} (num_heads must be a multiple)"
        )
    if (
        query.dtype not in FLOAT_DTYPES
        or k_cache.dtype != query.dtype
        or (v_cache.dtype != query.dtype)
    ):
        raise ValueError(
            f"query and caches must share one of {FLOAT_DTYPES}, got {query.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype}"
        )
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "query and caches must be contiguous in head_dim, and k_cache and "
            "v_cache must share strides (halves of one cache)"
        )
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    expected = {
        "block_tables": (block_tables, 2, (num_seqs,)),
        "seq_lens": (seq_lens, 1, (num_seqs,)),
        "query_start_loc": (query_start_loc, 1, (num_seqs + 1,)),
    }
    for name, (tensor, ndim, leading) in expected.items():
        if tensor.dim() != ndim or tensor.shape[:1] != leading or tensor.dtype not in INDEX_DTYPES:
            raise ValueError(
                f"{name} must be int32/int64 with {ndim} dims and leading size "
                f"{leading[0]} (seq_lens [num_seqs]), got {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if sliding_window is not None and not 1 <= sliding_window < NO_WINDOW:
        raise ValueError(f"sliding_window must be a positive token count, got {sliding_window}")
    tensors = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    check_on_kernel_device(query.device, _decode_partition_kernel if kernel is None else kernel)


@triton.jit
def _decode_partition_kernel(
    out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    partial_acc_ptr,
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
    max_num_partitions,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    slot = tl.program_id(0)  # index into seq_ids: the partial buffers are per slot
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + slot)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Partitions start at the window's first key, so a windowed layer needs no more of them.
    context_start = tl.maximum(seq_len - sliding_window, 0)
    part_start = context_start + partition * PARTITION_SIZE
    if part_start >= seq_len:
        return
    part_end = tl.minimum(part_start + PARTITION_SIZE, seq_len)

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    head_mask = group < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q = tl.load(
        query_ptr + q_row * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    running_max = tl.full([GROUP_PAD], -1e30, tl.float32)  # finite: no inf - inf = NaN
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    for tile_start in range(part_start, part_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        in_context = positions < part_end
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
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + dot(probs.to(v.dtype), v, DOT_FP32)
        running_max = new_max

    if SPLIT:
        partial = (slot * NUM_HEADS + heads) * max_num_partitions + partition
        tl.store(partial_max_ptr + partial, running_max, mask=head_mask)
        tl.store(partial_sum_ptr + partial, running_sum, mask=head_mask)
        tl.store(
            partial_acc_ptr + partial[:, None] * HEAD_DIM_PAD + dims[None, :],
            acc,
            mask=head_mask[:, None],
        )
    else:
        out = acc / running_sum[:, None]
        tl.store(
            out_ptr + q_row * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & dim_mask[None, :],
        )


@triton.jit
def _reduce_partitions_kernel(
    out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    partial_acc_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    sliding_window,
    stride_out_token,
    stride_out_head,
    max_num_partitions,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,
):
    slot = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + slot)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - tl.maximum(seq_len - sliding_window, 0)
    num_partitions = tl.cdiv(context_len, PARTITION_SIZE)
    partitions = tl.arange(0, PARTITIONS_PAD)
    valid = partitions < num_partitions
    partial = (slot * NUM_HEADS + head) * max_num_partitions + partitions
    maxes = tl.load(partial_max_ptr + partial, mask=valid, other=float("-inf"))
    global_max = tl.max(maxes, axis=0)
    weights = tl.where(valid, tl.exp2(maxes - global_max), 0.0)
    sums = tl.load(partial_sum_ptr + partial, mask=valid, other=0.0)
    total = tl.sum(weights * sums, axis=0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    accs = tl.load(
        partial_acc_ptr + partial[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    out = tl.sum(accs * weights[:, None], axis=0) / total
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(
        out_ptr + q_row * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def choose_partition_size(max_context_len: int, num_seqs: int, num_kv_heads: int) -> int | None:
    """Tokens per split-K partition for contexts of up to `max_context_len` tokens, or None for
    one pass: short contexts, or enough programs to fill the GPU without splitting."""
    if max_context_len <= DEFAULT_PARTITION_SIZE:
        return None
    if num_seqs * num_kv_heads >= ENOUGH_PROGRAMS and max_context_len <= MAX_UNSPLIT_CONTEXT:
        return None
    partition_size = DEFAULT_PARTITION_SIZE
    while triton.cdiv(max_context_len, partition_size) > MAX_NUM_PARTITIONS:
        partition_size *= 2
    return partition_size


def launch_decode(
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
    max_seq_len: int,
    partition_size: int | None = None,
) -> None:
    """Decode the sequences `seq_ids` (int32 on the device; each has q_len 1) into `out`'s
    rows. Arguments are checked by the caller; `max_seq_len` is the longest of their
    `seq_lens` (host int, tokens); `partition_size` None chooses one."""
    num_decodes = seq_ids.shape[0]
    num_heads, head_dim = query.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    window = NO_WINDOW if sliding_window is None else sliding_window
    max_context_len = min(max_seq_len, window)
    if partition_size is None:
        partition_size = choose_partition_size(max_context_len, num_decodes, num_kv_heads)
    num_partitions = 1 if partition_size is None else triton.cdiv(max_context_len, partition_size)
    split = num_partitions > 1
    # One pass: a single "partition" longer than any context; one compiled variant for all.
    partition_size = partition_size if split else NO_WINDOW
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if split:
        partial_max = torch.empty(
            num_decodes, num_heads, num_partitions, dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
        partial_acc = torch.empty(
            num_decodes,
            num_heads,
            num_partitions,
            head_dim_pad,
            dtype=torch.float32,
            device=query.device,
        )
    else:  # never read: the single-pass kernel writes `out` directly
        partial_max = partial_sum = partial_acc = out
    _decode_partition_kernel[(num_decodes, num_kv_heads, num_partitions)](
        out,
        partial_max,
        partial_sum,
        partial_acc,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        seq_ids,
        scale * LOG2_E,
        window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_partitions,
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=min(TILE_TOKENS[query.dtype], partition_size),
        PARTITION_SIZE=partition_size,
        SPLIT=split,
        DOT_FP32=dot_in_fp32(_decode_partition_kernel, query.dtype),
    )
    if split:
        _reduce_partitions_kernel[(num_decodes, num_heads)](
            out,
            partial_max,
            partial_sum,
            partial_acc,
            seq_lens,
            query_start_loc,
            seq_ids,
            window,
            out.stride(0),
            out.stride(1),
            num_partitions,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            PARTITION_SIZE=partition_size,
            PARTITIONS_PAD=triton.next_power_of_2(num_partitions),
        )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence (see the module docstring); returns
    [num_tokens, num_heads, head_dim] in the query's dtype. `partition_size` (tokens, a
    power of two >= 16) forces split-K partitions of that size; None chooses from the
    context length. Reads seq_lens/query_start_loc on the host (one sync)."""
    check_attention_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        sliding_window,
        _decode_partition_kernel,
    )
    if partition_size is not None and (
        partition_size < 16 or partition_size & (partition_size - 1)
    ):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts != list(range(len(starts))) or starts[-1] != query.shape[0]:
        raise ValueError(
            "decode attention needs exactly one query token per sequence "
            "(query_start_loc = 0, 1, ..., num_tokens)"
        )
    if any(n < 1 for n in lens):
        raise ValueError(f"every decoding sequence needs seq_len >= 1, got {lens}")
    check_block_tables_cover(block_tables, k_cache.shape[1], max(lens, default=0))
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if lens:
        seq_ids = torch.arange(len(lens), dtype=torch.int32, device=query.device)
        launch_decode(
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
            max(lens),
            partition_size,
        )
    return out


def check_block_tables_cover(block_tables: torch.Tensor, block_size: int, max_seq_len: int) -> None:
    if block_tables.shape[1] * block_size < max_seq_len:
        raise ValueError(
            f"block_tables hold {block_tables.shape[1]} blocks of {block_size} "
            f"tokens, fewer than a context of {max_seq_len} tokens"
        )
