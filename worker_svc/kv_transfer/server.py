"""The source side of KV block transfers: a worker serves reads of its paged KV cache.

A destination rank (`pull.py`) connects, names the layers, KV heads and blocks it wants,
and gets them as raw bytes on the socket, or gathered straight into a /dev/shm file it
made when both run on one host. No gRPC on this path: a 2,048-token request of a small
model is tens of MB, and protobuf would copy it twice more. The blocks read must not
change while they are read (the scheduler keeps a migrating request's blocks until the
destination has them); other blocks may be written meanwhile.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import socket
import stat
import threading
from dataclasses import replace

import torch

from worker_svc.kv_transfer.blocks import block_index, block_spans, gather, send_views, views_of
from worker_svc.kv_transfer.layout import RankSlice, host_key
from worker_svc.kv_transfer.wire import (
    PROTOCOL_VERSION, SHM_DIR, SHM_PREFIX, ReadReply, ReadRequest, ShmTarget, byte_view,
    dtype_name, layer_nbytes, recv_message, send_message, torch_dtype, tune_socket,
)

logger = logging.getLogger(__name__)

# MAP_POPULATE maps every page of the destination's file at once (the puller allocated them
# with posix_fallocate) instead of taking a fault per 4 KiB page while gathering.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class KVTransferServer:
    """Serves reads of `caches` (this rank's `[2, num_blocks, block_size, num_kv_heads,
    head_dim]` tensor per local layer, described by `mine`) on a TCP port, one daemon thread
    per connection. With a `token`, a read must carry the same one. A bad read is answered
    with its reason and the connection stays usable; nothing a client sends stops the server.
    """

    def __init__(self, caches: list[torch.Tensor], mine: RankSlice, token: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, idle_timeout_s: float = 60.0) -> None:
        check_caches(caches, mine)
        self._caches = caches
        self._mine = mine
        self._token = token
        self._idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._thread: threading.Thread | None = None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self.num_served = 0  # reads answered with their blocks
        self.bytes_served = 0  # payload bytes of those reads

    @property
    def address(self) -> str:
        """"host:port" the server listens on (the port the OS chose when given 0)."""
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def rank_slice(self) -> RankSlice:
        """What a destination needs to pull from this rank: `mine` with this server's
        address and this process's host key."""
        return replace(self._mine, address=self.address, host_key=host_key())

    def start(self) -> KVTransferServer:
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kv-transfer-{self.address}")
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops accepting, and cuts the connections being served (their pulls fail)."""
        with self._lock:
            connections = [self._listener, *self._connections]
        for sock in connections:  # shutdown() wakes a thread blocked in accept or recv
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def __enter__(self) -> KVTransferServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self.serve_connection, args=(conn,), daemon=True,
                             name=f"kv-transfer-conn-{self.address}").start()

    def serve_connection(self, conn: socket.socket) -> None:
        """Answers reads on `conn` until the peer closes it, goes idle or breaks framing;
        then closes it."""
        with self._lock:
            self._connections.add(conn)
        try:
            tune_socket(conn)
            conn.settimeout(self._idle_timeout_s)
            while self._serve_one(conn):
                pass
        except OSError as error:  # the peer went away or idled out: its pull reports it
            logger.debug("KV transfer connection ended: %s", error)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        try:
            message = recv_message(conn)
        except ValueError as error:  # framing is lost: answer, then drop the connection
            send_message(conn, ReadReply(False, f"unreadable request: {error}").to_json())
            return False
        if message is None:
            return False
        try:
            request = ReadRequest.from_json(message)
        except ValueError as error:
            send_message(conn, ReadReply(False, str(error)).to_json())
            return True
        reason = self._refusal(request)
        if reason:
            logger.warning("KV transfer %s refused: %s", request.transfer_id, reason)
            send_message(conn, ReadReply(False, reason).to_json())
            return True
        return self._serve_read(conn, request)

    def _serve_read(self, conn: socket.socket, request: ReadRequest) -> bool:
        try:
            if request.shm is not None:
                reply = self._gather_into_shm(request, request.shm)
                send_message(conn, reply.to_json())
            else:
                self._stream(conn, request)
        except OSError:
            raise
        except Exception:  # a torch or CUDA failure: this read fails, the server goes on
            logger.exception("KV transfer %s failed while gathering", request.transfer_id)
            return False  # mid-stream nothing more can be said: the puller sees a short read
        return True

    def _refusal(self, request: ReadRequest) -> str | None:
        """Why `request` cannot be served, or None when it can."""
        mine = self._mine
        if request.version != PROTOCOL_VERSION:
            return (f"protocol version {request.version} is not this server's "
                    f"{PROTOCOL_VERSION}")
        if self._token is not None and not hmac.compare_digest(
                request.token.encode(), self._token.encode()):
            return "the transfer token does not match this worker's"
        for field in ("dtype", "block_size", "head_dim"):
            if getattr(request, field) != getattr(mine, field):
                return (f"this rank's KV has {field} {getattr(mine, field)}, the read "
                        f"expects {getattr(request, field)}")
        layers = range(request.layer_start, request.layer_stop)
        heads = range(request.kv_head_start, request.kv_head_stop)
        if not layers or not heads or not mine.holds(layers, heads):
            return (f"layers [{layers.start}, {layers.stop}) x kv heads [{heads.start}, "
                    f"{heads.stop}) are not within this rank's {mine.describe()}")
        return _block_refusal(request, self._caches[0].shape[1]) or self._shm_refusal(request)

    def _shm_refusal(self, request: ReadRequest) -> str | None:
        if request.shm is None:
            return None
        expected = self._payload_nbytes(request)
        if request.shm.nbytes != expected:
            return f"the shm file is sized {request.shm.nbytes} bytes, the read needs {expected}"
        folder, name = os.path.split(request.shm.path)
        # Only a file of the agreed name under /dev/shm: a client must not make this process
        # write anywhere else it may write.
        if folder != SHM_DIR or not name.startswith(SHM_PREFIX) or name in (".", ".."):
            return f"{request.shm.path!r} is not a {SHM_DIR}/{SHM_PREFIX}* file"
        return None

    def _payload_nbytes(self, request: ReadRequest) -> int:
        return request.num_layers * layer_nbytes(
            len(request.block_ids), request.block_size, request.num_kv_heads,
            request.head_dim, self._caches[0].dtype)

    def _stream(self, conn: socket.socket, request: ReadRequest) -> None:
        """Header, then the payload a layer at a time: straight from the cache's blocks
        where they are big enough (`block_views`), else gathered into one of two buffers,
        layer i on the wire (on CUDA: on its way to the host) while layer i + 1 is
        gathered. Memory never holds the whole payload."""
        nbytes = self._payload_nbytes(request)
        gather = _Gather(self._caches, self._mine, request)
        send_message(conn, ReadReply(True, nbytes=nbytes).to_json())
        layers = range(request.layer_start, request.layer_stop)
        if gather.spans is not None:
            for layer in layers:
                send_views(conn, views_of(gather.cache(layer), gather.spans))
        else:
            _stream_copies(conn, gather, layers)
        self._count(nbytes)

    def _gather_into_shm(self, request: ReadRequest, target: ShmTarget) -> ReadReply:
        if target.nbytes == 0:
            return ReadReply(True)
        try:
            mapping = _map_target(target)
        except OSError as error:
            return ReadReply(False, f"cannot use {target.path}: {error}", shm_unavailable=True)
        try:
            _Gather(self._caches, self._mine, request).into_buffer(mapping)
        finally:
            mapping.close()  # the views into it died with into_buffer's frame
        self._count(target.nbytes)
        return ReadReply(True)

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.num_served += 1
            self.bytes_served += nbytes


def check_caches(caches: list[torch.Tensor], mine: RankSlice) -> None:
    """Raises ValueError unless `caches` is one `[2, num_blocks, block_size, num_kv_heads,
    head_dim]` tensor of `mine.dtype` per layer of `mine`."""
    if len(caches) != mine.num_layers:
        raise ValueError(f"{len(caches)} cache tensors for a slice of {mine.num_layers} layers")
    dtype = torch_dtype(mine.dtype)
    for cache in caches:
        if (cache.dim() != 5 or cache.shape[0] != 2 or cache.dtype != dtype
                or tuple(cache.shape[2:]) != (mine.block_size, mine.num_kv_heads, mine.head_dim)):
            raise ValueError(f"a cache tensor {tuple(cache.shape)} of {dtype_name(cache.dtype)} "
                             f"does not hold {mine.describe()} in blocks of {mine.block_size} "
                             f"tokens, head_dim {mine.head_dim}, {mine.dtype}")
        if cache.shape[1] != caches[0].shape[1] or cache.device != caches[0].device:
            raise ValueError("every layer's cache must have as many blocks, on one device")


def _block_refusal(request: ReadRequest, num_blocks: int) -> str | None:
    outside = [b for b in request.block_ids if not 0 <= b < num_blocks]
    if outside:
        return f"block ids {outside[:8]} are outside this rank's cache of {num_blocks} blocks"
    if len(set(request.block_ids)) != len(request.block_ids):
        return "the read names a block twice"
    return None


def _map_target(target: ShmTarget) -> mmap.mmap:
    """The puller's file, mapped shared, once checked to be the one it made: not a link,
    not another /dev/shm's file of the same name (a server in another mount namespace sees
    another /dev/shm), not resized (writing past a file's end is a SIGBUS)."""
    fd = os.open(target.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if (not stat.S_ISREG(info.st_mode) or info.st_size != target.nbytes
                or (info.st_dev, info.st_ino) != (target.device, target.inode)):
            raise FileNotFoundError(f"{target.path} here is not the puller's file "
                                    "(another /dev/shm?)")
        return mmap.mmap(fd, target.nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _stream_copies(conn: socket.socket, gather: _Gather, layers: range) -> None:
    slots = [gather.host_buffer() for _ in range(2)]
    pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
    for i, layer in enumerate(layers):
        slot = slots[i % 2]
        ready = gather.to_host(layer, slot)
        if pending is not None:
            _send_slot(conn, *pending)
        pending = (slot, ready)
    if pending is not None:
        _send_slot(conn, *pending)


def _send_slot(conn: socket.socket, slot: torch.Tensor, ready: torch.cuda.Event | None) -> None:
    if ready is not None:
        ready.synchronize()
    conn.sendall(byte_view(slot))


class _Gather:
    """One read's gather: the asked blocks and KV heads of a layer, K then V, contiguous."""

    def __init__(self, caches: list[torch.Tensor], mine: RankSlice, request: ReadRequest) -> None:
        self._caches = caches
        self._layer_start = mine.layer_start
        self._heads = slice(request.kv_head_start - mine.kv_head_start,
                            request.kv_head_stop - mine.kv_head_start)
        self._request = request
        self.device = caches[0].device
        self.shape = (2, len(request.block_ids), request.block_size, request.num_kv_heads,
                      request.head_dim)
        self.dtype = caches[0].dtype
        self._ids = block_index(request.block_ids, self.device)
        # On CUDA, gathers run on the current stream, behind whatever wrote these blocks.
        self._device_buffer = (torch.empty(self.shape, dtype=self.dtype, device=self.device)
                               if self.device.type == "cuda" else None)
        # Where the payload lies in each layer's cache, when it is sent in place.
        self.spans = block_spans(caches[0], self._heads, request.block_ids)

    def cache(self, layer: int) -> torch.Tensor:
        return self._caches[layer - self._layer_start]

    def layer_into(self, layer: int, out: torch.Tensor) -> None:
        """Gathers `layer` into `out` (on the cache's device)."""
        gather(self.cache(layer), self._heads, self._ids, out)

    def host_buffer(self) -> torch.Tensor:
        pin = self.device.type == "cuda"
        try:
            return torch.empty(self.shape, dtype=self.dtype, pin_memory=pin)
        except RuntimeError:  # no pinned memory to be had: pageable copies still work
            return torch.empty(self.shape, dtype=self.dtype)

    def to_host(self, layer: int, host: torch.Tensor) -> torch.cuda.Event | None:
        """Gathers `layer` into the CPU tensor `host`; on CUDA the copy is asynchronous and
        the returned event says when `host` is filled."""
        if self._device_buffer is None:
            self.layer_into(layer, host)
            return None
        self.layer_into(layer, self._device_buffer)
        host.copy_(self._device_buffer, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def into_buffer(self, buffer: mmap.mmap) -> None:
        """Gathers every layer of the read into `buffer` (the payload's bytes, in place)."""
        out = torch.frombuffer(buffer, dtype=self.dtype).view(self._request.num_layers,
                                                               *self.shape)
        for i, layer in enumerate(range(self._request.layer_start, self._request.layer_stop)):
            if self._device_buffer is None:
                self.layer_into(layer, out[i])
            else:
                self.layer_into(layer, self._device_buffer)
                out[i].copy_(self._device_buffer)
