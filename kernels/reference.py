"""Plain-torch reference ops with the signatures the Triton kernels will share.

Layout (see DESIGN.md): one cache tensor per layer `[2, num_blocks, block_size,
num_kv_heads, head_dim]`; `k_cache`/`v_cache` are its two halves. A token at position
`p` of a sequence lives in slot `block_table[p // block_size] * block_size + p %
block_size`.

A ragged batch packs each sequence's new query tokens back to back; sequence `i` owns
query rows `query_start_loc[i]:query_start_loc[i + 1]` (its `q_len`), and those are the
LAST `q_len` positions of its `seq_lens[i]` tokens of context. Decode is `q_len == 1`,
a fresh prefill is `q_len == seq_len`, chunked prefill and prefix-cache hits are in
between. The ops compute in fp32 whatever the cache dtype.
"""

from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their slots.

    `slot_mapping` [num_tokens] int; slot -1 means "do not store" (padding tokens).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.shape != value.shape or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit a cache of "
            f"{num_kv_heads} kv heads x {head_dim}"
        )
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


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
) -> torch.Tensor:
    """Causal attention of a ragged batch of queries over paged K/V.

    query [num_tokens, num_heads, head_dim]; block_tables [num_seqs, max_blocks] int
    (entries past a sequence's last block are ignored but must index a real block, e.g.
    0); seq_lens [num_seqs] int: context length including the new tokens;
    query_start_loc [num_seqs + 1] int. `num_heads` must be a multiple of
    `num_kv_heads` (GQA). With `sliding_window = w`, a query at position `p` sees keys
    at positions `p - w + 1 .. p`. Returns [num_tokens, num_heads, head_dim] in the
    query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0 or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} kv heads "
            f"x {k_cache.shape[3]}"
        )
    out = torch.empty_like(query)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    decode_rows = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if decode_rows:
        # Decodes dominate a running batch: gather all their contexts and do one matmul.
        rows = torch.tensor(decode_rows, device=query.device)
        token_rows = query_start_loc[:-1].to(query.device).long()[rows]
        out[token_rows] = _decode_attention(
            query[token_rows],
            k_cache,
            v_cache,
            block_tables[rows],
            seq_lens[rows],
            scale,
            sliding_window,
        )
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        start = starts[i]
        out[start : start + q_len] = _extend_attention(
            query[start : start + q_len],
            k_cache,
            v_cache,
            block_tables[i],
            lens[i],
            scale,
            sliding_window,
        )
    return out


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_context: int
) -> torch.Tensor:
    """[num_seqs, max_blocks] block ids -> [num_seqs, max_context, num_kv_heads, head_dim] fp32."""
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks_needed = (max_context + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks_needed].long().clamp(min=0)
    gathered = cache[blocks]  # [num_seqs, blocks, block_size, kv_heads, head_dim]
    gathered = gathered.reshape(num_seqs, -1, *cache.shape[2:])
    return gathered[:, :max_context].to(torch.float32)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query softmax attention in fp32.

    q [S, Q, H, D]; k, v [S, C, KVH, D]; visible [S, Q, C] bool. Returns [S, Q, H, D].
    """
    num_seqs, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    # Heads h = kv * group + g share kv head `kv`, as transformers' repeat_kv lays them out.
    qg = q.reshape(num_seqs, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    kt = k.permute(0, 2, 3, 1).unsqueeze(2)  # [S, KVH, 1, D, C]
    scores = torch.matmul(qg, kt) * scale  # [S, KVH, G, Q, C]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).unsqueeze(2))  # [S, KVH, G, Q, D]
    return out.permute(0, 3, 1, 2, 4).reshape(num_seqs, q_len, num_heads, head_dim)


def _visible(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """query_positions [S, Q], key_positions [C], seq_lens [S] -> [S, Q, C] bool."""
    keys = key_positions[None, None, :]
    queries = query_positions[:, :, None]
    visible = (keys <= queries) & (keys < seq_lens[:, None, None])
    if sliding_window is not None:
        visible &= keys > queries - sliding_window
    return visible


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    seq_lens = seq_lens.to(query.device).long()
    max_context = int(seq_lens.max())
    k = _gather_context(k_cache, block_tables, max_context)
    v = _gather_context(v_cache, block_tables, max_context)
    key_positions = torch.arange(max_context, device=query.device)
    visible = _visible((seq_lens - 1)[:, None], key_positions, seq_lens, sliding_window)
    out = _attend(query.to(torch.float32)[:, None], k, v, visible, scale)
    return out[:, 0].to(query.dtype)


def _extend_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    q_len = query.shape[0]
    if q_len > seq_len:
        raise ValueError(f"{q_len} query tokens cannot exceed a context of {seq_len}")
    k = _gather_context(k_cache, block_table[None], seq_len)
    v = _gather_context(v_cache, block_table[None], seq_len)
    key_positions = torch.arange(seq_len, device=query.device)
    query_positions = key_positions[seq_len - q_len :][None]
    lens = torch.tensor([seq_len], device=query.device)
    visible = _visible(query_positions, key_positions, lens, sliding_window)
    out = _attend(query.to(torch.float32)[None], k, v, visible, scale)
    return out[0].to(query.dtype)
