"""Paged attention for CPU, arranged for speed; same math as the reference.

Same signatures and cache layout as `kernels/reference.py` (read its docstring first); the
reference stays the readable definition that every kernel, this one included, is tested
against. What differs:

- Decodes (q_len == 1) of the whole batch go together. In fp32 and bf16 they go to the C
  kernel of `cpu_decode.py`, which reads K and V in place through the block tables.
  Without a C compiler (or in fp16): K and V are gathered once per layer (whole blocks,
  one `index_select` each) and attended by one `F.scaled_dot_product_attention` call (a
  fused flash kernel on CPU, GQA without copies) with a key-padding mask. A whole W64
  decode step (64 sequences): gather + SDPA measured far faster than the reference, and the
  C kernel faster than gather + SDPA, a little in fp32 and by far more in bf16 (`python -m
  bench.decode_step`, which writes bench/results/decode_step.md).
- A batch with longer sequences (prompts, chunks after cached context, prefix-cache hits,
  mixed with decodes or not) is one call of the C kernel in fp32 (vLLM's unified CPU
  attention: `cpu_decode.paged_attention`, tiles of the prompts and the decodes handed out
  together to the threads, keys read in place): `python -m bench.mixed_attention` (which
  writes bench/results/mixed_attention.md) has it faster than the torch paths below. In bf16
  those stay: SDPA's bf16 matmuls (AMX where the CPU has it) beat the kernel's fp32
  arithmetic on an AMX Xeon, and still with the kernel built for AVX2 and torch held to AVX2
  (`bench.mixed_attention --march x86-64-v3`). The torch paths (also fp16, and no compiler):
- whole prompts (no cached context: q_len == seq_len), when the caller passes this step's
  `key` and `value`, attend to those directly, with no gather from the cache: sequences of
  the same length go through one batched causal SDPA call;
- chunked prefills and prefills after a prefix-cache hit run one sequence at a time
  through SDPA with a causal mask offset by the cached context.
- Everything stays in the cache's dtype (bf16 runs bf16, accumulating in fp32 inside the
  kernels) except fp16, which is computed in fp32.

Like the reference, the torch path needs finite values in slots past a sequence's length
(the cache is allocated zeroed): they get probability 0, and 0 x NaN would still be NaN.
The C kernels never read them.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels import cpu_decode
from kernels.cpu_fused import store_kv  # noqa: F401  (one row copy per token, in C)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """As `reference.paged_attention`: [num_tokens, num_heads, head_dim] in the query's dtype.
    `key`, `value` [num_tokens, num_kv_heads, head_dim]: this step's own, the ones `store_kv`
    just wrote (optional; whole-prompt prefills then read them instead of the cache)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0 or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} "
            f"kv heads x {k_cache.shape[3]}"
        )
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    if all(q_len == 1 for q_len in q_lens):  # the steady state: no index juggling at all
        return _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
    if (
        query.dtype == torch.float32
        and cpu_decode.available(query.dtype)
        and k_cache.dtype == query.dtype
    ):
        return cpu_decode.paged_attention(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window
        )
    if (
        max(q_lens) <= MAX_ROWS_AS_DECODES
        and cpu_decode.available(query.dtype)
        and k_cache.dtype == query.dtype
    ):
        return _rows_as_decodes(
            query, k_cache, v_cache, block_tables, seq_lens, q_lens, scale, sliding_window
        )
    return sdpa_paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, starts, scale, sliding_window, key, value
    )


# Without a native mixed kernel for the dtype (bf16), sequences of at most this many query
# rows (a decode verifying its speculative drafts, a short prefill chunk) attend row by row
# through the decode kernel rather than through SDPA per sequence, which is faster for
# speculative steps at batch 8 (bench.spec_decode --dtype bfloat16); fp32's native mixed
# kernel is faster than either at these sizes (bench.spec_decode --step-cost).
MAX_ROWS_AS_DECODES = 16


def _rows_as_decodes(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: list[int],
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Each query row as a decode of its own: row j of a sequence of q_len rows attends to
    its first seq_len - (q_len - 1 - j) keys (causal), all in the cache already. One native
    decode call for the batch, and each row's arithmetic is a plain decode's at that
    position, so a speculative step's rows match decoding without drafts."""
    counts = torch.tensor(q_lens)
    seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), counts)
    first_row = torch.cumsum(counts, 0) - counts
    rows_after = counts[seq_of_row] - 1 - (torch.arange(len(seq_of_row)) - first_row[seq_of_row])
    row_lens = seq_lens.to(torch.long)[seq_of_row] - rows_after
    if bool((row_lens < 1).any()):
        raise ValueError("a sequence has more query tokens than its context")
    return _decode(
        query,
        k_cache,
        v_cache,
        block_tables[seq_of_row],
        row_lens.to(seq_lens.dtype),
        scale,
        sliding_window,
    )


def sdpa_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    starts: list[int],
    scale: float,
    sliding_window: int | None,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
) -> torch.Tensor:
    """A batch with sequences longer than one token through torch's SDPA (the decodes among
    them through `_decode`): fp16, no compiler, and bench.mixed_attention's baseline.
    `starts`: query_start_loc as a list."""
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    out = torch.empty_like(query)
    decode_rows = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows)
        token_rows = torch.tensor([starts[i] for i in decode_rows])
        out[token_rows] = _decode(
            query[token_rows],
            k_cache,
            v_cache,
            block_tables[rows],
            seq_lens[rows],
            scale,
            sliding_window,
        )
    lens = seq_lens.tolist()
    fresh: dict[int, list[int]] = {}  # q_len -> sequences whose prompt is all new
    if key is not None and value is not None and sliding_window is None:
        for i, q_len in enumerate(q_lens):
            if q_len > 1 and q_len == lens[i]:
                fresh.setdefault(q_len, []).append(i)
    for q_len, seqs in fresh.items():
        # Each run of them consecutive in the batch is one batched call on views of q, k and
        # v: row gathers and a scatter per layer were a tenth of a bf16 prefill step.
        for first, count in _runs([starts[i] for i in seqs], q_len):
            rows = slice(first, first + count * q_len)
            out[rows] = _fresh_prefill(query, key, value, rows, count, q_len, scale)
    done = {i for seqs in fresh.values() for i in seqs}
    for i, q_len in enumerate(q_lens):
        if q_len > 1 and i not in done:
            start = starts[i]
            out[start : start + q_len] = _extend(
                query[start : start + q_len],
                k_cache,
                v_cache,
                block_tables[i],
                lens[i],
                scale,
                sliding_window,
            )
    return out


def _runs(starts: list[int], q_len: int) -> list[tuple[int, int]]:
    """(first row, number of sequences) of each run of sequences that follow each other in
    the batch (each starting where the previous one's q_len rows end)."""
    runs: list[tuple[int, int]] = []
    for start in starts:
        if runs and runs[-1][0] + runs[-1][1] * q_len == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((start, 1))
    return runs


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float16 else dtype


def _gather(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [num_blocks, block_size, kv_heads, D], blocks [S, n] ->
    [S, n * block_size, kv_heads, D] in `dtype`: one contiguous copy of whole blocks."""
    num_seqs, num_blocks = blocks.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    # On a 2-D view each block is one contiguous row: index_select copies rows with memcpy
    # (several times faster than on the 4-D cache).
    flat = cache.view(cache.shape[0], block_size * num_kv_heads * head_dim)
    gathered = flat.index_select(0, blocks.reshape(-1)).to(dtype)
    return gathered.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    if cpu_decode.available(query.dtype) and k_cache.dtype == query.dtype:
        return cpu_decode.paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window
        )
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    dtype = _compute_dtype(query.dtype)
    lens = seq_lens.to(torch.long)
    num_blocks = -(-int(lens.max()) // block_size)
    blocks = block_tables[:, :num_blocks].to(torch.long)
    # [S, C, KVH, D] seen as [S, KVH, C, D]: SDPA's CPU kernel reads the strides in place.
    k = _gather(k_cache, blocks, dtype).transpose(1, 2)
    v = _gather(v_cache, blocks, dtype).transpose(1, 2)
    keys = torch.arange(k.shape[2])
    visible = keys[None, :] < lens[:, None]  # [S, C]
    if sliding_window is not None:
        visible &= keys[None, :] > (lens - 1 - sliding_window)[:, None]
    out = F.scaled_dot_product_attention(
        query.to(dtype)[:, :, None],
        k,
        v,
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def _fresh_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: slice,
    num_seqs: int,
    q_len: int,
    scale: float,
) -> torch.Tensor:
    """`num_seqs` whole prompts of q_len tokens each, consecutive (their token rows `rows`),
    causal over their own keys: one batched SDPA call. Returns [num_seqs * q_len, heads,
    head_dim]."""
    num_heads, head_dim = query.shape[1:]
    dtype = _compute_dtype(query.dtype)

    def batched(x: torch.Tensor) -> torch.Tensor:  # [S * L, heads, D] -> [S, heads, L, D]
        return x[rows].to(dtype).view(num_seqs, q_len, x.shape[1], head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        batched(query),
        batched(key),
        batched(value),
        is_causal=True,
        scale=scale,
        enable_gqa=num_heads != key.shape[1],
    )
    return out.transpose(1, 2).reshape(num_seqs * q_len, num_heads, head_dim).to(query.dtype)


def _extend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence's q_len (> 1) newest tokens over its seq_len tokens of context."""
    q_len, num_heads, head_dim = query.shape
    if q_len > seq_len:
        raise ValueError(f"{q_len} query tokens cannot exceed a context of {seq_len}")
    block_size = k_cache.shape[1]
    dtype = _compute_dtype(query.dtype)
    blocks = block_table[: -(-seq_len // block_size)].to(torch.long)[None]
    k = _gather(k_cache, blocks, dtype)[0, :seq_len].transpose(0, 1)  # [KVH, C, D]
    v = _gather(v_cache, blocks, dtype)[0, :seq_len].transpose(0, 1)
    q = query.to(dtype).transpose(0, 1)  # [H, Q, D]
    mask = None
    if sliding_window is not None or q_len != seq_len:
        positions = torch.arange(seq_len - q_len, seq_len)[:, None]
        keys = torch.arange(seq_len)[None, :]
        visible = keys <= positions
        if sliding_window is not None:
            visible &= keys > positions - sliding_window
        mask = visible
    out = F.scaled_dot_product_attention(
        q[None],
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=num_heads != k.shape[0],
    )
    return out[0].transpose(0, 1).to(query.dtype)
