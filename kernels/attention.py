"""The Triton attention ops behind one call with the torch reference's signatures.

`paged_attention` splits a ragged batch by query length: sequences with `q_len == 1` go
to the split-K decode kernel (`kernels/paged_attention.py`), the others to the prefill /
extend kernel (`kernels/prefill_attention.py`); both write into one output tensor, so a
step that mixes decodes with a chunked prefill needs no gather or scatter. The split needs
the lengths on the host: `plan_attention` reads them once (one device sync), and a caller
that runs many layers over the same batch (the worker's backend) plans once per step and
calls `paged_attention_planned` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_store import store_kv
from kernels.paged_attention import (
    _decode_partition_kernel,
    check_attention_args,
    check_block_tables_cover,
    interpreted,
    launch_decode,
)
from kernels.prefill_attention import check_query_lens, launch_prefill

__all__ = [
    "AttentionPlan",
    "paged_attention",
    "paged_attention_planned",
    "plan_attention",
    "runs_in_interpreter",
    "store_kv",
]


def runs_in_interpreter() -> bool:
    """Whether the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 when this
    module was first imported): then they run on CPU tensors, and only then."""
    return interpreted(_decode_partition_kernel)


@dataclass(frozen=True)
class AttentionPlan:
    """Which sequences each kernel takes, from one batch's lengths read on the host."""

    decode_seq_ids: torch.Tensor  # [num_decodes] int32 on the batch's device, q_len == 1
    prefill_seq_ids: torch.Tensor  # [num_prefills] int32, q_len > 1
    max_decode_seq_len: int  # tokens; 0 without decodes
    max_prefill_query_len: int  # tokens; 0 without prefills


def plan_attention(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    num_tokens: int,
    block_tables: torch.Tensor,
    block_size: int,
) -> AttentionPlan:
    """Split a batch into decodes and prefills; raise ValueError if the lengths are
    inconsistent (q_len > seq_len, starts not rising to `num_tokens`, block tables too
    narrow). Sequences with q_len 0 are in neither list."""
    lens = seq_lens.tolist()
    q_lens = check_query_lens(query_start_loc.tolist(), lens, num_tokens)
    check_block_tables_cover(block_tables, block_size, max(lens, default=0))
    decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    prefills = [i for i, q_len in enumerate(q_lens) if q_len > 1]
    device = seq_lens.device
    return AttentionPlan(
        decode_seq_ids=torch.tensor(decodes, dtype=torch.int32).to(device),
        prefill_seq_ids=torch.tensor(prefills, dtype=torch.int32).to(device),
        max_decode_seq_len=max((lens[i] for i in decodes), default=0),
        max_prefill_query_len=max((q_lens[i] for i in prefills), default=0),
    )


def paged_attention_planned(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    plan: AttentionPlan,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_attention` with the host-side split already made by `plan_attention` for
    these same `seq_lens`/`query_start_loc`; no device sync."""
    check_attention_args(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sliding_window
    )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    args = (
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
    )
    if plan.decode_seq_ids.numel():
        launch_decode(*args, plan.decode_seq_ids, plan.max_decode_seq_len)
    if plan.prefill_seq_ids.numel():
        launch_prefill(*args, plan.prefill_seq_ids, plan.max_prefill_query_len)
    return out


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
    """Causal attention of a ragged batch of queries over paged K/V; the same contract as
    `kernels.reference.paged_attention` (query [num_tokens, num_heads, head_dim] in, the
    same shape and dtype out)."""
    check_attention_args(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sliding_window
    )
    plan = plan_attention(
        seq_lens,
        query_start_loc,
        num_tokens=query.shape[0],
        block_tables=block_tables,
        block_size=k_cache.shape[1],
    )
    return paged_attention_planned(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        plan,
        sliding_window=sliding_window,
    )
