"""Tensor-parallel pieces of the decoder: which shard a rank holds, and the collectives.

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes some output
features: its attention heads, its slice of the MLP) and need no communication; o_proj
and down_proj are row-parallel (each rank multiplies its input slice) and end in one
all-reduce. The embedding and LM head are split by vocabulary rows.

Every module here knows which slice of the full checkpoint tensor it holds
(`checkpoint_slice`), so the loader reads exactly that slice from disk. With
tp_size = 1 each module is numerically the plain torch op (same call, same rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from worker_svc.model.config import ModelConfig
from worker_svc.model.matmul import PreparableLinear, PreparedWeight, linear

Index = tuple[slice, ...]  # what the loader applies to a checkpoint tensor
FULL: Index = (slice(None),)


class TPComm(Protocol):
    """The collectives a tensor-parallel model needs (`DistributedContext` has them)."""

    def tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def tp_all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...

    def tp_all_to_all(
        self, tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]: ...


class NoComm:
    """For a model built for its shapes only, or a single rank: collectives are only
    allowed when there is nobody to talk to."""

    def __init__(self, tp_size: int = 1) -> None:
        self.tp_size = tp_size

    def _check(self) -> None:
        if self.tp_size > 1:
            raise RuntimeError(
                "this model was built without a process group; pass the "
                "DistributedContext from init_distributed to run it"
            )

    def tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check()
        return tensor

    def tp_all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        self._check()
        return tensor

    def tp_all_to_all(
        self, tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        self._check()
        return tensor, list(send_counts)


def shard_range(size: int, tp_size: int, tp_rank: int, what: str) -> tuple[int, int]:
    """[start, stop) of rank `tp_rank`'s equal share of `size`; raises if it does not divide."""
    if size % tp_size != 0:
        raise ValueError(f"{what} ({size}) must be divisible by tp_size ({tp_size})")
    share = size // tp_size
    return tp_rank * share, (tp_rank + 1) * share


@dataclass(frozen=True)
class AttentionShard:
    """The heads one TP rank computes; head indices are global (checkpoint) indices."""

    num_heads: int
    num_kv_heads: int
    q_head_start: int
    kv_head_start: int


def attention_shard(
    num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int
) -> AttentionShard:
    """q heads split evenly; KV heads split too when there are at least tp_size of them,
    else replicated: each rank holds the one KV head its q heads read (GQA groups never
    straddle two ranks because tp_size is then a multiple of num_kv_heads)."""
    q_start, q_stop = shard_range(num_heads, tp_size, tp_rank, "num_attention_heads")
    if tp_size <= num_kv_heads:
        kv_start, kv_stop = shard_range(num_kv_heads, tp_size, tp_rank, "num_key_value_heads")
        return AttentionShard(q_stop - q_start, kv_stop - kv_start, q_start, kv_start)
    if tp_size % num_kv_heads != 0:
        raise ValueError(
            f"tp_size ({tp_size}) exceeds num_key_value_heads ({num_kv_heads}), "
            "so it must be a multiple of it (each KV head is replicated "
            "on tp_size / num_key_value_heads ranks)"
        )
    return AttentionShard(q_stop - q_start, 1, q_start, tp_rank // (tp_size // num_kv_heads))


def check_tensor_parallel(config: ModelConfig, tp_size: int, expert_parallel: bool = False) -> None:
    """Raise a ValueError naming the first dimension that `tp_size` cannot split (a MoE
    model's experts are sliced like the dense MLP, or under `expert_parallel` placed whole:
    then there must be an expert for every rank)."""
    attention_shard(config.num_heads, config.num_kv_heads, tp_size, 0)
    moe = config.moe
    if moe is None or not all(moe.sparse_layers):
        shard_range(config.intermediate_size, tp_size, 0, "intermediate_size")
    if moe is None:
        return
    if moe.shared_expert_intermediate_size:
        shard_range(
            moe.shared_expert_intermediate_size, tp_size, 0, "shared_expert_intermediate_size"
        )
    if expert_parallel and tp_size > 1:
        if moe.num_experts < tp_size:
            raise ValueError(
                f"--enable-expert-parallel over {tp_size} ranks needs at least "
                f"{tp_size} experts; the model has {moe.num_experts}"
            )
    else:
        shard_range(moe.intermediate_size, tp_size, 0, "moe_intermediate_size")


class RowParallelLinear(nn.Module, PreparableLinear):
    """y = x W^T + b where this rank holds input features [in_start, in_start + in_size).

    The partial products are summed across TP ranks; the bias, replicated, is added once
    after the sum (adding it on every rank would count it tp_size times).
    """

    def __init__(
        self, in_start: int, in_size: int, out_features: int, bias: bool, tp_size: int, comm: TPComm
    ) -> None:
        super().__init__()
        self.in_start = in_start
        self.tp_size = tp_size
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out_features, in_size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_weight: PreparedWeight | None = None  # quantized or packed: see matmul.py

    lora = None  # its LoRA slots (worker_svc/lora/slots.py LayerLora) when LoRA is on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # one fused op, as nn.Linear (and transformers) round it
            out = linear(x, self.weight, self.bias, self.packed_weight)
            return out if self.lora is None else self.lora.apply_(out, x)
        partial = linear(x, self.weight, None, self.packed_weight)
        if self.lora is not None:  # this rank's share of the product, summed with the rest
            self.lora.apply_(partial, x)
        out = self.comm.tp_all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def checkpoint_slice(self, param_name: str) -> Index:
        if param_name == "bias":
            return FULL
        return (slice(None), slice(self.in_start, self.in_start + self.weight.shape[1]))


class VocabParallelEmbedding(nn.Module, PreparableLinear):
    """Vocabulary rows split across TP ranks: used as the input embedding and as the LM head.

    The vocabulary is padded up to a multiple of tp_size; each rank holds
    `num_local_rows` rows starting at `vocab_start`, the padding rows (on the last ranks)
    zero. As embedding, ids outside the shard give zero rows and the all-reduce fills
    them in; as LM head, local logits are gathered and the padding columns dropped.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tp_size: int, tp_rank: int, comm: TPComm
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = tp_size
        self.comm = comm
        self.num_local_rows = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.num_local_rows
        # Rows of the checkpoint this rank reads; fewer than num_local_rows on a padded rank.
        self.vocab_stop = max(
            self.vocab_start, min(self.vocab_start + self.num_local_rows, vocab_size)
        )
        self.weight = nn.Parameter(torch.empty(self.num_local_rows, hidden_size))
        # The embedding lookup reads the plain rows, so packing (matmul.pack_linear_weights)
        # keeps them; only the module that computes logits opts in to packing (the model
        # sets its `packable`).
        self.packed_weight: PreparedWeight | None = None
        self.packable = False
        self.keeps_plain_weight = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_local_rows)
        rows = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside[:, None], 0.0)
        return self.comm.tp_all_reduce(rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> fp32 logits [num_rows, vocab_size]."""
        local = linear(hidden, self.weight, None, self.packed_weight)
        if self.tp_size == 1:
            return local.float()
        return self.comm.tp_all_gather(local, dim=-1)[:, : self.vocab_size].float()

    def checkpoint_slice(self) -> Index:
        return (slice(self.vocab_start, self.vocab_stop),)

    def load(self, tensor: torch.Tensor) -> None:
        """Copy this rank's checkpoint rows in and zero the padding rows."""
        num_rows = self.vocab_stop - self.vocab_start
        if tuple(tensor.shape) != (num_rows, self.weight.shape[1]):
            raise ValueError(
                f"vocab shard: expected {(num_rows, self.weight.shape[1])}, "
                f"got {tuple(tensor.shape)}"
            )
        self.weight.data[:num_rows].copy_(tensor)
        self.weight.data[num_rows:].zero_()
