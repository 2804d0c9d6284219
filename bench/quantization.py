"""Weight memory and W64 throughput of quantized weights on this CPU: fp32, bf16, FP8 and AWQ.

    .venv/bin/python -m bench.quantization [--quant-dtype float32] [--warmup 4]

The model is PEERS.md's W64 random Llama (`bench/common.py`), written on first use; its FP8
and AWQ checkpoints are written from it by `pagemesh/tools/testing/quant_checkpoints.py` into
.cache/ (FP8
in llm-compressor's layout, per-channel scales; AWQ 4-bit, group size 128, AutoAWQ's gemm
layout), so both rows load a quantized checkpoint (`--quantization auto`), not the plain
model quantized at load. Each row runs in a fresh `pagemesh up` (tp=1), driven by
`pagemesh bench`'s W64 workload (64 requests x 128 prompt ids x 128 new tokens, all at
once); weight bytes are what GetModelInfo reports (the worker's weights as it holds them).
The quantized rows compute in `--quant-dtype` (default float32: the CPU path dequantizes
to it). Figures of one run on a shared machine, not targets.
Writes bench/results/quantization.{md,json}.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import REPO_ROOT, write_results, write_w64_model
from kernels.cpu_features import cpu_features
from pagemesh.tools.loadgen import Target, build_workload, run_workload
from pagemesh.tools.mesh_process import Mesh
from protos.pagemesh.v1 import generate_pb2

MIB = 1 << 20
AWQ_GROUP_SIZE = 128


def checkpoints() -> dict[str, Path]:
    """The plain W64 model and its FP8 and AWQ checkpoints (each written once)."""
    from pagemesh.tools.testing.quant_checkpoints import write_awq_checkpoint, write_fp8_checkpoint

    cache = REPO_ROOT / ".cache"
    plain = write_w64_model(cache / "w64-llama")
    fp8, awq = cache / "w64-llama-fp8", cache / "w64-llama-awq"
    if not (fp8 / "config.json").exists():
        write_fp8_checkpoint(plain, fp8, per_channel=True)
    if not (awq / "config.json").exists():
        write_awq_checkpoint(plain, awq, group_size=AWQ_GROUP_SIZE)
    return {"plain": plain, "fp8": fp8, "awq": awq}


def configs(quant_dtype: str) -> list[tuple[str, str, str, str]]:
    """(row, checkpoint, --dtype, --quantization)."""
    return [
        ("fp32", "plain", "float32", "none"),
        ("bf16", "plain", "bfloat16", "none"),
        ("fp8", "fp8", quant_dtype, "auto"),
        ("awq", "awq", quant_dtype, "auto"),
    ]


def measure(model: Path, dtype: str, quantization: str, warmup: int) -> dict:
    log = Path(tempfile.mkdtemp()) / "mesh.log"
    mesh = Mesh(
        str(model),
        log,
        cluster="bench-quant",
        extra_args=["--dtype", dtype, "--quantization", quantization],
    ).wait_ready()
    try:
        info = mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
        result = run_workload(Target(mesh.address), build_workload("w64"), warmup=warmup)
    finally:
        mesh.stop()
    summary = result.summary()
    return {
        "dtype": info.dtype,
        "quantization": info.quantization,
        "weight_bytes": info.weight_bytes,
        "output_tok_s": result.output_tok_s,
        "duration_s": result.duration_s,
        "itl_p50_ms": summary["itl_ms"]["p50"],
        "num_errors": result.num_errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quant-dtype", default="float32", help="activation dtype of the FP8 and AWQ rows"
    )
    parser.add_argument("--warmup", type=int, default=4, help="requests before the timed run")
    args = parser.parse_args()
    paths = checkpoints()
    rows = {}
    skipped = {}
    for name, checkpoint, dtype, quantization in configs(args.quant_dtype):
        slow = cpu_features().why_bf16_is_slow() if dtype == "bfloat16" else None
        if slow:  # W64 through the mesh would take many minutes at the emulated rate
            skipped[name] = slow
            print(f"{name}: skipped: {slow}", flush=True)
            continue
        rows[name] = measure(paths[checkpoint], dtype, quantization, args.warmup)
        print(f"{name}: {rows[name]}", flush=True)
    base = rows["fp32"]
    table = [
        [
            name,
            row["dtype"],
            row["quantization"],
            f"{row['weight_bytes'] / MIB:.1f}",
            f"{row['weight_bytes'] / base['weight_bytes']:.2f}x",
            f"{row['output_tok_s']:,.0f}",
            f"{row['output_tok_s'] / base['output_tok_s']:.2f}x",
            f"{row['itl_p50_ms']:.1f}",
            str(row["num_errors"]),
        ]
        for name, row in rows.items()
    ]
    table += [
        [name, "bfloat16", "none", "—", "—", "—", "—", "—", f"skipped: {reason}"]
        for name, reason in skipped.items()
    ]
    header = (
        "Quantized weights on this CPU: W64 (64 x 128 prompt x 128 new tokens) through "
        "a fresh `pagemesh up` per row (`python -m bench.quantization`); weight MiB "
        "from GetModelInfo"
    )
    write_results(
        "quantization",
        header,
        [
            "row",
            "compute dtype",
            "quantization",
            "weight MiB",
            "weights vs fp32",
            "output tok/s",
            "tok/s vs fp32",
            "ITL p50 ms",
            "errors",
        ],
        table,
        {
            "quant_dtype": args.quant_dtype,
            "awq_group_size": AWQ_GROUP_SIZE,
            "rows": rows,
            "skipped": skipped,
        },
    )


if __name__ == "__main__":
    main()
