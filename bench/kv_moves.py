"""Moving a request's KV to another engine group against recomputing it there.

    .venv/bin/python -m bench.kv_moves [--prompt-tokens 2048] [--rounds 3] [--dtype float32]

One disaggregated mesh (`pagemesh up --prefill-replicas 1 --decode-replicas 1`, the default
model SmolLM2-135M-Instruct, one CPU worker per group). Each round streams a new
`--prompt-tokens` prompt (random ids, so no prefix is cached anywhere) with 8 greedy
tokens: the prefill group computes the prompt and the first token (time to first token =
what recomputing that KV costs a group), then hands the request over; the decode group
pulls the KV and samples the second token. The gap between the first and second token is
the whole move (router hand-over, claim, every rank's pull, release) plus one decode step;
the gaps after it are plain decode steps, so the move alone is that gap less their median.

Target (issue 41): the move >= 20x faster than recomputing, in the same run.
Writes bench/results/kv_moves.{md,json}.

    .venv/bin/python -m bench.kv_moves --worker-kill [--prompt-tokens 2048] [--rounds 3]

A worker killed (-9) in the middle of a `--prompt-tokens` request's decode, on one group
(one CPU worker) with a host tier (`--host-tier-gib 1`) and, for the baseline, without:
the client's stall (the longest gap between two tokens), against the worker's restart time
(from the kill to the new worker's registry entry saying ready), and the tokens the group
recomputed. Target (issue 41): with the tier, stall <= restart time + 10%, nothing
recomputed. Writes bench/results/kv_moves_worker_kill.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import redis

from bench.common import write_results
from pagemesh.tools.mesh_process import Mesh, greedy_request

CLUSTER = "bench-kv-moves"


def stream_times(mesh: Mesh, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds from sending to each token's arrival."""
    request = greedy_request(prompt, max_tokens)
    request.stopping.ignore_eos = True
    started, times = time.perf_counter(), []
    for chunk in mesh.stub.Generate(request, timeout=600):
        times += [time.perf_counter() - started] * len(chunk.token_ids)
    return times


def decode_counters(redis_url: str) -> dict[str, int]:
    """The decode group's KV counters, as its registry entry publishes them."""
    time.sleep(2.5)  # a heartbeat publishes them
    client = redis.Redis.from_url(redis_url)
    try:
        found = [
            json.loads(client.get(key) or b"{}")
            for key in client.scan_iter(f"{CLUSTER}:scheduler:*")
        ]
    finally:
        client.close()
    decode = next(e for e in found if e.get("role") == "decode")
    return {
        k: decode.get(k, 0)
        for k in (
            "kv_imports_pulled",
            "kv_imports_failed",
            "kv_bytes_pulled",
            "kv_blocks_pulled",
            "num_recomputed_tokens",
        )
    }


def registry(redis_url: str, cluster: str, kind: str) -> list[dict]:
    client = redis.Redis.from_url(redis_url)
    try:
        return [
            json.loads(client.get(key) or b"{}") for key in client.scan_iter(f"{cluster}:{kind}:*")
        ]
    finally:
        client.close()


def kill_during_decode(
    mesh: Mesh, cluster: str, prompt: list[int], max_tokens: int
) -> dict[str, float]:
    """Streams the prompt, kills the group's worker 1 s into its decode; returns the stall
    the client saw, the worker's restart time, and the tokens recomputed."""
    import os
    import signal
    import threading

    [worker] = registry(mesh.redis_url, cluster, "worker")
    times: list[float] = []  # each token's arrival, as it arrives

    def stream() -> None:
        request = greedy_request(prompt, max_tokens)
        request.stopping.ignore_eos = True
        for chunk in mesh.stub.Generate(request, timeout=600):
            times.extend([time.perf_counter()] * len(chunk.token_ids))

    before = registry(mesh.redis_url, cluster, "scheduler")[0].get("num_recomputed_tokens", 0)
    done = threading.Thread(target=stream)
    done.start()
    while len(times) < 25:  # well into its decode
        time.sleep(0.01)
    killed_at = time.perf_counter()
    os.kill(worker["pid"], signal.SIGKILL)
    restarted_at = None
    while restarted_at is None:
        ready = [
            w
            for w in registry(mesh.redis_url, cluster, "worker")
            if w.get("pid") != worker["pid"] and w.get("status") == "ready"
        ]
        restarted_at = time.perf_counter() if ready else None
        time.sleep(0.02)
    done.join()
    gaps = [b - a for a, b in zip(times, times[1:]) if b > killed_at]
    time.sleep(2.5)  # a heartbeat publishes the counters
    entry = registry(mesh.redis_url, cluster, "scheduler")[0]
    return {
        "stall_s": max(gaps),
        "restart_s": restarted_at - killed_at,
        "recomputed_tokens": entry.get("num_recomputed_tokens", 0) - before,
        "tier_loads": entry.get("kv_tier_loads", 0),
    }


def worker_kill(args: argparse.Namespace) -> None:
    rows, data = [], {}
    for tier in (True, False):
        cluster = f"{CLUSTER}-kill-{'tier' if tier else 'none'}"
        mesh = Mesh(
            None,
            Path(tempfile.mkdtemp()) / f"{cluster}.log",
            cluster=cluster,
            extra_args=[
                "--dtype",
                args.dtype,
                "--http-port",
                "0",
                *(["--host-tier-gib", "1"] if tier else []),
            ],
        )
        try:
            mesh.wait_ready(600)
            stream_times(mesh, list(range(100, 164)), 4)
            rng = random.Random(1)
            runs = [
                kill_during_decode(
                    mesh,
                    cluster,
                    [rng.randrange(200, 48000) for _ in range(args.prompt_tokens)],
                    400,
                )
                for _ in range(args.rounds)
            ]
        finally:
            mesh.stop()
        name = "host tier" if tier else "no tier (recompute)"
        data[name] = runs
        for run in runs:
            rows.append(
                [
                    name,
                    f"{run['restart_s']:.2f}",
                    f"{run['stall_s']:.2f}",
                    f"{run['stall_s'] / run['restart_s']:.2f}",
                    str(run["recomputed_tokens"]),
                ]
            )
    header = (
        f"## A worker killed (-9) during a {args.prompt_tokens}-token request's decode, "
        f"with and without the host tier ({args.dtype})\n\n`python -m bench.kv_moves "
        f"--worker-kill --prompt-tokens {args.prompt_tokens}`: one group, one CPU "
        "worker, SmolLM2-135M-Instruct; `pagemesh up` restarts the worker. Restart = "
        "kill to the new worker ready; stall = the client's longest gap between two "
        "tokens; recomputed = tokens the group computed again."
    )
    write_results(
        f"{args.name}_worker_kill",
        header,
        ["tier", "restart s", "stall s", "stall / restart", "recomputed tokens"],
        rows,
        data,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--name", default="kv_moves")
    parser.add_argument("--worker-kill", action="store_true")
    args = parser.parse_args()
    if args.worker_kill:
        worker_kill(args)
        return
    mesh = Mesh(
        None,
        Path(tempfile.mkdtemp()) / "kv-moves.log",
        cluster=CLUSTER,
        extra_args=[
            "--prefill-replicas",
            "1",
            "--decode-replicas",
            "1",
            "--dtype",
            args.dtype,
            "--http-port",
            "0",
        ],
    )
    rows, data = [], []
    try:
        mesh.wait_ready(600)
        stream_times(mesh, list(range(100, 164)), 4)  # warm both groups
        rng = random.Random(0)
        before = decode_counters(mesh.redis_url)
        for round_ in range(args.rounds):
            prompt = [rng.randrange(200, 48000) for _ in range(args.prompt_tokens)]
            times = stream_times(mesh, prompt, 8)
            gaps = [b - a for a, b in zip(times, times[1:])]
            recompute_s, move_gap_s = times[0], gaps[0]
            decode_s = statistics.median(gaps[1:])
            move_s = max(move_gap_s - decode_s, 1e-6)
            data.append(
                {
                    "round": round_,
                    "recompute_s": recompute_s,
                    "move_gap_s": move_gap_s,
                    "decode_step_s": decode_s,
                    "move_s": move_s,
                }
            )
            rows.append(
                [
                    str(round_),
                    f"{recompute_s * 1000:.0f}",
                    f"{move_gap_s * 1000:.1f}",
                    f"{decode_s * 1000:.1f}",
                    f"{move_s * 1000:.1f}",
                    f"{recompute_s / move_gap_s:.1f}x",
                    f"{recompute_s / move_s:.1f}x",
                ]
            )
        after = decode_counters(mesh.redis_url)
    finally:
        mesh.stop()
    moved = {k: after[k] - before[k] for k in after}
    recompute = statistics.median(d["recompute_s"] for d in data)
    gap = statistics.median(d["move_gap_s"] for d in data)
    move = statistics.median(d["move_s"] for d in data)
    rows.append(
        [
            "median",
            f"{recompute * 1000:.0f}",
            f"{gap * 1000:.1f}",
            "",
            f"{move * 1000:.1f}",
            f"{recompute / gap:.1f}x",
            f"{recompute / move:.1f}x",
        ]
    )
    header = (
        f"## Moving a {args.prompt_tokens}-token request's KV to another group vs "
        f"recomputing it ({args.dtype})\n\n`python -m bench.kv_moves --prompt-tokens "
        f"{args.prompt_tokens} --dtype {args.dtype}`: a prefill group and a decode "
        "group, one CPU worker each, SmolLM2-135M-Instruct. Recompute = the prefill "
        "group's time to first token on a cold prompt; move gap = first to second "
        "token (hand-over, pull, one decode step); move = the gap less a decode step.\n\n"
        f"Decode group over the rounds: {moved['kv_imports_pulled']} imports pulled, "
        f"{moved['kv_imports_failed']} failed, {moved['kv_blocks_pulled']} blocks, "
        f"{moved['kv_bytes_pulled'] / 1e6:.1f} MB, {moved['num_recomputed_tokens']} "
        "tokens recomputed."
    )
    write_results(
        args.name,
        header,
        [
            "round",
            "recompute ms",
            "move gap ms",
            "decode step ms",
            "move ms",
            "recompute / gap",
            "recompute / move",
        ],
        rows,
        {
            "rounds": data,
            "moved": moved,
            "recompute_s": recompute,
            "move_gap_s": gap,
            "move_s": move,
        },
    )


if __name__ == "__main__":
    main()
