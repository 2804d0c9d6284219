"""KV block transfer between two processes (worker_svc/kv_transfer) against a plain copy of
the same bytes between the same two processes.

    .venv/bin/python -m bench.kv_transfer [--tokens 2048] [--dtype float32] [--repeats 7]

A SmolLM2-135M-shaped cache (30 layers, 3 KV heads, head_dim 64, blocks of 16 tokens,
random values) lives in a child process (spawned) behind a KVTransferServer; this process
pulls one `--tokens` request's blocks (non-contiguous ids on both sides) into its own cache
of the same shape, over TCP and over /dev/shm. The baselines move as many bytes between the
same processes with nothing else done:
- plain tcp: one sendall of a contiguous buffer into one recv_into loop, on a new
  connection each time (as a pull makes);
- plain shm (the issue's): this process makes a /dev/shm file and allocates it, the child
  maps it and copies the bytes in, this process maps it and copies them out;
- plain shm (write/read): the same file written there and read here, which is how the
  pull's shm path moves its blocks (less their being scattered), for comparison.
Median of `--repeats` of each, all alternated; the pulled blocks are checked bit for bit
once. Target (the issue): pull >= 50% of the plain copy's throughput. Writes
bench/results/kv_transfer.{md,json} (bench/results/raw/ the samples).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection

import torch

from bench.common import write_results
from worker_svc.kv_transfer import KVTransferServer, RankSlice, pull_blocks
from worker_svc.kv_transfer.wire import (
    SHM_DIR,
    SHM_PREFIX,
    byte_view,
    recv_exactly,
    split_address,
    torch_dtype,
)

# SmolLM2-135M: 30 decoder layers, 3 KV heads of 64.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
TOKEN = "bench-token"


def smollm2_slice(dtype: str) -> RankSlice:
    return RankSlice(0, NUM_LAYERS, 0, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype)


def smollm2_caches(num_blocks: int, dtype: str, seed: int | None) -> list[torch.Tensor]:
    """Random per-layer caches from `seed` (zeros for None), the same in every process."""
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch_dtype(dtype)) for _ in range(NUM_LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=generator).to(torch_dtype(dtype)) for _ in range(NUM_LAYERS)
    ]


def source_process(pipe: Connection, num_blocks: int, dtype: str, nbytes: int) -> None:
    """The child: the transfer server over its cache, and the baselines' plain server."""
    caches = smollm2_caches(num_blocks, dtype, seed=0)
    server = KVTransferServer(caches, smollm2_slice(dtype), token=TOKEN).start()
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    plain = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve_plain, args=(plain, payload), daemon=True).start()
    pipe.send((server.rank_slice.to_json(), f"127.0.0.1:{plain.getsockname()[1]}"))
    pipe.recv()  # told to stop
    server.close()


def _serve_plain(listener: socket.socket, payload: torch.Tensor) -> None:
    """b"T": the payload's bytes on the socket. b"S" + path: the payload copied into that
    /dev/shm file through a shared mapping, then b"k"; b"W" + path: written into it."""
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            command = conn.recv(4096)
            if command == b"T":
                conn.sendall(byte_view(payload))
                continue
            fd = os.open(command[1:].decode(), os.O_RDWR)
            if command[:1] == b"W":
                os.pwrite(fd, byte_view(payload), 0)
            else:
                mapping = mmap.mmap(fd, len(payload), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                torch.frombuffer(mapping, dtype=torch.uint8).copy_(payload)
                mapping.close()
            os.close(fd)
            conn.sendall(b"k")


def plain_tcp(address: str, into: torch.Tensor) -> None:
    with socket.create_connection(split_address(address)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"T")
        recv_exactly(sock, byte_view(into))


def plain_shm(address: str, into: torch.Tensor) -> None:
    """The issue's baseline: a copy into a shared mapping there, out of one here."""
    path = f"{SHM_DIR}/{SHM_PREFIX}bench-plain-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, len(into))  # a sparse mapping written is a SIGBUS when full
        with socket.create_connection(split_address(address)) as sock:
            sock.sendall(b"S" + path.encode())
            assert sock.recv(1) == b"k"
        mapping = mmap.mmap(fd, len(into), flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)
    into.copy_(torch.frombuffer(mapping, dtype=torch.uint8))
    mapping.close()


def plain_shm_io(address: str, into: torch.Tensor) -> None:
    """What the pull's shm path does, less its scattered blocks: write() there, read() here."""
    path = f"{SHM_DIR}/{SHM_PREFIX}bench-plain-io-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, len(into))
        with socket.create_connection(split_address(address)) as sock:
            sock.sendall(b"W" + path.encode())
            assert sock.recv(1) == b"k"
        os.unlink(path)
        os.preadv(fd, [byte_view(into)], 0)
    finally:
        os.close(fd)
        if os.path.exists(path):
            os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--name", default="kv_transfer")
    args = parser.parse_args()

    num_request_blocks = -(-args.tokens // BLOCK_SIZE)
    num_blocks = 3 * num_request_blocks + 5
    rng = random.Random(1)
    src_ids = rng.sample(range(num_blocks), num_request_blocks)
    dst_ids = rng.sample(range(num_blocks), num_request_blocks)
    element_bytes = torch.empty((), dtype=torch_dtype(args.dtype)).element_size()
    nbytes = (
        NUM_LAYERS * 2 * num_request_blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * element_bytes
    )

    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    child = context.Process(
        target=source_process, daemon=True, args=(child_end, num_blocks, args.dtype, nbytes)
    )
    child.start()
    source_json, plain_address = parent_end.recv()
    source = RankSlice.from_json(source_json)
    try:
        samples = measure(args, source, plain_address, num_blocks, src_ids, dst_ids, nbytes)
    finally:
        parent_end.send("stop")
        child.join(timeout=10)
    report(args, nbytes, samples)


def measure(
    args: argparse.Namespace,
    source: RankSlice,
    plain_address: str,
    num_blocks: int,
    src_ids: list[int],
    dst_ids: list[int],
    nbytes: int,
) -> dict[str, list[float]]:
    mine = smollm2_slice(args.dtype)
    caches = smollm2_caches(num_blocks, args.dtype, seed=None)
    tcp_source = replace(source, host_key="elsewhere")  # forces TCP though on this host
    into = torch.empty(nbytes, dtype=torch.uint8)

    def pull(via: RankSlice, path: str) -> Callable[[], None]:
        def run() -> None:
            result = pull_blocks(
                mine, caches, [via], src_ids, dst_ids, time.monotonic() + 60, TOKEN, f"bench-{path}"
            )
            assert result.ok and result.paths == {path} and result.nbytes == nbytes, result

        return run

    actions = {
        "pull tcp": pull(tcp_source, "tcp"),
        "plain tcp": lambda: plain_tcp(plain_address, into),
        "pull shm": pull(source, "shm"),
        "plain shm": lambda: plain_shm(plain_address, into),
        "plain shm (write/read)": lambda: plain_shm_io(plain_address, into),
    }
    samples: dict[str, list[float]] = {name: [] for name in actions}
    for name, action in actions.items():
        action()  # warm-up: first-touch page faults of buffers, connections, thread pools
        if name.startswith("pull"):
            check_blocks(caches, args.dtype, num_blocks, src_ids, dst_ids)
            for cache in caches:
                cache.zero_()
    for _ in range(args.repeats):
        for name, action in actions.items():
            start = time.perf_counter()
            action()
            samples[name].append(time.perf_counter() - start)
    return samples


def check_blocks(
    caches: list[torch.Tensor], dtype: str, num_blocks: int, src_ids: list[int], dst_ids: list[int]
) -> None:
    expected = smollm2_caches(num_blocks, dtype, seed=0)
    for got, want in zip(caches, expected):
        if not torch.equal(got[:, dst_ids], want[:, src_ids]):
            raise AssertionError("pulled blocks differ from the source's")


def report(args: argparse.Namespace, nbytes: int, samples: dict[str, list[float]]) -> None:
    """One row per way of moving the bytes; a baseline's row says how fast the pull of the
    same path is next to it (the issue's target: pull / plain >= 0.5)."""
    seconds = {name: statistics.median(values) for name, values in samples.items()}
    rows, data = [], []
    for name, median in seconds.items():
        kind, path = name.split(" ", 1)
        pull = seconds.get(f"pull {path.split(' ')[0]}") if kind == "plain" else None
        ratio = median / pull if pull else None
        rows.append(
            [
                name,
                f"{nbytes:,}",
                f"{median * 1000:.1f} ms",
                f"{nbytes / median / 1e9:.2f}",
                f"{ratio:.2f}" if ratio else "",
            ]
        )
        data.append(
            {
                "what": name,
                "bytes": nbytes,
                "seconds_median": median,
                "gb_per_s": nbytes / median / 1e9,
                "pull_over_plain": ratio,
            }
        )
    header = (
        f"# KV block transfer, {args.tokens} tokens of SmolLM2-135M's KV ({args.dtype})\n\n"
        f"A pull (worker_svc/kv_transfer) from a child process into this one, "
        f"{NUM_LAYERS} layers, non-contiguous block ids on both sides, against the "
        f"same bytes moved plainly between the same processes; median of "
        f"{args.repeats}, alternated. Target: pull / plain >= 0.5."
    )
    write_results(
        args.name if args.dtype == "float32" else f"{args.name}_{args.dtype}",
        header,
        ["what", "bytes", "seconds", "GB/s", "pull / plain"],
        rows,
        {"tokens": args.tokens, "dtype": args.dtype, "repeats": args.repeats, "rows": data},
        raw={"samples_s": samples},
    )


if __name__ == "__main__":
    main()
