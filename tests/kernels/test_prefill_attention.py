"""The paged prefill / extend kernel and the dispatcher against the torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference  # noqa: E402
from kernels.attention import paged_attention, plan_attention  # noqa: E402
from kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from tests.support.paged_batch import assert_matches_reference, build_paged_batch  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def check(
    op, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, sliding_window=None
) -> None:
    batch = build_paged_batch(
        seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = op(*batch.args(), scale, sliding_window=sliding_window)
    expected = reference.paged_attention(
        *batch.reference_args(), scale, sliding_window=sliding_window
    )
    assert_matches_reference(out, expected)


# Per batch: a fresh prompt (q_len == seq_len), a chunked prefill / prefix-cache hit
# (1 < q_len < seq_len), a decode row; contexts longer than one 64-token tile and more
# query tokens than one 64-row tile, partly filled last blocks.
@pytest.mark.parametrize(
    "seq_lens,q_lens,num_heads,num_kv_heads,head_dim,block_size,dtype",
    [
        ([70, 40, 9], [70, 13, 1], 4, 4, 64, 8, F32),  # MHA
        ([33, 90, 5], [33, 20, 5], 6, 2, 96, 16, F16),  # GQA with a group of 3
        ([50, 17, 80], [2, 17, 31], 4, 1, 128, 32, BF16),  # MQA
        ([140, 6], [12, 6], 2, 1, 64, 128, F16),  # one big block size
    ],
)
def test_prefill_matches_reference(
    seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
):
    check(
        paged_prefill_attention,
        seq_lens,
        q_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
    )


@pytest.mark.parametrize("dtype,sliding_window", [(F32, 1), (F32, 7), (BF16, 48)])
def test_sliding_window_matches_reference(dtype, sliding_window):
    check(paged_prefill_attention, [100, 30, 12], [80, 9, 1], 4, 2, 64, 16, dtype, sliding_window)


@pytest.mark.parametrize("dtype,sliding_window", [(F32, None), (F16, 6)])
def test_dispatcher_on_a_mixed_batch(dtype, sliding_window):
    """Decodes (one of them long enough for split-K) share a step with chunked prefills
    and a sequence that has no query this step."""
    seq_lens = [1100, 9, 37, 4, 60]
    q_lens = [1, 9, 1, 0, 25]
    check(paged_attention, seq_lens, q_lens, 4, 2, 64, 16, dtype, sliding_window)


def test_plan_splits_decodes_from_prefills():
    batch = build_paged_batch([1100, 9, 37, 4, 60], [1, 9, 1, 0, 25], 2, 1, 16, 16)
    plan = plan_attention(
        batch.seq_lens,
        batch.query_start_loc,
        num_tokens=36,
        block_tables=batch.block_tables,
        block_size=16,
    )
    assert plan.decode_seq_ids.tolist() == [0, 2] and plan.max_decode_seq_len == 1100
    assert plan.prefill_seq_ids.tolist() == [1, 4] and plan.max_prefill_query_len == 25


def test_empty_batch():
    batch = build_paged_batch([], [], 2, 1, 64, 8)
    assert paged_attention(*batch.args(), 0.125).shape == (0, 2, 64)


def test_wrappers_reject_inconsistent_lengths():
    batch = build_paged_batch([5, 9], [3, 4], 4, 2, 64, 8)
    query, k_cache, v_cache, block_tables, seq_lens, starts = batch.args()
    too_many = torch.tensor([0, 7, 7], dtype=torch.int32)  # 7 query tokens, context of 5
    short = torch.tensor([0, 3, 6], dtype=torch.int32)  # ends before num_tokens
    for op in (paged_prefill_attention, paged_attention):
        with pytest.raises(ValueError, match="cannot exceed a context of 5"):
            op(query, k_cache, v_cache, block_tables, seq_lens, too_many, 0.125)
        with pytest.raises(ValueError, match="must rise from 0 to num_tokens 7"):
            op(query, k_cache, v_cache, block_tables, seq_lens, short, 0.125)
        with pytest.raises(ValueError, match="one device|kv heads"):
            op(query[:, :3], k_cache, v_cache, block_tables, seq_lens, starts, 0.125)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 2), (128, 1)])  # group 8; group > rows
def test_strided_query_and_int64_indices(num_heads, num_kv_heads):
    """The model's query is a view into its fused qkv projection (token stride > heads x dim),
    and callers may pass int64 index tensors."""
    batch = build_paged_batch([40, 12, 25], [40, 1, 5], num_heads, num_kv_heads, 32, 8)
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)
    query = fused[:, :num_heads]
    indices = [t.long() for t in (batch.block_tables, batch.seq_lens, batch.query_start_loc)]
    out = paged_attention(query, batch.k_cache, batch.v_cache, *indices, 0.2)
    _, k_cache, v_cache, *_ = batch.reference_args()
    expected = reference.paged_attention(query, k_cache, v_cache, *indices, 0.2)
    assert_matches_reference(out, expected)
