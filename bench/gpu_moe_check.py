"""The Triton fused-MoE kernel on a GPU (run by bench/gpu_check.sh): against the torch path
of the same signature on the same device, at Qwen3-30B-A3B's expert shape (128 experts,
top-8, hidden 2048, intermediate 768, bf16) for 1, 64 and 2,048 tokens; the largest
difference and the time of each (CUDA events, medians of 20).

    .venv/bin/python -m bench.gpu_moe_check            # on a CUDA machine
    TRITON_INTERPRET=1 .venv/bin/python -m bench.gpu_moe_check --device cpu --small  # smoke

Writes bench/results/gpu_moe_check.{md,json} (`--small`: gpu_moe_check_small).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import write_results
from kernels import moe as moe_kernels

FULL = dict(experts=128, top_k=8, hidden=2048, intermediate=768, tokens=(1, 64, 2048))
SMALL = dict(experts=8, top_k=2, hidden=64, intermediate=48, tokens=(1, 7))


def timed_ms(function, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            function()
            times.append((time.perf_counter() - begin) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny shape, for a smoke run")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    from kernels.fused_moe_triton import fused_experts_triton

    shape = SMALL if args.small else FULL
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    e, h, i = shape["experts"], shape["hidden"], shape["intermediate"]
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(device, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(device, dtype)
    rows, table = [], []
    for tokens in shape["tokens"]:
        x = torch.randn(tokens, h, generator=g).to(device, dtype)
        weights, ids = moe_kernels.route(
            torch.randn(tokens, e, generator=g).to(device), shape["top_k"], True, dtype
        )
        ours = fused_experts_triton(x, w13, w2, weights, ids)
        torch_path = moe_kernels.fused_experts(x, w13, w2, weights, ids)
        diff = float((ours.float() - torch_path.float()).abs().max())
        triton_ms = timed_ms(
            lambda: fused_experts_triton(x, w13, w2, weights, ids), device, args.reps
        )
        torch_ms = timed_ms(
            lambda: moe_kernels.fused_experts(x, w13, w2, weights, ids), device, args.reps
        )
        rows.append(dict(tokens=tokens, max_abs_diff=diff, triton_ms=triton_ms, torch_ms=torch_ms))
        table.append(
            [
                str(tokens),
                f"{diff:.2e}",
                f"{triton_ms:.3f}",
                f"{torch_ms:.3f}",
                f"{torch_ms / triton_ms:.2f}x",
            ]
        )
        print(table[-1], flush=True)
    name = "gpu_moe_check_small" if args.small else "gpu_moe_check"
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (interpreter)"
    write_results(
        name,
        f"Triton fused MoE on {where}, {e} experts top-{shape['top_k']}, "
        f"hidden {h}, intermediate {i}, {str(dtype).removeprefix('torch.')}; "
        "against kernels.moe.fused_experts on the same device. Command: `python -m "
        "bench.gpu_moe_check`.",
        ["tokens", "max |diff|", "Triton ms", "torch path ms", "speed-up"],
        table,
        rows,
    )


if __name__ == "__main__":
    main()
