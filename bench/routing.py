"""Prefix-aware routing vs round robin on a multi-tenant workload, two replicas, one run.

8 tenants each have a 1,000-token system prompt; 32 requests (4 short user turns per tenant,
shuffled) arrive 8 at a time. Round robin makes every replica compute every tenant's system
prompt; prefix-aware sends a tenant to the replica that already holds it.

    .venv/bin/python -m bench.routing [--model PATH]

Writes bench/results/routing.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import REPO_ROOT, timed_stream, write_results, write_w64_model
from pagemesh.tools.mesh_process import Mesh
from protos.pagemesh.v1 import generate_pb2

NUM_TENANTS, SYSTEM_LEN, TURNS, TURN_LEN, MAX_TOKENS, CONCURRENCY = 8, 1000, 4, 16, 16, 8


def workload(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(1, vocab) for _ in range(SYSTEM_LEN)] for _ in range(NUM_TENANTS)]
    requests = [
        system + [rng.randrange(1, vocab) for _ in range(TURN_LEN)]
        for system in systems
        for _ in range(TURNS)
    ]
    rng.shuffle(requests)
    return requests


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(model: str, policy: str, prompts: list[list[int]]) -> dict:
    mesh = Mesh(
        model,
        Path(tempfile.mkdtemp()) / f"{policy}.log",
        cluster=f"bench-routing-{policy}",
        extra_args=["--replicas", "2", "--routing", policy, "--max-model-len", "2048"],
    )
    try:
        mesh.wait_ready()
        deadline = time.monotonic() + 120
        while mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).layout.num_replicas < 2:
            assert time.monotonic() < deadline, "second replica never joined"
            time.sleep(0.3)
        start = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda p: timed_stream(mesh, p, MAX_TOKENS), prompts))
        wall_s = time.perf_counter() - start
    finally:
        mesh.stop()
    ttfts = [1000 * r[0] for r in results]
    return {
        "policy": policy,
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "output_tok_s": sum(r[2] for r in results) / wall_s,
        "wall_s": wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model = args.model or str(write_w64_model(REPO_ROOT / ".cache" / "w64-llama"))
    prompts = workload(32000)
    rows = [run(model, policy, prompts) for policy in ("round_robin", "prefix_aware")]
    base = rows[0]
    write_results(
        "routing",
        f"{NUM_TENANTS} tenants x {SYSTEM_LEN}-token system prompt, {len(prompts)} requests "
        f"(+{TURN_LEN} user tokens, {MAX_TOKENS} new), {CONCURRENCY} at a time, 2 replicas; "
        f"model {Path(model).name}, fp32, 2-core CPU.",
        [
            "routing",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "output tok/s",
            "TTFT p50 vs round robin",
            "throughput vs round robin",
        ],
        [
            [
                r["policy"],
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_p99_ms']:.0f}",
                f"{r['output_tok_s']:.1f}",
                f"{r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x",
                f"{r['output_tok_s'] / base['output_tok_s']:.2f}x",
            ]
            for r in rows
        ],
        rows,
    )


if __name__ == "__main__":
    main()
