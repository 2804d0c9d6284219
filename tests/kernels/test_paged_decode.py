"""The split-K paged decode kernel against `kernels.reference.paged_attention`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference  # noqa: E402
from kernels.paged_attention import (  # noqa: E402
    DEFAULT_PARTITION_SIZE,
    MAX_NUM_PARTITIONS,
    choose_partition_size,
    paged_decode_attention,
)
from tests.support.paged_batch import assert_matches_reference, build_paged_batch  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def check_decode(
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    sliding_window=None,
    partition_size=None,
    seed=0,
) -> None:
    batch = build_paged_batch(
        seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    out = paged_decode_attention(
        *batch.args(), scale, sliding_window=sliding_window, partition_size=partition_size
    )
    expected = reference.paged_attention(
        *batch.reference_args(), scale, sliding_window=sliding_window
    )
    assert_matches_reference(out, expected)


# Ragged lengths with partly filled last blocks, a one-token context and exact block ends.
@pytest.mark.parametrize(
    "seq_lens,num_heads,num_kv_heads,head_dim,block_size,dtype",
    [
        ([1, 8, 13, 30], 4, 4, 64, 8, F32),  # MHA
        ([17, 5, 48], 8, 2, 96, 16, F16),  # GQA, head_dim padded to 128
        ([33, 64, 7], 4, 1, 128, 32, BF16),  # MQA
        ([130, 3], 2, 1, 64, 128, F16),  # one big block size
        ([9, 21], 6, 2, 24, 4, F32),  # what the tiny test models use: group 3, dim 24, blocks of 4
    ],
)
def test_single_pass_matches_reference(
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
):
    check_decode(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,head_dim,sliding_window",
    [
        (F32, 4, 2, 64, None),
        (BF16, 8, 1, 96, None),
        (F16, 4, 4, 128, 40),  # the window spans partitions
    ],
)
def test_split_k_matches_reference(dtype, num_heads, num_kv_heads, head_dim, sliding_window):
    """16-token partitions: the 100-token context takes 7 of them, the 5-token one one."""
    check_decode(
        [100, 5, 47],
        num_heads,
        num_kv_heads,
        head_dim,
        16,
        dtype,
        sliding_window=sliding_window,
        partition_size=16,
    )


def test_default_split_for_a_long_context():
    seq_lens = [DEFAULT_PARTITION_SIZE * 2 + 77, 40]
    assert choose_partition_size(max(seq_lens), len(seq_lens), 1) == DEFAULT_PARTITION_SIZE
    check_decode(seq_lens, 2, 1, 64, 32, F16)


@pytest.mark.parametrize("sliding_window", [1, 5, 64])
def test_sliding_window_matches_reference(sliding_window):
    check_decode([3, 20, 70], 4, 2, 64, 8, F32, sliding_window=sliding_window)


def test_partition_choice():
    assert choose_partition_size(DEFAULT_PARTITION_SIZE, 1, 8) is None  # fits one pass
    assert choose_partition_size(4096, 1, 8) == DEFAULT_PARTITION_SIZE
    assert choose_partition_size(4096, 64, 8) is None  # 512 programs fill the GPU
    assert choose_partition_size(16384, 64, 8) == DEFAULT_PARTITION_SIZE
    long_context = DEFAULT_PARTITION_SIZE * MAX_NUM_PARTITIONS * 3
    assert choose_partition_size(long_context, 1, 1) == DEFAULT_PARTITION_SIZE * 4


def test_wrapper_rejects_bad_arguments():
    batch = build_paged_batch([5, 9], [1, 1], 4, 2, 64, 8)
    query, k_cache, v_cache, block_tables, seq_lens, starts = batch.args()
    two_tokens_first = torch.tensor([0, 2, 3], dtype=torch.int32)
    bad_calls = {
        "exactly one query token": dict(
            query_start_loc=two_tokens_first, query=query.repeat(2, 1, 1)[:3]
        ),
        "multiple": dict(query=query[:, :3]),
        "share one of": dict(query=query.half()),
        "block_tables hold 1 blocks": dict(block_tables=block_tables[:, :1]),
        "seq_lens must be int32/int64": dict(seq_lens=seq_lens.float()),
        "leading size": dict(seq_lens=seq_lens[:1]),
        "contiguous in head_dim": dict(query=query.transpose(1, 2).contiguous().transpose(1, 2)),
        "seq_len >= 1": dict(seq_lens=torch.tensor([0, 9], dtype=torch.int32)),
    }
    args = dict(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=starts,
        scale=0.125,
    )
    for message, changes in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            paged_decode_attention(**{**args, **changes})
    with pytest.raises(ValueError, match="sliding_window must be"):
        paged_decode_attention(**args, sliding_window=0)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(**args, partition_size=24)
