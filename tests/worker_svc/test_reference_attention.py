"""The paged reference ops against a naive dense causal attention."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import paged_attention, store_kv


def naive_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [q_len, H, D] for the last q_len of keys/values [seq_len, KVH, D]."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    out = torch.empty_like(query)
    for i in range(q_len):
        position = seq_len - q_len + i
        first = 0 if sliding_window is None else max(0, position - sliding_window + 1)
        for h in range(num_heads):
            scores = keys[first : position + 1, h] @ query[i, h] * scale
            out[i, h] = torch.softmax(scores, dim=0) @ values[first : position + 1, h]
    return out


def dense_batch(queries, contexts, scale: float, sliding_window: int | None = None):
    return torch.cat(
        [
            naive_attention(q, k, v, scale, sliding_window)
            for q, (k, v) in zip(queries, contexts, strict=True)
        ]
    )


def build_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    seed: int = 0,
):
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    contexts, queries = [], []
    for i, seq_len in enumerate(seq_lens):
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        block_tables[i, : len(blocks)] = torch.tensor(blocks)
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        positions = torch.arange(seq_len)
        slots = torch.tensor(blocks)[positions // block_size] * block_size + positions % block_size
        store_kv(keys, values, k_cache, v_cache, slots)
        contexts.append((keys, values))
        queries.append(torch.randn(q_lens[i], num_heads, head_dim, generator=generator))
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        torch.cat(queries),
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc,
        contexts,
        queries,
    )


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_ragged_batch_matches_dense(num_heads: int, num_kv_heads: int, sliding_window) -> None:
    # decode, fresh prefill, chunked prefill, decode exactly on a block boundary,
    # prefix-cache hit (q_len well below seq_len), one-token sequence.
    seq_lens = [13, 7, 20, 16, 11, 1]
    q_lens = [1, 7, 6, 1, 3, 1]
    head_dim, block_size, scale = 8, 4, 8**-0.5
    query, k_cache, v_cache, block_tables, lens, starts, contexts, queries = build_paged_batch(
        seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, num_blocks=40
    )
    out = paged_attention(
        query, k_cache, v_cache, block_tables, lens, starts, scale, sliding_window=sliding_window
    )
    expected = dense_batch(queries, contexts, scale, sliding_window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_decode_only_batch_matches_dense() -> None:
    seq_lens = [1, 4, 5, 9, 31]
    query, k_cache, v_cache, block_tables, lens, starts, contexts, queries = build_paged_batch(
        seq_lens, [1] * 5, num_heads=8, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=20
    )
    out = paged_attention(query, k_cache, v_cache, block_tables, lens, starts, 0.25)
    expected = dense_batch(queries, contexts, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bf16_cache_returns_query_dtype() -> None:
    query, k_cache, v_cache, block_tables, lens, starts, contexts, queries = build_paged_batch(
        [6, 3], [2, 1], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=4
    )
    out = paged_attention(
        query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), block_tables, lens, starts, 0.3
    )
    assert out.dtype == torch.bfloat16
    expected = dense_batch(queries, contexts, 0.3)
    torch.testing.assert_close(out.float(), expected, rtol=5e-2, atol=5e-2)


def test_store_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(3, 2, 1, 4)
    v_cache = torch.zeros(3, 2, 1, 4)
    key = torch.arange(12, dtype=torch.float32).reshape(3, 1, 4) + 1
    store_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], -key[0])
    assert torch.equal(k_cache[0, 0], key[2])
    assert int((k_cache != 0).any(-1).sum()) == 2  # the padding token wrote nothing


def test_store_kv_rejects_wrong_head_shape() -> None:
    k_cache = torch.zeros(2, 2, 2, 4)
    with pytest.raises(ValueError, match="kv heads"):
        store_kv(
            torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), k_cache, k_cache.clone(), torch.tensor([0])
        )
