"""The machine's measured matmul peak, so a tok/s figure can be read as a fraction of what the
cores can do (shared/PEERS.md: on these 2-core AMD machines `torch.mm` fp32 takes MKL's AVX2
path at ~220 GFLOP/s while oneDNN, what vLLM's CPU backend calls, reaches ~495).

Two shapes per implementation and dtype: 2048^3 (the compute roof) and M=64, K=512, N=2816,
the W64 decode step's widest matmul (64 sequences, hidden 512, gate+up of intermediate 1408),
which is what a decode step actually feeds the cores. oneDNN is reached through
`torch.ops.mkldnn._linear_pointwise` with the weight packed once by `_reorder_linear_weight`,
as torch's own CPU inference path (and vLLM) pack it. Runs in the project venv, ~10 s.

What the CPU cannot do is reported, not attempted (`kernels/cpu_features.py`): oneDNN bf16
only where this torch build runs it (it raises on an AVX2-only CPU), and bf16 at the square
shape only where the CPU has native bf16 (AVX512_BF16 or AMX): emulated, one 2048^3 call takes
~17 s on an AVX2 Zen 3 (about 1 GFLOP/s), so only the decode shape shows the emulated rate.
Skipped cases carry `gflop_s: None` and a `skipped` reason naming the missing instruction set.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kernels.cpu_features import CpuFeatures, cpu_features, machine_line

SHAPES = {"square": (2048, 2048, 2048), "decode": (64, 512, 2816)}  # (M, K, N)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _gflop_s(fn, flop: float, budget_s: float) -> float:
    """Best rate over a few timed windows of repeated calls; one call first as warm-up (it
    creates oneDNN primitives). The best window, not the mean, because other processes share
    the two cores and only ever make a window slower."""
    fn()
    start = time.perf_counter()
    fn()
    one_s = max(time.perf_counter() - start, 1e-6)
    reps = max(1, int(budget_s / 4 / one_s))
    best_s = float("inf")
    for _ in range(4):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best_s = min(best_s, (time.perf_counter() - start) / reps)
    return flop / best_s / 1e9


def skip_reason(impl: str, dtype: str, m: int, features: CpuFeatures) -> str | None:
    """Why this case is not measured on this machine, or None when it is."""
    if dtype != "bfloat16":
        return None
    if impl == "oneDNN" and not features.onednn_bf16_linear:
        return (
            "oneDNN bf16 linear is not supported here (it needs avx512bw+avx512vl+avx512dq "
            f"or avx_ne_convert; this CPU: {features.isa_summary})"
        )
    if m == SHAPES["square"][0] and not features.native_bf16:
        return (
            f"{features.why_bf16_is_slow()}; one 2048^3 call takes seconds, the decode "
            "shape shows the emulated rate"
        )
    return None


def _case(
    impl: str, dtype: str, m: int, k: int, n: int, budget_s: float, features: CpuFeatures
) -> dict:
    reason = skip_reason(impl, dtype, m, features)
    if reason is not None:
        return {
            "impl": impl,
            "dtype": dtype,
            "m": m,
            "k": k,
            "n": n,
            "gflop_s": None,
            "skipped": reason,
        }
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(torch_dtype)
    w = torch.randn(n, k, generator=gen).to(torch_dtype)  # nn.Linear layout: (out, in)
    if impl == "torch.mm":
        wt = w.t().contiguous()

        def fn() -> torch.Tensor:
            return torch.mm(x, wt)
    elif impl == "oneDNN":
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)

        def fn() -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    else:
        raise ValueError(f"unknown impl {impl!r}")
    with torch.inference_mode():
        rate = _gflop_s(fn, 2.0 * m * k * n, budget_s)
    return {"impl": impl, "dtype": dtype, "m": m, "k": k, "n": n, "gflop_s": rate}


def measure_peak(num_threads: int = 2, budget_s: float = 1.0) -> dict:
    """{"num_threads", "unit": "GFLOP/s", "machine", "cases": [{impl, dtype, m, k, n,
    gflop_s}]} for torch.mm and oneDNN, fp32 and bf16, both SHAPES; about 8 * budget_s
    seconds. A case this CPU cannot run has gflop_s None and a `skipped` reason. The
    caller's torch thread count is restored afterwards."""
    features = cpu_features()
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        cases = [
            _case(impl, dtype, *shape, budget_s, features)
            for dtype in DTYPES
            for shape in SHAPES.values()
            for impl in ("torch.mm", "oneDNN")
        ]
    finally:
        torch.set_num_threads(previous)
    return {
        "num_threads": num_threads,
        "unit": "GFLOP/s",
        "machine": features.describe(),
        "cases": cases,
    }


def format_peak(peak: dict) -> str:
    """A Markdown table of `measure_peak`'s result."""
    machine = peak.get("machine")
    where = f" on {machine_line(machine)}" if machine else ""
    lines = [
        f"Matmul peak, {peak['num_threads']} threads ({peak['unit']}){where}",
        "",
        "| impl | dtype | M×K×N | GFLOP/s |",
        "|---|---|---|---|",
    ]
    for c in peak["cases"]:
        rate = "—" if c["gflop_s"] is None else f"{c['gflop_s']:,.0f}"
        lines.append(f"| {c['impl']} | {c['dtype']} | {c['m']}×{c['k']}×{c['n']} | {rate} |")
    skipped = [c for c in peak["cases"] if c["gflop_s"] is None]
    if skipped:
        lines += [
            "",
            *(
                f"- {c['impl']} {c['dtype']} {c['m']}×{c['k']}×{c['n']}: {c['skipped']}"
                for c in skipped
            ),
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="measured matmul peak of this machine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=1.0, help="seconds per case")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    peak = measure_peak(args.threads, args.budget_s)
    print(json.dumps(peak, indent=2) if args.json else format_peak(peak))


if __name__ == "__main__":
    main()
