"""The C decode-attention kernel with a sequence's keys split across threads, against the
same kernel keeping each sequence on one thread, on SmolLM2-135M's attention shape.

    .venv/bin/python -m bench.kv_split [--contexts 128,512,2048,8192] [--batches 1,2,4]

One layer's decode attention (9 query heads over 3 KV heads of 64, blocks of 16, fp32 and,
where the CPU has native bf16, bf16), per batch size and context length: the median of
`--repeats` calls of `kernels/cpu_decode.paged_decode` with `split_keys` on and off, in
the same run, and their ratio. The split engages only with fewer sequences than threads
and at least 256 keys (two parts of 128). Writes bench/results/kv_split.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import write_results
from kernels import cpu_decode
from kernels.cpu_features import cpu_features

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def time_call(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def case(batch: int, context: int, dtype: torch.dtype, repeats: int) -> dict:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(
        dtype
    )
    v_cache = torch.randn(k_cache.shape, generator=generator).to(dtype)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    # Each sequence's blocks shuffled over the cache, as a serving cache holds them.
    tables = torch.randperm(num_blocks, generator=generator).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)

    def run(split: bool):
        return lambda: cpu_decode.paged_decode(
            query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, split_keys=split
        )

    torch.testing.assert_close(
        run(True)(),
        run(False)(),
        atol=2e-2 if dtype != torch.float32 else 1e-5,
        rtol=1e-2 if dtype != torch.float32 else 1e-5,
    )
    split_us, whole_us = time_call(run(True), repeats), time_call(run(False), repeats)
    return {
        "batch": batch,
        "context": context,
        "dtype": str(dtype).removeprefix("torch."),
        "split_us": split_us,
        "one_thread_per_seq_us": whole_us,
        "speedup": whole_us / split_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="128,512,2048,8192")
    parser.add_argument("--batches", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if not cpu_decode.available(torch.float32):
        raise SystemExit("the native kernels do not build here (no C compiler)")
    dtypes = [torch.float32]
    if cpu_features().native_bf16:
        dtypes.append(torch.bfloat16)
    rows = [
        case(b, c, d, args.repeats)
        for d in dtypes
        for b in map(int, args.batches.split(","))
        for c in map(int, args.contexts.split(","))
    ]
    header = (
        f"Decode attention of one layer (SmolLM2-135M: {NUM_HEADS} heads over "
        f"{NUM_KV_HEADS} KV heads of {HEAD_DIM}), the C kernel with the KV split against "
        f"one thread per sequence, {torch.get_num_threads()} threads; medians of "
        f"{args.repeats} calls. Command: `python -m bench.kv_split`."
    )
    table = [
        [
            r["dtype"],
            str(r["batch"]),
            f"{r['context']:,}",
            f"{r['split_us']:.1f}",
            f"{r['one_thread_per_seq_us']:.1f}",
            f"{r['speedup']:.2f}x",
        ]
        for r in rows
    ]
    write_results(
        "kv_split",
        header,
        ["dtype", "batch", "context", "split µs", "one thread per sequence µs", "speedup"],
        table,
        rows,
    )


if __name__ == "__main__":
    main()
