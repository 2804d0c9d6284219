"""Paged KV cache tensors: one `[2, num_blocks, block_size, num_kv_heads, head_dim]` per layer.

Slot `block_id * block_size + offset` holds the key (index 0) and value (index 1) of one
token. The scheduler owns which blocks belong to whom; the worker only sizes and
allocates the tensors.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"every KV cache dimension must be positive: {self}")

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim * element_bytes
        return self.num_layers * per_layer


def num_blocks_for_budget(
    spec: KVCacheSpec, memory_budget_bytes: int | None, num_blocks_override: int | None = None
) -> int:
    """How many blocks to allocate: the explicit override if given, else as many as fit."""
    if num_blocks_override is not None:
        if num_blocks_override <= 0:
            raise ValueError(f"num_blocks override must be positive, got {num_blocks_override}")
        return num_blocks_override
    if memory_budget_bytes is None:
        raise ValueError("give either a KV cache memory budget in bytes or a block count")
    num_blocks = memory_budget_bytes // spec.bytes_per_block
    if num_blocks <= 0:
        raise ValueError(
            f"a KV cache budget of {memory_budget_bytes} bytes holds no block "
            f"({spec.bytes_per_block} bytes each); raise the budget"
        )
    return num_blocks


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, device: torch.device | str
) -> list[torch.Tensor]:
    """Zeroed, because attention over a partial block still multiplies its unused slots by a
    zero probability, and uninitialised memory may hold NaN (NaN * 0 = NaN).

    On CPU the zeros are the kernel's: anonymous pages, zeroed on first write, so a cache
    sized from the host's memory costs neither start-up time nor memory until its blocks
    are used (`torch.zeros` writes every page: the time and all the memory up front); a
    block's first use pays its pages' faults instead, at about the same rate. No
    transparent huge pages are asked for: first touch measured much slower with them (each
    fault zeroing 2 MB) than with 4 KiB pages, and the steady state was the same."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
    return [_zeroed_pages(shape, spec.dtype) for _ in range(spec.num_layers)]


def _zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps the mapping alive; it is unmapped when the last view is gone.
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def allocate_swap_caches(
    spec: KVCacheSpec, num_swap_blocks: int, device: torch.device | str
) -> list[torch.Tensor]:
    """CPU swap space with the device cache's layout; pinned when the cache is on CUDA so
    that swaps are plain DMA copies. Left uninitialised (no memory is touched until a block
    is swapped out): a swap block is only ever read after a whole device block was copied in."""
    if num_swap_blocks <= 0:
        return []
    pin = torch.device(device).type == "cuda"
    shape = (2, num_swap_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.empty(shape, dtype=spec.dtype, pin_memory=pin) for _ in range(spec.num_layers)]


def move_blocks(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> None:
    """Copies every layer's K and V of block `src` in `src_caches` to block `dst` in
    `dst_caches`, for each (src, dst) pair. Destinations must be distinct from the sources
    of the same call (they are fresh blocks: swap targets or copy-on-write copies)."""
    if not pairs:
        return
    src_device, dst_device = src_caches[0].device, dst_caches[0].device
    src_index = torch.tensor([s for s, _ in pairs], device=src_device)
    dst_index = torch.tensor([d for _, d in pairs], device=dst_device)
    for src, dst in zip(src_caches, dst_caches):
        dst[:, dst_index] = src[:, src_index].to(dst_device, non_blocking=True)


def model_kv_spec(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """A rank's share of the KV cache: its stage's layers, its KV heads."""
    return KVCacheSpec(
        num_layers=model.num_local_layers,  # type: ignore[arg-type]
        block_size=block_size,
        num_kv_heads=model.num_local_kv_heads,  # type: ignore[arg-type]
        head_dim=model.config.head_dim,  # type: ignore[union-attr]
        dtype=dtype,
    )
