"""Reading and writing one layer's blocks of a paged cache for a transfer: gathered and
scattered copies, or byte views of the blocks themselves for scatter-gather socket I/O.

CPU copies go through numpy, not torch: numpy copies on the calling thread, where a torch
op above its grain size starts an OpenMP team of its own beside the one the worker computes
with (twice as many spinning threads as cores: a 94 MB pull took 380 ms instead of 70 on
2 cores). numpy has no bfloat16, so a cache is viewed as integers of its element's width:
a copy moves bits, whatever they mean. CUDA caches are copied by torch on their device.
"""

from __future__ import annotations

import socket

import numpy as np
import torch

from worker_svc.kv_transfer.wire import expect, set_deadline

# Below this many contiguous bytes per block a view costs more in Python and in the
# kernel's iovec walk than copying the block does; such reads (some heads of each block)
# are gathered into a buffer instead.
MIN_VIEW_BYTES = 2048
# Linux's limit on the buffers of one sendmsg/recvmsg.
IOV_MAX = 1024
_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The CPU tensor's memory as a numpy array of integers of its element's width."""
    return tensor.view(_INTEGER_OF_WIDTH[tensor.element_size()]).numpy()


def block_index(block_ids: list[int], device: torch.device) -> np.ndarray | torch.Tensor:
    """Block ids as `gather` and `scatter` take them for a cache on `device`."""
    if device.type == "cpu":
        return np.asarray(block_ids, dtype=np.int64)
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def gather(cache: torch.Tensor, heads: slice, block_ids: np.ndarray | torch.Tensor,
           out: torch.Tensor) -> None:
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


def scatter(cache: torch.Tensor, heads: slice, block_ids: np.ndarray | torch.Tensor,
            data: torch.Tensor) -> None:
    """The inverse of `gather`: `data` into `block_ids`' `heads` of one layer's cache.
    `data` is on the cache's device."""
    if cache.device.type != "cpu":
        for kv in (0, 1):
            cache[kv, :, :, heads].index_copy_(0, block_ids, data[kv])
        return
    target, source = as_numpy(cache), as_numpy(data)
    for kv in (0, 1):
        target[kv, block_ids, :, heads] = source[kv]


def block_spans(cache: torch.Tensor, heads: slice, block_ids: list[int]) -> list[tuple[int, int]] | None:
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
    return [((kv * num_blocks + first) * block_bytes,
             (kv * num_blocks + first + count) * block_bytes)
            for kv in (0, 1) for first, count in _runs(block_ids)]


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


def send_views(sock: socket.socket, views: list[memoryview], deadline: float | None = None) -> None:
    """sendall of the views' bytes, in order, by sendmsg: the kernel reads them where they are."""
    cursor = _Cursor(views)
    while not cursor.done:
        set_deadline(sock, deadline)
        cursor.advance(sock.sendmsg(cursor.window()))


def recv_views(sock: socket.socket, views: list[memoryview], deadline: float | None = None) -> None:
    """Fills the views, in order, by recvmsg_into: the kernel writes where they are.
    ConnectionError when the peer closes first."""
    cursor = _Cursor(views)
    while not cursor.done:
        set_deadline(sock, deadline)
        expect(sock, cursor.total - cursor.moved)
        got = sock.recvmsg_into(cursor.window())[0]
        if got == 0:
            raise ConnectionError(f"the peer closed the connection after {cursor.moved} of "
                                  f"{cursor.total} bytes")
        cursor.advance(got)


class _Cursor:
    """How far into a list of views a send or receive is. A call gets at most WINDOW views:
    one returns a socket buffer's worth (a few hundred KB on loopback), and each view
    passed costs a buffer export whether or not the kernel reaches it."""

    WINDOW = 64

    def __init__(self, views: list[memoryview]) -> None:
        self._views = [v for v in views if len(v)]
        self._index = 0  # the first view not wholly moved
        self._offset = 0  # bytes of it already moved
        self.total = sum(len(v) for v in self._views)
        self.moved = 0

    @property
    def done(self) -> bool:
        return self._index == len(self._views)

    def window(self) -> list[memoryview]:
        views = self._views[self._index:self._index + min(self.WINDOW, IOV_MAX)]
        if self._offset:
            views[0] = views[0][self._offset:]
        return views

    def advance(self, nbytes: int) -> None:
        self.moved += nbytes
        nbytes += self._offset
        while self._index < len(self._views) and nbytes >= len(self._views[self._index]):
            nbytes -= len(self._views[self._index])
            self._index += 1
        self._offset = nbytes
