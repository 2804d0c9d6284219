"""How much memory a worker gives its KV cache, and why: sized from the device, as vLLM does.

- An explicit budget (`--kv-cache-memory-gib`, or `--num-kv-blocks`) is used as given.
- CUDA: `gpu_memory_utilization` (default 0.9) of the device's total memory is this worker's,
  for weights, activations and KV. A profiling forward pass at the largest step the
  scheduler sends (`max_num_batched_tokens` tokens, the LM head over `max_num_seqs` rows)
  measures the peak activations; the KV cache gets what is left after the weights, that
  peak and whatever else already holds device memory (other processes, the CUDA context).
- CPU: `cpu_kv_cache_fraction` (default 0.4) of the memory actually available now —
  MemAvailable, or the cgroup's limit minus its usage when that is lower (a container) —
  shared by the workers of the host (`pagemesh up` divides the fraction among them). CPU
  caches are allocated lazily zeroed (anonymous pages the kernel zeroes on first write), so
  a large budget costs nothing until blocks are used.

The chosen size and the reason are logged, and reach clients in GetModelInfo
(`kv_cache_bytes`, `kv_cache_sizing`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_CPU_KV_CACHE_FRACTION = 0.4


@dataclass(frozen=True)
class KVBudget:
    bytes: int
    sizing: str  # how the size was chosen, in words, with the figures


def explicit_budget(num_bytes: int, flag: str = "--kv-cache-memory-gib") -> KVBudget:
    return KVBudget(num_bytes, f"{flag} {num_bytes / GIB:.2f} GiB, as given")


def available_cpu_memory(root: Path = Path("/")) -> tuple[int, str]:
    """Bytes of memory this process can still use, and where the figure came from."""
    available, source = _meminfo_available(root / "proc" / "meminfo"), "MemAvailable"
    cgroup = root / "sys" / "fs" / "cgroup"
    limit = _read_int(cgroup / "memory.max")
    usage = _read_int(cgroup / "memory.current")
    if limit is not None and usage is not None and limit - usage < available:
        available, source = max(0, limit - usage), "the cgroup's memory.max - memory.current"
    return available, source


def cpu_budget(fraction: float = DEFAULT_CPU_KV_CACHE_FRACTION, root: Path = Path("/")) -> KVBudget:
    if not 0 < fraction <= 1:
        raise ValueError(f"cpu_kv_cache_fraction must be in (0, 1], got {fraction}")
    available, source = available_cpu_memory(root)
    budget = int(available * fraction)
    return KVBudget(
        budget,
        f"cpu: {fraction:g} of {available / GIB:.2f} GiB available "
        f"({source}) = {budget / GIB:.2f} GiB",
    )


def cuda_budget(device: torch.device, utilization: float, profile) -> KVBudget:
    """`profile()` runs the profiling forward pass; its peak memory above the weights (torch's
    allocator stats) is the activations' share."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Memory held outside torch's allocator: the CUDA context, NCCL, other processes.
    others = total - free - torch.cuda.memory_reserved(device)
    budget = int(utilization * total) - weights - peak - others
    sizing = (
        f"cuda: {utilization:g} x {total / GIB:.2f} GiB - weights {weights / GIB:.2f} "
        f"- peak activations {peak / GIB:.2f} - other {others / GIB:.2f} = "
        f"{budget / GIB:.2f} GiB"
    )
    if budget <= 0:
        raise ValueError(
            f"no device memory left for the KV cache ({sizing}); raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, or free "
            "the device"
        )
    return KVBudget(budget, sizing)


def _meminfo_available(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{path} has no MemAvailable line")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" = no limit
