"""The machine line every benchmark result carries beside its figures.

Figures from an AVX2-only CPU and an AVX-512 + AVX512_BF16 one differ by more than any change
being measured (bf16 is emulated on the first, far slower than fp32), so every result file
records the CPU model, its relevant ISA flags and the torch version
(`kernels/cpu_features.py`), and every Markdown table starts from the same line.
"""

from __future__ import annotations

import time

# torch is imported only when a record is made: `pagemesh` (whose `bench` command writes
# reports) must start without it, `pagemesh health` is a liveness probe.


def machine_record() -> dict:
    """The CPU (model, arch, ISA flags, torch build), torch's thread count and the date."""
    import torch

    from kernels.cpu_features import cpu_features

    return {
        **cpu_features().describe(),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }


def machine_markdown(record: dict | None = None) -> str:
    """ "Machine: AMD EPYC (family 25, model 1), x86_64 [avx2 -avx512f -avx512_bf16 -amx],
    torch 2.13.0+cpu, 2 torch threads; 2026-12-01." for `record` (default: this machine)."""
    from kernels.cpu_features import machine_line

    record = record or machine_record()
    return (
        f"Machine: {machine_line(record)}, {record['torch_threads']} torch threads; "
        f"{record['date']}."
    )
