"""The attention backend seam: which ops store K/V and attend over the paged cache.

The model calls `backend.store_kv` and `backend.forward` and knows nothing else; the
runner builds one `AttentionMetadata` per step and hands it to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import reference

BACKEND_NAMES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence may attend to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, prefix sums of query lengths


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None: ...

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
        scale: float, sliding_window: int | None = None,
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    """The plain-torch reference ops from `kernels/reference.py`; works on any device."""

    name = "torch"

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        reference.store_kv(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
        scale: float, sliding_window: int | None = None,
    ) -> torch.Tensor:
        return reference.paged_attention(
            query, kv_cache[0], kv_cache[1], metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, scale, sliding_window=sliding_window,
        )


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """"torch" everywhere; "auto" is torch on CPU (and will be triton on CUDA)."""
    device = torch.device(device)
    if name == "auto":
        # Until the Triton kernels land, CUDA also runs the reference ops.
        name = "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        raise NotImplementedError(
            "the 'triton' attention backend comes with the Triton kernels issue; "
            f"use 'torch' (device {device}) until then"
        )
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
