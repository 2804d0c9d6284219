"""The destination side of KV block transfers: a rank pulls a request's blocks from the
ranks of another engine group (`server.py` serves them) into its own paged cache.

The destination's rectangle of (layers x KV heads) is cut into pieces by `plan_pull`, one
source rank each, pulled in parallel threads. A piece from a rank on this host and network
namespace goes through a /dev/shm file that the source writes and this rank reads back;
any other piece, or one whose file cannot be made or used, comes over TCP. Either way the
bytes go straight between the stream and the cache's blocks (`payload.py`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, replace

import torch

from worker_svc.kv_transfer.blocks import check_caches
from worker_svc.kv_transfer.layout import PullPiece, RankSlice, TransferError, host_key, plan_pull
from worker_svc.kv_transfer.payload import Blocks, FileStream, read_payload, socket_reader
from worker_svc.kv_transfer.staging import StagingFiles
from worker_svc.kv_transfer.wire import (
    ReadReply,
    ReadRequest,
    ShmTarget,
    layer_nbytes,
    recv_message,
    send_message,
    split_address,
    tune_socket,
)

# How long past the deadline a pull waits for its threads: every socket call of theirs
# already times out at the deadline, so this covers one layer's scatter, not a network wait.
JOIN_SLACK_S = 5.0
_STAGING = StagingFiles()


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


def pull_blocks(
    mine: RankSlice,
    caches: list[torch.Tensor],
    sources: list[RankSlice],
    src_block_ids: list[int],
    dst_block_ids: list[int],
    deadline_s: float,
    token: str | None,
    transfer_id: str,
) -> PullResult:
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
    job = _Job(
        mine,
        caches,
        [int(b) for b in src_block_ids],
        [int(b) for b in dst_block_ids],
        deadline_s,
        token or "",
        transfer_id,
        host_key(),
    )
    outcomes = _run_pieces(job, pieces)
    reasons = [o.reason for o in outcomes if o.reason]
    return PullResult(
        not reasons,
        "; ".join(reasons),
        sum(o.nbytes for o in outcomes),
        time.monotonic() - start,
        frozenset(o.path for o in outcomes if o.path and not o.reason),
    )


def _check_block_ids(src_block_ids: list[int], dst_block_ids: list[int], num_blocks: int) -> None:
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destination blocks"
        )
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise ValueError("a destination block is named twice")
    outside = [b for b in dst_block_ids if not 0 <= b < num_blocks]
    if outside:
        raise ValueError(
            f"destination blocks {outside[:8]} are outside this rank's cache of {num_blocks} blocks"
        )


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
        return ReadRequest(
            self.token,
            self.transfer_id,
            piece.layers.start,
            piece.layers.stop,
            piece.kv_heads.start,
            piece.kv_heads.stop,
            self.src_block_ids,
            self.mine.block_size,
            self.mine.head_dim,
            self.mine.dtype,
        )

    def blocks(self, piece: PullPiece) -> Blocks:
        return Blocks(self.caches, self.mine, piece.layers, piece.kv_heads, self.dst_block_ids)

    def payload_nbytes(self, piece: PullPiece) -> int:
        return len(piece.layers) * layer_nbytes(
            len(self.dst_block_ids),
            self.mine.block_size,
            len(piece.kv_heads),
            self.mine.head_dim,
            self.caches[0].dtype,
        )


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

    threads = [
        threading.Thread(target=run, args=(i,), daemon=True, name=f"kv-pull-{job.transfer_id}-{i}")
        for i in range(1, len(pieces))
    ]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join(timeout=max(0.0, job.deadline - time.monotonic()) + JOIN_SLACK_S)
    done = []
    for piece, outcome in zip(pieces, outcomes):
        if outcome is None:
            outcome = _Outcome(
                reason=f"source {piece.source.describe()}: still transferring past the deadline"
            )
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
    try:
        host, port = split_address(piece.source.address)
    except ValueError as error:
        raise ConnectionError(f"no address to reach it at: {error}") from None
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
    """The piece as bytes after the reply, straight into the destination blocks
    (`read_payload`)."""
    reply = _ask(sock, job, job.request(piece))
    if not reply.ok:
        raise _Refused(reply.reason)
    expected = job.payload_nbytes(piece)
    if reply.nbytes != expected:
        raise ValueError(f"the source offers {reply.nbytes} bytes, the read needs {expected}")
    read_payload(job.blocks(piece), socket_reader(sock, job.deadline))
    return expected


def _pull_shm(sock: socket.socket, job: _Job, piece: PullPiece) -> int | None:
    """The piece through a /dev/shm file the source writes into; None when no file can
    be made here or the source cannot use it (then TCP, on the same connection)."""
    nbytes = job.payload_nbytes(piece)
    try:
        fd, path = _STAGING.acquire(nbytes)  # staging.py: kept across pulls, pages and all
    except OSError:
        return None
    done = False
    try:
        info = os.fstat(fd)
        target = ShmTarget(path, info.st_dev, info.st_ino, nbytes)
        reply = _ask(sock, job, replace(job.request(piece), shm=target))
        if not reply.ok:
            if reply.shm_unavailable:
                return None
            raise _Refused(reply.reason)
        read_payload(job.blocks(piece), FileStream(fd).read)
        done = True
    finally:
        # A pull that failed midway may leave its source still writing: never reuse that file.
        _STAGING.release(fd, path, reusable=done)
    return nbytes
