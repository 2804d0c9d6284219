"""Where a mesh's time goes: CPU seconds per process and the worker's forward time against
the scheduler's step time, for one W64 run through a fresh `pagemesh up`.

    .venv/bin/python -m bench.mesh_profile [--dtype bfloat16] [--model DIR --name STEM]
        [-- extra pagemesh up flags]

Per process (router, scheduler, worker, the client driving the load): CPU seconds spent
during the run. From the services' /metrics: the worker's summed forward time and the
scheduler's summed step time (the step as it waits for the worker); their difference per
step is the gRPC round trip and conversions. Writes bench/results/mesh_profile.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import urllib.request
from pathlib import Path

import psutil
import redis

from bench.common import REPO_ROOT, write_results, write_w64_model
from pagemesh.tools.loadgen import Target, build_workload, run_workload
from pagemesh.tools.mesh_process import Mesh

SERVICES = ("router.main", "scheduler_svc.main", "worker_svc.main")
METRICS = re.compile(r"pagemesh:(step_time_seconds|worker_forward_time_seconds)_(sum|count)\b")


def cpu_seconds(processes: list[psutil.Process]) -> dict[str, float]:
    """Service name (or "client" for this process) -> user + system CPU seconds so far."""
    out: dict[str, float] = {}
    for process in processes:
        try:
            command = " ".join(process.cmdline())
            times = process.cpu_times()
        except psutil.Error:
            continue
        name = next((s.split(".")[0] for s in SERVICES if s in command), None)
        if process.pid == psutil.Process().pid:
            name = "client"
        if name:
            out[name] = out.get(name, 0.0) + times.user + times.system
    return out


def scrape(redis_url: str, cluster: str) -> dict[str, float]:
    """The step-time and forward-time sums and counts from every service's /metrics."""
    client = redis.Redis.from_url(redis_url)
    figures: dict[str, float] = {}
    for key in client.scan_iter(f"{cluster}:*"):
        try:
            entry = json.loads(client.get(key) or b"{}")
        except (ValueError, redis.ResponseError):
            continue
        address = entry.get("metrics_address") if isinstance(entry, dict) else None
        if not address:
            continue
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            match = METRICS.match(line)
            if match:
                name = f"{match[1]}_{match[2]}"
                figures[name] = figures.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", help="a model folder (default: W64's model, written once)")
    parser.add_argument("--name", default="mesh_profile", help="results file stem")
    parser.add_argument("extra", nargs="*", help="more `pagemesh up` flags, after --")
    args = parser.parse_args()
    model = args.model or str(write_w64_model(REPO_ROOT / ".cache" / "w64-llama"))
    cluster = "mesh-profile"
    mesh = Mesh(
        model,
        Path(tempfile.mkdtemp()) / "mesh.log",
        cluster=cluster,
        extra_args=["--dtype", args.dtype, *args.extra],
    ).wait_ready()
    try:
        target = Target(mesh.address)
        run_workload(target, build_workload("w64", num_requests=4, max_tokens=8, seed=5))
        root = psutil.Process(mesh.process.pid)
        processes = [root, *root.children(recursive=True), psutil.Process()]
        before_cpu, before = cpu_seconds(processes), scrape(mesh.redis_url, cluster)
        result = run_workload(target, build_workload("w64"), warmup=0)
        after_cpu, after = cpu_seconds(processes), scrape(mesh.redis_url, cluster)
    finally:
        mesh.stop()
    used = {name: after_cpu[name] - before_cpu.get(name, 0.0) for name in after_cpu}
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    steps = delta.get("step_time_seconds_count", 0) or float("nan")
    forward_ms = 1000 * delta.get("worker_forward_time_seconds_sum", 0) / steps
    step_ms = 1000 * delta.get("step_time_seconds_sum", 0) / steps
    summary = result.summary()
    rows = [
        [f"output tok/s ({args.dtype})", f"{result.output_tok_s:,.0f}"],
        ["run wall time, s", f"{result.duration_s:.2f}"],
        ["ITL p50, ms", f"{summary['itl_ms']['p50']:.1f}"],
        ["steps", f"{steps:.0f}"],
        ["worker forward per step (mean, prefill included), ms", f"{forward_ms:.1f}"],
        ["scheduler step per step (waiting for the worker), ms", f"{step_ms:.1f}"],
    ]
    rows += [[f"CPU seconds: {name}", f"{seconds:.2f}"] for name, seconds in sorted(used.items())]
    write_results(
        args.name,
        f"Where a W64 run's time goes in the mesh, {Path(model).name} "
        "(`python -m bench.mesh_profile`)",
        ["figure", "value"],
        rows,
        {
            "tok_s": result.output_tok_s,
            "cpu_s": used,
            "metrics": delta,
            "forward_ms": forward_ms,
            "step_ms": step_ms,
        },
    )


if __name__ == "__main__":
    main()
