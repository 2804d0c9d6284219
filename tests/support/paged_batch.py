"""Random paged batches for the kernel tests (a helper, not a test).

Blocks are handed out from a shuffled free list (so block tables are not monotonic), the
last block of each sequence is partly filled, and every slot no sequence owns holds NaN:
a kernel that reads past a context (or a masked lane that leaks) turns its output into NaN.
The reference needs finite memory there (it multiplies unused slots by a zero probability),
so `reference_caches` hands it a copy with the NaNs zeroed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tolerances (rtol, atol) against the fp32 reference, per dtype. fp32: only summation order
# differs. fp16/bf16: the output is rounded to the dtype (a few ulps at values ~1: 2**-10 for
# fp16, 2**-7 for bf16), and on a GPU the probabilities are rounded to it before P @ V.
TOLERANCES = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], NaN where unused
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32

    def args(self) -> tuple:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )

    def reference_args(self) -> tuple:
        zeroed = [torch.nan_to_num(c, nan=0.0) for c in (self.k_cache, self.v_cache)]
        return (self.query, *zeroed, self.block_tables, self.seq_lens, self.query_start_loc)


def build_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two spare blocks nobody owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    free = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq, default=1), dtype=torch.int32)
    for i, seq_len in enumerate(seq_lens):
        blocks = [free.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        positions = torch.arange(seq_len)
        block_ids = block_tables[i].long()[positions // block_size]
        offsets = positions % block_size
        for cache in (k_cache, v_cache):
            cache[block_ids, offsets] = torch.randn(
                seq_len, num_kv_heads, head_dim, generator=generator
            )
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        query.to(dtype),
        k_cache.to(dtype),
        v_cache.to(dtype),
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        starts,
    )


def assert_matches_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCES[expected.dtype]
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)
