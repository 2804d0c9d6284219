"""Attention of batches with prompts in them: one call of the C kernel for the whole batch
(`kernels/cpu_decode.paged_attention`), against the torch paths it replaced (decodes through
the C decode kernel, whole prompts through one batched SDPA call per length, chunks after
cached context gathered and attended one sequence at a time), on SmolLM2-135M's shape.

    .venv/bin/python -m bench.mixed_attention [--repeats 20]
    # AVX2 code on an AVX-512 machine, torch's kernels held to AVX2 too:
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python -m bench.mixed_attention --march x86-64-v3 --name mixed_attention-avx2

One layer (9 query heads over 3 KV heads of 64, blocks of 16, fp32 and, where the CPU has
native bf16, bf16), each sequence's blocks shuffled over the cache; this step's keys and
values given to the torch path too (its whole-prompt shortcut). The median of `--repeats`
calls each, in the same run, and their ratio; both outputs checked against each other.
Writes bench/results/mixed_attention.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import write_results
from bench.kv_split import time_call
from kernels import cpu_attention, cpu_decode, cpu_native
from kernels.cpu_features import cpu_features

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# name: (new tokens, cached context) per sequence
CASES = {
    "W64 prefill chunk: 16 prompts x 128": [(128, 0)] * 16,
    "one 2,048-token prompt": [(2048, 0)],
    "64 decodes (ctx 140) + a 1,024-token prompt": [(1, 140)] * 64 + [(1024, 0)],
    "a 512-token chunk after 1,536 cached": [(512, 1536)],
    "4 prompts of 256 after a 512-token prefix hit": [(256, 512)] * 4,
}


def batch(shape: list[tuple[int, int]], dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(0)
    seq_lens = [new + cached for new, cached in shape]
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    order = torch.randperm(sum(blocks), generator=generator)
    tables = torch.zeros(len(shape), max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[first : first + n]
        first += n
    k_cache = torch.randn(sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(
        dtype
    )
    v_cache = torch.randn(k_cache.shape, generator=generator).to(dtype)
    tokens = sum(new for new, _ in shape)
    starts = [0]
    for new, _ in shape:
        starts.append(starts[-1] + new)
    # This step's own keys and values, as store_kv just wrote them into the cache.
    slots = [
        int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
        for i, (new, cached) in enumerate(shape)
        for p in range(cached, cached + new)
    ]
    return {
        "query": torch.randn(tokens, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "tables": tables,
        "lens": torch.tensor(seq_lens, dtype=torch.int32),
        "starts": starts,
        "key": k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots],
        "value": v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots],
    }


def case(name: str, dtype: torch.dtype, repeats: int, lib=None) -> dict:
    b = batch(CASES[name], dtype)
    scale = HEAD_DIM**-0.5
    start_loc = torch.tensor(b["starts"], dtype=torch.int32)

    def one_call():
        return cpu_decode.paged_attention(
            b["query"],
            b["k_cache"],
            b["v_cache"],
            b["tables"],
            b["lens"],
            start_loc,
            scale,
            lib=lib,
        )

    def torch_paths():
        return cpu_attention.sdpa_paged_attention(
            b["query"],
            b["k_cache"],
            b["v_cache"],
            b["tables"],
            b["lens"],
            b["starts"],
            scale,
            None,
            b["key"],
            b["value"],
        )

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        one_call().float(), torch_paths().float(), atol=tolerance, rtol=tolerance
    )
    one_us, torch_us = time_call(one_call, repeats), time_call(torch_paths, repeats)
    return {
        "case": name,
        "dtype": str(dtype).removeprefix("torch."),
        "one_call_ms": one_us / 1e3,
        "torch_paths_ms": torch_us / 1e3,
        "speedup": torch_us / one_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--march",
        default=None,
        help="build the kernel for this -march (x86-64-v3: AVX2) instead of for this CPU",
    )
    parser.add_argument("--name", default="mixed_attention", help="results file name")
    args = parser.parse_args()
    lib = cpu_native._build("cpu_decode", (f"-march={args.march}",)) if args.march else None
    if not cpu_decode.available(torch.float32):
        raise SystemExit("the native kernels do not build here (no C compiler)")
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_features().native_bf16 else [])
    rows = [case(name, dtype, args.repeats, lib) for dtype in dtypes for name in CASES]
    header = (
        f"Attention of one layer with prompts in the batch (SmolLM2-135M: {NUM_HEADS} "
        f"heads over {NUM_KV_HEADS} KV heads of {HEAD_DIM}): one C call for the whole "
        f"batch against the torch paths (C decode kernel + SDPA), "
        f"{torch.get_num_threads()} threads; medians of {args.repeats} calls; kernel "
        f"built for {'-march=' + args.march if args.march else 'this CPU'}, torch's "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}. Command: "
        f"`python -m bench.mixed_attention`."
    )
    table = [
        [
            r["dtype"],
            r["case"],
            f"{r['one_call_ms']:.2f}",
            f"{r['torch_paths_ms']:.2f}",
            f"{r['speedup']:.2f}x",
        ]
        for r in rows
    ]
    write_results(
        args.name,
        header,
        ["dtype", "batch", "one C call ms", "torch paths ms", "speedup"],
        table,
        rows,
    )


if __name__ == "__main__":
    main()
