"""A mixture-of-experts model through the mesh under tensor parallelism and under expert
parallelism: output tokens/s and the bytes each step sends between the ranks.

    .venv/bin/python -m bench.moe_parallel [--num-requests 16] [--max-tokens 64] [--rounds 2]

The model is W64's as a Qwen3-MoE (`bench.common.write_w64_moe_model`: 8 layers, hidden
512, 8 experts of intermediate 704, top-2). Layouts: tp=1 (the baseline), tp=2 (every rank
a slice of every expert, one all-reduce per block) and tp=2 + ep (`--enable-expert-parallel`:
each rank 4 whole experts, two all-to-alls and the all-reduce per block). Each layout is a
fresh `pagemesh up`, driven over gRPC with `--num-requests` prompts of 128 ids at once, the
layouts alternated over `--rounds`. Bytes come from the workers' `tp_bytes_sent` counters in
their registry entries (worker_svc/distributed.py says what a collective counts), summed
over the ranks, per scheduler step of the run. Figures, not targets: two cores shared by
every rank. Writes bench/results/moe_parallel.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import redis

from bench.common import (
    REPO_ROOT,
    add_w64_workload_args,
    run_mesh,
    w64_workload,
    write_results,
    write_w64_moe_model,
)
from bench.parallel import worker_counters
from pagemesh.tools.mesh_process import Mesh, greedy_request

LAYOUTS = {
    "tp=1": ["--tp", "1"],
    "tp=2": ["--tp", "2"],
    "tp=2 + ep": ["--tp", "2", "--enable-expert-parallel"],
}


def measure(model: str, name: str, prompts: list[list[int]], max_tokens: int) -> dict:
    cluster = f"bench-moe-{name.replace(' ', '').replace('=', '').replace('+', '-')}"
    mesh = Mesh(
        model, Path(tempfile.mkdtemp()) / "mesh.log", cluster=cluster, extra_args=LAYOUTS[name]
    ).wait_ready()
    client = redis.Redis.from_url(mesh.redis_url)
    try:
        mesh.generate(greedy_request(prompts[0], 4))
        time.sleep(1.2)  # a heartbeat: counters after the warm-up
        before = worker_counters(client, cluster)
        row = run_mesh(mesh, prompts, max_tokens, len(prompts), engine=f"pagemesh {name}")
        time.sleep(1.2)
        after = worker_counters(client, cluster)
    finally:
        client.close()
        mesh.stop()
    steps = max(after[w]["num_steps"] - before[w]["num_steps"] for w in after)
    sent = sum(after[w].get("tp_bytes_sent", 0) - before[w].get("tp_bytes_sent", 0) for w in after)
    collective_s = max(
        after[w].get("tp_collective_time_s", 0) - before[w].get("tp_collective_time_s", 0)
        for w in after
    )
    return {
        "layout": name,
        "tok_s": row.output_tokens_per_s,
        "steps": steps,
        "bytes_per_step": sent / steps,
        "collective_ms_per_step": collective_s * 1e3 / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_w64_workload_args(parser)  # --model: default W64's model as a Qwen3-MoE
    parser.set_defaults(num_requests=16, max_tokens=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    args.model = args.model or str(write_w64_moe_model(REPO_ROOT / ".cache" / "w64-moe"))
    model, prompts = w64_workload(args)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for index in range(args.rounds):
        for name in LAYOUTS if index % 2 == 0 else reversed(list(LAYOUTS)):
            runs[name].append(measure(model, name, prompts, args.max_tokens))
            print(runs[name][-1], flush=True)
    rows = []
    for name, measured in runs.items():
        rows.append(
            {
                "layout": name,
                **{
                    key: statistics.median(m[key] for m in measured)
                    for key in ("tok_s", "steps", "bytes_per_step", "collective_ms_per_step")
                },
                "tok_s_vs_tp1": statistics.median(
                    m["tok_s"] / b["tok_s"] for m, b in zip(measured, runs["tp=1"])
                ),
            }
        )
    header = (
        f"W64's model as a Qwen3-MoE (8 experts of 704, top-2, fp32) through `pagemesh "
        f"up`: {args.num_requests} x {args.prompt_len} prompt ids x {args.max_tokens} new "
        f"tokens at once, over gRPC; medians of {args.rounds} alternated rounds. Bytes: sent "
        "between ranks in tensor-parallel collectives, all ranks, per step. Command: "
        "`python -m bench.moe_parallel`."
    )
    table = [
        [
            r["layout"],
            f"{r['tok_s']:.1f}",
            f"{r['tok_s_vs_tp1']:.2f}x",
            f"{r['bytes_per_step'] / 1024:,.0f}",
            f"{r['collective_ms_per_step']:.2f}",
            f"{r['steps']:.0f}",
        ]
        for r in rows
    ]
    write_results(
        "moe_parallel",
        header,
        [
            "layout",
            "output tok/s",
            "x tp=1",
            "KiB sent per step",
            "collective ms per step",
            "steps",
        ],
        table,
        rows,
    )


if __name__ == "__main__":
    main()
