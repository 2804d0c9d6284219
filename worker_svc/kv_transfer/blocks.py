"""Reading and writing one layer's blocks of a paged cache for a transfer: gathered and
scattered copies, or byte views of the blocks themselves for scatter-gather I/O.

CPU copies go through numpy, not torch: numpy copies on the calling thread, where a torch
op above its grain size starts an OpenMP team of its own beside the one the worker computes
with (twice as many spinning threads as cores: a 94 MB pull took several times as long on
2 cores). numpy has no bfloat16, so a cache is viewed as integers of its element's width:
a copy moves bits, whatever they mean. CUDA caches are copied by torch on their device.
"""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.kv_transfer.layout import RankSlice
from worker_svc.kv_transfer.wire import dtype_name, torch_dtype

# Below this many contiguous bytes per block a view costs more in Python and in the
# kernel's iovec walk than copying the block does; such reads (some heads of each block)
# are gathered into a buffer instead.
MIN_VIEW_BYTES = 2048
_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_caches(caches: list[torch.Tensor], mine: RankSlice) -> None:
    """Raises ValueError unless `caches` is one `[2, num_blocks, block_size, num_kv_heads,
    head_dim]` tensor of `mine.dtype` per layer of `mine`."""
    if len(caches) != mine.num_layers:
        raise ValueError(f"{len(caches)} cache tensors for a slice of {mine.num_layers} layers")
    dtype = torch_dtype(mine.dtype)
    for cache in caches:
        if (
            cache.dim() != 5
            or cache.shape[0] != 2
            or cache.dtype != dtype
            or tuple(cache.shape[2:]) != (mine.block_size, mine.num_kv_heads, mine.head_dim)
        ):
            raise ValueError(
                f"a cache tensor {tuple(cache.shape)} of {dtype_name(cache.dtype)} "
                f"does not hold {mine.describe()} in blocks of {mine.block_size} "
                f"tokens, head_dim {mine.head_dim}, {mine.dtype}"
            )
        if cache.shape[1] != caches[0].shape[1] or cache.device != caches[0].device:
            raise ValueError("every layer's cache must have as many blocks, on one device")


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The CPU tensor's memory as a numpy array of integers of its element's width."""
    return tensor.view(_INTEGER_OF_WIDTH[tensor.element_size()]).numpy()


def block_index(block_ids: list[int], device: torch.device) -> np.ndarray | torch.Tensor:
    """Block ids as `gather` and `scatter` take them for a cache on `device`."""
    if device.type == "cpu":
        return np.asarray(block_ids, dtype=np.int64)
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def gather(
    cache: torch.Tensor, heads: slice, block_ids: np.ndarray | torch.Tensor, out: torch.Tensor
) -> None:
    """`out` ([2, n, block_size, num_heads, head_dim]) = K and V of `block_ids` (a numpy
    array on CPU, a tensor on the cache's device), `heads` of them, from one layer's cache."""
    if cache.device.type != "cpu":
        for kv in (0, 1):
            torch.index_select(cache[kv, :, :, heads], 0, block_ids, out=out[kv])
        return
    source, target = as_numpy(cache), as_numpy(out)
    for kv in (0, 1):
        if _all_heads(cache, heads):
            # mode="clip" writes straight into `out` (the ids were checked); "raise" would
            # go through a temporary.
            np.take(source[kv], block_ids, axis=0, out=target[kv], mode="clip")
        else:
            target[kv] = source[kv, block_ids, :, heads]


def scatter(
    cache: torch.Tensor, heads: slice, block_ids: np.ndarray | torch.Tensor, data: torch.Tensor
) -> None:
    """The inverse of `gather`: `data` into `block_ids`' `heads` of one layer's cache.
    `data` is on the cache's device."""
    if cache.device.type != "cpu":
        for kv in (0, 1):
            cache[kv, :, :, heads].index_copy_(0, block_ids, data[kv])
        return
    target, source = as_numpy(cache), as_numpy(data)
    for kv in (0, 1):
        target[kv, block_ids, :, heads] = source[kv]


def block_spans(
    cache: torch.Tensor, heads: slice, block_ids: list[int]
) -> list[tuple[int, int]] | None:
    """Where the payload of one layer (K of each block in order, then V) lies in a layer's
    cache, as [start, stop) byte offsets, runs of consecutive blocks joined; None when
    sending or receiving in place is not worth it (a CUDA cache, some heads only, small
    blocks): then gather or scatter through a buffer. Every layer of a cache has the same."""
    if cache.device.type != "cpu" or not cache.is_contiguous() or not _all_heads(cache, heads):
        return None
    block_bytes = cache[0, 0].numel() * cache.element_size()
    if block_bytes < MIN_VIEW_BYTES:
        return None
    num_blocks = cache.shape[1]
    return [
        ((kv * num_blocks + first) * block_bytes, (kv * num_blocks + first + count) * block_bytes)
        for kv in (0, 1)
        for first, count in _runs(block_ids)
    ]


def views_of(cache: torch.Tensor, spans: list[tuple[int, int]]) -> list[memoryview]:
    """The `block_spans` of one layer's cache as views of its memory."""
    memory = memoryview(as_numpy(cache)).cast("B")
    return [memory[start:stop] for start, stop in spans]


def _runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive ids: [4, 5, 6, 9] -> [(4, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def _all_heads(cache: torch.Tensor, heads: slice) -> bool:
    return heads.start == 0 and heads.stop == cache.shape[3]
