"""One mixture-of-experts layer's experts on CPU: the grouped path against transformers'
per-expert loop, paired.

    .venv/bin/python -m bench.moe [--tokens 64,1,512] [--reps 15] [--name moe]

For each shape (hidden, expert intermediate; 8 experts, top-2, router logits drawn at
random, fp32) and token count, times per call, alternated over `--reps` rounds (medians):

- `per_expert_loop` (`kernels.moe.per_expert_loop`): transformers 5's loop, a one-hot mask
  and a `where` per expert, the baseline of the ratios;
- `grouped, F.linear` (`kernels.moe.fused_experts`): one sort, one GEMM pair per expert
  with rows, one weighted `index_add_`;
- `grouped, packed` (`worker_svc.model.moe.FusedExperts` after `pack_experts`), what the
  worker runs: in fp32 where the C kernels build, one call (`cpu_linear.c`'s `moe_f32`:
  the sort, each expert's rows through its panels, SiLU-and-mul, the weighted sum); else
  the grouping above over oneDNN-packed experts.

Shapes: a tiny test model's (hidden 64, intermediate 48), a small MoE's (1024 / 512), and
Qwen3-30B-A3B's expert shape (2048 / 768). Writes bench/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import write_results
from kernels import moe as moe_kernels
from worker_svc.model.matmul import resolve_cpu_linear
from worker_svc.model.moe import FusedExperts
from worker_svc.parallel import ParallelConfig

NUM_EXPERTS, TOP_K = 8, 2
SHAPES = {
    "tiny test model": (64, 48),
    "small MoE": (1024, 512),
    "Qwen3-30B-A3B experts": (2048, 768),
}


def timed(functions: list, reps: int) -> list[float]:
    """Median ms per call of each function, alternated round by round."""
    inner = 1
    start = time.perf_counter()
    functions[0]()
    elapsed = time.perf_counter() - start
    inner = max(1, min(50, int(0.05 / max(elapsed, 1e-6))))
    times: list[list[float]] = [[] for _ in functions]
    for f in functions:
        f()
    for _ in range(reps):
        for index, f in enumerate(functions):
            start = time.perf_counter()
            for _ in range(inner):
                f()
            times[index].append((time.perf_counter() - start) / inner * 1000)
    return [statistics.median(t) for t in times]


def case(hidden: int, inter: int, tokens: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(NUM_EXPERTS, hidden, inter, generator=g) * inter**-0.5
    weights, ids = moe_kernels.route(
        torch.randn(tokens, NUM_EXPERTS, generator=g), TOP_K, True, torch.float32
    )
    experts = FusedExperts(NUM_EXPERTS, hidden, inter, ParallelConfig())
    experts.w13.data.copy_(w13)
    experts.w2.data.copy_(w2)
    backend = resolve_cpu_linear("auto", torch.device("cpu"), torch.float32)
    experts.pack_experts(backend)
    loop, grouped, packed = timed(
        [
            lambda: moe_kernels.per_expert_loop(x, w13, w2, weights, ids),
            lambda: moe_kernels.fused_experts(x, w13, w2, weights, ids),
            lambda: experts(x, weights, ids),
        ],
        reps,
    )
    torch.testing.assert_close(
        experts(x, weights, ids),
        moe_kernels.per_expert_loop(x, w13, w2, weights, ids),
        rtol=1e-4,
        atol=1e-5,
    )
    return dict(
        hidden=hidden,
        intermediate=inter,
        tokens=tokens,
        packed_backend=backend,
        loop_ms=loop,
        grouped_ms=grouped,
        packed_ms=packed,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="64,1,512")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--name", default="moe")
    args = parser.parse_args()
    results, table = [], []
    for shape, (hidden, inter) in SHAPES.items():
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = case(hidden, inter, tokens, args.reps) | {"shape": shape}
            results.append(row)
            table.append(
                [
                    f"{shape} ({hidden} / {inter})",
                    str(tokens),
                    f"{row['loop_ms']:.3f}",
                    f"{row['grouped_ms']:.3f}",
                    f"{row['loop_ms'] / row['grouped_ms']:.2f}x",
                    f"{row['packed_ms']:.3f}",
                    f"{row['loop_ms'] / row['packed_ms']:.2f}x ({row['packed_backend']})",
                ]
            )
            print(table[-1], flush=True)
    header = (
        f"One MoE layer's experts, {NUM_EXPERTS} experts top-{TOP_K}, fp32, "
        f"{torch.get_num_threads()} torch threads: transformers' per-expert loop "
        f"against the grouped path; medians of {args.reps} alternated rounds. "
        "Command: `python -m bench.moe`."
    )
    write_results(
        args.name,
        header,
        [
            "shape (hidden / intermediate)",
            "tokens",
            "per-expert loop ms",
            "grouped, F.linear ms",
            "x loop",
            "grouped, packed ms",
            "x loop",
        ],
        table,
        results,
    )


if __name__ == "__main__":
    main()
