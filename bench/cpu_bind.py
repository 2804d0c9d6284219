"""`pagemesh up --cpu-bind` and `--omp-wait`: the mesh with its CPU workers unbound, bound
beside a reserved control-plane core, or bound over every core, their idle OpenMP threads
spinning (the runtime's default) or sleeping at once, alternated, on the same prompts.

    .venv/bin/python -m bench.cpu_bind [--rounds 2] [--variants none/spin,none/passive,...]

A variant is `BIND/WAIT` (`--cpu-bind BIND --omp-wait WAIT`; WAIT omitted: spin; WAIT a
number: that spin count); the first is the baseline of the ratios.

SmolLM2-135M-Instruct fp32 (`.cache/smollm2-hf`, as bench.step_profile writes it). Each
round starts `pagemesh up --cpu-bind MODE` once per mode (the odd rounds in reverse order)
and drives it over gRPC with W64 (64 requests x 128 prompt ids x 128 new tokens, all at
once) and then batch 1 (4 of those prompts' shape, one at a time: TTFT and ITL of a lone
request). On a 2-core host `reserve` leaves the worker one core (one OpenMP thread) and
gives the other to the router, the scheduler and Valkey; `pin` binds the worker's two
threads one per core with the control plane unbound; `none` is the default there.
Writes bench/results/cpu_bind.{md,json} (`--name` another stem): medians over the rounds,
and the medians of the per-round ratios to the first variant.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import REPO_ROOT, write_results
from bench.versus_vllm import BATCH1, W64, workloads
from pagemesh.tools.loadgen import Target, run_workload
from pagemesh.tools.loadgen.result import RunResult
from pagemesh.tools.mesh_process import Mesh


def up_flags(variant: str) -> list[str]:
    bind, _, wait = variant.partition("/")
    return ["--cpu-bind", bind, "--omp-wait", wait or "spin"]


def run_mode(model: str, mode: str, args: argparse.Namespace) -> dict[str, RunResult]:
    log = Path(tempfile.mkdtemp()) / "mesh.log"
    mesh = Mesh(
        model, log, cluster=f"cpu-bind-{mode.replace('/', '-')}", extra_args=up_flags(mode)
    ).wait_ready()
    try:
        target = Target(mesh.address)
        w64, batch1 = workloads(args, 0)
        return {
            W64: run_workload(target, w64, warmup=2),
            BATCH1: run_workload(target, batch1, concurrency=1, warmup=1),
        }
    finally:
        mesh.stop()


def _p50(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def figures(rounds: list[dict[str, dict[str, RunResult]]], modes: list[str]) -> list[dict]:
    rows = []
    for mode in modes:

        def ratios(value, runs=rounds, mode=mode):
            return statistics.median(value(r[mode]) / value(r[modes[0]]) for r in runs)

        def median(value, runs=rounds, mode=mode):
            return statistics.median(value(r[mode]) for r in runs)

        def w64_tok_s(run):
            return run[W64].output_tok_s

        def itl(run):
            return _p50(run[BATCH1].itl_ms)

        def ttft(run):
            return _p50(run[BATCH1].ttft_ms)

        rows.append(
            {
                "variant": mode,
                "w64_tok_s": median(w64_tok_s),
                "itl_p50_ms": median(itl),
                "ttft_p50_ms": median(ttft),
                "w64_vs_first": ratios(w64_tok_s),
                "itl_vs_first": ratios(itl),
                "ttft_vs_first": ratios(ttft),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO_ROOT / ".cache" / "smollm2-hf"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="none/spin,none/passive,pin/spin,pin/passive,reserve")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch1-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--name", default="cpu_bind", help="results file stem")
    args = parser.parse_args()
    modes = list(dict.fromkeys(args.variants.split(",")))
    model = str(Path(args.model).resolve())
    rounds = []
    for round_ in range(args.rounds):
        order = modes if round_ % 2 == 0 else modes[::-1]
        rounds.append({mode: run_mode(model, mode, args) for mode in order})
        print(
            f"round {round_}:",
            {m: round(r[W64].output_tok_s, 1) for m, r in rounds[-1].items()},
            flush=True,
        )
    rows = figures(rounds, modes)
    header = (
        f"pagemesh up --cpu-bind BIND --omp-wait WAIT, SmolLM2-135M-Instruct fp32 over "
        f"gRPC; {args.rounds} alternating rounds, medians; ratios: medians of per-round "
        f"ratios to {modes[0]} (tok/s: above 1 is faster; ITL, TTFT: below 1 is faster). "
        f"W64: {args.num_requests} x 128 prompt ids x {args.max_tokens} new, all at once; "
        f"batch 1: {args.batch1_requests} requests one at a time. "
        f"Command: `python -m bench.cpu_bind`."
    )
    table = [
        [
            row["variant"],
            f"{row['w64_tok_s']:.1f}",
            f"{row['w64_vs_first']:.2f}x",
            f"{row['itl_p50_ms']:.1f}",
            f"{row['itl_vs_first']:.2f}x",
            f"{row['ttft_p50_ms']:.1f}",
            f"{row['ttft_vs_first']:.2f}x",
        ]
        for row in rows
    ]
    write_results(
        args.name,
        header,
        [
            "BIND/WAIT",
            "W64 tok/s",
            "ratio",
            "batch-1 ITL p50 ms",
            "ratio",
            "batch-1 TTFT p50 ms",
            "ratio",
        ],
        table,
        rows,
    )


if __name__ == "__main__":
    main()
