"""The source side of KV block transfers: a worker serves reads of its paged KV cache.

A destination rank (`pull.py`) connects, names the layers, KV heads and blocks it wants,
and gets them as raw bytes on the socket, or written straight into a /dev/shm file it
made when both run on one host. No gRPC on this path: a 2,048-token request of a small
model is tens of MB, and protobuf would copy it twice more. The blocks read must not
change while they are read (the scheduler keeps a migrating request's blocks until the
destination has them); other blocks may be written meanwhile.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import stat
import threading
from dataclasses import replace

import torch

from worker_svc.kv_transfer.blocks import check_caches
from worker_svc.kv_transfer.layout import RankSlice, host_key
from worker_svc.kv_transfer.payload import Blocks, FileStream, socket_writer, write_payload
from worker_svc.kv_transfer.wire import (
    PROTOCOL_VERSION,
    SHM_DIR,
    SHM_PREFIX,
    ReadReply,
    ReadRequest,
    ShmTarget,
    encode_message,
    layer_nbytes,
    recv_message,
    send_message,
    tune_socket,
)

logger = logging.getLogger(__name__)


class KVTransferServer:
    """Serves reads of `caches` (this rank's `[2, num_blocks, block_size, num_kv_heads,
    head_dim]` tensor per local layer, described by `mine`) on a TCP port, one daemon thread
    per connection. With a `token`, a read must carry the same one. A bad read is answered
    with its reason and the connection stays usable; nothing a client sends stops the server.
    `advertise_host` is the host other workers reach this one at (`rank_slice.address`),
    when `host` is a wildcard such as "0.0.0.0"; a connection idle for `idle_timeout_s`
    between reads, or stalled that long within one, is closed.
    """

    def __init__(
        self,
        caches: list[torch.Tensor],
        mine: RankSlice,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_timeout_s: float = 60.0,
        advertise_host: str | None = None,
    ) -> None:
        check_caches(caches, mine)
        self._advertise_host = advertise_host or host
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
        """ "host:port" to reach the server at (the port the OS chose when given 0)."""
        host, port = self._advertise_host, self._listener.getsockname()[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def rank_slice(self) -> RankSlice:
        """What a destination needs to pull from this rank: `mine` with this server's
        address and this process's host key."""
        return replace(self._mine, address=self.address, host_key=host_key())

    def start(self) -> KVTransferServer:
        self._thread = threading.Thread(
            target=self._accept_loop, daemon=True, name=f"kv-transfer-{self.address}"
        )
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
            threading.Thread(
                target=self.serve_connection,
                args=(conn,),
                daemon=True,
                name=f"kv-transfer-conn-{self.address}",
            ).start()

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
                reply = self._write_into_shm(request, request.shm)
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
            return f"protocol version {request.version} is not this server's {PROTOCOL_VERSION}"
        if self._token is not None and not hmac.compare_digest(
            request.token.encode(), self._token.encode()
        ):
            return "the transfer token does not match this worker's"
        for field in ("dtype", "block_size", "head_dim"):
            if getattr(request, field) != getattr(mine, field):
                return (
                    f"this rank's KV has {field} {getattr(mine, field)}, the read "
                    f"expects {getattr(request, field)}"
                )
        layers = range(request.layer_start, request.layer_stop)
        heads = range(request.kv_head_start, request.kv_head_stop)
        if not layers or not heads or not mine.holds(layers, heads):
            return (
                f"layers [{layers.start}, {layers.stop}) x kv heads [{heads.start}, "
                f"{heads.stop}) are not within this rank's {mine.describe()}"
            )
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
            len(request.block_ids),
            request.block_size,
            request.num_kv_heads,
            request.head_dim,
            self._caches[0].dtype,
        )

    def _blocks(self, request: ReadRequest) -> Blocks:
        return Blocks(
            self._caches,
            self._mine,
            range(request.layer_start, request.layer_stop),
            range(request.kv_head_start, request.kv_head_stop),
            request.block_ids,
        )

    def _stream(self, conn: socket.socket, request: ReadRequest) -> None:
        """The reply, then the payload on the socket (`write_payload`)."""
        nbytes = self._payload_nbytes(request)
        head = encode_message(ReadReply(True, nbytes=nbytes).to_json())
        write_payload(self._blocks(request), socket_writer(conn, head))
        self._count(nbytes)

    def _write_into_shm(self, request: ReadRequest, target: ShmTarget) -> ReadReply:
        """The payload written into the puller's file, straight from the cache's blocks."""
        try:
            fd = _open_target(target)
        except OSError as error:
            return ReadReply(False, f"cannot use {target.path}: {error}", shm_unavailable=True)
        try:
            write_payload(self._blocks(request), FileStream(fd).write)
        except OSError as error:  # a full /dev/shm: the same read over TCP may do
            return ReadReply(False, f"cannot write {target.path}: {error}", shm_unavailable=True)
        finally:
            os.close(fd)
        self._count(target.nbytes)
        return ReadReply(True)

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.num_served += 1
            self.bytes_served += nbytes


def _block_refusal(request: ReadRequest, num_blocks: int) -> str | None:
    outside = [b for b in request.block_ids if not 0 <= b < num_blocks]
    if outside:
        return f"block ids {outside[:8]} are outside this rank's cache of {num_blocks} blocks"
    if len(set(request.block_ids)) != len(request.block_ids):
        return "the read names a block twice"
    return None


def _open_target(target: ShmTarget) -> int:
    """The puller's file, once checked to be the one it made: not a link, not another
    /dev/shm's file of the same name (a server in another mount namespace sees another
    /dev/shm), holding the size agreed (a reused staging file may be larger)."""
    fd = os.open(target.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if (
        not stat.S_ISREG(info.st_mode)
        or info.st_size < target.nbytes
        or (info.st_dev, info.st_ino) != (target.device, target.inode)
    ):
        os.close(fd)
        raise FileNotFoundError(f"{target.path} here is not the puller's file (another /dev/shm?)")
    return fd
