"""Hostile input by volume through a live mesh (issue 21).

    .venv/bin/python -m bench.fuzz                          # 10,000 requests, a mesh of its own
    .venv/bin/python -m bench.fuzz --num-requests 500 --seed 3
    .venv/bin/python -m bench.fuzz --only 4711,4712         # send those requests of the run again
    .venv/bin/python -m bench.fuzz --target 127.0.0.1:50051 --http-url http://127.0.0.1:8000 \\
        --redis-url redis://127.0.0.1:6379/0 --cluster pagemesh   # a mesh already running

Requests come from Hypothesis strategies drawn from (seed, index) (bench/fuzz/plan.py for
the kinds, strategies.py and malformed.py for what each sends): every GenerateRequest field
and the OpenAI completion and chat bodies, valid and not; malformed bytes (HTTP bodies, raw
HTTP, protobuf bytes, HTTP/2 garbage); messages past the size limit; slow clients; storms of
clients that leave mid-stream. Meanwhile a gRPC and an HTTP client send known greedy
requests. Every answer is classed (bench/fuzz/outcomes.py); afterwards every KV block must
be free, no service process may have died, and leaving mid-stream must free the request
(the disconnect audit). Writes bench/results/<name>.{md,json}; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

from bench.common import RESULTS
from bench.fuzz import mesh as mesh_checks
from bench.fuzz import report
from bench.fuzz.plan import KIND_WEIGHTS
from bench.fuzz.run import FuzzConfig, FuzzResult, fuzz


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=32, help="probes in flight")
    parser.add_argument(
        "--deadline-s", type=float, default=120.0, help="a probe not done by then is hung"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=60.0,
        help="how long the mesh may take to be quiet after the last request",
    )
    parser.add_argument("--only", default="", help="comma-separated request indices: just those")
    parser.add_argument(
        "--kinds",
        default="",
        help="kind=weight,... replacing the default mix: " + ", ".join(KIND_WEIGHTS),
    )
    parser.add_argument("--no-audit", action="store_true", help="skip the disconnect audit")
    parser.add_argument("--target", help="the router's gRPC address (default: start a mesh)")
    parser.add_argument("--http-url", help="with --target: the router's HTTP base URL")
    parser.add_argument("--redis-url", help="with --target: the cluster's Redis")
    parser.add_argument("--cluster", default="pagemesh", help="with --target: the cluster name")
    parser.add_argument(
        "--grpc-limit-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="with --target: the router's --max-message-bytes",
    )
    parser.add_argument(
        "--mesh-from",
        type=Path,
        help="run the mesh of this checkout (e.g. a `git worktree` of an older commit)",
    )
    parser.add_argument("--name", default="fuzz", help="results file name")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.target and not (args.http_url and args.redis_url):
        parser.error("--target needs --http-url and --redis-url")
    return args


def config_from(args: argparse.Namespace) -> FuzzConfig:
    weights = None
    if args.kinds:
        weights = {
            name: float(weight)
            for name, weight in (item.split("=") for item in args.kinds.split(","))
        }
    only = tuple(int(i) for i in args.only.split(",") if i.strip())
    return FuzzConfig(
        num_requests=args.num_requests,
        seed=args.seed,
        concurrency=args.concurrency,
        deadline_s=args.deadline_s,
        settle_s=args.settle_s,
        weights=weights,
        only=only,
        audit=not args.no_audit,
    )


def run(
    config: FuzzConfig,
    endpoints: mesh_checks.Endpoints | None = None,
    workdir: Path | None = None,
    mesh_from: Path | None = None,
) -> FuzzResult:
    """Fuzzes `endpoints`, or a mesh of its own (of checkout `mesh_from`, default this one)
    started under `workdir`."""
    if endpoints is not None:
        return asyncio.run(fuzz(endpoints, config))
    with mesh_checks.own_mesh(workdir or mesh_checks.default_workdir(), repo_root=mesh_from) as (
        own,
        mesh,
    ):
        result = asyncio.run(fuzz(own, config, mesh))
    if result.died:
        print(f"the mesh's log: {mesh.log_path}", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    endpoints = None
    if args.target:
        endpoints = mesh_checks.Endpoints(
            args.target,
            args.http_url.rstrip("/"),
            args.redis_url,
            args.cluster,
            args.grpc_limit_bytes,
        )
    result = run(config_from(args), endpoints, mesh_from=args.mesh_from)
    command = "python -m bench.fuzz " + shlex.join(argv if argv is not None else sys.argv[1:])
    report.write(result, args.results_dir, args.name, command.strip())
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
