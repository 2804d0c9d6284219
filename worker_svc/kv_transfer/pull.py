"""The destination side of KV block transfers: a rank pulls a request's blocks from the
ranks of another engine group (`server.py` serves them) into its own paged cache.

The destination's rectangle of (layers x KV heads) is cut into pieces by `plan_pull`, one
source rank each, pulled in parallel threads. A piece from a rank on this host and network
namespace goes through a /dev/shm file the source gathers into; any other piece, or one
whose file cannot be made or used, streams over TCP straight into a layer-sized buffer that
is scattered into the cache while the next layer arrives.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, replace

import torch

from worker_svc.kv_transfer.blocks import (
    block_index, block_spans, recv_views, scatter, views_of,
)
from worker_svc.kv_transfer.layout import PullPiece, RankSlice, TransferError, host_key, plan_pull
from worker_svc.kv_transfer.server import check_caches
from worker_svc.kv_transfer.wire import (
    SHM_DIR, SHM_PREFIX, ReadReply, ReadRequest, ShmTarget, byte_view, layer_nbytes,
    recv_exactly, recv_message, send_message, split_address, tune_socket,
)

# How long past the deadline a pull waits for its threads: every socket call of theirs
# already times out at the deadline, so this covers one layer's scatter, not a network wait.
JOIN_SLACK_S = 5.0
_file_numbers = itertools.count()


@dataclass(frozen=True)
class PullResult:
    """ok, or the reason not (naming each failed source); `nbytes` received, `seconds` the
    pull took, and `paths` the ways pieces came ("shm", "tcp")."""

    ok: bool
    reason: str
    nbytes: int
    seconds: float
    paths: frozenset[str] = frozenset()


class _Refused(Exception):
    """The source answered, and said no."""


def pull_blocks(mine: RankSlice, caches: list[torch.Tensor], sources: list[RankSlice],
                src_block_ids: list[int], dst_block_ids: list[int], deadline_s: float,
                token: str | None, transfer_id: str) -> PullResult:
    """Copies this rank's share (`mine`: its layers and KV heads) of source blocks
    `src_block_ids` of `sources` (one engine group's ranks) into blocks `dst_block_ids` of
    `caches` (this rank's cache tensor per local layer), pair by pair. `deadline_s` is an
    absolute time.monotonic() time: the pull gives up there (plus a layer's scatter).

    Every failure the network or the source group can cause comes back as ok=False with
    its reason; only the caller's own mistakes raise ValueError (caches that do not match
    `mine`, block id lists of different lengths, a destination block out of range or
    named twice). After a failed pull some destination blocks may hold part of the
    transfer: treat all of `dst_block_ids` as garbage (recompute that KV or free them).
    """
    start = time.monotonic()
    check_caches(caches, mine)
    _check_block_ids(src_block_ids, dst_block_ids, caches[0].shape[1])
    if not dst_block_ids:
        return PullResult(True, "", 0, 0.0)
    try:
        pieces = plan_pull(mine, sources)
    except TransferError as error:
        return PullResult(False, str(error), 0, time.monotonic() - start)
    job = _Job(mine, caches, list(src_block_ids), list(dst_block_ids), deadline_s,
               token or "", transfer_id, host_key())
    outcomes = _run_pieces(job, pieces)
    reasons = [o.reason for o in outcomes if o.reason]
    return PullResult(not reasons, "; ".join(reasons), sum(o.nbytes for o in outcomes),
                      time.monotonic() - start,
                      frozenset(o.path for o in outcomes if o.path and not o.reason))


def _check_block_ids(src_block_ids: list[int], dst_block_ids: list[int], num_blocks: int) -> None:
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} "
                         "destination blocks")
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise ValueError("a destination block is named twice")
    outside = [b for b in dst_block_ids if not 0 <= b < num_blocks]
    if outside:
        raise ValueError(f"destination blocks {outside[:8]} are outside this rank's cache "
                         f"of {num_blocks} blocks")


@dataclass(frozen=True)
class _Job:
    """What every piece of one pull shares."""

    mine: RankSlice
    caches: list[torch.Tensor]
    src_block_ids: list[int]
    dst_block_ids: list[int]
    deadline: float
    token: str
    transfer_id: str
    host_key: str

    def request(self, piece: PullPiece) -> ReadRequest:
        return ReadRequest(self.token, self.transfer_id, piece.layers.start, piece.layers.stop,
                           piece.kv_heads.start, piece.kv_heads.stop, self.src_block_ids,
                           self.mine.block_size, self.mine.head_dim, self.mine.dtype)

    def payload_nbytes(self, piece: PullPiece) -> int:
        return len(piece.layers) * layer_nbytes(
            len(self.dst_block_ids), self.mine.block_size, len(piece.kv_heads),
            self.mine.head_dim, self.caches[0].dtype)


@dataclass
class _Outcome:
    nbytes: int = 0
    path: str = ""
    reason: str = ""
    error: BaseException | None = None  # a programming error, re-raised in the caller


def _run_pieces(job: _Job, pieces: list[PullPiece]) -> list[_Outcome]:
    """Each piece in its own thread but the first, which runs in the caller's; waits for
    all of them until the deadline (plus JOIN_SLACK_S)."""
    outcomes: list[_Outcome | None] = [None] * len(pieces)

    def run(i: int) -> None:
        outcomes[i] = _pull_piece(job, pieces[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True,
                                name=f"kv-pull-{job.transfer_id}-{i}")
               for i in range(1, len(pieces))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join(timeout=max(0.0, job.deadline - time.monotonic()) + JOIN_SLACK_S)
    done = []
    for piece, outcome in zip(pieces, outcomes):
        if outcome is None:
            outcome = _Outcome(reason=f"source {piece.source.describe()}: still transferring "
                                      "past the deadline")
        if outcome.error is not None:
            raise outcome.error
        done.append(outcome)
    return done


def _pull_piece(job: _Job, piece: PullPiece) -> _Outcome:
    """One piece over shm (same host key) or TCP; any failure becomes its reason."""
    what = f"source {piece.source.describe()}"
    try:
        return _pull_piece_or_raise(job, piece)
    except _Refused as error:
        return _Outcome(reason=f"{what} refused: {error}")
    except TimeoutError:
        return _Outcome(reason=f"{what}: no answer before the deadline")
    except ConnectionRefusedError:
        return _Outcome(reason=f"{what}: connection refused (no transfer server there)")
    except (ConnectionError, OSError) as error:
        return _Outcome(reason=f"{what}: {error}")
    except ValueError as error:  # the source spoke something else than this protocol
        return _Outcome(reason=f"{what}: protocol error: {error}")
    except Exception as error:  # noqa: BLE001 - handed to the caller's thread to raise
        return _Outcome(error=error)


def _pull_piece_or_raise(job: _Job, piece: PullPiece) -> _Outcome:
    host, port = split_address(piece.source.address)
    remaining_s = job.deadline - time.monotonic()
    if remaining_s <= 0:
        raise TimeoutError
    with socket.create_connection((host, port), timeout=remaining_s) as sock:
        tune_socket(sock)
        if piece.source.host_key == job.host_key:
            nbytes = _pull_shm(sock, job, piece)
            if nbytes is not None:
                return _Outcome(nbytes, "shm")
        return _Outcome(_pull_tcp(sock, job, piece), "tcp")


def _ask(sock: socket.socket, job: _Job, request: ReadRequest) -> ReadReply:
    send_message(sock, request.to_json(), job.deadline)
    message = recv_message(sock, job.deadline)
    if message is None:
        raise ConnectionError("the source closed the connection without answering")
    return ReadReply.from_json(message)


def _pull_tcp(sock: socket.socket, job: _Job, piece: PullPiece) -> int:
    """The piece as bytes after the reply, a layer at a time: straight into the
    destination blocks where they are big enough (`block_views`), else into one of two
    buffers, scattered while the kernel's socket buffer fills with the next layer."""
    reply = _ask(sock, job, job.request(piece))
    if not reply.ok:
        raise _Refused(reply.reason)
    expected = job.payload_nbytes(piece)
    if reply.nbytes != expected:
        raise ValueError(f"the source offers {reply.nbytes} bytes, the read needs {expected}")
    scatter = _Scatter(job, piece)
    if scatter.spans is not None:
        for layer in piece.layers:
            recv_views(sock, views_of(scatter.cache(layer), scatter.spans), job.deadline)
        return expected
    _recv_copies(sock, job, piece, scatter)
    return expected


def _recv_copies(sock: socket.socket, job: _Job, piece: PullPiece, scatter: _Scatter) -> None:
    slots = [scatter.host_buffer() for _ in range(2)]
    pending: list[torch.cuda.Event | None] = [None, None]
    for i, layer in enumerate(piece.layers):
        slot = slots[i % 2]
        if pending[i % 2] is not None:
            pending[i % 2].synchronize()  # its last copy to the device has left it
        recv_exactly(sock, byte_view(slot), job.deadline)
        pending[i % 2] = scatter.layer_from(layer, slot)
    scatter.finish()


def _pull_shm(sock: socket.socket, job: _Job, piece: PullPiece) -> int | None:
    """The piece through a /dev/shm file the source gathers into; None when no file can
    be made here or the source cannot use it (then TCP, on the same connection)."""
    nbytes = job.payload_nbytes(piece)
    try:
        fd, path = _make_shm_file(job.transfer_id, nbytes)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        target = ShmTarget(path, info.st_dev, info.st_ino, nbytes)
        reply = _ask(sock, job, replace(job.request(piece), shm=target))
        if not reply.ok:
            if reply.shm_unavailable:
                return None
            raise _Refused(reply.reason)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        _unlink_quietly(path)  # the mapping keeps the pages until it is closed
    try:
        _Scatter(job, piece).all_from(mapping)
    finally:
        mapping.close()
    return nbytes


def _make_shm_file(transfer_id: str, nbytes: int) -> tuple[int, str]:
    """A new file under /dev/shm of `nbytes`, its pages allocated now: a full /dev/shm is
    an OSError here (then TCP), not a SIGBUS in the source writing into a sparse file.
    Named by transfer id, process and a counter: destination ranks of one host pull the
    same transfer at once, and the process id tells a leak's owner."""
    safe_id = re.sub(r"[^A-Za-z0-9_.-]", "_", transfer_id)[:80]
    path = f"{SHM_DIR}/{SHM_PREFIX}{safe_id}-{os.getpid()}-{next(_file_numbers)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    return fd, path


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Scatter:
    """One piece's scatter: a layer's K and V of these heads into the destination blocks."""

    def __init__(self, job: _Job, piece: PullPiece) -> None:
        self._job = job
        self._piece = piece
        self._heads = slice(piece.kv_heads.start - job.mine.kv_head_start,
                            piece.kv_heads.stop - job.mine.kv_head_start)
        self.device = job.caches[0].device
        self.dtype = job.caches[0].dtype
        self.shape = (2, len(job.dst_block_ids), job.mine.block_size, len(piece.kv_heads),
                      job.mine.head_dim)
        self._ids = block_index(job.dst_block_ids, self.device)
        # Where this piece's bytes go in each layer's cache, when received in place.
        self.spans = block_spans(job.caches[0], self._heads, job.dst_block_ids)

    def host_buffer(self) -> torch.Tensor:
        """A CPU buffer for one layer; pinned when the cache is on CUDA (asynchronous copies)."""
        if self.device.type == "cuda":
            try:
                return torch.empty(self.shape, dtype=self.dtype, pin_memory=True)
            except RuntimeError:
                pass
        return torch.empty(self.shape, dtype=self.dtype)

    def layer_from(self, layer: int, data: torch.Tensor) -> torch.cuda.Event | None:
        """Writes `data` (`shape`, on the CPU) into `layer`'s destination blocks. On CUDA
        the copy to the device is asynchronous: the returned event says when `data` may be
        overwritten."""
        ready = None
        if self.device.type == "cuda":
            data = data.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        scatter(self.cache(layer), self._heads, self._ids, data)
        return ready

    def cache(self, layer: int) -> torch.Tensor:
        return self._job.caches[layer - self._job.mine.layer_start]

    def all_from(self, buffer: mmap.mmap) -> None:
        """Every layer of the piece from the payload bytes in `buffer`."""
        payload = torch.frombuffer(buffer, dtype=self.dtype).view(len(self._piece.layers),
                                                                  *self.shape)
        for i, layer in enumerate(self._piece.layers):
            ready = self.layer_from(layer, payload[i])
            if ready is not None:
                ready.synchronize()  # pageable memory: the copy must be done before unmapping
        self.finish()

    def finish(self) -> None:
        """On CUDA, waits for the scatters: when a pull returns ok, the blocks are written."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
