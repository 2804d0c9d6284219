"""A read's payload moved between a rank's cache and a byte stream: a TCP socket, or the
/dev/shm file a puller made. Layer by layer, in the wire order (`wire.py`): in place, as
views of the cache's blocks, where blocks are big enough (`block_spans`), else through two
layer buffers that a helper thread fills or drains while the stream moves the other one.

Both streams take lists of views, so the kernel copies straight between the cache and the
socket or file (sendmsg, recvmsg_into, pwritev, preadv). A file is written, not mapped:
tmpfs pages that a write fills whole are not zeroed first, and a full /dev/shm is an
ENOSPC here rather than a SIGBUS in whoever touches the mapping.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from worker_svc.kv_transfer.blocks import block_index, block_spans, gather, scatter, views_of
from worker_svc.kv_transfer.layout import RankSlice
from worker_svc.kv_transfer.wire import byte_view, expect, set_deadline

Views = list[memoryview]
# Linux's limit on the buffers of one sendmsg, recvmsg, pwritev or preadv.
IOV_MAX = 1024


class Blocks:
    """What one read moves: `layers` x `kv_heads` (global numbers) of `block_ids` in the
    caches of the rank `mine` describes."""

    def __init__(
        self,
        caches: list[torch.Tensor],
        mine: RankSlice,
        layers: range,
        kv_heads: range,
        block_ids: list[int],
    ) -> None:
        self._caches = caches
        self._layer_start = mine.layer_start
        self._heads = slice(kv_heads.start - mine.kv_head_start, kv_heads.stop - mine.kv_head_start)
        self.layers = layers
        self.device = caches[0].device
        self.dtype = caches[0].dtype
        self.shape = (2, len(block_ids), mine.block_size, len(kv_heads), mine.head_dim)
        self._ids = block_index(block_ids, self.device)
        self.spans = block_spans(caches[0], self._heads, block_ids)
        # On CUDA a layer is gathered on the device, then copied to the host in one piece.
        self._device_buffer = (
            torch.empty(self.shape, dtype=self.dtype, device=self.device)
            if self.device.type == "cuda"
            else None
        )

    def views(self, layer: int) -> Views:
        return views_of(self._cache(layer), self.spans)

    def host_buffer(self) -> torch.Tensor:
        """A CPU buffer for one layer; pinned when the cache is on CUDA (DMA copies)."""
        if self.device.type == "cuda":
            try:
                return torch.empty(self.shape, dtype=self.dtype, pin_memory=True)
            except RuntimeError:  # no pinned memory to be had: pageable copies still work
                pass
        return torch.empty(self.shape, dtype=self.dtype)

    def gather_to_host(self, layer: int, host: torch.Tensor) -> None:
        """`layer`'s blocks into the CPU tensor `host`, done when this returns. On CUDA,
        behind whatever the current stream has queued (the writes of these blocks)."""
        if self._device_buffer is None:
            gather(self._cache(layer), self._heads, self._ids, host)
            return
        gather(self._cache(layer), self._heads, self._ids, self._device_buffer)
        host.copy_(self._device_buffer, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()

    def scatter_from_host(self, layer: int, host: torch.Tensor) -> None:
        """The CPU tensor `host` into `layer`'s blocks; `host` may be reused on return."""
        if self.device.type == "cuda":
            data = host.to(self.device, non_blocking=True)
            scatter(self._cache(layer), self._heads, self._ids, data)
            torch.cuda.current_stream(self.device).synchronize()
            return
        scatter(self._cache(layer), self._heads, self._ids, host)

    def _cache(self, layer: int) -> torch.Tensor:
        return self._caches[layer - self._layer_start]


def write_payload(blocks: Blocks, write: Callable[[Views], None]) -> None:
    """The payload of `blocks` into a stream: `write(views)` must take every byte."""
    if blocks.spans is not None:
        for layer in blocks.layers:
            write(blocks.views(layer))
        return
    layers = blocks.layers
    slots = [blocks.host_buffer() for _ in range(2)]
    with ThreadPoolExecutor(1, thread_name_prefix="kv-gather") as helper:
        pending: deque[Future[None]] = deque(
            helper.submit(blocks.gather_to_host, layers[i], slots[i])
            for i in range(min(len(slots), len(layers)))
        )
        for i in range(len(layers)):
            pending.popleft().result()
            slot = slots[i % len(slots)]
            write([byte_view(slot)])
            if i + len(slots) < len(layers):
                pending.append(helper.submit(blocks.gather_to_host, layers[i + len(slots)], slot))


def read_payload(blocks: Blocks, read: Callable[[Views], None]) -> None:
    """The payload of `blocks` from a stream: `read(views)` must fill every byte."""
    if blocks.spans is not None:
        for layer in blocks.layers:
            read(blocks.views(layer))
        return
    slots = [blocks.host_buffer() for _ in range(2)]
    with ThreadPoolExecutor(1, thread_name_prefix="kv-scatter") as helper:
        pending: deque[Future[None]] = deque()
        for i, layer in enumerate(blocks.layers):
            if len(pending) == len(slots):
                pending.popleft().result()  # its slot is free again
            slot = slots[i % len(slots)]
            read([byte_view(slot)])
            pending.append(helper.submit(blocks.scatter_from_host, layer, slot))
        while pending:
            pending.popleft().result()


def socket_writer(
    sock: socket.socket, head: bytes = b"", deadline: float | None = None
) -> Callable[[Views], None]:
    """`write` for a socket, `head` going out with the first bytes. A reply sent on its own
    ahead of the payload, as a small segment, made a 94 MB stream on loopback markedly
    slower and cost the receiver far more CPU time (plain sendall and recv_into)."""
    first = [memoryview(head)] if head else []

    def write(views: Views) -> None:
        cursor = _Cursor(first + views)
        first.clear()
        while not cursor.done:
            set_deadline(sock, deadline)
            cursor.advance(sock.sendmsg(cursor.window()))

    return write


def socket_reader(sock: socket.socket, deadline: float | None) -> Callable[[Views], None]:
    """`read` for a socket: ConnectionError when the peer closes first, TimeoutError at
    `deadline`."""

    def read(views: Views) -> None:
        cursor = _Cursor(views)
        while not cursor.done:
            set_deadline(sock, deadline)
            expect(sock, cursor.total - cursor.moved)
            got = sock.recvmsg_into(cursor.window())[0]
            if got == 0:
                raise ConnectionError(
                    f"the peer closed the connection after {cursor.moved} "
                    f"of {cursor.total} bytes of a layer"
                )
            cursor.advance(got)

    return read


class FileStream:
    """`write` and `read` for a file descriptor, from offset 0 on (a file takes or gives
    every byte asked for, so each call passes as many views as the kernel allows)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._offset = 0

    def write(self, views: Views) -> None:
        cursor = _Cursor(views)
        while not cursor.done:
            written = os.pwritev(self._fd, cursor.window(IOV_MAX), self._offset)
            self._offset += written
            cursor.advance(written)

    def read(self, views: Views) -> None:
        cursor = _Cursor(views)
        while not cursor.done:
            got = os.preadv(self._fd, cursor.window(IOV_MAX), self._offset)
            if got == 0:
                raise ConnectionError(
                    f"the file ended {cursor.total - cursor.moved} bytes short of the payload"
                )
            self._offset += got
            cursor.advance(got)


class _Cursor:
    """How far a list of views has been moved. A call gets at most WINDOW views: a socket
    call moves a socket buffer's worth (a few hundred KB on loopback), and every view
    passed costs a buffer export whether or not the kernel reaches it."""

    WINDOW = 64

    def __init__(self, views: Views) -> None:
        self._views = [v for v in views if len(v)]
        self._index = 0  # the first view not wholly moved
        self._offset = 0  # bytes of it already moved
        self.total = sum(len(v) for v in self._views)
        self.moved = 0

    @property
    def done(self) -> bool:
        return self._index == len(self._views)

    def window(self, limit: int = WINDOW) -> Views:
        views = self._views[self._index : self._index + min(limit, IOV_MAX)]
        if self._offset:
            views[0] = views[0][self._offset :]
        return views

    def advance(self, nbytes: int) -> None:
        self.moved += nbytes
        nbytes += self._offset
        while self._index < len(self._views) and nbytes >= len(self._views[self._index]):
            nbytes -= len(self._views[self._index])
            self._index += 1
        self._offset = nbytes
