"""KV blocks pulled from one engine group's ranks into another's (worker_svc/kv_transfer):
real sockets on 127.0.0.1, random caches, TCP and /dev/shm, across TP and PP layouts; and
every way a pull can fail ends in a reason, in time, with no file left in /dev/shm."""

from __future__ import annotations

import errno
import glob
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from worker_svc.kv_transfer import (
    KVTransferServer,
    PullResult,
    RankSlice,
    TransferError,
    host_key,
    plan_pull,
    pull_blocks,
    slice_for_rank,
)
from worker_svc.kv_transfer import blocks as blocks_module
from worker_svc.kv_transfer import pull as pull_module
from worker_svc.kv_transfer import server as server_module
from worker_svc.parallel import ParallelConfig

NUM_LAYERS = 4
NUM_HEADS = 8  # query heads
BLOCK_SIZE = 4
HEAD_DIM = 8
NUM_BLOCKS = 16
SRC_IDS = [9, 2, 3, 4, 14, 11]  # a request's blocks on the source, in block-table order
DST_IDS = [3, 12, 13, 0, 7, 15]  # the blocks the destination's scheduler gave it
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Rank:
    slice: RankSlice
    caches: list[torch.Tensor]


def model_kv(num_kv_heads: int, dtype: str, seed: int = 0) -> list[torch.Tensor]:
    """The whole model's KV in the source group's blocks: one tensor per global layer."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=generator).to(
            DTYPES[dtype]
        )
        for _ in range(NUM_LAYERS)
    ]


def layout(tp: int, pp: int, num_kv_heads: int, dtype: str) -> list[RankSlice]:
    return [
        slice_for_rank(
            ParallelConfig(tp, tp_rank, pp, pp_rank),
            num_layers=NUM_LAYERS,
            num_heads=NUM_HEADS,
            num_kv_heads=num_kv_heads,
            block_size=BLOCK_SIZE,
            head_dim=HEAD_DIM,
            dtype=dtype,
        )
        for pp_rank in range(pp)
        for tp_rank in range(tp)
    ]


def rank_caches(full: list[torch.Tensor], mine: RankSlice) -> list[torch.Tensor]:
    heads = slice(mine.kv_head_start, mine.kv_head_stop)
    return [full[layer][:, :, :, heads].clone() for layer in mine.layers]


def empty_ranks(tp: int, pp: int, num_kv_heads: int, dtype: str) -> list[Rank]:
    return [
        Rank(
            mine,
            [
                torch.zeros(
                    2, NUM_BLOCKS, BLOCK_SIZE, mine.num_kv_heads, HEAD_DIM, dtype=DTYPES[dtype]
                )
                for _ in mine.layers
            ],
        )
        for mine in layout(tp, pp, num_kv_heads, dtype)
    ]


@pytest.fixture
def transfer_id() -> Iterator[str]:
    """A fresh transfer id; the test fails if a /dev/shm file of it outlives the test."""
    tid = f"test-{uuid.uuid4().hex[:12]}"
    yield tid
    assert glob.glob(f"/dev/shm/pagemesh-kv-{tid}*") == []
    # The staging files this process keeps for the next pulls, and no more than one per
    # pull that ran at once (staging.py).
    assert len(glob.glob(f"/dev/shm/pagemesh-kv-stage-{os.getpid()}-*")) <= 8


@pytest.fixture(params=["views", "buffers"])
def io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Payloads (on a socket or through a file) moved from and into the caches' blocks
    themselves ("views"), or through layer buffers ("buffers"), whatever the block size."""
    min_view_bytes = 0 if request.param == "views" else 1 << 40
    monkeypatch.setattr(blocks_module, "MIN_VIEW_BYTES", min_view_bytes)
    return request.param


@pytest.fixture
def source_group() -> Iterator[Callable[..., list[RankSlice]]]:
    """`source_group(full, tp, pp, ...)`: a transfer server per rank of that layout over
    `full`; the slices to pull from (host key "elsewhere" unless `shm`, forcing TCP)."""
    servers: list[KVTransferServer] = []

    def start(
        full: list[torch.Tensor],
        tp: int,
        pp: int,
        *,
        dtype: str = "float32",
        shm: bool = False,
        token: str | None = None,
    ) -> list[RankSlice]:
        slices = []
        for mine in layout(tp, pp, full[0].shape[3], dtype):
            server = KVTransferServer(rank_caches(full, mine), mine, token=token).start()
            servers.append(server)
            slices.append(
                server.rank_slice if shm else replace(server.rank_slice, host_key="elsewhere")
            )
        return slices

    yield start
    for server in servers:
        server.close()


def pull(
    rank: Rank,
    sources: list[RankSlice],
    transfer_id: str,
    *,
    deadline_s: float = 5.0,
    token: str | None = None,
    src_ids: list[int] = SRC_IDS,
) -> PullResult:
    return pull_blocks(
        rank.slice,
        rank.caches,
        sources,
        src_ids,
        DST_IDS,
        time.monotonic() + deadline_s,
        token,
        transfer_id,
    )


def assert_holds(rank: Rank, full: list[torch.Tensor]) -> None:
    """The rank's DST_IDS blocks are the model's SRC_IDS blocks, bit for bit; the rest zero."""
    heads = slice(rank.slice.kv_head_start, rank.slice.kv_head_stop)
    others = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
    for cache, layer in zip(rank.caches, rank.slice.layers):
        assert torch.equal(cache[:, DST_IDS], full[layer][:, SRC_IDS][:, :, :, heads])
        assert not cache[:, others].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_same_layout_pull_is_bit_identical(
    source_group, transfer_id: str, dtype: str, path: str, io: str
) -> None:
    full = model_kv(4, dtype)
    sources = source_group(full, 2, 2, dtype=dtype, shm=path == "shm")
    for rank in empty_ranks(2, 2, 4, dtype):
        result = pull(rank, sources, transfer_id)
        assert result.ok, result.reason
        assert result.paths == {path}
        assert result.nbytes == 2 * 2 * len(DST_IDS) * BLOCK_SIZE * 2 * HEAD_DIM * (
            4 if dtype == "float32" else 2
        )
        assert_holds(rank, full)


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_a_tensor_parallel_resplit_moves_every_head(
    source_group, transfer_id: str, src_tp: int, dst_tp: int, io: str
) -> None:
    full = model_kv(4, "float32")
    sources = source_group(full, src_tp, 1)
    for rank in empty_ranks(dst_tp, 1, 4, "float32"):
        result = pull(rank, sources, transfer_id)
        assert result.ok, result.reason
        assert_holds(rank, full)


def test_a_pipeline_resplit_moves_every_layer(source_group, transfer_id: str) -> None:
    full = model_kv(4, "bfloat16")
    sources = source_group(full, 1, 2, dtype="bfloat16", shm=True)
    (rank,) = empty_ranks(1, 1, 4, "bfloat16")
    result = pull(rank, sources, transfer_id)
    assert result.ok, result.reason
    assert_holds(rank, full)


def test_replicated_heads_are_pulled_once_each(source_group, transfer_id: str) -> None:
    full = model_kv(2, "float32")  # 2 KV heads over tp 4: each held by two ranks
    sources = source_group(full, 4, 1)
    assert [s.kv_head_start for s in sources] == [0, 0, 1, 1]
    for rank in empty_ranks(1, 1, 2, "float32") + empty_ranks(2, 1, 2, "float32"):
        pieces = plan_pull(rank.slice, sources)
        assert len(pieces) == rank.slice.num_kv_heads
        result = pull(rank, sources, transfer_id)
        assert result.ok, result.reason
        assert_holds(rank, full)


def test_the_plan_takes_the_fewest_sources_and_names_what_is_missing() -> None:
    def rank(layers: range, heads: range, address: str) -> RankSlice:
        return RankSlice(
            layers.start,
            len(layers),
            heads.start,
            len(heads),
            BLOCK_SIZE,
            HEAD_DIM,
            "float32",
            address,
        )

    mine = rank(range(0, 8), range(0, 4), "me")
    assert RankSlice.from_json(mine.to_json()) == mine
    halves = [rank(range(0, 4), range(0, 4), "a"), rank(range(4, 8), range(0, 4), "b")]
    whole = rank(range(0, 8), range(0, 4), "whole")
    assert [p.source.address for p in plan_pull(mine, halves + [whole])] == ["whole"]
    pieces = plan_pull(mine, halves)
    assert [(p.source.address, p.layers, p.kv_heads) for p in pieces] == [
        ("a", range(0, 4), range(0, 4)),
        ("b", range(4, 8), range(0, 4)),
    ]
    with pytest.raises(TransferError, match="no source has layers 4-7 x kv heads 0-3"):
        plan_pull(mine, halves[:1])


def test_a_dtype_mismatch_is_refused_with_both_dtypes_named(source_group, transfer_id: str) -> None:
    sources = source_group(model_kv(4, "bfloat16"), 1, 1, dtype="bfloat16")
    (rank,) = empty_ranks(1, 1, 4, "float32")
    result = pull(rank, sources, transfer_id)
    assert not result.ok
    assert "the source group's KV is bfloat16, this group's float32" in result.reason
    # A source that claims float32 but holds bfloat16 is caught by its own server.
    lying = [replace(s, dtype="float32") for s in sources]
    result = pull(rank, lying, transfer_id)
    assert not result.ok and "this rank's KV has dtype bfloat16" in result.reason
    assert not any(cache.any() for cache in rank.caches)


@pytest.mark.parametrize("shm", [False, True])
def test_a_wrong_token_is_refused(source_group, transfer_id: str, shm: bool) -> None:
    full = model_kv(4, "float32")
    sources = source_group(full, 1, 1, shm=shm, token="right")
    (rank,) = empty_ranks(1, 1, 4, "float32")
    for token in ("wrong", None):
        result = pull(rank, sources, transfer_id, token=token)
        assert not result.ok and "token does not match" in result.reason
        assert sources[0].address in result.reason
    assert pull(rank, sources, transfer_id, token="right").ok
    assert_holds(rank, full)


def test_bad_reads_are_answered_and_the_server_goes_on(source_group, transfer_id: str) -> None:
    full = model_kv(4, "float32")
    (source,) = source_group(full, 1, 1)
    (rank,) = empty_ranks(1, 1, 4, "float32")
    result = pull(rank, [source], transfer_id, src_ids=[1, 2, 3, 4, 5, NUM_BLOCKS])
    assert not result.ok and f"block ids [{NUM_BLOCKS}] are outside" in result.reason
    result = pull(rank, [source], transfer_id, src_ids=[1, 2, 3, 1, 5, 6])
    assert not result.ok and "names a block twice" in result.reason
    host, port = source.address.split(":")
    for garbage in (
        struct.pack(">I", 1 << 30),
        struct.pack(">I", 5) + b"nope!",
        struct.pack(">I", 2) + b"[]",
    ):
        with socket.create_connection((host, int(port)), timeout=2) as sock:
            sock.sendall(garbage)
            assert b'"ok":false' in sock.recv(4096)
    assert pull(rank, [source], transfer_id).ok
    assert_holds(rank, full)


def test_shm_falls_back_to_tcp_when_it_cannot_be_used(
    source_group, transfer_id: str, monkeypatch
) -> None:
    model = model_kv(4, "float32")
    sources = source_group(model, 1, 1, shm=True)
    (rank,) = empty_ranks(1, 1, 4, "float32")

    def unavailable(*args: object) -> None:
        raise FileNotFoundError("another /dev/shm")

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    # The source sees another /dev/shm, or fills it up; this side cannot make the file.
    for module, name, fail in (
        (server_module, "_open_target", unavailable),
        (server_module.FileStream, "write", full),
        (pull_module._STAGING, "acquire", unavailable),
    ):
        with monkeypatch.context() as patch:
            patch.setattr(module, name, fail)
            result = pull(rank, sources, transfer_id)
        assert result.ok and result.paths == {"tcp"}, result
        assert_holds(rank, model)


@pytest.fixture
def fake_source() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """`fake_source(behave)`: a listening socket whose accepted connections get `behave`."""
    listeners: list[socket.socket] = []
    stop = threading.Event()

    def start(behave: Callable[[socket.socket], None]) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def accept() -> None:
            conn, _ = listener.accept()
            with conn:
                behave(conn)
                stop.wait(10)

        threading.Thread(target=accept, daemon=True).start()
        return f"127.0.0.1:{listener.getsockname()[1]}"

    yield start
    stop.set()
    for listener in listeners:
        listener.close()


@pytest.mark.parametrize("same_host", [False, True])
def test_a_source_that_never_answers_fails_by_the_deadline(
    fake_source, transfer_id: str, same_host: bool
) -> None:
    address = fake_source(lambda conn: None)  # accepts, reads nothing, says nothing
    (rank,) = empty_ranks(1, 1, 4, "float32")
    source = replace(rank.slice, address=address, host_key=host_key() if same_host else "elsewhere")
    start = time.monotonic()
    result = pull(rank, [source], transfer_id, deadline_s=0.5)
    assert not result.ok and "no answer before the deadline" in result.reason
    assert address in result.reason
    assert 0.45 < time.monotonic() - start < 1.5  # the deadline, plus slack for a busy CI


@pytest.mark.parametrize(
    "offered,reason",
    [(None, "closed the connection after"), (12345, "offers 12345 bytes, the read needs")],
)
def test_a_source_that_breaks_off_or_offers_the_wrong_size_fails(
    fake_source, transfer_id: str, offered: int | None, reason: str
) -> None:
    (rank,) = empty_ranks(1, 1, 4, "float32")
    nbytes = NUM_LAYERS * 2 * len(DST_IDS) * BLOCK_SIZE * 4 * HEAD_DIM * 4

    def half_then_close(conn: socket.socket) -> None:
        conn.recv(65536)
        header = b'{"ok":true,"reason":"","nbytes":%d,"shm_unavailable":false}' % (
            offered or nbytes
        )
        conn.sendall(struct.pack(">I", len(header)) + header + bytes(nbytes // 2))
        conn.shutdown(socket.SHUT_RDWR)

    source = replace(rank.slice, address=fake_source(half_then_close), host_key="elsewhere")
    result = pull(rank, [source], transfer_id)
    assert not result.ok and reason in result.reason, result.reason


def test_a_closed_port_fails_at_once(transfer_id: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    (rank,) = empty_ranks(1, 1, 4, "float32")
    start = time.monotonic()
    result = pull(rank, [replace(rank.slice, address=f"127.0.0.1:{port}")], transfer_id)
    assert not result.ok and "connection refused" in result.reason
    assert time.monotonic() - start < 1.0  # not the 5 s deadline


def test_a_failing_piece_does_not_hide_the_others(
    source_group, fake_source, transfer_id: str
) -> None:
    full = model_kv(4, "float32")
    good = source_group(full, 1, 2, shm=True)
    silent = replace(good[1], address=fake_source(lambda conn: None))
    (rank,) = empty_ranks(1, 1, 4, "float32")
    result = pull(rank, [good[0], silent], transfer_id, deadline_s=0.5)
    assert not result.ok and silent.address in result.reason
    assert good[0].address not in result.reason
    assert result.nbytes > 0  # the first stage's layers came


def test_nothing_to_pull_is_ok_without_a_connection(transfer_id: str) -> None:
    (rank,) = empty_ranks(1, 1, 4, "float32")
    result = pull_blocks(
        rank.slice, rank.caches, [], [], [], time.monotonic() + 1, None, transfer_id
    )
    assert result.ok and result.nbytes == 0
    with pytest.raises(ValueError, match="named twice"):
        pull_blocks(
            rank.slice, rank.caches, [], [1, 2], [3, 3], time.monotonic() + 1, None, transfer_id
        )


def test_staging_files_are_reused_and_a_dead_processs_are_removed(tmp_path: Path) -> None:
    """A pull's shm file is kept for the next one (its pages already there); one a failed
    pull used is dropped; files a killed process left are removed by the next to stage."""
    from worker_svc.kv_transfer.staging import StagingFiles

    orphan = tmp_path / "pagemesh-kv-stage-999999999-0"  # no such process
    orphan.write_bytes(b"x")
    staging = StagingFiles(str(tmp_path))
    fd, path = staging.acquire(1 << 20)
    assert not orphan.exists()
    staging.release(fd, path, reusable=True)
    again, same = staging.acquire(1 << 16)
    assert same == path and os.fstat(again).st_size == 1 << 20
    staging.release(again, same, reusable=False)
    assert not os.path.exists(same)
    staging.close()
