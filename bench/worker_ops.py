"""The worker's small ops, each C kernel or vectorized path against what it replaced, paired.

    .venv/bin/python -m bench.worker_ops

At SmolLM2-135M's shapes (hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536,
vocabulary 49,152), for a decode step of 64 rows and a prefill step of 2,048: the fused
ops of `kernels/cpu_fused.py` against their torch references, greedy argmax against
`torch.argmax`, and the step batch from persistent block tables against the plain
per-request numpy construction it replaced (kept in `bench/batch_before.py`),
at 64 and 256 decodes.
Each pair alternates over `--reps` rounds; medians. Writes bench/results/worker_ops.{md,json}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.batch_before import as_dict, per_request_batch
from bench.common import write_results
from kernels import cpu_fused, reference
from protos.step import SamplingParams
from worker_svc.batch import BlockTables, RequestState, build_batch


def paired(new, old, reps: int, inner: int = 20) -> tuple[float, float]:
    """Median ms per call of `new` and `old`, alternated."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for f in (new, old):
        f()
    for _ in range(reps):
        for index, f in enumerate((new, old)):
            start = time.perf_counter()
            for _ in range(inner):
                f()
            times[index].append((time.perf_counter() - start) / inner * 1000)
    return statistics.median(times[0]), statistics.median(times[1])


def op_cases(rows: int) -> list[tuple[str, object, object]]:
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
    weight = torch.randn(576, generator=g)
    gate_up = torch.randn(rows, 3072, generator=g)
    qkv = torch.randn(rows, 960, generator=g)
    q, k, v = (
        qkv[:, :576].view(rows, 9, 64),
        qkv[:, 576:768].view(rows, 3, 64),
        qkv[:, 768:].view(rows, 3, 64),
    )
    positions = torch.arange(rows) + 7
    cos, sin = torch.rand(8192, 64, generator=g), torch.rand(8192, 64, generator=g)
    caches = torch.zeros(2, 1456, 16, 3, 64)
    slots = torch.randperm(1456 * 16, generator=g)[:rows]
    return [
        (
            "add_rms_norm",
            lambda: cpu_fused.add_rms_norm(x, residual, weight, 1e-5),
            lambda: cpu_fused.add_rms_norm_reference(x, residual, weight, 1e-5),
        ),
        (
            "rotary_ (q)",
            lambda: cpu_fused.rotary_(q, positions, cos, sin),
            lambda: cpu_fused.rotary_reference_(q, positions, cos, sin),
        ),
        (
            "silu_mul",
            lambda: cpu_fused.silu_mul(gate_up),
            lambda: cpu_fused.silu_mul_reference(gate_up),
        ),
        (
            "store_kv (k, v views)",
            lambda: cpu_fused.store_kv(k, v, caches[0], caches[1], slots),
            lambda: reference.store_kv(k, v, caches[0], caches[1], slots),
        ),
    ]


BLOCK_SIZE = 4  # tokens; small, as the batch-table test's, so each request has many blocks


def batch_case(num_requests: int):
    rng = random.Random(0)
    requests, tables = {}, BlockTables()
    for i in range(num_requests):
        tokens = [rng.randrange(1000) for _ in range(200)]
        per = -(-len(tokens) // BLOCK_SIZE)
        blocks = list(range(i * per, (i + 1) * per))
        requests[f"r{i}"] = RequestState(tokens, 128, blocks, 199, SamplingParams())
        tables.set(f"r{i}", blocks)
    decodes = dict.fromkeys(requests, 1)
    cpu = torch.device("cpu")
    # Both end in the same lists, so each side pays the same conversions.
    return (
        lambda: as_dict(build_batch(requests, decodes, BLOCK_SIZE, cpu, tables)),
        lambda: per_request_batch(requests, decodes, BLOCK_SIZE),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    rows, data = [], []

    def add(name: str, shape: str, new, old, what_new: str, what_old: str) -> None:
        new_ms, old_ms = paired(new, old, args.reps)
        rows.append(
            [
                name,
                shape,
                what_new,
                f"{new_ms:.3f}",
                what_old,
                f"{old_ms:.3f}",
                f"{old_ms / new_ms:.2f}x",
            ]
        )
        data.append({"op": name, "shape": shape, "new_ms": new_ms, "old_ms": old_ms})

    for num_rows in (64, 2048):
        for name, new, old in op_cases(num_rows):
            add(name, f"{num_rows} rows", new, old, "C", "torch reference")
    for num_rows in (64, 256):  # W64's decode; the control-plane bench's 256 streams
        logits = torch.randn(num_rows, 49152, generator=torch.Generator().manual_seed(1))
        add(
            "greedy argmax",
            f"{num_rows} x 49,152",
            lambda x=logits: cpu_fused.argmax(x),
            lambda x=logits: x.argmax(dim=-1),
            "C",
            "torch.argmax",
        )
        add(
            "a read of the logits",
            f"{num_rows} x 49,152",
            lambda x=logits: x.amax(dim=-1),
            lambda x=logits: x.argmax(dim=-1),
            "torch.amax",
            "torch.argmax",
        )
    for num_requests in (64, 256):
        new, old = batch_case(num_requests)
        add(
            "build_batch",
            f"{num_requests} decodes",
            new,
            old,
            "block tables",
            "numpy per request (before)",
        )
    write_results(
        "worker_ops",
        "# The worker's small ops, paired (median ms per call)",
        ["op", "shape", "new", "new ms", "old", "old ms", "speed-up"],
        rows,
        data,
    )


if __name__ == "__main__":
    main()
