"""The Triton LoRA kernels (SGMV shrink + expand) on a GPU (run by bench/gpu_check.sh):
against the torch grouped path and the fp32 reference on the same device, at SmolLM2-135M's
and a 7B model's projection shapes, 8 rank-16 adapters (one row in nine on the base) for 1,
64 and 512 rows, bf16; the largest difference and the time of each (CUDA events, medians of
20), beside the base layer's own matmul, which LoRA rides on.

    .venv/bin/python -m bench.gpu_lora_check            # on a CUDA machine
    TRITON_INTERPRET=1 .venv/bin/python -m bench.gpu_lora_check --device cpu --small  # smoke

Writes bench/results/gpu_lora_check.{md,json} (`--small`: gpu_lora_check_small).
"""

from __future__ import annotations

import argparse

import torch

from bench.common import write_results
from bench.gpu_moe_check import timed_ms
from kernels.lora import lora_grouped_, lora_reference_

# (name, in, out): SmolLM2-135M's q|k|v and down; a 7B model's q|k|v and gate|up.
FULL = dict(
    shapes=[
        ("135M qkv", 576, 960),
        ("135M down", 1536, 576),
        ("7B qkv", 4096, 12288),
        ("7B gate_up", 4096, 22016),
    ],
    rows=(1, 64, 512),
    slots=8,
    rank=16,
)
SMALL = dict(shapes=[("tiny", 64, 96)], rows=(1, 9), slots=3, rank=4)


def slots_for(rows: int, num_slots: int, device: torch.device) -> torch.Tensor:
    """Rows spread over the adapters in turn, every ninth on the base (-1)."""
    slots = torch.arange(rows) % num_slots
    slots[torch.arange(rows) % 9 == 8] = -1
    return slots.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny shape, for a smoke run")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    from kernels.lora_triton import lora_triton_

    shape = SMALL if args.small else FULL
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    s, r = shape["slots"], shape["rank"]
    rows_out, table = [], []
    for name, in_f, out_f in shape["shapes"]:
        weight = (torch.randn(out_f, in_f, generator=g) * in_f**-0.5).to(device, dtype)
        lora_a = (torch.randn(s, r, in_f, generator=g) * in_f**-0.5).to(device, dtype)
        lora_bt = (torch.randn(s, r, out_f, generator=g) * 0.1).to(device, dtype)
        for n in shape["rows"]:
            x = torch.randn(n, in_f, generator=g).to(device, dtype)
            slots = slots_for(n, s, device)
            base = x @ weight.T
            ours, grouped, reference = base.clone(), base.clone(), base.clone()
            lora_triton_(ours, x, lora_a, lora_bt, slots)
            lora_grouped_(grouped, x, lora_a, lora_bt, slots)
            lora_reference_(reference, x, lora_a, lora_bt, slots)
            diff = float((ours.float() - reference.float()).abs().max())
            out = base.clone()
            triton_ms = timed_ms(
                lambda: lora_triton_(out, x, lora_a, lora_bt, slots), device, args.reps
            )
            grouped_ms = timed_ms(
                lambda: lora_grouped_(out, x, lora_a, lora_bt, slots), device, args.reps
            )
            base_ms = timed_ms(lambda: x @ weight.T, device, args.reps)
            rows_out.append(
                dict(
                    shape=name,
                    rows=n,
                    max_abs_diff=diff,
                    triton_ms=triton_ms,
                    grouped_ms=grouped_ms,
                    base_matmul_ms=base_ms,
                )
            )
            table.append(
                [
                    name,
                    str(n),
                    f"{diff:.2e}",
                    f"{triton_ms:.4f}",
                    f"{grouped_ms:.4f}",
                    f"{base_ms:.4f}",
                    f"{grouped_ms / triton_ms:.2f}x",
                    f"{triton_ms / base_ms:.2f}",
                ]
            )
            print(table[-1], flush=True)
    name = "gpu_lora_check_small" if args.small else "gpu_lora_check"
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (interpreter)"
    write_results(
        name,
        f"Triton LoRA (SGMV shrink + expand) on {where}, {s} adapters of "
        f"rank {r}, every ninth row on the base, {str(dtype).removeprefix('torch.')}; "
        "against kernels.lora.lora_grouped_ on the same device, and the base "
        "layer's matmul. Command: `python -m bench.gpu_lora_check`.",
        [
            "shape",
            "rows",
            "max |diff| vs fp32 reference",
            "Triton ms",
            "torch grouped ms",
            "base matmul ms",
            "speed-up",
            "LoRA / base",
        ],
        table,
        rows_out,
    )


if __name__ == "__main__":
    main()
