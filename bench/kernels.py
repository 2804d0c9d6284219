"""Paged decode attention on one CUDA GPU: achieved memory bandwidth, and time against
torch SDPA over K/V gathered out of the paged cache.

    .venv/bin/python -m bench.kernels                    # ~2-3 minutes on one H100/H200
    .venv/bin/python -m bench.kernels --peak-gbps 3350   # a device missing from PEAK_GBPS

Shape: a Llama-3-8B layer (32 query heads, 8 KV heads, head_dim 128), blocks of 16 tokens
handed out in shuffled order; every sequence of a batch has the same context. Decode is
memory bound, so the figure of merit is bytes read (K, V, query, output) / time, against
the device's peak HBM bandwidth. The baseline is `F.scaled_dot_product_attention` on
contiguous `[batch, kv_heads, context, head_dim]` K/V: "SDPA" times it alone (the best a
dense kernel does on the same bytes), "gather+SDPA" adds the copy out of the paged cache
(what a non-paged kernel would really pay). Times are medians of `triton.testing.do_bench`
(L2 flushed between runs). Writes bench/results/kernels.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pagemesh.tools.loadgen.machine import machine_markdown, machine_record  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
# Peak HBM bandwidth in GB/s (1e9 bytes/s) from the vendors' data sheets, matched as a
# substring of torch.cuda.get_device_name(); the first match wins, so specific names first.
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "H100": 3350.0,  # SXM
    "H20": 4000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,  # 40 GB
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "RTX 4090": 1008.0,
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Row:
    dtype: str
    batch: int
    context_tokens: int
    num_partitions: int  # split-K partitions per sequence (1 = one pass)
    triton_us: float
    triton_gbps: float
    triton_peak_pct: float
    sdpa_us: float
    sdpa_gbps: float
    gather_sdpa_us: float
    speedup_vs_gather_sdpa: float
    max_abs_err: float  # Triton output vs SDPA output


def peak_gbps(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    return next((gbps for name, gbps in PEAK_GBPS.items() if name in device_name), None)


def paged_inputs(batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype):
    """Random query, caches and shuffled block tables for `batch` sequences of `context`."""
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    query = torch.randn(batch, args.num_heads, args.head_dim, dtype=dtype, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return query, k_cache, v_cache, block_tables, seq_lens, query_start_loc


def gather(cache: torch.Tensor, block_tables: torch.Tensor, context: int) -> torch.Tensor:
    """Paged cache -> contiguous [batch, kv_heads, context, head_dim]."""
    batch = block_tables.shape[0]
    dense = cache[block_tables.long()].view(batch, -1, *cache.shape[2:])[:, :context]
    return dense.transpose(1, 2).contiguous()


def sdpa(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """query [batch, heads, head_dim] against dense k/v [batch, kv_heads, context, head_dim]."""
    out = F.scaled_dot_product_attention(query[:, :, None], k, v, scale=scale, enable_gqa=True)
    return out[:, :, 0]


def measure(
    batch: int, context: int, dtype_name: str, args: argparse.Namespace, peak: float | None
) -> Row:
    import triton.testing

    from kernels.attention import paged_attention_planned, plan_attention
    from kernels.paged_attention import choose_partition_size

    dtype = DTYPES[dtype_name]
    query, k_cache, v_cache, block_tables, seq_lens, starts = paged_inputs(
        batch, context, args, dtype
    )
    scale = args.head_dim**-0.5
    plan = plan_attention(
        seq_lens, starts, num_tokens=batch, block_tables=block_tables, block_size=args.block_size
    )

    def run_triton() -> torch.Tensor:
        return paged_attention_planned(
            query, k_cache, v_cache, block_tables, seq_lens, starts, scale, plan
        )

    k_dense = gather(k_cache, block_tables, context)
    v_dense = gather(v_cache, block_tables, context)
    max_abs_err = float(
        (run_triton().float() - sdpa(query, k_dense, v_dense, scale).float()).abs().max()
    )
    bench = lambda fn: triton.testing.do_bench(fn, return_mode="median")  # noqa: E731
    triton_ms = bench(run_triton)
    sdpa_ms = bench(lambda: sdpa(query, k_dense, v_dense, scale))
    gather_sdpa_ms = bench(
        lambda: sdpa(
            query,
            gather(k_cache, block_tables, context),
            gather(v_cache, block_tables, context),
            scale,
        )
    )
    element = query.element_size()
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * element
    total_bytes = kv_bytes + 2 * query.numel() * element  # + query read, output written
    partition_size = choose_partition_size(context, batch, args.num_kv_heads)
    gbps = lambda ms: total_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    return Row(
        dtype=dtype_name,
        batch=batch,
        context_tokens=context,
        num_partitions=1 if partition_size is None else -(-context // partition_size),
        triton_us=1e3 * triton_ms,
        triton_gbps=gbps(triton_ms),
        triton_peak_pct=float("nan") if peak is None else 100 * gbps(triton_ms) / peak,
        sdpa_us=1e3 * sdpa_ms,
        sdpa_gbps=gbps(sdpa_ms),
        gather_sdpa_us=1e3 * gather_sdpa_ms,
        speedup_vs_gather_sdpa=gather_sdpa_ms / triton_ms,
        max_abs_err=max_abs_err,
    )


def markdown(rows: list[Row], header: str) -> str:
    lines = [
        header,
        "",
        "| dtype | batch | context | partitions | Triton µs | Triton GB/s | % of peak "
        "| SDPA µs | SDPA GB/s | gather+SDPA µs | Triton vs gather+SDPA | max abs err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.dtype} | {r.batch} | {r.context_tokens} | {r.num_partitions} "
            f"| {r.triton_us:.1f} | {r.triton_gbps:.0f} | {r.triton_peak_pct:.0f}% "
            f"| {r.sdpa_us:.1f} | {r.sdpa_gbps:.0f} | {r.gather_sdpa_us:.1f} "
            f"| {r.speedup_vs_gather_sdpa:.2f}x | {r.max_abs_err:.1e} |"
        )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[512, 4096, 16384],
        help="context tokens per sequence",
    )
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--peak-gbps",
        type=float,
        default=None,
        help="the device's peak memory bandwidth in GB/s (default: PEAK_GBPS)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); "
            "the kernels' correctness tests run on CPU: pytest tests/kernels"
        )
    device_name = torch.cuda.get_device_name(0)
    peak = peak_gbps(device_name, args.peak_gbps)
    rows = []
    for dtype_name in args.dtypes:
        for batch in args.batches:
            for context in args.contexts:
                rows.append(measure(batch, context, dtype_name, args, peak))
                print(markdown(rows[-1:], "").splitlines()[-1], flush=True)
                torch.cuda.empty_cache()
    machine = machine_record()
    peak_text = "unknown (pass --peak-gbps)" if peak is None else f"{peak:.0f} GB/s"
    header = (
        f"Paged decode attention on {device_name} (peak {peak_text}): {args.num_heads} "
        f"heads / {args.num_kv_heads} KV heads x {args.head_dim}, blocks of "
        f"{args.block_size} tokens; medians of triton.testing.do_bench."
    )
    table = markdown(rows, f"{header}\n\n{machine_markdown(machine)}")
    print("\n" + table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kernels.md").write_text(table)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out_dir / "kernels.json").write_text(
        json.dumps(
            {
                "device": device_name,
                "machine": machine,
                "peak_gbps": peak,
                "config": config,
                "rows": [asdict(r) for r in rows],
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
