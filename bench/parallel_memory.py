"""Peak resident memory per rank after loading a model, tp=1 vs tp=2, pp=2 and tp=2 x pp=2.

Each rank reads only its shard (`worker_svc/loader.py`), so its peak should fall with the
number of ranks sharing the weights; what does not shrink is the process itself (Python,
torch: the "before load" column) and the replicated norms.

    .venv/bin/python -m bench.parallel_memory [--model PATH] [--dtype float32]

The default model is PEERS.md's W64 random Llama (56M parameters, 214 MiB in fp32),
written on first use. Every layout runs in fresh spawned processes (gloo on 127.0.0.1),
with a 16-block KV cache so that the weights dominate. Peak = VmHWM from /proc, which
also counts the checkpoint pages a rank touched through safetensors' memory map (page
cache: shared between ranks on a host, unmapped once loading ends); "private" is the
growth of RssAnon, the memory the rank keeps.
Writes bench/results/parallel_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from bench.common import REPO_ROOT, write_results, write_w64_model
from worker_svc.loader import rank_weight_shapes
from worker_svc.local_group import LocalWorkerGroup
from worker_svc.parallel import ParallelConfig
from worker_svc.runner_config import RunnerConfig

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp_size, pp_size)
MIB = 1 << 20


def measure(model: Path, dtype: str, tp_size: int, pp_size: int) -> list[dict]:
    """One row per rank: the weights it holds and its memory before and after loading."""
    config = RunnerConfig(model_path=str(model), dtype=dtype, num_blocks=16)
    element_bytes = 2 if dtype in ("bfloat16", "float16") else 4
    rows = []
    with LocalWorkerGroup(tp_size, pp_size, num_threads=1) as group:
        group.load(config)
        for rank, memory in enumerate(group.call_ok("memory")):
            parallel = ParallelConfig(tp_size, rank % tp_size, pp_size, rank // tp_size)
            shapes = rank_weight_shapes(model, parallel)
            rows.append(
                {
                    "tp_size": tp_size,
                    "pp_size": pp_size,
                    "rank": rank,
                    "weights_mib": sum(math.prod(s) for s in shapes.values()) * element_bytes / MIB,
                    "before_load_mib": memory["before_load"]["VmRSS"] / 1024,
                    "peak_mib": memory["now"]["VmHWM"] / 1024,
                    "private_growth_mib": (
                        memory["now"]["RssAnon"] - memory["before_load"]["RssAnon"]
                    )
                    / 1024,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model = args.model or write_w64_model(REPO_ROOT / ".cache" / "w64-llama")
    rows = [row for tp, pp in LAYOUTS for row in measure(model, args.dtype, tp, pp)]
    base = rows[0]
    base_growth = base["peak_mib"] - base["before_load_mib"]
    table = []
    for row in rows:
        growth = row["peak_mib"] - row["before_load_mib"]
        row["load_growth_mib"] = growth
        row["peak_vs_tp1"] = row["peak_mib"] / base["peak_mib"]
        row["growth_vs_tp1"] = growth / base_growth
        table.append(
            [
                f"tp={row['tp_size']} pp={row['pp_size']}",
                str(row["rank"]),
                f"{row['weights_mib']:.1f}",
                f"{row['before_load_mib']:.0f}",
                f"{row['peak_mib']:.0f}",
                f"{row['peak_vs_tp1']:.2f}x",
                f"{growth:.0f}",
                f"{row['growth_vs_tp1']:.2f}x",
                f"{row['private_growth_mib']:.0f}",
                f"{row['private_growth_mib'] / base['private_growth_mib']:.2f}x",
            ]
        )
    mean_growth = {
        f"tp={tp} pp={pp}": statistics.mean(
            r["growth_vs_tp1"] for r in rows if (r["tp_size"], r["pp_size"]) == (tp, pp)
        )
        for tp, pp in LAYOUTS
    }
    header = (
        f"Peak RSS per rank after loading {model.name} ({args.dtype}); growth = peak - "
        "RSS before loading (Python + torch)\n\nmean growth vs tp=1: "
        + ", ".join(f"{k} {v:.2f}x" for k, v in mean_growth.items())
    )
    write_results(
        "parallel_memory",
        header,
        [
            "layout",
            "rank",
            "weights held MiB",
            "before load MiB",
            "peak MiB",
            "peak vs tp=1",
            "load growth MiB",
            "growth vs tp=1",
            "private growth MiB",
            "private vs tp=1",
        ],
        table,
        {"model": str(model), "dtype": args.dtype, "ranks": rows},
    )


if __name__ == "__main__":
    main()
