"""CPU per generated token of every thread of every service, for one run of the
control-plane workload (bench/control_plane.py: the near-zero-cost model, every stream at
once) through a fresh `pagemesh up`: where a change moved the cost, thread by thread.

    .venv/bin/python -m bench.mesh_threads [--streams 256] [--http] [-- extra pagemesh up flags]

Prints one line per thread that used more than 50 ms, and the client's own CPU per token.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import psutil

from bench.common import REPO_ROOT
from bench.control_plane import workload, write_zero_cost_model
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.loadgen import Target, run_workload
from pagemesh.tools.mesh_process import Mesh

SERVICES = ("router", "scheduler_svc", "worker_svc")


def thread_seconds(processes: list[psutil.Process]) -> dict[tuple[str, int], float]:
    """(service, thread id) -> user + system CPU seconds so far."""
    out = {}
    for process in processes:
        command = " ".join(process.cmdline())
        service = next((s for s in SERVICES if f"{s}.main" in command), None)
        if service is not None:
            for thread in process.threads():
                out[(service, thread.id)] = thread.user_time + thread.system_time
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--http", action="store_true", help="the OpenAI HTTP API, not gRPC")
    parser.add_argument("extra", nargs="*", help="more `pagemesh up` flags, after --")
    args = parser.parse_args()
    model = str(write_zero_cost_model(REPO_ROOT / ".cache" / "zero-cost-llama"))
    http_port = reserve_port()
    mesh = Mesh(
        model,
        Path(tempfile.mkdtemp()) / "mesh.log",
        cluster="mesh-threads",
        extra_args=[
            "--dtype",
            "float32",
            "--http-port",
            str(http_port),
            "--max-num-seqs",
            str(args.streams),
            "--max-queued-requests",
            str(max(1024, 2 * args.streams)),
            *args.extra,
        ],
    ).wait_ready()
    target = Target(http_url=f"http://127.0.0.1:{http_port}") if args.http else Target(mesh.address)
    try:
        run_workload(target, workload(8, 3), warmup=0)
        processes = psutil.Process(mesh.process.pid).children(recursive=True)
        before, client_before = thread_seconds(processes), psutil.Process().cpu_times()
        result = run_workload(target, workload(args.streams, 0), warmup=0, engine="mesh")
        after, client_after = thread_seconds(processes), psutil.Process().cpu_times()
    finally:
        mesh.stop()
    tokens = result.output_tokens
    print(
        f"{result.output_tok_s:,.0f} tok/s, {tokens} tokens, "
        f"{'HTTP' if args.http else 'gRPC'}, {args.streams} streams"
    )
    for (service, thread_id), seconds in sorted(after.items()):
        used = seconds - before.get((service, thread_id), 0.0)
        if used > 0.05:
            print(
                f"{service:14s} thread {thread_id:>8d} {1e6 * used / tokens:6.0f} µs CPU per token"
            )
    client = (client_after.user + client_after.system) - (client_before.user + client_before.system)
    print(f"client {1e6 * client / tokens:.0f} µs CPU per token")


if __name__ == "__main__":
    main()
