"""`pagemesh bench`: load a running router with a named workload and write a report.

    pagemesh bench --workload w64 --concurrency 1,4,16,64
    pagemesh bench --http http://127.0.0.1:8000 --workload sharegpt-like --request-rate 2
    python -m pagemesh.tools.loadgen ...        # the same, without the `pagemesh` command

Prints the Markdown table and writes <output-dir>/<name>.{md,json} and PNG plots.
Every level re-sends the same prompts: with prefix caching on, later levels (and later
runs against the same mesh) find them cached. bench/README.md says more.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from pagemesh.runtime.config import add_flag, add_tls_flags, tls_config
from pagemesh.tools.loadgen.client import DEFAULT_ADDRESS, RequestError, Target
from pagemesh.tools.loadgen.report import load_results, write_report
from pagemesh.tools.loadgen.runner import Level, fetch_model_info, run_sweep
from pagemesh.tools.loadgen.workloads import DEFAULT_VOCAB_SIZE, WORKLOADS, Workload, build_workload

# Relative, so reports land where the user runs the command, never inside the installed package.
DEFAULT_OUTPUT_DIR = Path(".")


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected integers >= 0 separated by commas, got {text!r}"
        )
    return values


def _float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers >= 0 separated by commas, got {text!r}")
    return values


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagemesh bench` (each also read from `PAGEMESH_<FLAG>`)."""
    add_flag(parser, "--address", default=DEFAULT_ADDRESS, help="router gRPC host:port")
    add_flag(
        parser,
        "--http",
        default=None,
        help="OpenAI-compatible base URL (e.g. http://127.0.0.1:8000): load "
        "/v1/completions over HTTP instead of gRPC",
    )
    add_flag(parser, "--workload", default="w64", choices=sorted(WORKLOADS), help="named workload")
    add_flag(
        parser,
        "--concurrency",
        type=_int_list,
        default=[0],
        help="requests in flight at most; a comma list sweeps (1,4,16); 0 = all at once "
        "(with --request-rate: no cap)",
    )
    add_flag(
        parser,
        "--request-rate",
        type=_float_list,
        default=[0.0],
        help="open loop: Poisson arrivals per second (a comma list sweeps); 0 = closed loop",
    )
    add_flag(
        parser,
        "--num-requests",
        type=int,
        default=None,
        help="requests per level; unset = the workload's",
    )
    add_flag(
        parser,
        "--prompt-len",
        type=int,
        default=None,
        help="prompt tokens (w64), median prompt tokens (sharegpt-like) or system prefix "
        "tokens (shared-prefix)",
    )
    add_flag(
        parser,
        "--max-tokens",
        type=int,
        default=None,
        help="tokens to generate per request (sharegpt-like: the median)",
    )
    add_flag(parser, "--num-tenants", type=int, default=None, help="shared-prefix: tenants")
    add_flag(
        parser,
        "--vocab-size",
        type=int,
        default=None,
        help=f"prompt ids are < this; unset = the router's over gRPC, else {DEFAULT_VOCAB_SIZE}",
    )
    add_flag(parser, "--seed", type=int, default=0, help="seed of the prompts and arrivals")
    add_flag(parser, "--warmup", type=int, default=2, help="unmeasured requests sent first")
    add_flag(
        parser,
        "--timeout-s",
        type=float,
        default=0.0,
        help="per-request deadline in seconds; 0 = none",
    )
    add_flag(
        parser,
        "--engine",
        default=None,
        help="label of these runs; unset = pagemesh gRPC / pagemesh HTTP",
    )
    add_flag(
        parser,
        "--baseline",
        default=None,
        help="engine label the ratio column compares with; unset = the first row",
    )
    add_flag(
        parser,
        "--include",
        action="append",
        default=None,
        help="earlier results JSON whose runs join the report (repeatable)",
    )
    add_flag(
        parser,
        "--output-dir",
        default=str(DEFAULT_OUTPUT_DIR),
        help="where reports go (default: the current directory)",
    )
    add_flag(
        parser,
        "--name",
        default=None,
        help="file stem of the reports; unset = <workload>-<grpc|http>",
    )
    add_flag(
        parser, "--title", default=None, help="report title; unset = pagemesh bench: <workload>"
    )
    add_flag(
        parser,
        "--progress",
        type=bool,
        default=True,
        help="progress bar (only when stdout is a terminal)",
    )
    add_flag(parser, "--api-key", default=None, help="sent as `authorization: Bearer <key>`")
    add_tls_flags(parser)  # --tls-ca: dial TLS / verify HTTPS; --tls-cert/--tls-key: client cert


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `bench` on the `pagemesh` command's subparsers."""
    bench = sub.add_parser(
        "bench",
        help="load a running router with a benchmark workload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)


def _workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    return build_workload(
        args.workload,
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        vocab_size=vocab_size,
        seed=args.seed,
        num_tenants=args.num_tenants,
    )


def run_bench(args: argparse.Namespace) -> int:
    """Runs every level, prints the table, writes the report. Exit status 2 when the target
    cannot be asked about its model, 1 when a level had no successful request."""
    target = Target(
        address=args.address, http_url=args.http, tls=tls_config(args), api_key=args.api_key
    )
    try:
        info = fetch_model_info(target)
    except RequestError as exc:  # unreachable, wrong key or certificate: nothing to measure
        print(f"error: {target.describe()}: {exc}", file=sys.stderr)
        return 2
    vocab_size = args.vocab_size or info.vocab_size or DEFAULT_VOCAB_SIZE
    if not (args.vocab_size or info.vocab_size):
        print(
            f"note: {target.describe()} does not say its vocabulary size; prompt ids are drawn "
            f"below {vocab_size} (set --vocab-size)",
            file=sys.stderr,
        )
    workload = _workload(args, vocab_size)
    too_long = [
        r
        for r in workload.requests
        if info.max_model_len and len(r.prompt_token_ids) + r.max_tokens > info.max_model_len
    ]
    if too_long:
        print(
            f"warning: {len(too_long)} requests exceed the model's {info.max_model_len} tokens "
            "of context; they will fail",
            file=sys.stderr,
        )
    levels = [Level(c, r) for r, c in itertools.product(args.request_rate, args.concurrency)]
    results = run_sweep(
        target,
        workload,
        levels,
        arrival_seed=args.seed,
        warmup=args.warmup,
        progress=args.progress and sys.stdout.isatty(),
        engine=args.engine,
        timeout_s=args.timeout_s or None,
    )
    included = [run for path in args.include or [] for run in load_results(path)]
    name = args.name or f"{workload.name}-{target.protocol}"
    header = [
        f"- target: {target.describe()}, model {info.name or '?'}"
        f"{f' ({info.dtype})' if info.dtype else ''}, prompt ids < {vocab_size}",
        f"- workload {workload.name}: {workload.description}",
        f"- greedy, EOS ignored; {args.warmup} warm-up requests; "
        f"levels: {', '.join(level.describe() for level in levels)}",
    ]
    markdown = write_report(
        [*included, *results],
        args.output_dir,
        name,
        args.title or f"pagemesh bench: {workload.name}",
        args.baseline,
        header,
    )
    print(markdown)
    print(f"wrote {Path(args.output_dir) / name}.{{md,json}} and plots", file=sys.stderr)
    return 1 if any(r.num_requests == 0 for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagemesh.tools.loadgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))
